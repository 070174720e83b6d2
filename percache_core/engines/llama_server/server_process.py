"""Starting a llama-server process: its binary (:func:`find_server_binary`), its flags
(:class:`ServerLaunch`), a free port (:func:`free_port`), and the running process with its
log (:class:`ServerProcess`), stopped on :meth:`ServerProcess.stop` or with the Python
process that started it.
"""

from __future__ import annotations

import http.client as http_client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .server_http import ServerError, ServerHTTP

BINARY_ENV = "PERCACHE_LLAMA_SERVER"
INVARIANT_BINARY_ENV = "PERCACHE_LLAMA_SERVER_INVARIANT"  # the tinyBLAS-for-every-batch build (ServerLaunch.batch_invariant)
DEFAULT_SLOTS = 4  # llama-server's slots when started with no -np (it says "n_parallel is set to auto")


def find_server_binary(*, batch_invariant: bool = False) -> Path:
    """The llama-server to start: ``$PERCACHE_LLAMA_SERVER``, the one ``make llama-server``
    installed beside this Python (``.venv/bin``), or one on ``PATH``. With *batch_invariant*,
    the build whose llamafile kernels take every batch size: ``$PERCACHE_LLAMA_SERVER_INVARIANT``
    or the one ``make llama-server-invariant`` installed (``.venv/bin/llama-server-invariant``)."""
    env, name = (INVARIANT_BINARY_ENV, "llama-server-invariant") if batch_invariant else (BINARY_ENV, "llama-server")
    named = os.environ.get(env)
    candidates = [Path(named)] if named else []
    candidates.append(Path(sys.prefix) / "bin" / name)
    found = shutil.which(name)
    if found:
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise ServerError(
        f"no {name} binary: run `make {name}` (builds it from the llama-cpp-python "
        f"sdist into .venv/bin), or set {env} to one"
    )


def _die_with_parent() -> None:
    """In the child before it runs the server: ask Linux to stop it when its parent dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(process: subprocess.Popen[bytes], log: Any) -> None:
    """Stop a started server (politely, then by force) and close its log."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    log.close()


