"""``CallerCache`` (``pc.caller``): a PerCache for apps that run their own pipeline.

Its verbs come in two parts: over stored answers (:mod:`percache_core.callers.answers`)
and over the caller's own prompts (:mod:`percache_core.callers.prompts`).

A LlamaIndex query engine, a LangChain chain or your own code builds its prompts and
retrieves on its own; what it needs of a cache is a short verb list over the same parts
and the same answering path (:class:`~percache_core.answering.request_path.RequestPath`)
that ``PerCache.answer`` uses:

- :meth:`~CallerCache.lookup`: a stored answer the caller may serve (counted as a hit);
- :meth:`~CallerCache.complete`: continue the caller's finished prompt through the
  chunk states (its output is the model's own, with or without the cache);
- :meth:`~CallerCache.generate`: answer a question from chunks the caller retrieved;
- :meth:`~CallerCache.remember` / :meth:`~CallerCache.forget`: store the caller's
  answer, and delete what it stored.

Every answer the caller keeps is bound to a *binding* (a key of whatever decides its
answers: model, prompt template, settings, retrieved context), so two pipelines never share
answers by accident.

>>> with PerCache.open("cache") as pc:                    # doctest: +SKIP
...     hit = pc.caller.lookup("When is the review?", binding="my-app-v1")
...     text = hit.text if hit else my_pipeline("When is the review?")
...     pc.caller.remember("When is the review?", text, binding="my-app-v1")
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ..answering.parts import CacheParts
from ..answering.request_path import RequestPath
from ..types import QAHit
from .answers import StoredAnswerVerbs
from .prompts import PromptVerbs

__all__ = ["CallerCache"]


class CallerCache(StoredAnswerVerbs, PromptVerbs):
    """The verbs an app with its own pipeline uses (see the module docstring); reach it as
    ``pc.caller``.

    Args:
        parts: the cache's parts.
        request_path: the path every request to the cache's model takes.
        ensure_open: raises :class:`~percache_core.errors.CacheClosedError` once the cache
            is closed.

    >>> pc.caller.lookup("When is the review?")   # doctest: +SKIP
    """

    def __init__(self, parts: CacheParts, request_path: RequestPath, ensure_open: Callable[[], None]) -> None:
        self._parts = parts
        self._path = request_path
        self._ensure_open = ensure_open
        # semantic lookups that served nothing: the stored answers they saw, until the
        # caller remembers its own answer to the question (a calibration label each)
        self._offered: OrderedDict[tuple[str, str, str], list[QAHit]] = OrderedDict()
        self._quote_index: tuple[int, dict[str, list[str]]] = (-1, {})  # knowledge version, index
        self._deferred_quote_index: tuple[int, dict[str, list[str]]] = (-1, {})  # queued passages' version, index
