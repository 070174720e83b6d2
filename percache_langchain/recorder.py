"""What ``PerCacheRetriever`` saw, for the cache and the LLM of the same chain.

Each PerCache has one recorder. It keeps the last few (question, documents) records;
readers take the newest record whose question (or documents) appear in the prompt they
are given, so a record from another chain or thread is never used by mistake.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass

from langchain_core.documents import Document

from percache_core import PerCache


@dataclass(frozen=True)
class Retrieval:
    question: str
    documents: tuple[Document, ...]


class RetrievalRecorder:
    def __init__(self, size: int = 16) -> None:
        self._records: deque[Retrieval] = deque(maxlen=size)
        self._lock = threading.Lock()

    def record(self, question: str, documents: list[Document]) -> None:
        with self._lock:
            self._records.append(Retrieval(question, tuple(documents)))

    def question_in(self, prompt: str) -> str | None:
        """The newest recorded question that appears in *prompt*."""
        with self._lock:
            records = list(self._records)
        for record in reversed(records):
            if record.question and record.question in prompt:
                return record.question
        return None

    def documents_in(self, prompt: str) -> list[Document]:
        """The newest record's documents that appear in *prompt*, in prompt order."""
        with self._lock:
            records = list(self._records)
        for record in reversed(records):
            found = [
                (prompt.find(d.page_content), d)
                for d in record.documents
                if d.page_content and d.page_content in prompt
            ]
            if found:
                return [d for _, d in sorted(found, key=lambda pair: pair[0])]
        return []


_recorders: weakref.WeakKeyDictionary[PerCache, RetrievalRecorder] = weakref.WeakKeyDictionary()
_recorders_lock = threading.Lock()


def recorder_for(percache: PerCache) -> RetrievalRecorder:
    """The recorder shared by the LangChain components of one PerCache."""
    with _recorders_lock:
        if percache not in _recorders:
            _recorders[percache] = RetrievalRecorder()
        return _recorders[percache]


def as_percache(value: object) -> PerCache:
    """*value* if it is a PerCache (for the components' validators), else TypeError; the
    cache is told that an app brings its own prompts (``pc.caller.serves_app``)."""
    if not isinstance(value, PerCache):
        raise TypeError(f"percache must be a PerCache, got {type(value).__name__}")
    value.caller.serves_app()
    return value
