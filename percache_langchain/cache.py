"""``PerCacheLLMCache``: LangChain's LLM cache on PerCache's QA bank.

A LangChain cache answers without calling the model, so it cannot have a stored answer
verified. In PerCache's default ``qa_mode="exact"`` it therefore returns an answer only
for the same prompt and ``llm_string`` (the same inputs give the same output). With
``qa_mode="semantic"`` (approximate, opt-in) the key is the user's question when a
``PerCacheRetriever`` of the same PerCache recorded one that appears in the prompt, and
entries are bound to the ``llm_string`` and to the prompt around that question (its
template, instructions and retrieved documents): another chain's prompt, another model
or other settings never share answers, and a changed document changes the binding.
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


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode("utf-8")).hexdigest()[:32]


class PerCacheLLMCache(BaseCache):
    """LangChain's LLM cache on PerCache's QA bank: ``set_llm_cache(PerCacheLLMCache(pc))``
    or ``cache=``. Exact (the same prompt and settings) unless the PerCache's
    ``qa_mode="semantic"`` (see the module docstring).

    ``similarity_threshold`` overrides the PerCache's tau for this cache (semantic mode).
    """

    def __init__(self, percache: PerCache, *, similarity_threshold: float | None = None) -> None:
        self._percache = as_percache(percache)
        self._threshold = similarity_threshold

    def _key(self, prompt: str, llm_string: str) -> tuple[str, str, str | None]:
        """(the text stored as the question, its binding, the user's question as the
        retriever recorded it or None)."""
        question = recorder_for(self._percache).question_in(prompt)
        if not self._percache.answer_policy.approximate or not question:
            return prompt, _digest("prompt", llm_string), question
        return question, _digest("question", llm_string, prompt.replace(question, "\x00")), question

    def lookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        """LangChain's cache lookup: the generations stored for *prompt* and this LLM.

        Args:
            prompt: the prompt as LangChain serialized it.
            llm_string: the LLM's parameters as LangChain serialized them.

        Returns:
            The stored generations, or None.

        >>> set_llm_cache(PerCacheLLMCache(pc)); llm.invoke("Hi")   # doctest: +SKIP
        """
        key, binding, question = self._key(prompt, llm_string)
        answer = self._percache.caller.lookup(key, similarity_threshold=self._threshold, binding=binding, asked=question)
        if answer is None or answer.entry_id is None:
            return None
        entry = self._percache.caller.entry(answer.entry_id)
        if entry is None or "lc_generations" not in entry.metadata:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # langchain_core.load is marked beta
            return loads(entry.metadata["lc_generations"])

    def update(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        """LangChain's cache update: store the generations *return_val* for *prompt*.

        Args:
            prompt: the prompt as LangChain serialized it.
            llm_string: the LLM's parameters as LangChain serialized them.
            return_val: the LLM's generations.

        >>> cache.update("Hi", llm_string, [Generation(text="Hello")])   # doctest: +SKIP
        """
        if not return_val:
            return
        key, binding, _ = self._key(prompt, llm_string)
        self._percache.caller.remember(
            key,
            return_val[0].text,
            binding=binding,
            metadata={"origin": _ORIGIN, "lc_generations": dumps(list(return_val))},
        )

    def clear(self, **kwargs: Any) -> None:
        """Drop every entry this cache stored (other PerCache entries stay).

        Args:
            **kwargs: LangChain's options (unused).

        >>> cache.clear()   # doctest: +SKIP
        """
        self._percache.caller.forget(origin=_ORIGIN)

    async def alookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        """:meth:`lookup` from async code (run in a thread)."""
        return await asyncio.to_thread(self.lookup, prompt, llm_string)

    async def aupdate(self, prompt: str, llm_string: str, return_val: RETURN_VAL_TYPE) -> None:
        """:meth:`update` from async code (run in a thread)."""
        await asyncio.to_thread(self.update, prompt, llm_string, return_val)

    async def aclear(self, **kwargs: Any) -> None:
        """:meth:`clear` from async code (run in a thread)."""
        await asyncio.to_thread(self.clear, **kwargs)


__all__: Sequence[str] = ["PerCacheLLMCache"]
