"""How often an approximate answer is wrong, measured on the model's own labels.

An approximate tier serves an answer the model did not compute for this question: semantic
mode serves a similar question's stored answer, composed chunk states reuse chunks out of
place. Whether such an answer is *right* is defined by an **equivalence** against the text
the model gives to the question's own prompt (the cache-off answer): ``"text"`` (the
default: the same text) or ``"token_f1"`` (token F1 at least ``equivalence_min_f1``).

A **label** is one such comparison: a stored answer offered at some cosine similarity to a
question whose own answer the model computed, and whether the two are equivalent. Labels
cost nothing when the model answers a user's question anyway (every stored answer that was
a candidate for it is compared with the answer it got), and one model answer otherwise
(idle work answers the questions served an approximate answer, and variants it writes of
stored questions). Only labels of candidates the verifier accepts count (the others are
never served). A label also says whether the question retrieved the same chunks as the
entry's (its prompt differs only in the question: ``context="same"``), other chunks
(``"other"``), or whether that is not known (a caller's pipeline: ``"unknown"``); each
context is calibrated on its own. :class:`Calibration` keeps them and says:

- the **threshold**: the lowest similarity (in steps of 1/200) at which the labels at or
  above it show an error rate whose one-sided 95% upper bound is at most ``max_error_rate``
  (Clopper-Pearson's exact bound; Wilson's score bound above 30 errors, where the two agree
  within a few percent: :func:`error_upper_bound`)
  (``None``: no similarity does yet; nothing is served);
- an entry's **floor**: the highest similarity at which one of its own labels was wrong (it
  is never served at or below it: a per-entry threshold, raised by its own evidence);
- the **accuracy** of an answer at a similarity: the share of right labels at or above it,
  with one right and one wrong added (the posterior mean under a uniform prior).

Composed chunk states are calibrated the same way, with labels keyed by the recompute
setting instead of an entry (see :meth:`Calibration.recompute_choice`).

>>> calibration = Calibration()
>>> for i in range(200):
...     calibration.add(Label("e1", 0.95, True, "asked"))
>>> calibration.add(Label("e2", 0.80, False, "asked"))
>>> calibration.threshold(0.02)
0.95
>>> calibration.threshold(0.001) is None
True
"""

from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from ..storage import Store

CONFIDENCE = 0.95
BUCKETS = 200  # similarities are counted in steps of 1 / BUCKETS
LABELS_KEPT = 20_000
PREFIX = "calibration:"
COMPOSED = "composed:"  # the entry id of a composed-states label: COMPOSED + recompute tokens
EQUIVALENCES = ("text", "token_f1")
SEMANTIC_KINDS = ("asked", "served", "variant")
CONTEXTS = ("same", "other", "unknown")  # the entry's chunks retrieved again, others, not known


@dataclass(frozen=True)
class Label:
    """One comparison of an approximate answer with the model's own answer."""

    entry_id: str  # the stored answer offered (or COMPOSED + recompute tokens)
    similarity: float  # of the question asked to the entry's question (1.0 for composed)
    right: bool  # equivalent to the model's answer to the question's own prompt
    kind: str  # "asked" (a user's question), "served" (checked after serving), "variant", "composed"
    accepted: bool = True  # the verifier let it through (a rejected candidate is never served)
    context: str = "unknown"  # "same": the question retrieved the entry's chunks; "other"; "unknown"


def retrieval_context(chunk_ids: Sequence[str], entry_chunk_ids: Sequence[str]) -> str:
    """A label's context: "same" when a question's prompt holds the chunks the entry's
    answer came from (in order), else "other".

    >>> retrieval_context(["a#c000", "b#c000"], ("a#c000", "b#c000")), retrieval_context(["b#c000"], ["a#c000"])
    ('same', 'other')
    """
    return "same" if tuple(chunk_ids) == tuple(entry_chunk_ids) else "other"


