"""The llama.cpp engine: one model, one context, one sequence, driven token list by token list.

It uses llama-cpp-python's low-level bindings rather than ``Llama`` because state reuse
needs what ``Llama`` hides: per-sequence state bytes (``llama_state_seq_*``), a scratch
sequence for state slices, and no n_tokens x n_vocab score copies. Weights are repacked
as ``Llama`` does by default (``repack_weights``), so a prompt prefilled in one call gives
``Llama``'s logits; where a prompt may be cut without changing them is found by the
self-check in :mod:`percache_core.kv.cuts` (with repacking: pieces of 8+ tokens cut at
multiples of 4).

Facts it relies on (llama-cpp-python 0.3.36, CPU): restoring a state saved after
prefilling segments 1..d and then prefilling the rest gives bit-identical logits to
prefilling every segment live with the same call schedule. A state is only valid for the
same model file, llama.cpp build and context settings, which ``fingerprint`` captures.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import EngineError, ModelNotFoundError, missing_dependency
from ...kv.cuts import feed_calls
from ...kv.engine import Sampling
from ...kv.state_cells import laid_out_as_prefill
from ...models import file_identity, file_sha256
from .compute_thread import on_compute_thread, process_compute_thread
from .text_model import LlamaTextModel

logger = logging.getLogger(__name__)

_SCRATCH = 1  # the sequence id state slices pass through
_STATE_HEADER = 8  # a sequence state's magic and sequence id, before its cells
_backend_lock = threading.Lock()
_backend_ready = False
_silent_log_callback = None  # kept alive for the process lifetime once installed


def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as error:
        raise missing_dependency("llama_cpp", "percache-core[llama-cpp]") from error
    return llama_cpp


def load_identity(
    model_path: Path, *, n_ctx: int, n_batch: int, n_threads: int | None, repack_weights: bool, extra: str = ""
) -> str:
    """A digest of what a :class:`LlamaEngine` would be loaded from, read without loading
    or importing anything heavy: the model file (path, size, modification time), the
    llama.cpp libraries beside ``llama_cpp`` (the same), this processor, the context
    settings and *extra*. Two loads with the same identity give the same
    :meth:`LlamaEngine.fingerprint`, so a fingerprint recorded under it names the engine
    before it loads (see ``ModelRuntime.model_id``)."""
    libraries: list[str] = []
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin:
        folder = Path(spec.origin).parent
        libraries = sorted(file_identity(p) for p in folder.glob("lib/*") if p.is_file())
        libraries.append(file_identity(Path(spec.origin)))
    payload = {
        "model": file_identity(Path(model_path)),
        "libraries": libraries,
        "processor": _processor_identity(),
        "settings": [n_ctx, n_batch, n_threads or os.cpu_count() or 1, repack_weights],
        "extra": extra,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def _processor_identity() -> str:
    """The processor's model name and feature flags (they pick llama.cpp's kernels)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            lines = [line for line in handle.read(65536).splitlines() if line.startswith(("model name", "flags"))]
        return "|".join(lines[:2])
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"


