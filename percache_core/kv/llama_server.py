"""``LlamaServer``: llama.cpp's ``llama-server`` as PerCache's engine, over HTTP.

A server speaks in whole prompts: a request sends a prompt's token ids, and the server
prefills what its slot does not already hold (its ``cache_prompt`` reuse of the longest
common token prefix) and decodes. It cannot hand out logits or cut a prefill where a
client likes, so this engine is not a token-level :class:`~percache_core.kv.engine.Engine`;
it offers what the server's API allows:

- :meth:`LlamaServer.complete`: one completion of a token list, streamed, with
  ``cache_prompt`` on (reuse what the slot holds) or off (a fresh prefill), reporting how
  many tokens the server reused before any text arrives (``prompt_progress.cache``);
- :meth:`LlamaServer.save_slot` / :meth:`LlamaServer.restore_slot`: the slot's tokens and
  KV cells as a file (``--slot-save-path``), the chunk states PerCache stores;
- the text side: ``/tokenize``, ``/detokenize`` and ``/apply-template``.

:mod:`percache_core.serving.server_runner` runs PerCache's prompts on it, exactly: the
answer's text is what the same server gives the same prompt with nothing reused.

Start a server from the build ``make llama-server`` made (``.venv/bin/llama-server``, or
``$PERCACHE_LLAMA_SERVER``), or attach to one you run::

    server = LlamaServer.start("model.gguf")                    # owns the process
    server = LlamaServer(url="http://127.0.0.1:8080",           # yours, started with
                         slot_save_path="/var/cache/slots")     # --slot-save-path
    pc = PerCache.open("cache", engine=server)
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..errors import PerCacheError
from .engine import ChatPrompt, Decoding, EngineFeatures, Sampling

logger = logging.getLogger(__name__)

BINARY_ENV = "PERCACHE_LLAMA_SERVER"
SLOT = 0  # the one slot PerCache uses (a started server runs with -np 1)


class ServerError(PerCacheError):
    """The llama-server answered with an error, or could not be reached or started."""


class ServerUnreachable(ServerError):
    """The llama-server could not be reached (stopped, or not there)."""


@dataclass
class Completion:
    """What one :meth:`LlamaServer.complete` request did (filled in as it streams)."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)  # generated ids (the server's, without stop text trimming)
    cached: int | None = None  # prompt tokens the server reused (prompt_progress.cache / timings.cache_n)
    prompt_tokens: int = 0  # tokens it prefilled
    stop_type: str = ""  # "eos", "limit", "word", or "" while streaming
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # first token's, with n_probs
    timings: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""  # a relayed OpenAI request's: "stop" or "length"
    usage: dict[str, Any] = field(default_factory=dict)  # a relayed OpenAI request's, as the server sent it
    plain: bool = True  # a relayed chat's deltas held nothing but its text (no reasoning, no tool calls)


