"""Which kernels a batch-invariant launch runs with, flash attention on or off and the tiled
K-quant matmul for every batch size or for none: measured once per build, model, threads and
context, and kept in the self-check memo.

On the build ``make llama-server-invariant`` makes, every pair computes a request as alone
whatever runs beside it (``benchmarks.batch_invariance --load 8``: 48/48 texts and first
log-probabilities; with ``-fa off`` attention takes the matrix products whose kernels that
build makes batch-independent, with ``-fa on`` flash attention's per-row kernel, the only path
that build leaves it; the tiled matmul adds each 256-value slab into an output in the same
order whatever the batch, so forced for every batch size it holds too, while as shipped it
takes only batches of 8 rows or more). Which pair is faster is the model's (2 cores, a
one-slot server, medians of two rounds): SmolLM2-135M prefilled 1,040 tokens at 112 tok/s
with ``-fa on`` against 246 with ``-fa off``; Gemma 3 270M prefilled them at 654 tok/s with
the tiled matmul forced against 536 without it, but decoded at 34.7 against 40.2 tok/s. So
the first start of such a server for a model times one RAG-sized request (a probe prompt of
about 560 tokens, 32 tokens decoded, nothing reused, the faster of two after a short
warm-up) on a one-slot server of each pair, one after the other, and keeps the fastest;
later starts read it.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path

from ...kv.engine import SELF_CHECK_MEMO
from ...kv.probe_text import probe_sentences
from ...memo import Memo
from ...models import file_identity
from .server_http import ServerHTTP
from .server_process import ServerLaunch, ServerProcess, find_server_binary

logger = logging.getLogger(__name__)

SWITCHES = ("on", "off")
PROBE_SENTENCES = 24  # about 560 tokens on Gemma 3: a RAG prompt's size
PROBE_DECODE = 32


def with_kernels_chosen(model: Path, launch: ServerLaunch) -> ServerLaunch:
    """*launch* with its ``flash_attention`` and ``tiled_matmul`` set: as given, or (a
    batch-invariant launch that leaves either None) the pair measured fastest for *model*
    (see the module), read from the memo when measured before. Other launches are returned
    as they are."""
    if not launch.batch_invariant or None not in (launch.flash_attention, launch.tiled_matmul):
        return launch
    candidates = [
        replace(launch, flash_attention=attention, tiled_matmul=tiled)
        for attention, tiled in itertools.product(
            [launch.flash_attention] if launch.flash_attention else SWITCHES,
            [launch.tiled_matmul] if launch.tiled_matmul else SWITCHES,
        )
    ]
    key = _memo_key(model, launch)
    kept = Memo(SELF_CHECK_MEMO).get(key)
    for candidate in candidates:
        if kept == _name(candidate):
            return candidate
    from tqdm.auto import tqdm

    started = time.perf_counter()
    measuring = tqdm(candidates, desc="batch-invariant launch: timing its kernels, once for this model",
                     unit="launch", leave=False)
    seconds = {_name(candidate): _request_seconds(model, candidate) for candidate in measuring}
    chosen = min(candidates, key=lambda candidate: seconds[_name(candidate)])
    logger.info("batch-invariant launch: %s (a probe request took %s; measured in %.1f s, kept for this model)",
                _name(chosen), ", ".join(f"{s:.2f} s with {n}" for n, s in seconds.items()), time.perf_counter() - started)
    Memo(SELF_CHECK_MEMO).put(key, _name(chosen))
    return chosen


def _name(launch: ServerLaunch) -> str:
    """A pair as the memo and the log name it: ``-fa on, tiled matmul off``."""
    return f"-fa {launch.flash_attention}, tiled matmul {launch.tiled_matmul}"


def _request_seconds(model: Path, launch: ServerLaunch) -> float:
    """The server's own time (prefill and decode) for the probe request on a one-slot
    server of *launch* (the faster of two, after a short warm-up request)."""
    one = replace(launch, n_slots=1, port=None, slot_save_path=None)
    process = ServerProcess(model, one)
    try:
        http = ServerHTTP(one.host, process.port, api_key=None, timeout_s=600.0)
        process.wait_until_ready(http, one.startup_timeout_s)
        prompt = " ".join(probe_sentences(PROBE_SENTENCES)) + "\nQuestion: who said the van is late?\nAnswer:"
        body = {"prompt": prompt, "n_predict": PROBE_DECODE, "temperature": 0, "cache_prompt": False}
        http.call("POST", "/completion", {**body, "prompt": prompt[:200], "n_predict": 1})  # warm-up: the weights paged in
        times = []
        for _ in range(2):
            timings = http.call("POST", "/completion", body)["timings"]
            times.append((float(timings["prompt_ms"]) + float(timings["predicted_ms"])) / 1000)
        return min(times)
    finally:
        process.stop()


def _memo_key(model: Path, launch: ServerLaunch) -> str:
    """What decides the choice: the binary and the model (path, size, modification
    time), the threads and the context."""
    binary = Path(launch.binary) if launch.binary is not None else find_server_binary(batch_invariant=True)
    return f"invariant-kernels|{file_identity(binary)}|{file_identity(model)}|t={launch.threads}|c={launch.n_ctx}"
