"""The knowledge abstract: key topics, names and facts of the user's chunks, kept small.

New chunks are summarised by the local LLM in batches (PerCache, section 4.1.2) and the
facts merged into a persistent list of lines; when it grows past ``max_lines`` the oldest
half is condensed by the LLM (or, if that yields nothing, dropped). Predicting from this
abstract instead of raw chunks keeps prediction prompts short and broad.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..kv.engine import Decoding, Sampling
from ..storage import Store
from ..types import Chunk, live
from .predictor import Complete, parse_list

SUMMARY_DECODING = Decoding(96, Sampling(0.0, 1.0, 0), ("\n\n",))  # one list of facts, greedy

_KEY = "abstract"
MAX_FACT_WORDS = 30


def _clean_fact(line: str) -> str | None:
    """A summary line kept as a fact, or None.

    >>> _clean_fact("  Rehearsal: Thursday 4 pm, Birch room. ")
    'Rehearsal: Thursday 4 pm, Birch room.'
    >>> _clean_fact("ok") is None
    True
    """
    fact = " ".join(line.split()).strip(" -*")
    words = fact.split()
    if len(words) < 2 or len(words) > MAX_FACT_WORDS or sum(c.isalpha() for c in fact) < 5:
        return None
    return fact


class KnowledgeAbstract:
    """A persistent, LLM-written summary of the knowledge bank."""

    def __init__(
        self, store: Store, *, max_lines: int | Callable[[], int] = 40, batch_chunks: int | Callable[[], int] = 3
    ) -> None:
        self._store = store
        self._max_lines = live(max_lines)
        self._batch_chunks = live(batch_chunks)
        saved = store.get(_KEY) or {}
        self.lines: list[str] = list(saved.get("lines", []))
        self.summarized: set[str] = set(saved.get("summarized", []))
        self.version: int = saved.get("version", 0)

    @property
    def max_lines(self) -> int:
        """Lines kept before the abstract is condensed (``abstract_max_lines``)."""
        return self._max_lines()

    def _save(self) -> None:
        self._store.put(
            _KEY, {"lines": self.lines, "summarized": sorted(self.summarized), "version": self.version}
        )

    def pending(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """Chunks not summarised yet."""
        return [chunk for chunk in chunks if chunk.id not in self.summarized]

    def summarise(
        self,
        chunks: Sequence[Chunk],
        complete: Complete,
        *,
        chat_format: Callable[[str], str] | None = None,
        max_batches: int | None = None,
    ) -> int:
        """Summarise *chunks* batch by batch (each batch is saved when done); return the
        number of fact lines added."""
        added = 0
        size = self._batch_chunks()
        batches = [chunks[i : i + size] for i in range(0, len(chunks), size)]
        for batch in batches[:max_batches]:
            notes = "\n\n".join(chunk.text.strip() for chunk in batch)
            if chat_format is not None:
                prompt = chat_format(
                    "List the key topics, names, dates and facts in these notes as short "
                    f"bullet points:\n\n{notes}"
                )
                open_item = False
            else:
                prompt = f"Notes:\n{notes}\n\nThe key topics, names, dates and facts in these notes:\n-"
                open_item = True
            text = complete(prompt, SUMMARY_DECODING)
            known = {line.lower() for line in self.lines}
            for item in parse_list(text, first_item_open=open_item):
                fact = _clean_fact(item)
                if fact is not None and fact.lower() not in known:
                    self.lines.append(fact)
                    known.add(fact.lower())
                    added += 1
            self.summarized.update(chunk.id for chunk in batch)
            if len(self.lines) > self._max_lines():
                self._condense(complete, chat_format)
            self.version += 1
            self._save()
        return added

    def _condense(self, complete: Complete, chat_format: Callable[[str], str] | None) -> None:
        half = len(self.lines) // 2
        old, recent = self.lines[:half], self.lines[half:]
        facts = "\n".join(f"- {line}" for line in old)
        if chat_format is not None:
            prompt = chat_format(f"Rewrite these facts as fewer, shorter bullet points:\n{facts}")
            open_item = False
        else:
            prompt = f"Facts:\n{facts}\n\nThe same facts in fewer, shorter lines:\n-"
            open_item = True
        text = complete(prompt, SUMMARY_DECODING)
        condensed = [f for f in (_clean_fact(i) for i in parse_list(text, first_item_open=open_item)) if f]
        condensed = condensed[: max(1, half // 2)]
        self.lines = (condensed + recent)[-self._max_lines() :]

    def clear(self) -> None:
        """Forget the abstract (every chunk becomes pending again)."""
        self.lines, self.summarized = [], set()
        self.version += 1
        self._save()