def find_server_binary() -> Path:
    """The llama-server to start: ``$PERCACHE_LLAMA_SERVER``, the one ``make llama-server``
    installed beside this Python (``.venv/bin``), or one on ``PATH``."""
    named = os.environ.get(BINARY_ENV)
    candidates = [Path(named)] if named else []
    candidates.append(Path(sys.prefix) / "bin" / "llama-server")
    found = shutil.which("llama-server")
    if found:
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise ServerError(
        "no llama-server binary: run `make llama-server` (builds it from the llama-cpp-python "
        f"sdist into .venv/bin), or set {BINARY_ENV} to one"
    )


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_sliding_window(path: str | os.PathLike[str]) -> int:
    """The sliding-window size of the model in GGUF file *path* (its
    ``<arch>.attention.sliding_window`` value; 0 when it has none), read from the file's
    header without loading it."""
    with open(path, "rb") as file:

        def read(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            return struct.unpack("<" + fmt, file.read(size))[0]

        def skip(kind: int) -> Any:
            if kind == 8:
                return file.read(read("Q"))
            if kind == 9:
                inner, count = read("I"), read("Q")
                for _ in range(count):
                    skip(inner)
                return None
            return read(_GGUF_SCALARS[kind])

        if file.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read("I")  # version
        read("Q")  # tensors
        for _ in range(read("Q")):
            key = file.read(read("Q")).decode(errors="replace")
            value = skip(read("I"))
            if key.endswith(".attention.sliding_window"):
                return int(value)
    return 0


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


@dataclass(frozen=True)
class ServerLaunch:
    """How :meth:`LlamaServer.start` launches a server.

    Attributes:
        n_ctx: the context length (``-c``).
        n_batch: the logical and physical batch (``-b``, ``-ub``).
        n_threads: threads (``-t``, ``-tb``; None: all cores).
        host: the address it listens on.
        port: its port (None: a free one).
        slot_save_path: where it saves slot files (None: a temporary folder).
        extra_args: more flags, added as given.
        binary: the llama-server executable (None: found as :func:`find_server_binary` does).
        startup_timeout_s: how long to wait for it to answer.
    """

    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    slot_save_path: str | os.PathLike[str] | None = None
    extra_args: Sequence[str] = ()
    binary: str | os.PathLike[str] | None = None
    startup_timeout_s: float = 180.0

    def flags(self) -> tuple[str, ...]:
        """The arithmetic and slot flags the server runs with (where it listens aside)."""
        threads = self.n_threads or max(1, os.cpu_count() or 1)
        return (
            "-c", str(self.n_ctx), "-b", str(self.n_batch), "-ub", str(self.n_batch), "-np", "1",
            "-t", str(threads), "-tb", str(threads),
            "--swa-full", "--cache-ram", "0", "--no-webui", *self.extra_args,
        )  # fmt: skip


class LlamaServer:
    """A llama-server, started by :meth:`start` or attached to by its *url*.

    An attached server is used as it runs: its settings are read from ``/props``; chunk
    states need it to run with ``--slot-save-path`` (give the same folder as
    *slot_save_path*, readable here), one slot (``-np 1``) and, on sliding-window models,
    ``--swa-full``; where that is not so, PerCache keeps only stored answers for it and
    says why (:attr:`chunk_state_problem`). Nothing is sent before the first use.

    >>> server = LlamaServer(url="http://127.0.0.1:8080")   # doctest: +SKIP
    >>> server.tokenize("Hello")                             # doctest: +SKIP
    [9259]
    """

    def __init__(
        self,
        url: str,
        *,
        slot_save_path: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"give the server's http:// address, e.g. http://127.0.0.1:8080 (got {url!r})")
        self.url = f"http://{parts.hostname}:{parts.port or 80}"
        self._host, self._port = parts.hostname, parts.port or 80
        self.slot_save_path = Path(slot_save_path) if slot_save_path is not None else None
        self._api_key = api_key
        self._timeout_s = timeout_s
        self.lock = threading.RLock()  # one request chain at a time: the slot is shared state
        self._local = threading.local()
        self._props: dict[str, Any] | None = None
        self._pieces: dict[int, bytes] = {}  # token id -> bytes, from /tokenize
        self._sliding_window: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Any = None  # a started server's log file
        self._finalizer: Any = None
        self._owned_folder: tempfile.TemporaryDirectory[str] | None = None
        self.launch_flags: tuple[str, ...] = ()  # the flags a started server runs with (but where)
        self.model_path: Path | None = None  # the GGUF (a started server's, or /props' when readable)

    # -- starting and stopping --------------------------------------------------------------

    @classmethod
    def start(cls, model_path: str | os.PathLike[str] | None = None, launch: ServerLaunch | None = None) -> LlamaServer:
        """Start a llama-server on *model_path* and wait until it answers. It runs with the
        flags exact chunk states need: one slot, ``-b``/``-ub`` ``n_batch``,
        ``--swa-full``, ``--cache-ram 0`` (PerCache keeps the states), ``--slot-save-path``
        (the launch's, or a temporary folder removed on :meth:`close`).

        Args:
            model_path: a GGUF file (None: the bundled model).
            launch: the context, batch, threads, address, slot folder and extra flags
                (default: :class:`ServerLaunch`'s).

        Returns:
            The started server (close it, or use it as a context manager).

        Raises:
            ValueError: a context under 64 tokens or a batch under 32.
            ServerError: no binary, or the server exited or did not answer in time.

        >>> server = LlamaServer.start(None, ServerLaunch(n_ctx=2048))   # doctest: +SKIP
        >>> server.close()                                               # doctest: +SKIP
        """
        from ..models import resolve_model_path

        launch = launch or ServerLaunch()
        if launch.n_ctx < 64 or launch.n_batch < 32:
            raise ValueError(f"n_ctx must be >= 64 and n_batch >= 32 (got {launch.n_ctx}, {launch.n_batch})")
        executable = Path(launch.binary) if launch.binary is not None else find_server_binary()
        model = Path(resolve_model_path(None if model_path is None else str(model_path)))
        owned, slot_save_path = None, launch.slot_save_path
        if slot_save_path is None:
            owned = tempfile.TemporaryDirectory(prefix="percache-slots-")
            slot_save_path = owned.name
        Path(slot_save_path).mkdir(parents=True, exist_ok=True)
        host = launch.host
        port = launch.port or free_port(host)
        flags = launch.flags()
        where = ("-m", str(model), "--host", host, "--port", str(port), "--slot-save-path", str(slot_save_path))
        # its log goes to a file (a pipe nobody reads fills up and stops the server); the
        # server dies with this process (Linux: the parent-death signal)
        log = tempfile.TemporaryFile(prefix="percache-llama-server-")
        process = subprocess.Popen(
            [str(executable), *where, *flags], stdout=subprocess.DEVNULL, stderr=log, preexec_fn=_die_with_parent
        )
        server = cls(f"http://{host}:{port}", slot_save_path=slot_save_path)
        server._process, server._owned_folder, server._log = process, owned, log
        server._finalizer = weakref.finalize(server, _stop, process, log)
        server.launch_flags, server.model_path = flags, model
        try:
            server._wait_until_ready(launch.startup_timeout_s)
        except BaseException:
            server.close()
            raise
        return server

    def _log_tail(self, size: int = 2000) -> str:
        """The end of a started server's log."""
        if self._log is None:
            return ""
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - size))
        return self._log.read().decode(errors="replace")

    def _wait_until_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise ServerError(f"llama-server exited with code {self._process.returncode}:\n{self._log_tail()}")
            try:
                status, _ = self._request("GET", "/health", timeout_s=2.0)
                if status == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        raise ServerError(f"llama-server did not answer at {self.url} within {timeout_s:.0f} s")

    @property
    def owns_process(self) -> bool:
        """Whether this object started the server (and stops it on :meth:`close`)."""
        return self._process is not None

    def close(self) -> None:
        """Stop a server this object started (an attached one keeps running)."""
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
            self._local.connection = None
        process, self._process = self._process, None
        if process is not None:
            self._finalizer()  # stops it and closes its log
        if self._owned_folder is not None:
            self._owned_folder.cleanup()
            self._owned_folder = None

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- HTTP -------------------------------------------------------------------------------

    def _connection(self, timeout_s: float | None = None) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s or self._timeout_s)
            self._local.connection = connection
        connection.timeout = timeout_s or self._timeout_s
        if connection.sock is not None:
            connection.sock.settimeout(connection.timeout)
        return connection

    def _drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
        self._local.connection = None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def _send(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> http.client.HTTPResponse:
        """Send one request on this thread's kept-alive connection (opened again once when
        the server had closed it); the response, its body not read."""
        payload = None if body is None else json.dumps(body).encode()
        for attempt in (0, 1):
            connection = self._connection(timeout_s)
            try:
                connection.request(method, path, body=payload, headers=self._headers())
                return connection.getresponse()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
                self._drop_connection()
                if attempt:
                    raise
            except BaseException:
                self._drop_connection()
                raise
        raise AssertionError("unreachable")

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> tuple[int, Any]:
        """One request and its decoded JSON body: (status, body)."""
        response = self._send(method, path, body, timeout_s=timeout_s)
        try:
            raw = response.read()
        except BaseException:
            self._drop_connection()
            raise
        if response.will_close:
            self._drop_connection()
        return response.status, _json(raw) if raw else None

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return self._call("POST", path, body)

    def _get(self, path: str) -> dict[str, Any]:
        """The JSON object the server answers a GET of *path* with."""
        decoded = self._call("GET", path)
        if not isinstance(decoded, dict):
            raise ServerError(f"llama-server {path}: not a JSON object")
        return decoded

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request's decoded JSON answer (:class:`ServerUnreachable` when the server
        cannot be reached, :class:`ServerError` on another status than 200)."""
        try:
            status, decoded = self._request(method, path, body)
        except (OSError, http.client.HTTPException) as error:
            raise ServerUnreachable(f"llama-server at {self.url} unreachable: {error}") from error
        if status != 200:
            raise ServerError(f"llama-server {path}: HTTP {status}: {_error_text(decoded)}")
        return decoded

    # -- what the server is -----------------------------------------------------------------

    @property
    def props(self) -> dict[str, Any]:
        """The server's ``/props`` (read once)."""
        if self._props is None:
            decoded = self._props = self._get("/props")
            if self.model_path is None:
                path = Path(str(decoded.get("model_path", "")))
                self.model_path = path if path.is_file() else None
        return self._props

    @property
    def n_ctx(self) -> int:
        """The slot's context size."""
        return int(self.props.get("default_generation_settings", {}).get("n_ctx", 0))

    @property
    def model_name(self) -> str:
        alias = self.props.get("model_alias") or ""
        return str(alias or Path(str(self.props.get("model_path", "model"))).stem)

    @property
    def api_key(self) -> str | None:
        """The key the server asks for (None: none)."""
        return self._api_key

    def models(self) -> dict[str, Any]:
        """The server's ``/v1/models`` list."""
        return self._get("/v1/models")

    @property
    def chat_template(self) -> str | None:
        template = self.props.get("chat_template")
        return str(template) if template else None

    @property
    def chunk_state_problem(self) -> str | None:
        """Why this server cannot hold exact chunk states (None: it can, subject to the
        start-up check of :mod:`percache_core.serving.server_runner`)."""
        props = self.props
        if int(props.get("total_slots", 0)) != 1:
            return f"it runs {props.get('total_slots')} slots; start it with -np 1"
        if self.slot_save_path is None or not self.slot_save_path.is_dir():
            return "no slot-save folder readable here: start it with --slot-save-path DIR and give that DIR"
        if not (self.owns_process or os.access(self.slot_save_path, os.W_OK)):
            return f"the slot-save folder {self.slot_save_path} is not writable here"
        if self.model_path is None:
            return f"its model file {props.get('model_path')!r} is not readable here (its layout decides which states restore exactly)"
        return None

    @property
    def sliding_window(self) -> int:
        """The model's sliding-window size (0: none), read from its GGUF file once."""
        if self._sliding_window is None:
            self._sliding_window = gguf_sliding_window(self.model_path) if self.model_path is not None else 0
        return self._sliding_window

    @property
    def features(self) -> EngineFeatures:
        """What PerCache can do on this server (read once per server)."""
        return EngineFeatures(chunk_states=self.chunk_state_problem is None)

    @property
    def verdict_key(self) -> str | None:
        """The key its self-check verdicts are kept on disk under: a started server's
        fingerprint (its flags are known); None for an attached one (measured in each
        process: its batch sizes and attention settings cannot be read from it)."""
        return self.fingerprint("self-checks") if self.owns_process else None

    @property
    def n_vocab(self) -> int:
        try:
            return int(self.models()["data"][0]["meta"]["n_vocab"])
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise ServerError("llama-server /v1/models: no n_vocab") from error

    def warm_up(self) -> None:
        """Read the server's settings (it warms its model up itself when it starts)."""
        _ = self.props

    def fingerprint(self, extra: str = "") -> str:
        """A digest of what decides the server's output and the bytes of its slot files:
        its build, its model (path, and size and modification time where readable), its
        context size, and a started server's flags; plus *extra*."""
        props = self.props
        model = str(props.get("model_path", ""))
        stat = ""
        if self.model_path is not None:
            info = self.model_path.stat()
            stat = f"{info.st_size}:{info.st_mtime_ns}"
        record = json.dumps(
            [props.get("build_info"), model, stat, self.n_ctx, props.get("total_slots"), self.launch_flags, extra],
            default=str,
        )
        return hashlib.sha256(record.encode()).hexdigest()[:32]

    # -- text -------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = False, *, special: bool = False) -> list[int]:
        """The server's token ids of *text* (with BOS where *add_bos* and the model adds one);
        their bytes are kept for :meth:`token_bytes`."""
        body = {"content": text, "add_special": add_bos, "parse_special": special, "with_pieces": True}
        tokens: list[int] = []
        for item in self._post("/tokenize", body)["tokens"]:
            token, piece = int(item["id"]), item["piece"]
            self._pieces[token] = bytes(piece) if isinstance(piece, list) else str(piece).encode("utf-8")
            tokens.append(token)
        return tokens

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of *token* (as the server printed it when it tokenized it; else asked)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.detokenize([token]).encode("utf-8")
        return piece

    def detokenize(self, tokens: Sequence[int]) -> str:
        return str(self._post("/detokenize", {"tokens": list(tokens)})["content"])

    def stock_chat(self, messages: Sequence[tuple[str, str]]) -> ChatPrompt:
        """The chat laid out as the server's ``/v1/chat/completions`` lays it out (its own
        template, tokenized with special tokens and the model's BOS rule)."""
        body = {"messages": [{"role": role, "content": content} for role, content in messages]}
        prompt = str(self._post("/apply-template", body)["prompt"])
        return ChatPrompt(prompt, add_bos=True)

    def apply_template(self, body: dict[str, Any]) -> str:
        """The prompt the server's ``/v1/chat/completions`` lays out for the OpenAI request
        *body* (its messages, tools and template settings), without running it."""
        return str(self._post("/apply-template", body)["prompt"])

    def format_chat(self, messages: Sequence[tuple[str, str]], *, template: str | None = None) -> str:
        if template is not None:
            raise ServerError("a server formats chats with its own template only")
        return self.stock_chat(messages).text

    def chat_prompt(self, user_message: str) -> str:
        return self.format_chat([("user", user_message)])

    def tokenize_chat(self, prompt: str) -> list[int]:
        return self.tokenize(prompt, True, special=True)

    # -- the slot ----------------------------------------------------------------------------

    def complete(
        self,
        tokens: Sequence[int],
        decoding: Decoding,
        *,
        cache_prompt: bool,
        n_probs: int = 0,
        expected_cached: int | None = None,
    ) -> Iterator[str]:
        """Stream the completion of *tokens* in slot 0 with *decoding* (its
        ``max_new_tokens`` set, 0 to prefill only; greedy and no stop strings unless it
        says): yields text pieces; the request's :class:`Completion` is :attr:`last` (read
        it once the iterator is done).

        With *cache_prompt* the server reuses the longest common prefix of its slot's tokens
        (at least one token is always prefilled again); without, it prefills everything.
        When *expected_cached* is given and the server reports another reuse before any
        text, the request is cancelled and :class:`UnexpectedReuse` raised (no text was
        yielded). Closing the iterator early cancels the request (the connection is closed).
        """
        if decoding.max_new_tokens is None:
            raise ValueError("a server completion needs max_new_tokens")
        sampling = decoding.sampling or Sampling()
        body: dict[str, Any] = {
            "prompt": list(tokens),
            "n_predict": decoding.max_new_tokens,
            "cache_prompt": cache_prompt,
            "id_slot": SLOT,
            "stream": True,
            "return_progress": True,
            "return_tokens": True,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "stop": list(decoding.stop or ()),
            "n_probs": n_probs,
        }
        completion = self.last = Completion()
        yield from self._stream(body, completion, expected_cached)

    last: Completion = Completion()

    def _event_stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of a streamed POST to *path*, read on to the stream's end (so the
        connection can be reused) unless the caller stops early; an error event raised."""
        try:
            response = self._send("POST", path, body)
        except (OSError, http.client.HTTPException) as error:
            raise ServerUnreachable(f"llama-server at {self.url} unreachable: {error}") from error
        if response.status != 200:
            raise ServerError(f"llama-server {path}: HTTP {response.status}: {_error_text(_json(response.read()))}")
        for event in _events(response):
            if "error" in event:
                raise ServerError(f"llama-server {path}: {_error_text(event)}")
            yield event
        response.read()
        if response.will_close:
            self._drop_connection()

    def _stream(self, body: dict[str, Any], completion: Completion, expected_cached: int | None) -> Iterator[str]:
        finished = False
        try:
            for event in self._event_stream("/completion", body):
                progress = event.get("prompt_progress")
                if progress is not None and completion.cached is None:
                    completion.cached = int(progress.get("cache", 0))
                    if expected_cached is not None and completion.cached != expected_cached:
                        raise UnexpectedReuse(expected_cached, completion.cached)
                self._absorb(event, completion)
                if event.get("content"):
                    yield event["content"]
                finished = finished or bool(event.get("stop"))  # (the stream ends after it)
            if not finished:
                raise ServerError("llama-server closed the stream before the end of the completion")
        finally:
            if not finished:
                self._drop_connection()  # the server cancels the request when the client goes

    @staticmethod
    def _absorb(event: dict[str, Any], completion: Completion) -> None:
        completion.text += event.get("content") or ""
        if event.get("prompt_progress") is None:  # progress events carry a placeholder token
            completion.tokens.extend(int(t) for t in event.get("tokens") or ())
        probabilities = event.get("completion_probabilities")
        if probabilities and not completion.top_logprobs:
            completion.top_logprobs = [(int(p["id"]), float(p["logprob"])) for p in probabilities[0]["top_logprobs"]]
        timings = event.get("timings")
        if timings:
            completion.timings = {k: float(v) for k, v in timings.items() if isinstance(v, (int, float))}
            completion.prompt_tokens = int(timings.get("prompt_n", completion.prompt_tokens))
            if completion.cached is None:
                completion.cached = int(timings.get("cache_n", 0))
        if event.get("stop"):
            completion.stop_type = str(event.get("stop_type", ""))

    def relay(
        self,
        path: str,
        body: dict[str, Any],
        *,
        cache_prompt: bool,
        expected_cached: int,
        expected_total: int,
        chunks: list[dict[str, Any]],
    ) -> Iterator[str]:
        """Run a client's OpenAI request *body* on the server's own endpoint *path*
        (``/v1/chat/completions`` or ``/v1/completions``) in slot 0, streamed: the server
        lays out the prompt, samples, stops and parses the reply as it does for the client
        alone. Appends each chunk the client would get to *chunks* as it arrives (the
        server's progress events left out) and yields the text each adds; the request's
        :class:`Completion` is :attr:`last`.

        Before any text, the server's progress event must show *expected_cached* tokens
        reused of a prompt of *expected_total* tokens (the prompt PerCache laid out):
        otherwise the request is cancelled and :class:`UnexpectedReuse` raised."""
        request = dict(body)
        request.update(
            stream=True,
            stream_options={"include_usage": True},
            cache_prompt=cache_prompt,
            id_slot=SLOT,
            return_progress=True,
        )
        completion = self.last = Completion()
        yield from self._relay_stream(path, request, completion, (expected_cached, expected_total), chunks)

    def _relay_stream(
        self,
        path: str,
        body: dict[str, Any],
        completion: Completion,
        expected: tuple[int, int],
        chunks: list[dict[str, Any]],
    ) -> Iterator[str]:
        finished = False
        try:
            for event in self._event_stream(path, body):
                progress = event.get("prompt_progress")
                if progress is not None:
                    if completion.cached is None:
                        completion.cached = int(progress.get("cache", 0))
                        total = int(progress.get("total", 0))
                        if (completion.cached, total) != expected:
                            raise UnexpectedReuse(expected[0], completion.cached, expected[1], total)
                    continue  # progress is PerCache's, not the client's
                if completion.cached is None:
                    raise ServerError(f"llama-server {path} reported no prompt progress: its reuse is unknown")
                if event.get("usage"):
                    completion.usage = dict(event["usage"])
                if event.get("timings"):
                    completion.timings = {k: float(v) for k, v in event["timings"].items() if isinstance(v, (int, float))}
                    event = {k: v for k, v in event.items() if k != "timings"}
                chunks.append(event)
                text = _absorb_choice(event, completion)
                if text:
                    yield text
            finished = True
        finally:
            if not finished:
                self._drop_connection()  # the server cancels the request when the client goes

    def save_slot(self, filename: str) -> int:
        """Save slot 0's tokens and KV cells as *filename* in the slot-save folder; the
        tokens saved."""
        return int(self._post(f"/slots/{SLOT}?action=save", {"filename": filename})["n_saved"])

    def restore_slot(self, filename: str) -> int:
        """Load *filename* from the slot-save folder into slot 0; the tokens restored
        (:class:`ServerError` when the server refuses the file)."""
        return int(self._post(f"/slots/{SLOT}?action=restore", {"filename": filename})["n_restored"])

    def erase_slot(self) -> None:
        self._post(f"/slots/{SLOT}?action=erase", {})


class UnexpectedReuse(ServerError):
    """The server reused another number of prompt tokens than the request counted on (or,
    for a relayed request, laid out a prompt of another length)."""

    def __init__(self, expected: int, cached: int, expected_total: int = 0, total: int = 0) -> None:
        other_prompt = f" of a {total}-token prompt, not {expected_total}" if total != expected_total else ""
        super().__init__(f"the server reused {cached} prompt tokens{other_prompt}, not {expected}")
        self.expected, self.cached = expected, cached


def _absorb_choice(event: dict[str, Any], completion: Completion) -> str:
    """The text one OpenAI chunk adds (a chat delta's content, a completion's text); its
    finish reason and whether it holds more than text are noted on *completion*."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if choice.get("finish_reason"):
        completion.finish_reason = str(choice["finish_reason"])
    delta = choice.get("delta")
    if delta is None:  # /v1/completions
        text = choice.get("text") or ""
    else:
        text = delta.get("content") or ""
        if any(value for key, value in delta.items() if key not in ("role", "content")):
            completion.plain = False  # reasoning or tool calls: relayed, not kept as an answer
    completion.text += text
    return text


def _events(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream."""
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        event = _json(data)
        if isinstance(event, dict):
            yield event


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode(errors="replace")


def _error_text(decoded: Any) -> str:
    if isinstance(decoded, dict):
        error = decoded.get("error", decoded)
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    return str(decoded)[:500]
