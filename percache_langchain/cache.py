"""``PerCacheSemanticCache``: LangChain's LLM cache on PerCache's QA bank.

Entries are scoped by ``llm_string`` inside the search (another model's or setting's
answers are never candidates). The key is the user's question when a
``PerCacheRetriever`` of the same PerCache recorded one that appears in the prompt (so
that the retrieved context does not drown the similarity), else the whole prompt.
"""

from __future__ import annotations

import asyncio
import hashlib
import warnings
from collections.abc import Sequence
from typing import Any

from langchain_core.caches import RETURN_VAL_TYPE, BaseCache
from langchain_core.load import dumps, loads

from percache_core import PerCache

from .recorder import as_percache, recorder_for

_ORIGIN = "langchain-cache"


def _scope(llm_string: str) -> dict[str, str]:
    return {"llm": hashlib.sha256(llm_string.encode("utf-8")).hexdigest()[:32]}


class PerCacheSemanticCache(BaseCache):
    """A semantic LLM cache: ``set_llm_cache(PerCacheSemanticCache(pc))`` or ``cache=``.

    ``similarity_threshold`` overrides the PerCache's tau for this cache.
    """

    def __init__(self, percache: PerCache, *, similarity_threshold: float | None = None) -> None:
        self._percache = as_percache(percache)
        self._threshold = similarity_threshold

    def _key(self, prompt: str) -> str:
        return recorder_for(self._percache).question_in(prompt) or prompt

    def lookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        answer = self._percache.lookup(
            self._key(prompt), similarity_threshold=self._threshold, scope=_scope(llm_string)
        )
        if answer is None or answer.entry_id is None:
            return None
        entry = self._percache.qa_bank.get(answer.entry_id)
        if entry is None or "lc_generations" not in entry.metadata:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # langchain_core.load is marked beta
            return loads(entry.metadata["lc_generations"])

    def update(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        if not return_val:
            return
        self._percache.remember(
            self._key(prompt),
            return_val[0].text,
            scope=_scope(llm_string),
            metadata={"origin": _ORIGIN, "lc_generations": dumps(list(return_val))},
        )

    def clear(self, **kwargs: Any) -> None:
        """Drop every entry this cache stored (other PerCache entries stay)."""
        bank = self._percache.qa_bank
        for entry in bank.entries:
            if entry.metadata.get("origin") == _ORIGIN:
                bank.drop(entry.id)

    async def alookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        return await asyncio.to_thread(self.lookup, prompt, llm_string)

    async def aupdate(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        await asyncio.to_thread(self.update, prompt, llm_string, return_val)

    async def aclear(self, **kwargs: Any) -> None:
        await asyncio.to_thread(self.clear, **kwargs)


__all__: Sequence[str] = ["PerCacheSemanticCache"]
