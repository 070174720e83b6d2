"""What a stored answer is bound to, and the metadata that model-generated entries carry.

A QA entry is only seen by lookups under the same binding: the model, the prompt
template, the retrieval depth and the generation settings that produced it (and, kept
apart, its scope). Model-generated entries also keep their token ids (drafts for exact
mode) and the chunks their question retrieved (staleness checks for semantic mode).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ..config import PerCacheConfig
from ..types import Chunk
from .prompting import TEMPLATE_VERSION
from .state_runner import RunResult


def answer_binding(config: PerCacheConfig, model: str, *, top_k: int, max_new_tokens: int) -> str:
    """A key of everything that decides an answer besides the question and the chunks:
    the model (engine fingerprint, or a framework LLM's identity), the prompt template,
    the retrieval depth, the context policy (when adaptive) and the generation settings.

    >>> from percache_core.config import PerCacheConfig
    >>> c = PerCacheConfig()
    >>> a = answer_binding(c, "m", top_k=3, max_new_tokens=64)
    >>> a == answer_binding(c, "m", top_k=3, max_new_tokens=64), a == answer_binding(c, "m", top_k=3, max_new_tokens=32)
    (True, False)
    """
    payload = {
        "model": model,
        "template": [TEMPLATE_VERSION, config.retrieval.system_prompt],
        "top_k": top_k,
        "max_new_tokens": max_new_tokens,
        "temperature": config.engine.temperature,
        "top_p": config.engine.top_p,
        "seed": config.engine.seed,
        "stop": list(config.engine.stop),
    }
    if config.retrieval.adaptive:  # the prompt's chunks depend on the policy
        payload["context"] = [config.retrieval.context, config.retrieval.adaptive_signal, config.retrieval.adaptive_threshold]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def text_digest(text: str) -> str:
    """A short digest of a chunk's text (to tell changed chunks)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def chunk_sources(chunks: Sequence[Chunk]) -> list[list[str]]:
    """``[[chunk id, text digest], ...]`` of the chunks an answer was generated from."""
    return [[c.id, text_digest(c.text)] for c in chunks]


def answer_metadata(
    result: RunResult, chunks: Sequence[Chunk], *, binding: str, scope: dict[str, Any] | None, origin: str
) -> dict[str, Any]:
    """The metadata a model-generated QA entry carries: where it came from, its binding,
    its scope, its token ids (drafts) and the retrieved chunks (staleness checks)."""
    metadata: dict[str, Any] = {
        "origin": origin,
        "binding": binding,
        "tokens": list(result.tokens),
        "sources": chunk_sources(chunks),
    }
    if scope:
        metadata["scope"] = scope
    return metadata