def _readonly_pointer(data: bytes):
    """*data* as the uint8 pointer llama.cpp reads states from (no copy)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))


def _holds(lc: Any, memory: Any, sequence: int, start: int, end: int) -> bool:
    """Whether *sequence* of *memory* holds positions *start* to *end* - 1 (none outside)."""
    return lc.llama_memory_seq_pos_max(memory, sequence) == end - 1 and lc.llama_memory_seq_pos_min(memory, sequence) == start


def _init_backend(lc, verbose: bool) -> None:
    global _backend_ready, _silent_log_callback
    with _backend_lock:
        if not verbose and _silent_log_callback is None:
            _silent_log_callback = lc.llama_log_callback(lambda level, text, data: None)
            lc.llama_log_set(_silent_log_callback, ctypes.c_void_p(0))
        if not _backend_ready:
            lc.llama_backend_init()
            _backend_ready = True
            advice = openmp_advice(lc.llama_print_system_info().decode("utf-8", "replace"), sys.modules)
            if advice:
                logger.warning(advice)


def openmp_advice(system_info: str, modules: Any) -> str | None:
    """What to do where llama.cpp is an OpenMP build (llama-cpp-python's default) and torch
    is loaded in the process: PerCache computes on a thread of its own, and beside torch's
    OpenMP team libgomp stops spinning at its barriers, so each decode step took about 1.5x
    stock's (docs/concepts.md). None where neither holds.

    >>> openmp_advice("AVX2 = 1 | OPENMP = 1 |", {"torch": object()}) is not None
    True
    >>> openmp_advice("AVX2 = 1 | OPENMP = 1 |", {}), openmp_advice("AVX2 = 1 |", {"torch": object()})
    (None, None)
    """
    if "OPENMP = 1" not in system_info or "torch" not in modules:
        return None
    return (
        "llama.cpp here is an OpenMP build and torch is loaded: beside torch's OpenMP threads "
        "PerCache's decode can take about 1.5x stock's. Build llama-cpp-python without OpenMP: "
        'CMAKE_ARGS="-DGGML_OPENMP=OFF" pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python'
    )


def _context_params(lc: Any, n_ctx: int, n_batch: int, threads: int) -> Any:
    """The llama.cpp context parameters of an engine: one physical batch of *n_batch*,
    two sequences (sequence 1 is scratch space for state slices) in one unified cell
    buffer (so cells can be shared between them), no flash attention, no perf counters."""
    params = lc.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_batch
    params.n_seq_max = 2
    params.kv_unified = True
    params.n_threads = threads
    params.n_threads_batch = threads
    params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.no_perf = True
    return params


def _state_settings(lc: Any, params: Any, repack_weights: bool, n_ctx: int) -> dict[str, Any]:
    """Everything of the build and the context that changes state bytes (part of the
    engine's fingerprint)."""
    return {
        "llama_cpp_python": getattr(lc, "__version__", "unknown"),
        "system_info": lc.llama_print_system_info().decode("utf-8", "replace"),
        "type_k": int(params.type_k),
        "type_v": int(params.type_v),
        "flash_attn_type": int(params.flash_attn_type),
        "use_extra_bufts": repack_weights,
        "n_seq_max": int(params.n_seq_max),
        "kv_unified": bool(params.kv_unified),
        "swa_full": bool(params.swa_full),
        "n_ctx": n_ctx,
        "n_batch": int(params.n_batch),
        "n_ubatch": int(params.n_ubatch),
        "batch_split": "even, cut at multiples of 16; stock's short last call",  # feed_calls: calls decide logits
    }


def pick_token(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """The next token from *logits*: the top one when greedy, else sampled at the
    temperature from the top-p nucleus with *rng*.

    >>> pick_token(np.array([0.1, 2.0, 0.3]), Sampling(), np.random.default_rng(0))
    1
    """
    if sampling.temperature <= 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / sampling.temperature
    scaled -= scaled.max()
    probabilities = np.exp(scaled)
    probabilities /= probabilities.sum()
    if sampling.top_p < 1.0:
        order = np.argsort(-probabilities)
        cumulative = np.cumsum(probabilities[order])
        keep = order[: int(np.searchsorted(cumulative, sampling.top_p)) + 1]
        mask = np.zeros_like(probabilities)
        mask[keep] = probabilities[keep]
        probabilities = mask / mask.sum()
    return int(rng.choice(len(probabilities), p=probabilities))


class LlamaEngine(LlamaTextModel):
    """A GGUF model in a llama.cpp context with a single sequence (id 0): the
    :class:`~percache_core.kv.engine.Engine` that PerCache runs on. Its text side
    (tokenizer, chat template) is :class:`~percache_core.engines.llama_cpp.text_model.LlamaTextModel`;
    this class adds the sequence side (eval, logits, states).

    The engine is not thread-safe by itself: callers hold ``engine.lock`` (a plain lock,
    so a streaming generator may release it from another thread) around any sequence of
    calls that must not interleave (restore, prefill, generate). Whatever thread calls,
    the work runs on the process's one :class:`~percache_core.engines.llama_cpp.compute_thread.ComputeThread`
    (``engine.compute``, shared by every engine), as stock ``llama_cpp.Llama`` runs on its caller's one thread.

    >>> engine = LlamaEngine("gemma-3-270m-q4_k_m.gguf")   # doctest: +SKIP
    >>> engine.reset(); engine.eval(engine.tokenize("The capital of France is", True))  # doctest: +SKIP
    >>> b"".join(engine.token_bytes(t) for t in engine.generate(max_new_tokens=2))   # doctest: +SKIP
    b' Paris.'
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        n_ctx: int = 2048,
        n_batch: int = 512,
        n_threads: int | None = None,
        repack_weights: bool = True,
        verbose: bool = False,
    ) -> None:
        lc = _import_llama_cpp()
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise ModelNotFoundError(f"model file not found: {self.model_path}")
        _init_backend(lc, verbose)
        self.lock = threading.Lock()
        # every call that computes or touches the context runs on the process's one compute
        # thread: one OpenMP team in an OpenMP build, whatever thread asks (see compute_thread.py)
        self.compute = process_compute_thread()

        model_params = lc.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model_params.use_extra_bufts = repack_weights
        self._model = lc.llama_model_load_from_file(str(self.model_path).encode("utf-8"), model_params)
        if not self._model:
            raise ModelNotFoundError(f"llama.cpp could not load the model file {self.model_path}")
        super().__init__(lc, self._model, self.model_path)

        context_params = _context_params(lc, n_ctx, n_batch, n_threads or os.cpu_count() or 1)
        self._ctx = lc.llama_init_from_model(self._model, context_params)
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise EngineError("llama.cpp could not create a context (out of memory?)")
        self._memory = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_init(n_batch, 0, 1)

        self.n_ctx = lc.llama_n_ctx(self._ctx)
        self.n_batch = n_batch
        self.n_past = 0
        self.changes = 0  # bumped by every call that changes the sequence
        self._zero_end = 0  # positions below it may hold zero cells a restore put back (load_state)
        self._settings = _state_settings(lc, context_params, repack_weights, self.n_ctx)
        self._model_sha256: str | None = None
        self._verdict_key: str | None = None
        self._closed = False

    # -- identity -------------------------------------------------------------------------

    def fingerprint(self, extra: str = "") -> str:
        """A digest of everything that changes the state bytes, plus *extra* (e.g. the
        prompt template version). States saved under one fingerprint are never loaded
        under another."""
        if self._model_sha256 is None:
            self._model_sha256 = file_sha256(self.model_path)
        payload = json.dumps(
            {"model_sha256": self._model_sha256, "extra": extra, **self._settings}, sort_keys=True
        )
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    @property
    def verdict_key(self) -> str:
        """The key the self-checks' verdicts are kept on disk under
        (:class:`~percache_core.kv.engine.EngineVerdicts`): this fingerprint, plus the
        ``GGML_CPU_TILED_MM`` setting, which ggml reads from the environment and which
        changes where a prefill may be cut."""
        if self._verdict_key is None:
            self._verdict_key = self.fingerprint(f"self-checks|tiled_mm={os.environ.get('GGML_CPU_TILED_MM', '')}")
        return self._verdict_key

    def warm_up(self) -> None:
        """Run one small prefill so that the first real question is not slowed by set-up."""
        with self.lock:
            self.reset()
            self.eval(self.tokenize("Warm-up.\n\n", True))
            self.reset()

    # -- sequence state -------------------------------------------------------------------

    @on_compute_thread
    def reset(self) -> None:
        """Empty the sequence."""
        self.changes += 1
        self._lc.llama_memory_clear(self._memory, True)
        self.n_past = self._zero_end = 0

    @on_compute_thread
    def save_state(self) -> bytes:
        """The sequence's state bytes (everything needed to continue from ``n_past``)."""
        size = self._lc.llama_state_seq_get_size(self._ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = self._lc.llama_state_seq_get_data(self._ctx, buffer, size, 0)
        if written == 0:
            raise EngineError("llama.cpp returned an empty sequence state")
        return ctypes.string_at(buffer, written)

    @on_compute_thread
    def load_state(self, data: bytes, n_tokens: int) -> bool:
        """Replace the sequence with *data* saved at *n_tokens*, its cells laid out as a
        fresh prefill's (:func:`~percache_core.kv.state_cells.laid_out_as_prefill`); False
        (sequence empty) if llama.cpp refuses it or it cannot be laid out so."""
        self.reset()  # counts as a change
        laid_out = laid_out_as_prefill(data, _STATE_HEADER, 0, n_tokens, self.n_swa)
        if laid_out is None:
            return False
        read = self._lc.llama_state_seq_set_data(self._ctx, _readonly_pointer(laid_out[0]), len(laid_out[0]), 0)
        if read == 0 or not _holds(self._lc, self._memory, 0, 0, n_tokens):
            self.reset()
            return False
        self.n_past, self._zero_end = n_tokens, laid_out[1]
        return True

    @on_compute_thread
    def save_slice(self, start: int) -> bytes:
        """The state of the sequence's positions from *start* to ``n_past`` only (a slice:
        the cells are shared with scratch sequence 1 and saved from there, so sequence 0 is
        untouched). :meth:`append_slice` puts it back after a prefix of *start* tokens."""
        if not 0 <= start < self.n_past:
            raise ValueError(f"no positions from {start} in a sequence of {self.n_past}")
        data = self._scratch_state(start, self.n_past)
        if data is None:
            raise EngineError("llama.cpp returned an empty state slice")
        return data

    @on_compute_thread
    def save_prefix(self, end: int, start: int = 0) -> bytes | None:
        """The state of positions *start* .. *end* of the sequence, taken after the fact:
        the state a prefill that stopped at *end* would have saved (whole with *start* 0,
        else a slice), with sequence 0 untouched. None when the sequence no longer holds
        every cell that prefix needs (sliding-window cells the window has left since)."""
        if not 0 <= start < end <= self.n_past:
            raise ValueError(f"no positions {start}..{end} in a sequence of {self.n_past}")
        return self._scratch_state(start, end, complete=True)

    def _scratch_state(self, start: int, end: int, *, complete: bool = False) -> bytes | None:
        """Share positions *start* .. *end* of sequence 0 with scratch sequence 1 and save
        that; with *complete*, None unless it holds what a sequence ending at *end* needs."""
        memory, lc = self._memory, self._lc
        lc.llama_memory_seq_rm(memory, _SCRATCH, -1, -1)
        lc.llama_memory_seq_cp(memory, 0, _SCRATCH, start, end)
        try:
            if complete:  # (zero cells a restore put back are no cells of the prefix)
                lowest = max(lc.llama_memory_seq_pos_min(memory, _SCRATCH), self._zero_end)
                window = self.n_swa
                if lc.llama_memory_seq_pos_max(memory, _SCRATCH) != end - 1 or (
                    window and lowest > max(start, end - window)
                ):
                    return None
            size = lc.llama_state_seq_get_size(self._ctx, _SCRATCH)
            buffer = (ctypes.c_uint8 * size)()
            written = lc.llama_state_seq_get_data(self._ctx, buffer, size, _SCRATCH)
        finally:
            lc.llama_memory_seq_rm(memory, _SCRATCH, -1, -1)
        return ctypes.string_at(buffer, written) if written else None

    @on_compute_thread
    def append_slice(self, data: bytes, n_tokens: int) -> bool:
        """Add a slice saved by :meth:`save_slice` that ends at *n_tokens* after the current
        sequence (the slice must start at ``n_past``). The slice is read into scratch
        sequence 1, its cells laid out as a fresh prefill's (see :meth:`load_state`), and then
        shared with sequence 0; they keep their positions. False (sequence unchanged) if
        llama.cpp refuses it or its positions do not fit."""
        memory = self._memory
        self.changes += 1
        laid_out = laid_out_as_prefill(data, _STATE_HEADER, self.n_past, n_tokens, self.n_swa)
        fits = laid_out is not None and self._read_into_scratch(laid_out[0], n_tokens)
        fits = fits and _holds(self._lc, memory, _SCRATCH, self.n_past, n_tokens)
        fits = fits and self._lc.llama_memory_seq_pos_max(memory, 0) == self.n_past - 1
        if fits:
            self._lc.llama_memory_seq_cp(memory, _SCRATCH, 0, -1, -1)
            self.n_past, self._zero_end = n_tokens, max(self._zero_end, laid_out[1])  # type: ignore[index]
        self._lc.llama_memory_seq_rm(memory, _SCRATCH, -1, -1)
        return fits

    def _read_into_scratch(self, data: bytes, n_tokens: int) -> bool:
        """Replace scratch sequence 1 with a saved state; whether it ends at *n_tokens*
        (the caller empties the scratch sequence afterwards)."""
        read = self._lc.llama_state_seq_set_data(self._ctx, _readonly_pointer(data), len(data), _SCRATCH)
        return read != 0 and self._lc.llama_memory_seq_pos_max(self._memory, _SCRATCH) == n_tokens - 1

    @on_compute_thread
    def append_moved(self, data: bytes, n_tokens: int, start: int) -> bool:
        """Approximate reuse: add positions *start* .. *n_tokens* of a saved state (whole or
        a slice) after the current sequence, moved to begin at ``n_past``. Their keys are
        re-rotated to the new positions at the next decode, but their values still
        reflect the context they were computed in, so what follows is no longer exactly
        what a live prefill gives. False (sequence unchanged) if refused."""
        memory = self._memory
        self.changes += 1
        fits = self._read_into_scratch(data, n_tokens)
        fits = fits and 0 <= start < n_tokens and self.n_past + n_tokens - start <= self.n_ctx
        if fits:
            self._lc.llama_memory_seq_rm(memory, _SCRATCH, -1, start)
            self._lc.llama_memory_seq_add(memory, _SCRATCH, start, n_tokens, self.n_past - start)
            self._lc.llama_memory_seq_cp(memory, _SCRATCH, 0, -1, -1)
            self.n_past += n_tokens - start
        self._lc.llama_memory_seq_rm(memory, _SCRATCH, -1, -1)
        return fits

    # -- evaluation -----------------------------------------------------------------------

    @on_compute_thread
    def eval(
        self, tokens: Sequence[int], should_stop: Callable[[], bool] | None = None, *, ends_prompt: bool = False
    ) -> None:
        """Feed *tokens* after the current position in the calls of :func:`feed_calls`:
        nearly equal ones of at most ``n_batch`` tokens, and where they end a prompt
        (*ends_prompt*), stock's last call as it is when that is short. Logits are kept for
        the last token only. ``should_stop`` is polled between calls (for pre-emption); when
        it returns True, evaluation stops early."""
        base = self.n_past
        if base + len(tokens) > self.n_ctx:
            raise EngineError(f"{base + len(tokens)} tokens do not fit the context of {self.n_ctx}")
        for start, end in feed_calls(self, base, base + len(tokens), ends_prompt=ends_prompt):
            if should_stop is not None and should_stop():
                return
            self._decode_piece(tokens[start - base : end - base], all_logits=False)

    def _decode_piece(self, piece: Sequence[int], *, all_logits: bool) -> None:
        """One ``llama_decode`` call for at most ``n_batch`` tokens after ``n_past``, with
        logits for every token or for the last one only."""
        self.changes += 1
        batch = self._batch
        batch.n_tokens = len(piece)
        for i, token in enumerate(piece):
            batch.token[i] = token
            batch.pos[i] = self.n_past + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits
        batch.logits[len(piece) - 1] = True
        status = self._lc.llama_decode(self._ctx, batch)
        if status != 0:
            raise EngineError(f"llama_decode returned {status}")
        self.n_past += len(piece)

    @on_compute_thread
    def eval_with_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed *tokens* after the current position in as few calls as ``n_batch`` allows,
        keeping the logits of every position: row ``i`` predicts the token after
        ``tokens[i]``. Returns a copy of shape ``(len(tokens), n_vocab)``.

        Batched evaluation is not bit-identical to feeding tokens one at a time (CPU
        kernels differ for batch sizes 1 and > 1), so callers that need the one-at-a-time
        result compare with a margin (see :mod:`percache_core.engines.llama_cpp.drafting`).
        """
        if not tokens:
            raise ValueError("tokens must not be empty")
        if self.n_past + len(tokens) > self.n_ctx:
            raise EngineError(f"{self.n_past + len(tokens)} tokens do not fit the context of {self.n_ctx}")
        rows = np.empty((len(tokens), self.n_vocab), dtype=np.float32)
        for start in range(0, len(tokens), self.n_batch):
            piece = tokens[start : start + self.n_batch]
            self._decode_piece(piece, all_logits=True)
            for i in range(len(piece)):
                pointer = self._lc.llama_get_logits_ith(self._ctx, i)
                rows[start + i] = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
        return rows

    @on_compute_thread
    def truncate(self, n_tokens: int) -> bool:
        """Drop every position from *n_tokens* on, keeping the first *n_tokens*.

        Returns False when the kept sequence can no longer continue exactly: with a
        sliding-window attention cache, llama.cpp reuses the cells of positions that the
        window had left, so positions a shorter sequence needs again may be gone. The
        caller must then rebuild the sequence (restore and prefill again).
        """
        if not 0 <= n_tokens <= self.n_past:
            raise ValueError(f"cannot keep {n_tokens} of {self.n_past} tokens")
        self.changes += 1
        if not self._lc.llama_memory_seq_rm(self._memory, 0, n_tokens, -1):
            return False
        self.n_past = n_tokens
        if n_tokens == 0:
            return True
        lowest = max(self._lc.llama_memory_seq_pos_min(self._memory, 0), self._zero_end)  # (zero cells: none)
        window = self.n_swa
        return self._lc.llama_memory_seq_pos_max(self._memory, 0) == n_tokens - 1 and (
            window == 0 or lowest <= max(0, n_tokens - window)
        )

    @property
    def n_swa(self) -> int:
        """The sliding-window size of the model's windowed layers (0: none)."""
        return int(self._lc.llama_model_n_swa(self._model))

    def last_logits(self) -> np.ndarray:
        """Logits of the last evaluated token (a view into llama.cpp's buffer)."""
        pointer = self._lc.llama_get_logits_ith(self._ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def generate(
        self,
        *,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[int]:
        """Decode up to *max_new_tokens* tokens after the evaluated prompt, one at a time.

        Yields token ids; an end-of-generation token is yielded too (it does not count
        towards *max_new_tokens*), and then generation stops. Use :meth:`token_bytes` for
        their text.
        """
        rng = np.random.default_rng(sampling.seed)
        previous: int | None = None
        for _ in range(max_new_tokens):
            if previous is not None:  # evaluated lazily: the last token never needs it
                if self.n_past >= self.n_ctx or (should_stop is not None and should_stop()):
                    break
                self.eval([previous])
            token = pick_token(self.last_logits(), sampling, rng)
            yield token
            if self.is_end_of_generation(token):
                break
            previous = token

    def close(self) -> None:
        """Free the context and the model."""
        if self._closed:
            return
        self._closed = True
        self._lc.llama_batch_free(self._batch)
        self._lc.llama_free(self._ctx)
        self._lc.llama_model_free(self._model)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
