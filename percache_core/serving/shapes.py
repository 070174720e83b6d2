"""What apps send: the shape of their requests, learned from the prompts they bring.

An app that keeps its own pipeline (a LangChain chain, a LlamaIndex engine, a chat model)
sends PerCache finished prompt strings. One that quotes passages of the cache's knowledge
is split into what is the app's and what changes per question::

    prefix | passage 1 | separator | passage 2 | ... | middle | question | suffix

(the question is known where the adapter knows it: a retriever's query, the last user
message; without it the text after the last passage is kept as the suffix). A
:class:`RequestShape` is that split, bound to the decoding the app asked for, with how
often it was seen, how many passages it quotes and its *agreement*: how often the request
rebuilt from the question (the app's own retriever where PerCache holds it, else
PerCache's retrieval, rendered in the shape) was the very prompt the app sent. Each request
is rebuilt with every retrieval at hand (:data:`APP`, :data:`HYBRID`, :data:`DENSE`), so
that idle work ranks its passages the way that rebuilt the app's requests more often.

Idle work (:mod:`percache_core.prediction.app_requests`) renders prompts in these shapes:
the leading states ([prefix + passage], [... + passage 2]) pay whatever the agreement; a
whole predicted request's answer pays only where the app sends exactly that request.
Nothing here changes what a request gets: a rendered prompt runs as any caller's prompt
does (its stored answer serves only an identical prompt, a state restores only through the
engine's checks).

>>> shapes = RequestShapes()
>>> prompt = "Notes:\\nLunch is at noon.\\n--\\nTea is at four.\\nQ: When is lunch?\\nA:"
>>> shape = shapes.observe(prompt, ["Lunch is at noon.", "Tea is at four."], "When is lunch?", {"max_new_tokens": 8})
>>> (shape.prefix, shape.separator, shape.middle, shape.suffix, shape.passages)
('Notes:\\n', '\\n--\\n', '\\nQ: ', '\\nA:', 2)
>>> shape.render(["Tea is at four.", "Lunch is at noon."], "When is tea?")
'Notes:\\nTea is at four.\\n--\\nLunch is at noon.\\nQ: When is tea?\\nA:'
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import StorageWriteError
from ..kv.engine import Decoding, Sampling

SHAPES_KEPT = 16  # shapes kept (the most seen, then the latest)
CHECKS_KEPT = 64  # observed requests waiting for their agreement check (idle work runs it)
_PREFIX = "shape:"
STAND_IN_QUESTION = "What do the notes above say about this?"  # follows a leading prompt's last passage

Retrieve = Callable[[str, int], list[str]]  # (question, passages) -> passage texts, in prompt order
APP = "app"  # the retrievals a request is rebuilt with: the app's own retriever (where registered),
HYBRID = "hybrid"  # PerCache's hybrid retrieval (embeddings and BM25),
DENSE = "dense"  # and the embeddings' similarity alone (a plain vector store's ranking)


@dataclass
class RequestShape:
    """One shape of an app's requests (see the module docstring).

    *middle* is None where the question was not known: the shape then only renders the
    leading part of a request (:meth:`leading`), for its states. *decoding* is the app's
    decoding as JSON (tokens, sampling, stop strings, trim), the settings a rendered
    request runs with, so its stored answer is the one the app's identical request finds.
    *relayed*: learned from a client's request relayed to a llama-server (``percache
    serve``), whose reply is the server's and stored under the client's body: a rendered
    request is then only prefilled (its states), never decoded.
    """

    key: str
    prefix: str
    separator: str
    middle: str | None
    suffix: str
    passages: int
    decoding: dict[str, Any]
    add_bos: bool | None = None
    seen: int = 0
    compared: int = 0  # observed requests rebuilt from their question
    agreed: dict[str, int] = field(default_factory=dict)  # per retrieval: rebuilt to the very prompt sent
    last_seen: float = 0.0
    relayed: bool = False

    @property
    def predicts(self) -> bool:
        """Whether a whole request can be rendered from a question (the question was known)."""
        return self.middle is not None

    def agreement(self, retrieval: str) -> float | None:
        """The share of compared requests *retrieval* rebuilt exactly (None before any
        comparison)."""
        return self.agreed.get(retrieval, 0) / self.compared if self.compared else None

    def render(self, passages: Sequence[str], question: str) -> str:
        """The request the app sends for *question* with *passages* (needs :attr:`predicts`)."""
        if self.middle is None:
            raise ValueError("this shape was seen without its question: it renders leading parts only")
        return self.prefix + self.separator.join(passages) + self.middle + question + self.suffix

    def leading(self, passages: Sequence[str]) -> str:
        """A prompt that starts as the app's requests with these leading *passages* do,
        then goes on as the app's text after a passage does, with a stand-in question
        (what follows the last passage is not prefilled: a prefix run stops at its end;
        the stand-in only leaves the engine's cut rule room for a cut there).

        >>> RequestShape("k", "Notes: ", " | ", " Q: ", " A:", 2, {}).leading(["x"])
        'Notes: x | What do the notes above say about this? A:'
        """
        if len(passages) < self.passages and self.separator:
            after = self.separator
        else:
            after = self.middle if self.middle is not None else ""
        return self.prefix + self.separator.join(passages) + after + STAND_IN_QUESTION + self.suffix

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Observed:
    """A request whose agreement is checked in idle time (a retrieval each)."""

    shape_key: str
    prompt: str
    question: str


def split_request(prompt: str, passages: Sequence[str], question: str | None) -> tuple[str, str, str | None, str] | None:
    """(prefix, separator, middle, suffix) of *prompt* around its *passages* (in order, each
    found after the one before) and *question* (after the last passage); None where the
    passages are not separated alike (a template that labels each one differently) or the
    question comes before them (LangChain's RAG tutorial: every state after the question
    holds it, so no leading state serves another question, and idle work has none to make).

    >>> split_request("A: x; y. Q: why?", ["x", "y"], "why?")
    ('A: ', '; ', '. Q: ', '')
    >>> split_request("A: x; y. Q: why?", ["x", "y"], None)
    ('A: ', '; ', None, '. Q: why?')
    >>> split_request("Q: why? A: x; y.", ["x", "y"], "why?") is None
    True
    """
    if not passages:
        return None
    spans: list[tuple[int, int]] = []
    cursor = 0
    for passage in passages:
        start = prompt.find(passage, cursor)
        if start < 0:
            return None
        spans.append((start, start + len(passage)))
        cursor = start + len(passage)
    separators = {prompt[end:start] for (_, end), (start, _) in zip(spans, spans[1:])}
    if len(separators) > 1:
        return None
    separator = separators.pop() if separators else ""
    prefix, rest = prompt[: spans[0][0]], prompt[cursor:]
    if question and question in prefix:
        return None
    at = rest.rfind(question) if question else -1
    if question is None or at < 0:
        return prefix, separator, None, rest
    return prefix, separator, rest[:at], rest[at + len(question) :]


def decoding_record(decoding: Decoding) -> dict[str, Any]:
    """A resolved *decoding* as JSON (a shape's binding; :func:`decoding_from` reads it).

    >>> decoding_from(decoding_record(Decoding(8, Sampling(), ["\\n"]))) == Decoding(8, Sampling(), ("\\n",))
    True
    """
    sampling = decoding.sampling or Sampling()
    return {
        "max_new_tokens": decoding.max_new_tokens,
        "sampling": [sampling.temperature, sampling.top_p, sampling.seed],
        "stop": None if decoding.stop is None else list(decoding.stop),
        "prompt_lookup": decoding.prompt_lookup,
        "trim": decoding.trim,
    }


def decoding_from(record: dict[str, Any]) -> Decoding:
    """The :class:`Decoding` :func:`decoding_record` wrote."""
    stop = record.get("stop")
    return Decoding(
        record.get("max_new_tokens"),
        Sampling(*record.get("sampling", (0.0, 1.0, 0))),
        None if stop is None else tuple(stop),
        prompt_lookup=bool(record.get("prompt_lookup", False)),
        trim=bool(record.get("trim", False)),
    )


def shape_key(parts: Sequence[Any]) -> str:
    """A stable key of a shape's defining parts (texts, decoding, BOS)."""
    text = json.dumps(list(parts), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


class RequestShapes:
    """The shapes learned from callers' requests, per decoding, with their agreement;
    kept in *store* (the cache's small records) when given, so a new process predicts in
    them before the app's first request.

    ``retrieve`` is the app's own retriever where an adapter registered it
    (``pc.caller.retrieves_with``): idle work then builds requests from the app's passages.
    ``neighbour_order`` is PerCache's ranking idle work follows (:data:`HYBRID` or
    :data:`DENSE`, learned from the app's requests).
    """

    def __init__(self, store: Any = None) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._shapes: dict[str, RequestShape] = {}
        self._checks: deque[Observed] = deque(maxlen=CHECKS_KEPT)
        self._recent: deque[tuple[str, ...]] = deque(maxlen=CHECKS_KEPT)  # the latest requests' passages
        self.retrieve: Retrieve | None = None
        self.neighbour_order = HYBRID  # how idle work ranks passages (it learns which)
        self.app_attached = False  # an app brings its own prompts here (``pc.caller.serves_app``)
        if store is not None:
            for record in store.records(_PREFIX):
                try:
                    shape = RequestShape(**record.value)
                except TypeError:  # written by another version: learned again
                    continue
                if not isinstance(shape.agreed, dict):  # one count, before the retrievals were told apart
                    shape.compared, shape.agreed = 0, {}
                self._shapes[shape.key] = shape

    def observe(
        self,
        prompt: str,
        passages: Sequence[str],
        question: str | None,
        decoding: dict[str, Any],
        add_bos: bool | None = None,
        *,
        relayed: bool = False,
    ) -> RequestShape | None:
        """Learn from one request the app sent: its shape (None where it quotes no passage
        of the knowledge, or quotes them unevenly) is counted, and the request waits for
        its agreement check when the question is known. *relayed*: a client's request
        relayed to a llama-server (see :class:`RequestShape`)."""
        split = split_request(prompt, passages, question)
        if split is None:
            return None
        prefix, separator, middle, suffix = split
        key = shape_key([prefix, separator, middle, suffix, len(passages), decoding, add_bos, relayed])
        with self._lock:
            shape = self._shapes.get(key)
            if shape is None:
                shape = RequestShape(
                    key, prefix, separator, middle, suffix, len(passages), dict(decoding), add_bos, relayed=relayed
                )
                self._shapes[key] = shape
            shape.seen += 1
            shape.last_seen = time.time()
            self._recent.append(tuple(passages))
            if question and middle is not None:
                self._checks.append(Observed(key, prompt, question))
            self._trim()
        self._save(shape)
        return shape

    def _trim(self) -> None:
        """Keep the :data:`SHAPES_KEPT` most seen shapes (the latest among equals)."""
        if len(self._shapes) <= SHAPES_KEPT:
            return
        kept = sorted(self._shapes.values(), key=lambda s: (s.seen, s.last_seen), reverse=True)[:SHAPES_KEPT]
        for key in set(self._shapes) - {s.key for s in kept}:
            del self._shapes[key]
            if self._store is not None:
                self._store.delete(_PREFIX + key)

    def _save(self, shape: RequestShape) -> None:
        if self._store is not None:
            try:
                self._store.put(_PREFIX + shape.key, shape.as_dict())
            except StorageWriteError:  # a full disk: the shape stays learned in this process
                pass

    def check_agreement(
        self, retrievals: Mapping[str, Retrieve], should_stop: Callable[[], bool] = lambda: False
    ) -> int:
        """Rebuild the waiting observed requests from their questions with each of
        *retrievals* (name -> retrieve) and count, per shape and retrieval, whether each
        came out as the very prompt the app sent; returns how many were checked."""
        checked = 0
        while not should_stop():
            with self._lock:
                if not self._checks:
                    break
                observed = self._checks.popleft()
                shape = self._shapes.get(observed.shape_key)
            if shape is None:
                continue
            same = {name: self._rebuilt(shape, observed, retrieve) for name, retrieve in retrievals.items()}
            with self._lock:
                shape.compared += 1
                for name, agreed in same.items():
                    shape.agreed[name] = shape.agreed.get(name, 0) + agreed
            self._save(shape)
            checked += 1
        return checked

    @staticmethod
    def _rebuilt(shape: RequestShape, observed: Observed, retrieve: Retrieve) -> bool:
        passages = retrieve(observed.question, shape.passages)
        return len(passages) == shape.passages and shape.render(passages, observed.question) == observed.prompt

    @property
    def retrieval(self) -> str:
        """The retrieval idle work builds the app's requests with: the app's own retriever
        where registered, else PerCache's learned ranking."""
        return APP if self.retrieve is not None else self.neighbour_order

    def agreement(self, shape: RequestShape) -> float | None:
        """*shape*'s agreement under :attr:`retrieval`."""
        return shape.agreement(self.retrieval)

    def ranking_agreed(self) -> dict[str, int]:
        """How many of the app's requests each of PerCache's rankings rebuilt exactly, over
        every shape (the learned ranking is the one that rebuilt more)."""
        with self._lock:
            shapes = list(self._shapes.values())
        return {name: sum(s.agreed.get(name, 0) for s in shapes) for name in (HYBRID, DENSE)}

    def recent_passages(self) -> set[str]:
        """The passages the app's latest requests quoted."""
        with self._lock:
            return {passage for request in self._recent for passage in request}

    def recent_requests(self) -> list[tuple[str, ...]]:
        """The passages of each of the app's latest requests, in its order, oldest first."""
        with self._lock:
            return list(self._recent)

    @property
    def pending_checks(self) -> int:
        return len(self._checks)

    def shapes(self) -> list[RequestShape]:
        """The shapes, most seen first."""
        with self._lock:
            return sorted(self._shapes.values(), key=lambda s: (s.seen, s.last_seen), reverse=True)

    def stats(self) -> dict[str, Any]:
        """Per shape: seen, passages, whether it predicts whole requests, the agreement, and
        the texts around the passages (shortened)."""
        return {
            "shapes": [
                {
                    "key": s.key,
                    "seen": s.seen,
                    "passages": s.passages,
                    "predicts": s.predicts,
                    "relayed": s.relayed,
                    "agreement": self.agreement(s),
                    "agreement_by": {name: s.agreement(name) for name in s.agreed},
                    "compared": s.compared,
                    "prefix": _short(s.prefix),
                    "separator": s.separator,
                    "middle": None if s.middle is None else _short(s.middle),
                    "suffix": _short(s.suffix),
                    "max_new_tokens": s.decoding.get("max_new_tokens"),
                }
                for s in self.shapes()
            ],
            "pending_checks": self.pending_checks,
            "app_retriever": self.retrieve is not None,
            "app_attached": self.app_attached,
            "neighbour_order": self.neighbour_order,
        }


def _short(text: str, size: int = 60) -> str:
    return text if len(text) <= size else text[: size // 2] + "…" + text[-size // 2 :]


__all__ = ["Observed", "RequestShape", "RequestShapes", "Retrieve", "decoding_from", "decoding_record", "split_request"]
