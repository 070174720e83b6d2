"""Adaptive context: how many of the retrieved chunks a question's prompt gets.

With ``context="adaptive"`` (opt-in), the prompt grows one retrieved chunk at a time, in
retrieval order: after prefilling [system, chunk 1..k, question], the next-token
distribution's confidence (``confidence_signals``) decides whether to answer from these k
chunks or to add the next one (the last is always used). Each step restores its prefix
from the chunk-state tree, so it prefills only the new chunk and the question. The
decision depends only on the logits, which are the same with or without a cache, so the
answers equal those of the same policy with caches off.

Calibrated on this project's data (``benchmarks/adaptive_context.py``): with the bundled
270M base model no signal beat a fixed chunk count on the test split, which is why the
mode is off by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import numpy as np

from ..config import ContextMode, Signal
from ..serving.state_runner import RunOptions, StateRunner, StopCheck
from ..serving.streaming import drain
from ..types import Chunk

CONTEXT_MODES = get_args(ContextMode)
SIGNALS = get_args(Signal)

__all__ = ["CONTEXT_MODES", "SIGNALS", "confidence_signals", "context_chunks", "is_confident"]
_HIGHER_IS_CONFIDENT = {"top_probability": True, "margin": True, "entropy": False}


def confidence_signals(logits: np.ndarray) -> dict[str, float]:
    """The next-token distribution's top probability, the margin between its two most
    likely tokens, and its entropy (nats).

    >>> signals = confidence_signals(np.array([10.0, 0.0, 0.0]))
    >>> round(signals["top_probability"], 3), signals["entropy"] < 0.01
    (1.0, True)
    """
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max()
    probabilities = np.exp(shifted)
    probabilities /= probabilities.sum()
    second, first = np.partition(probabilities, -2)[-2:]
    entropy = float(-(probabilities * np.log(np.clip(probabilities, 1e-300, None))).sum())
    return {"top_probability": float(first), "margin": float(first - second), "entropy": entropy}


def is_confident(signals: dict[str, float], signal: str, threshold: float) -> bool:
    """Whether *signal* passes *threshold* (at or above it; for entropy, at or below).

    >>> is_confident({"entropy": 0.5}, "entropy", 1.0), is_confident({"margin": 0.1}, "margin", 0.2)
    (True, False)
    """
    value = signals[signal]
    return value >= threshold if _HIGHER_IS_CONFIDENT[signal] else value <= threshold


def context_chunks(
    runner: StateRunner,
    question: str,
    chunks: Sequence[Chunk],
    *,
    max_new_tokens: int,
    should_stop: StopCheck | None = None,
) -> list[Chunk]:
    """The retrieved *chunks* the prompt uses: all of them with ``context="fixed"``; with
    ``context="adaptive"`` the shortest leading run whose prompt makes the first answer
    token confident, else all. Each tried prompt restores its prefix from the tree and
    keeps its new states (through *runner*), so each step prefills one chunk and the
    question; the choice depends on the logits only, so it is the same with or without a
    cache."""
    config = runner.config
    if not config.retrieval.adaptive:
        return list(chunks)
    for count in range(1, len(chunks)):
        layout = runner.lay_out(question, chunks[:count], max_new_tokens=max_new_tokens)
        options = RunOptions(max_new_tokens, decode=False, keep_logits=True)
        events = runner.run(layout, options, should_stop=should_stop)
        logits = drain(events).next_token_logits
        assert logits is not None
        if is_confident(confidence_signals(logits), config.retrieval.adaptive_signal, config.retrieval.adaptive_threshold):
            return list(chunks[:count])
    return list(chunks)
