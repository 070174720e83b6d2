"""Verifying QA-bank hits: rejecting near-misses that cosine similarity lets through.

Sentence embeddings score "When is the rehearsal?" and "When is the rehearsal not taking
place?" as near-identical. The QA bank therefore returns the top candidates above a
lower *recall* threshold and a verifier accepts or rejects each one. A verifier is any
object with ``name`` and ``verify(question, entry, similarity) -> Verdict``.

:class:`LexicalVerifier` (the default) rejects a candidate whose question differs from
the new one in what cosine similarity blurs: negation, numbers, dates and times, named
entities (names, places, products), the order of shared names (who did what to whom,
from where to where), antonyms (lowest/highest, start/end, ...) and the kind of answer
asked for (when vs where vs who vs how much). It needs no model and takes microseconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..types import QAEntry

_TOKEN = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?|\d+(?:[.,:]\d+)*[A-Za-z]{0,2}")
_NEGATIONS = frozenset(
    "not no never none nobody nothing nowhere neither nor without cannot n't isn't aren't "
    "wasn't weren't don't doesn't didn't won't wouldn't can't couldn't shouldn't hasn't "
    "haven't hadn't unpaid undone unfinished unread unanswered".split()
)
_NUMBER_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve twenty thirty "
    "hundred thousand first second third fourth fifth sixth seventh eighth ninth tenth "
    "half quarter dozen".split()
)
_TIME_WORDS = frozenset(
    "monday tuesday wednesday thursday friday saturday sunday weekend january february march "
    "april may june july august september october november december today tomorrow "
    "yesterday tonight morning afternoon evening night noon midnight week month year "
    "quarter spring summer autumn fall winter last next this previous upcoming".split()
)
_ANTONYMS = [
    ("lowest", "highest"),
    ("low", "high"),
    ("start", "end"),
    ("starts", "ends"),
    ("begin", "finish"),
    ("first", "last"),
    ("earliest", "latest"),
    ("early", "late"),
    ("increase", "decrease"),
    ("increased", "decreased"),
    ("open", "close"),
    ("opens", "closes"),
    ("before", "after"),
    ("cheapest", "expensive"),
    ("cheap", "expensive"),
    ("minimum", "maximum"),
    ("min", "max"),
    ("accepted", "rejected"),
    ("accept", "reject"),
    ("depart", "arrive"),
    ("departs", "arrives"),
    ("leave", "arrive"),
    ("added", "removed"),
    ("add", "remove"),
    ("pros", "cons"),
    ("won", "lost"),
    ("win", "lose"),
    ("buy", "sell"),
    ("bought", "sold"),
    ("on", "off"),
    ("oldest", "newest"),
    ("old", "new"),
    ("joined", "left"),
    ("join", "leave"),
    ("include", "exclude"),
    ("included", "excluded"),
    ("more", "less"),
    ("most", "least"),
    ("above", "below"),
    ("over", "under"),
    ("best", "worst"),
    ("up", "down"),
    ("in", "out"),
    ("sent", "received"),
    ("send", "receive"),
    ("import", "export"),
    ("inbound", "outbound"),
    ("pass", "fail"),
    ("passed", "failed"),
    ("true", "false"),
    ("yes", "no"),
    ("morning", "evening"),
    ("north", "south"),
    ("east", "west"),
    ("left", "right"),
    ("enter", "exit"),
    ("positive", "negative"),
    ("profit", "loss"),
    ("income", "expense"),
    ("credit", "debit"),
]
_ANTONYM_OF: dict[str, set[str]] = {}
for _a, _b in _ANTONYMS:
    _ANTONYM_OF.setdefault(_a, set()).add(_b)
    _ANTONYM_OF.setdefault(_b, set()).add(_a)
_SAME_AS = {  # words that name the same number or time
    "one": "1",
    "first": "1",
    "1st": "1",
    "two": "2",
    "second": "2",
    "2nd": "2",
    "three": "3",
    "third": "3",
    "3rd": "3",
    "four": "4",
    "fourth": "4",
    "4th": "4",
    "five": "5",
    "fifth": "5",
    "5th": "5",
    "six": "6",
    "sixth": "6",
    "seven": "7",
    "seventh": "7",
    "eight": "8",
    "eighth": "8",
    "nine": "9",
    "ninth": "9",
    "ten": "10",
    "tenth": "10",
    "upcoming": "next",
    "coming": "next",
    "previous": "last",
    "past": "last",
}
_COMPATIBLE_KINDS = {frozenset({"time", "duration"}), frozenset({"quantity", "duration"})}
_NOT_ENTITIES = frozenset(
    "i i'm i've i'd what when where who whom whose which why how is are was were do does did "
    "can could should would will has have had may might the a an in on at to for from of and "
    "or my our your please summarize summarise give tell show list remind".split()
)
_ANSWER_KINDS = [
    ("reason", re.compile(r"^(why\b|what (caused|is the reason|was the reason)|how come\b)")),
    (
        "duration",
        re.compile(
            r"^(how (long|early|soon|late)\b|how many (minutes|hours|days|weeks|months|years)\b|until when\b)"
        ),
    ),
    (
        "time",
        re.compile(
            r"^(when\b|what (time|date|day)\b|which (day|date|time|month|week)\b|by when\b|until when\b|how (early|soon|late)\b|at what time\b|on (which|what) (day|date)\b)"
        ),
    ),
    (
        "place",
        re.compile(
            r"^(where\b|in which (city|room|place|country|building|town)\b|which (room|city|place|floor|address|country)\b|at which (place|address)\b)"
        ),
    ),
    ("person", re.compile(r"^(who\b|whom\b|whose\b|which (person|one of us|colleague|member)\b|at whose\b)")),
    (
        "quantity",
        re.compile(
            r"^(how (much|many|long|far|often|big|old)\b|what (is the )?(price|cost|amount|number)\b)"
        ),
    ),
]


@dataclass(frozen=True)
class Verdict:
    """A verifier's decision on one candidate, with the reason."""

    accepted: bool
    reason: str = ""


