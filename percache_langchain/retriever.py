"""``PerCacheRetriever``: wraps any retriever and records what it returns."""

from __future__ import annotations

import hashlib
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable
from pydantic import ConfigDict, field_validator

from percache_core import InvalidQuestionError, PerCache

from .recorder import as_percache, recorder_for


def _document_id(document: Document) -> str:
    return document.id or "lc-" + hashlib.sha1(document.page_content.encode("utf-8")).hexdigest()[:16]


class PerCacheRetriever(BaseRetriever):
    """Returns the inner retriever's documents unchanged, and records the question and the
    documents for ``PerCacheLLMCache`` and ``PerCacheLLM``; with
    ``add_to_knowledge`` (default) the documents also join PerCache's knowledge bank, so
    that prediction and chunk states cover them.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    inner: Runnable
    percache: Any
    add_to_knowledge: bool = True

    @field_validator("percache")
    @classmethod
    def _check_percache(cls, value: Any) -> PerCache:
        return as_percache(value)

    @staticmethod
    def _checked(query: str) -> str:
        """*query*, refused before any work when it is not a non-empty string (as
        ``pc.answer`` refuses it)."""
        if not isinstance(query, str) or not query.strip():
            raise InvalidQuestionError("the question is empty: ask a question")
        return query

    def _keep(self, query: str, documents: list[Document]) -> list[Document]:
        recorder_for(self.percache).record(query, documents)
        self.percache.caller.retrieves_with(self._passages)  # idle work builds requests as this chain does
        if self.add_to_knowledge:
            usable = [d for d in documents if d.page_content.strip()]
            if usable:
                self.percache.add_documents(
                    [{"id": _document_id(d), "text": d.page_content} for d in usable], split=False
                )
        return documents

    def _passages(self, question: str, count: int) -> list[str]:
        """The texts the inner retriever returns for *question* (at most *count*), for
        idle work's predicted requests (``pc.caller.retrieves_with``)."""
        return [d.page_content for d in self.inner.invoke(question)][:count]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        documents = self.inner.invoke(self._checked(query), config={"callbacks": run_manager.get_child()})
        return self._keep(query, documents)

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[Document]:
        documents = await self.inner.ainvoke(self._checked(query), config={"callbacks": run_manager.get_child()})
        return self._keep(query, documents)