def token_f1(answer: str, reference: str) -> float:
    """SQuAD-style token F1 of two answers (lower-cased words).

    >>> token_f1("Friday at 3 pm", "on Friday at 3 pm")
    0.888...
    """
    ours, theirs = answer.lower().split(), reference.lower().split()
    if not ours or not theirs:
        return float(ours == theirs)
    common = sum((Counter(ours) & Counter(theirs)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(ours), common / len(theirs)
    return 2 * precision * recall / (precision + recall)


def equivalent(answer: str, reference: str, *, equivalence: str = "text", min_f1: float = 0.8) -> bool:
    """Whether *answer* counts as the model's own *reference* under *equivalence*.

    >>> equivalent("Friday.", "Friday."), equivalent("Friday", "Friday.")
    (True, False)
    >>> equivalent("on Friday", "Friday", equivalence="token_f1", min_f1=0.6)
    True
    """
    if equivalence == "text":
        return answer.strip() == reference.strip()
    if equivalence == "token_f1":
        return token_f1(answer, reference) >= min_f1
    raise ValueError(f"equivalence must be one of {', '.join(EQUIVALENCES)}, got {equivalence!r}")


def error_upper_bound(errors: int, total: int, confidence: float = CONFIDENCE) -> float:
    """The one-sided upper bound of an error rate seen as *errors* of *total*: Clopper-Pearson's
    exact bound, or above 30 errors Wilson's score bound (the binomial is near normal there,
    and the exact bound's search would cost more than it adds).

    >>> round(error_upper_bound(0, 150), 4)    # the rule of three: about 3 / n
    0.0198
    >>> error_upper_bound(0, 0)
    1.0
    """
    if total <= 0 or errors >= total:
        return 1.0
    if errors > 30:  # the binomial is near normal: Wilson's score bound, within a few percent
        z = 1.6448536269514722  # the one-sided 95% normal quantile
        p = errors / total
        centre = p + z * z / (2 * total)
        spread = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
        return min(1.0, (centre + spread) / (1 + z * z / total))
    target = 1.0 - confidence  # the p at which P(X <= errors) falls to this is the bound
    low, high = errors / total, 1.0
    for _ in range(32):
        middle = (low + high) / 2
        if _binomial_cdf(errors, total, middle) > target:
            low = middle
        else:
            high = middle
    return high


def _binomial_cdf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0 if k < n else 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


class Calibration:
    """The labels of one cache (kept in *store* when given) and what they say; thread-safe."""

    def __init__(self, store: Store | None = None) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._labels: list[Label] = []
        self._floors: dict[str, float] = {}
        self._next = 0
        self._cache: dict[tuple[str, float], float | None] = {}
        if store is not None:
            for record in store.records(PREFIX):
                label = _label(record.value)
                if label is not None:
                    self._remember(label)
            self._next = max((int(k.removeprefix(PREFIX)) for k in store.keys(PREFIX) if k[len(PREFIX) :].isdigit()), default=-1) + 1

    def __len__(self) -> int:
        return len(self._labels)

    @property
    def labels(self) -> list[Label]:
        with self._lock:
            return list(self._labels)

    def add(self, label: Label) -> None:
        """Keep *label* (see :meth:`add_many`)."""
        self.add_many([label])

    def add_many(self, labels: Iterable[Label]) -> None:
        """Keep *labels*, written to the store in one transaction; beyond ``LABELS_KEPT``
        the oldest go."""
        labels = list(labels)
        if not labels:
            return
        with self._lock:
            first = self._next
            self._next += len(labels)
            if self._store is not None:
                items = [(f"{PREFIX}{first + i:012d}", asdict(label), None) for i, label in enumerate(labels)]
                old = [f"{PREFIX}{n - LABELS_KEPT:012d}" for n in range(first, self._next) if n >= LABELS_KEPT]
                self._store.put_many(items, remove=old)
            for label in labels:
                self._remember(label)
            del self._labels[: max(0, len(self._labels) - LABELS_KEPT)]
            self._cache.clear()

    def _remember(self, label: Label) -> None:
        self._labels.append(label)
        if label.accepted and not label.right:
            self._floors[label.entry_id] = max(self._floors.get(label.entry_id, -1.0), label.similarity)

    # -- what the labels say ---------------------------------------------------------------

    def threshold(
        self, max_error_rate: float, *, context: str = "unknown", kinds: Sequence[str] = SEMANTIC_KINDS
    ) -> float | None:
        """The lowest similarity at which the labels of *kinds* and *context* at or above it
        meet *max_error_rate* (95% upper bound), or None."""
        key = (f"threshold:{context}:" + ",".join(kinds), max_error_rate)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
            points = sorted(
                (
                    (label.similarity, label.right)
                    for label in self._labels
                    if label.kind in kinds and label.accepted and label.context == context
                ),
                reverse=True,
            )
        counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # bucket -> [labels, wrong]
        for similarity, right in points:
            bucket = counts[math.floor(similarity * BUCKETS + 1e-9)]
            bucket[0] += 1
            bucket[1] += not right
        best = None
        seen = errors = 0
        for bucket in sorted(counts, reverse=True):
            seen += counts[bucket][0]
            errors += counts[bucket][1]
            if errors <= max_error_rate * seen and error_upper_bound(errors, seen) <= max_error_rate:
                best = bucket / BUCKETS
        with self._lock:
            self._cache[key] = best
        return best

    def floor(self, entry_id: str) -> float:
        """The highest similarity at which one of the entry's own labels was wrong (-1: none)."""
        with self._lock:
            return self._floors.get(entry_id, -1.0)

    def accuracy(self, similarity: float, *, context: str = "unknown", kinds: Sequence[str] = SEMANTIC_KINDS) -> float:
        """The estimated probability that a stored answer offered at *similarity* (in
        *context*) is right: the right share of labels at or above it, one right and one
        wrong added."""
        with self._lock:
            above = [
                label.right
                for label in self._labels
                if label.kind in kinds and label.accepted and label.context == context and label.similarity >= similarity
            ]
        return (sum(above) + 1) / (len(above) + 2)

    def recompute_choice(self, ladder: Sequence[int], max_error_rate: float) -> int | None:
        """The fewest recompute tokens of *ladder* whose composed answers meet
        *max_error_rate* (95% upper bound), or None (compose nothing)."""
        by_setting: dict[int, list[bool]] = defaultdict(list)
        with self._lock:
            for label in self._labels:
                if label.kind == "composed":
                    by_setting[int(label.entry_id.removeprefix(COMPOSED))].append(label.right)
        for tokens in sorted(ladder):
            outcomes = by_setting.get(tokens, [])
            if outcomes and error_upper_bound(outcomes.count(False), len(outcomes)) <= max_error_rate:
                return tokens
        return None

    def composed_accuracy(self, tokens: int) -> float:
        """The estimated probability that an answer composed with *tokens* recomputed is right."""
        with self._lock:
            outcomes = [label.right for label in self._labels if label.entry_id == f"{COMPOSED}{tokens}"]
        return (sum(outcomes) + 1) / (len(outcomes) + 2)

    def summary(self, max_error_rate: float) -> dict[str, object]:
        """Label counts by kind, their measured error rates, and the threshold in force."""
        with self._lock:
            labels = list(self._labels)
        kinds: dict[str, dict[str, float]] = {}
        for kind in sorted({label.kind for label in labels}):
            of_kind = [label for label in labels if label.kind == kind]
            wrong = sum(not label.right for label in of_kind)
            kinds[kind] = {"labels": len(of_kind), "wrong": wrong, "error_rate": wrong / len(of_kind)}
        thresholds = {context: self.threshold(max_error_rate, context=context) for context in CONTEXTS}
        return {"labels": len(labels), "by_kind": kinds, "thresholds": thresholds}


def _label(value: object) -> Label | None:
    if not isinstance(value, dict):
        return None
    try:
        return Label(
            str(value["entry_id"]),
            float(value["similarity"]),
            bool(value["right"]),
            str(value["kind"]),
            bool(value.get("accepted", True)),
            str(value.get("context", "unknown")),
        )
    except (KeyError, TypeError, ValueError):
        return None