@runtime_checkable
class HitVerifier(Protocol):
    """Decides whether a stored entry answers a new question."""

    name: str

    def verify(self, question: str, entry: QAEntry, similarity: float) -> Verdict: ...


class AcceptAll:
    """No verification: cosine similarity alone decides (the plain semantic cache)."""

    name = "none"

    def verify(self, question: str, entry: QAEntry, similarity: float) -> Verdict:
        return Verdict(True, "cosine only")


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def _entities(text: str) -> list[str]:
    """Capitalised words after the first word, and words with digits, in order.

    >>> _entities("Did Priya email Maya about flight SW 482?")
    ['priya', 'maya', 'sw', '482']
    """
    found = []
    for index, token in enumerate(_tokens(text)):
        lower = token.lower()
        if any(ch.isdigit() for ch in token):
            found.append(lower)
        elif (
            index > 0
            and token[0].isupper()
            and lower not in _NOT_ENTITIES
            and lower.removesuffix("'s") not in _TIME_WORDS
        ):
            found.append(lower.removesuffix("'s"))
    return found


def _answer_kind(text: str) -> str | None:
    """What kind of answer a question asks for, when its opening says so clearly.

    >>> _answer_kind("What time is my appointment?"), _answer_kind("Where is it?"), _answer_kind("What is it?")
    ('time', 'place', None)
    """
    opening = " ".join(text.lower().replace("?", " ").split()[:5])
    for kind, pattern in _ANSWER_KINDS:
        if pattern.match(opening):
            return kind
    return None


def _words(text: str) -> list[str]:
    """Lower-cased tokens with number and time synonyms unified.

    >>> _words("The first of May, the upcoming 2nd week")
    ['the', '1', 'of', 'may', 'the', 'next', '2', 'week']
    """
    words = [t.lower() for t in _tokens(text)]
    return [_SAME_AS.get(w, w) for w in words]


def _negated(words: list[str]) -> bool:
    return sum(w in _NEGATIONS or w.endswith("n't") for w in words) % 2 == 1


class LexicalVerifier:
    """Rejects candidates that differ from the question in a detail cosine blurs.

    >>> v = LexicalVerifier()
    >>> def entry(q): return QAEntry("x", q, None, "a")
    >>> v.verify("When is the rehearsal not taking place?", entry("When will the rehearsal take place?"), 0.92)
    Verdict(accepted=False, reason='negation differs')
    >>> v.verify("What did Priya say about the map?", entry("What did Ana say about the map?"), 0.9)
    Verdict(accepted=False, reason='entity differs: priya / ana')
    >>> v.verify("When does my Tuesday yoga class begin?", entry("Remind me what time my yoga class starts on Tuesday."), 0.8)
    Verdict(accepted=True, reason='no conflicting detail')
    """

    name = "lexical"

    def verify(self, question: str, entry: QAEntry, similarity: float) -> Verdict:
        new, old = question, entry.question
        new_words, old_words = _words(new), _words(old)
        if _negated(new_words) != _negated(old_words):
            return Verdict(False, "negation differs")
        new_numbers = {w for w in new_words if w in _NUMBER_WORDS or any(c.isdigit() for c in w)}
        old_numbers = {w for w in old_words if w in _NUMBER_WORDS or any(c.isdigit() for c in w)}
        if new_numbers != old_numbers and (new_numbers and old_numbers):
            return Verdict(False, f"number differs: {sorted(new_numbers ^ old_numbers)}")
        new_times = {w for w in new_words if w in _TIME_WORDS}
        old_times = {w for w in old_words if w in _TIME_WORDS}
        if new_times and old_times and new_times != old_times:
            return Verdict(False, f"date or time differs: {sorted(new_times ^ old_times)}")
        new_set, old_set = {t.lower() for t in _tokens(new)}, {t.lower() for t in _tokens(old)}
        for word in new_set - old_set:
            opposites = _ANTONYM_OF.get(word, set()) & (old_set - new_set)
            if opposites:
                return Verdict(False, f"opposite words: {word} / {min(opposites)}")
        new_entities, old_entities = _entities(new), _entities(old)
        only_new = [e for e in new_entities if e not in old_entities]
        only_old = [e for e in old_entities if e not in new_entities]
        if only_new and only_old:
            return Verdict(False, f"entity differs: {' '.join(only_new)} / {' '.join(only_old)}")
        shared = [e for e in new_entities if e in old_entities]
        if len(shared) >= 2 and shared != [e for e in old_entities if e in new_entities]:
            return Verdict(False, "shared names in another order")
        new_kind, old_kind = _answer_kind(new), _answer_kind(old)
        if (
            new_kind
            and old_kind
            and new_kind != old_kind
            and frozenset({new_kind, old_kind}) not in _COMPATIBLE_KINDS
        ):
            return Verdict(False, f"asks for another kind of answer: {new_kind} / {old_kind}")
        return Verdict(True, "no conflicting detail")


VERIFIERS = {"lexical": LexicalVerifier, "none": AcceptAll}


def make_verifier(name: str) -> HitVerifier:
    """The verifier called *name* ("lexical" or "none").

    >>> make_verifier("lexical").name
    'lexical'
    """
    try:
        return VERIFIERS[name]()
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; choose one of {sorted(VERIFIERS)}") from None
