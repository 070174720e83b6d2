"""Answers of whole prompts: an identical prompt is answered without the model.

Greedy decoding (and seeded sampling) of the same token sequence, fed in the same pieces, on
the same engine and settings gives the same tokens every time. So once a prompt has been
answered, its answer *is* the answer to that prompt: a later run of the same prompt needs no
restore, prefill or decode. The key (:func:`prompt_key`) is a digest of everything that
decides the output: the engine's fingerprint (model file, llama.cpp build, context
settings, template version), the prompt's pieces as token ids, and the decoding settings
(``max_new_tokens``, sampling, stop strings). Anything that changes the prompt (another
question, other retrieved chunks, an edited document, another template) changes the key,
so an old answer can never be served for a new prompt.

A question asked of the cache's own pipeline is also kept as an *asked* record (prefix
``asked:``): a digest of the question and everything that decides its prompt (the knowledge's
version, the retrieval and answer settings, the model; :func:`~percache_core.answering.request.asked_key`)
-> the key of its prompt's answer. The same question asked again finds its answer through it
before anything is embedded or loaded (:meth:`PromptAnswers.find_asked`).

The answers live in the QA bank's store (prefix ``prompt:``, shared by every process on the
folder) within the QA bank's byte budget, least frequently used first. Deleting documents
empties them (a key does not say which texts its prompt held). With a shared tier, they are
shared with other clients too: a key has one right answer, so an older envelope put back in
Redis is still that answer (see :mod:`percache_core.shared.redis_tier`).

>>> import tempfile
>>> from percache_core.storage import Store
>>> answers = PromptAnswers(Store(tempfile.mkdtemp()), budget_bytes=10_000)
>>> key = prompt_key("engine-1", [[2, 10, 11], [12]], {"max_new_tokens": 8})
>>> answers.put(key, PromptAnswer("Friday.", (7, 8, 1), prompt_tokens=4, generated_tokens=2))
>>> answers.find(key).text
'Friday.'
>>> answers.find(prompt_key("engine-1", [[2, 10, 11], [12]], {"max_new_tokens": 9})) is None
True
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import StorageWriteError
from ..storage import Budget, Store
from ..types import live

logger = logging.getLogger(__name__)

PREFIX = "prompt:"
ASKED_PREFIX = "asked:"
ASKED_SHARE = 8  # asked records keep within 1/8 of the prompt answers' budget


@dataclass(frozen=True)
class PromptAnswer:
    """What one run of a prompt produced."""

    text: str
    tokens: tuple[int, ...]  # decoded ids, end of generation included
    prompt_tokens: int
    generated_tokens: int
    chunk_ids: tuple[str, ...] = ()
    idle: bool = False  # produced by idle work (a predicted or refreshed question)
    finish_reason: str = ""  # a relayed OpenAI request's ("stop" or "length")


def prompt_key(model: str, pieces: Sequence[Sequence[int]], decoding: Mapping[str, Any]) -> str:
    """A digest of what decides a prompt's output: *model* (the engine's fingerprint), the
    prompt's *pieces* (token ids, in the calls they are fed in) and the *decoding* settings.

    >>> prompt_key("m", [[1, 2]], {"stop": ["\\n"]}) == prompt_key("m", [[1], [2]], {"stop": ["\\n"]})
    False
    """
    payload = json.dumps(
        {"model": model, "pieces": [list(map(int, p)) for p in pieces], "decoding": dict(decoding)},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


class SharedPromptAnswers(Protocol):
    """Prompt answers of other clients (the shared tier)."""

    def fetch_prompt_answer(self, prompt_key: str) -> dict[str, Any] | None: ...

    def put_prompt_answer(self, prompt_key: str, value: dict[str, Any]) -> None: ...


class PromptAnswers:
    """Stored answers of whole prompts, by :func:`prompt_key`; *shared* (optional) is asked
    when this folder has no answer, and given every answer stored here."""

    def __init__(self, store: Store, *, budget_bytes: int | Callable[[], int], shared: SharedPromptAnswers | None = None) -> None:
        self._store = store
        self.shared = shared
        self._budget_bytes = live(budget_bytes)
        self.evictions = 0

    @property
    def budget_bytes(self) -> int:
        """The byte budget in force (read from the configuration when it is a setting)."""
        return self._budget_bytes()

    def find(self, key: str) -> PromptAnswer | None:
        """The stored answer of the prompt with *key* (counted as a use), or None."""
        answer = _answer(self._store.get(PREFIX + key))
        if answer is None and self.shared is not None:
            answer = _answer(self.shared.fetch_prompt_answer(key))
            if answer is not None:
                try:
                    self._store_locally(key, answer)
                except StorageWriteError as error:
                    logger.warning("shared prompt answer not kept locally: %s", error)
        if answer is None:
            return None
        self._store.note_use(PREFIX + key)
        return answer

    def put(self, key: str, answer: PromptAnswer) -> None:
        """Store *answer* under *key* (replacing what was there) within the budget, and share
        it. Raises :class:`~percache_core.errors.StorageWriteError` when the local write
        fails."""
        value = self._store_locally(key, answer)
        if self.shared is not None:
            self.shared.put_prompt_answer(key, value)

    def _store_locally(self, key: str, answer: PromptAnswer) -> dict[str, Any]:
        value = {
            "text": answer.text,
            "tokens": list(answer.tokens),
            "prompt_tokens": answer.prompt_tokens,
            "generated_tokens": answer.generated_tokens,
            "chunk_ids": list(answer.chunk_ids),
            "idle": answer.idle,
            "finish_reason": answer.finish_reason,
        }
        evicted = self._store.put(PREFIX + key, value, budget=Budget(PREFIX, self.budget_bytes))
        self.evictions += len(evicted or ())
        return value

    def remember_asked(self, asked_key: str, key: str) -> None:
        """Record that the question with *asked_key* is answered by the prompt with *key*.
        Raises :class:`~percache_core.errors.StorageWriteError` when the write fails."""
        record = ASKED_PREFIX + asked_key
        if self._store.get(record) == {"prompt": key}:
            return
        self._store.put(record, {"prompt": key}, budget=Budget(ASKED_PREFIX, max(self.budget_bytes // ASKED_SHARE, 1)))

    def find_asked(self, asked_key: str) -> tuple[str, PromptAnswer] | None:
        """The prompt key and stored answer of the question with *asked_key*, or None (this
        folder only: asked records are not shared)."""
        record = self._store.get(ASKED_PREFIX + asked_key)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            return None
        answer = self.find(record["prompt"])
        return None if answer is None else (record["prompt"], answer)

    def clear(self) -> None:
        """Remove every stored prompt answer and asked record."""
        self._store.clear(PREFIX)
        self._store.clear(ASKED_PREFIX)

    def __len__(self) -> int:
        return len(self._store.keys(PREFIX))

    @property
    def bytes(self) -> int:
        return self._store.total_size(PREFIX)


def _answer(value: Any) -> PromptAnswer | None:
    """A stored value as a :class:`PromptAnswer`, or None when absent or malformed."""
    if not isinstance(value, dict):
        return None
    try:
        tokens = tuple(int(t) for t in value["tokens"])
        return PromptAnswer(
            text=str(value["text"]),
            tokens=tokens,
            prompt_tokens=int(value["prompt_tokens"]),
            generated_tokens=int(value["generated_tokens"]),
            chunk_ids=tuple(str(c) for c in value.get("chunk_ids", ())),
            idle=bool(value.get("idle", False)),
            finish_reason=str(value.get("finish_reason", "")),
        )
    except (KeyError, TypeError, ValueError):
        return None