def free_port(host: str) -> int:
    """A port of *host* that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


# what makes a request's arithmetic independent of the requests batched with it (on the CPU
# backend: benchmarks.batch_invariance; the KV cache per slot comes with every launch)
INVARIANT_FLAGS = ("-nr",)  # and -fa on or off, the model's faster (launch_choice); in that build both hold
TILED_MATMUL_ENVIRONMENT = {  # the tiled K-quant matmul: for every batch size, or for none (vec_dot)
    "on": {"GGML_CPU_TILED_MM_FORCE": "1"},
    "off": {"GGML_CPU_TILED_MM": "0"},
}


@dataclass(frozen=True)
class ServerLaunch:
    """How :meth:`LlamaServer.start` launches a server.

    Attributes:
        n_ctx: the context length (``-c``).
        n_batch: the logical and physical batch (``-b``, ``-ub``).
        n_threads: threads (``-t``, ``-tb``; None: all cores).
        n_slots: slots (``-np``; None: as many as llama-server runs by default, 4). Each
            slot has a KV cache of its own of ``n_ctx`` cells (``-c n_ctx * n_slots
            --no-kv-unified``): in the one cache llama-server's default slots share, a
            request's arithmetic depends on the cells other slots hold (measured: another
            slot's 480 tokens changed a fresh prefill's log-probabilities), so that no
            request there is exactly what a fresh server computes.
        host: the address it listens on.
        port: its port (None: a free one).
        slot_save_path: where it saves slot files (None: a temporary folder).
        batch_invariant: run every request as it runs alone, whatever runs beside it, so that
            what a run batched with another computes is kept and reused as a lone run's: the
            build whose llamafile kernels take every batch size, one token included, and whose
            CPU flash attention computes each query row on its own path (``make
            llama-server-invariant``), weight repacking off ``-nr``, with the KV cache per
            slot, and flash attention and the tiled K-quant matmul as *flash_attention* and
            *tiled_matmul* say. Measured on 2 cores through ``percache serve``
            (``benchmarks.load_exactness --batch-invariant``, 8 clients x 13 RAG prompts at
            once, then each asked again alone): 104 of 104 replies under load the fresh text
            and 0 of 104 asked again different, on Gemma 3 270M and on SmolLM2-135M (the
            default build with such switches, ``benchmarks.batch_invariance --load 4``: 22
            and 23 of 24 texts). It costs speed alone, by model (Gemma 3 decodes slower);
            off by default: one client alone pays (``benchmarks.endpoint --load-clients 1
            --batch-invariant``: Gemma 3 1.14x, SmolLM2 1.00x a default server's time) and gets
            that launch's own text, while clients at once gain (4 and 8 clients: 0.78x-0.93x on
            Gemma 3, 0.69x-0.72x on SmolLM2). See docs/engines.md, "Batch invariance".
        flash_attention: a batch-invariant launch's ``-fa``, ``"on"`` or ``"off"`` (both hold
            on that build); None: measured with *tiled_matmul*, the fastest pair for the
            model, by :meth:`LlamaServer.start` the first time (about 18-27 s here) and kept
            (:mod:`~percache_core.engines.llama_server.launch_choice`; measured: on for Gemma 3
            270M, off for SmolLM2-135M, whose prefill it halves). Ignored without
            *batch_invariant*.
        tiled_matmul: a batch-invariant launch's tiled K-quant matmul, ``"on"`` for every
            batch size (``GGML_CPU_TILED_MM_FORCE=1``) or ``"off"`` for none
            (``GGML_CPU_TILED_MM=0``): as llama.cpp ships it, it takes batches of 8 rows or
            more only. Both hold (``benchmarks.batch_invariance --load 8``, 48/48 on both
            models); on prefills faster and decodes slower. None: measured with
            *flash_attention*, the faster pair for the model. Ignored without *batch_invariant*.
        extra_args: more flags, added as given.
        binary: the llama-server executable (None: found as :func:`find_server_binary` does).
        startup_timeout_s: how long to wait for it to answer.
    """

    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int | None = None
    n_slots: int | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    slot_save_path: str | os.PathLike[str] | None = None
    batch_invariant: bool = False
    flash_attention: str | None = None
    tiled_matmul: str | None = None
    extra_args: Sequence[str] = ()
    binary: str | os.PathLike[str] | None = None
    startup_timeout_s: float = 180.0

    @property
    def slot_count(self) -> int:
        """The slots the server runs (``n_slots``, or llama-server's default 4)."""
        return DEFAULT_SLOTS if self.n_slots is None else self.n_slots

    @property
    def threads(self) -> int:
        """The threads it runs with (``n_threads``, or every core)."""
        return self.n_threads or max(1, os.cpu_count() or 1)

    def flags(self) -> tuple[str, ...]:
        """The arithmetic and slot flags the server runs with (where it listens aside); a
        batch-invariant launch's ``-fa`` as ``flash_attention`` says (``on`` while it is None:
        :meth:`LlamaServer.start` sets it first)."""
        threads, slots = self.threads, self.slot_count
        invariant = (*INVARIANT_FLAGS, "-fa", self.flash_attention or "on") if self.batch_invariant else ()
        return (
            "-c", str(self.n_ctx * slots), "-b", str(self.n_batch), "-ub", str(self.n_batch), "-np", str(slots), "-no-kvu",
            "-t", str(threads), "-tb", str(threads),
            "--swa-full", "--cache-ram", "0", "--no-webui", *invariant, *self.extra_args,
        )  # fmt: skip

    def environment(self) -> dict[str, str]:
        """The environment variables the server runs with beside this process's."""
        return dict(TILED_MATMUL_ENVIRONMENT[self.tiled_matmul or "off"]) if self.batch_invariant else {}


def wait_until_ready(http: ServerHTTP, timeout_s: float, process: ServerProcess | None = None) -> None:
    """Wait until the server behind *http* answers ``/health`` with 200
    (:class:`ServerError` when *process* exits or nothing answers within *timeout_s*)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = process.exit_code() if process is not None else None
        if process is not None and code is not None:
            raise ServerError(f"llama-server exited with code {code}:\n{process.log_tail()}")
        try:
            status, _ = http.request("GET", "/health", timeout_s=2.0)
            if status == 200:
                return
        except (OSError, http_client.HTTPException):
            pass
        time.sleep(0.1)
    raise ServerError(f"llama-server did not answer at {http.url} within {timeout_s:.0f} s")


class ServerProcess:
    """A llama-server started on *model* as *launch* says, its log in a temporary file (a
    pipe nobody reads fills up and stops the server) and, without a slot folder in the
    launch, a temporary one it owns. It dies with this process (Linux: the parent-death
    signal) and is stopped when this object is collected.

    Attributes:
        popen: the process.
        executable: the llama-server binary it runs.
        port: the port it listens on.
        url: where it listens.
        slot_save_path: its slot-save folder.
        flags: the flags it runs with (but where).
    """

    def __init__(self, model: Path, launch: ServerLaunch) -> None:
        if launch.n_ctx < 64 or launch.n_batch < 32:
            raise ValueError(f"n_ctx must be >= 64 and n_batch >= 32 (got {launch.n_ctx}, {launch.n_batch})")
        if launch.n_slots is not None and launch.n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, or None for llama-server's default (got {launch.n_slots})")
        for name in ("flash_attention", "tiled_matmul"):
            if getattr(launch, name) not in (None, "on", "off"):
                raise ValueError(f"{name} is 'on', 'off' or None (measured) (got {getattr(launch, name)!r})")
        executable = Path(launch.binary) if launch.binary is not None else find_server_binary(batch_invariant=launch.batch_invariant)
        self._owned_folder: tempfile.TemporaryDirectory[str] | None = None
        slot_save_path = launch.slot_save_path
        if slot_save_path is None:
            self._owned_folder = tempfile.TemporaryDirectory(prefix="percache-slots-")
            slot_save_path = self._owned_folder.name
        Path(slot_save_path).mkdir(parents=True, exist_ok=True)
        self.slot_save_path = Path(slot_save_path)
        self.executable = executable
        self.port = launch.port or free_port(launch.host)
        self.url = f"http://{launch.host}:{self.port}"
        self.flags = launch.flags()
        where = ("-m", str(model), "--host", launch.host, "--port", str(self.port), "--slot-save-path", str(slot_save_path))
        self._log: Any = tempfile.TemporaryFile(prefix="percache-llama-server-")
        self.popen = subprocess.Popen(
            [str(executable), *where, *self.flags], stdout=subprocess.DEVNULL, stderr=self._log, preexec_fn=_die_with_parent,
            env={**os.environ, **launch.environment()},
        )
        self._finalizer = weakref.finalize(self, _stop, self.popen, self._log)

    def wait_until_ready(self, http: ServerHTTP, timeout_s: float) -> None:
        """:func:`wait_until_ready` for this process (an error with its log if it exits)."""
        wait_until_ready(http, timeout_s, self)

    def exit_code(self) -> int | None:
        """The process's exit code, or None while it runs."""
        return self.popen.poll()

    def log_tail(self, size: int = 2000) -> str:
        """The end of its log."""
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - size))
        return self._log.read().decode(errors="replace")

    def stop(self) -> None:
        """Stop it (politely, then by force), close its log and remove the slot folder it owns."""
        self._finalizer()
        if self._owned_folder is not None:
            self._owned_folder.cleanup()
            self._owned_folder = None
