"""Idle work that labels approximate answers (see :mod:`percache_core.qa.calibration`).

The questions users ask label the semantic tier for free (the request path compares the
stored answers it offered with the model's own answer). Two kinds of labels cost a model
answer each, and an idle round buys them within ``calibration_answers_per_round``:

- **variants** (``qa_mode="semantic"``): questions written from stored ones, paraphrases
  that keep the meaning and near-misses that change it (a negation, another number,
  another question word). Each is answered on its own prompt, exactly; the stored answers a
  lookup would offer for it (same binding and scope) are compared with that answer.
- **composed runs** (``reuse="approximate"``): recent user questions are answered again
  with [system, first chunk] restored and the later chunks composed from their independent
  states (as for a new path), at each recompute setting of the ladder, and compared with
  their exact answers.

A variant or a question is labelled once (a key in the cache's meta store says so).

>>> [kind for _, kind in question_variants("When is the review of the 2 budgets?")]
['paraphrase', 'paraphrase', 'paraphrase', 'near-miss', 'near-miss', 'near-miss']
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..answering.parts import CacheParts
from ..answering.request import IdleQuestion
from ..answering.request_path import RequestPath
from ..policies import recompute_ladder
from ..qa.calibration import COMPOSED, Label
from ..serving.state_runner import RunOptions
from ..serving.streaming import drain
from ..types import QAEntry

DONE = "calibrated:"  # meta-store keys of the variants and questions labelled
PARAPHRASES = ("Can you tell me: {question}", "Quick question: {question}", "{bare}, please?")
AUXILIARIES = frozenset(
    "is are was were do does did will would can could should shall has have had may might must".split()
)
QUESTION_WORDS = {"when": "where", "where": "when", "who": "what", "what": "who", "why": "how", "how": "why"}


def question_variants(question: str) -> list[tuple[str, str]]:
    """(variant, "paraphrase" or "near-miss") pairs written from *question* by rule.

    >>> question_variants("Who approved the budget?")[-2:]
    [('Who not approved the budget?', 'near-miss'), ('What approved the budget?', 'near-miss')]
    """
    text = " ".join(question.split())
    bare = text.rstrip("?").rstrip()
    if not bare:
        return []
    variants = [(frame.format(question=text, bare=bare), "paraphrase") for frame in PARAPHRASES]
    words = bare.split()
    negated = next((i for i, w in enumerate(words) if w.lower() in AUXILIARIES), None)
    if negated is None and len(words) > 1:
        negated = 0  # "Who approved ..." -> "Who not approved ...": the meaning turns
    if negated is not None:
        variants.append((" ".join([*words[: negated + 1], "not", *words[negated + 1 :]]) + "?", "near-miss"))
    number = re.search(r"\d+", bare)
    if number:
        changed = bare[: number.start()] + str(int(number.group()) + 1) + bare[number.end() :]
        variants.append((changed + "?", "near-miss"))
    swapped = QUESTION_WORDS.get(words[0].lower())
    if swapped:
        variants.append((" ".join([swapped.capitalize(), *words[1:]]) + "?", "near-miss"))
    return variants


@dataclass
class CalibrationSpend:
    """What one idle round spent on labels."""

    answers: int = 0
    labels: int = 0


class CalibrationWork:
    """Buys labels with idle model answers (see the module docstring)."""

    def __init__(self, parts: CacheParts, request_path: RequestPath) -> None:
        self.parts = parts
        self.request_path = request_path

    def due(self) -> bool:
        """Whether an approximate tier is on, under a bound, with a budget for labels."""
        parts = self.parts
        if parts.config.bound.calibration_answers_per_round == 0:
            return False
        return parts.answers.calibrates or parts.states.calibrates

    def run(self, should_stop: Callable[[], bool], spend: CalibrationSpend) -> None:
        """Label until the round's budget is spent, nothing is left, or *should_stop*."""
        if not self.due():
            return
        if self.parts.states.calibrates:
            self._composed_runs(should_stop, spend)
        if self.parts.answers.calibrates:
            self._variants(should_stop, spend)

    # -- variants of stored questions -----------------------------------------------------

    def _variants(self, should_stop: Callable[[], bool], spend: CalibrationSpend) -> None:
        parts = self.parts
        budget = parts.config.bound.calibration_answers_per_round
        binding = parts.binding()
        entries = [
            e
            for e in parts.qa_bank.entries
            if e.answer and not e.remembered and not e.stale and e.binding == binding
        ]
        pending = {e.id: [v for v in question_variants(e.question) if not self._done(e.id, v[0])] for e in entries}
        while spend.answers < budget and any(pending.values()):
            for entry in entries:  # one variant per entry per pass: labels spread over entries
                if spend.answers >= budget or should_stop():
                    return
                if pending[entry.id]:
                    variant, _ = pending[entry.id].pop(0)
                    self._label_variant(entry, variant, should_stop, spend)

    def _label_variant(
        self, entry: QAEntry, variant: str, should_stop: Callable[[], bool], spend: CalibrationSpend
    ) -> None:
        parts = self.parts
        embedding = parts.embed_question(variant)
        item = IdleQuestion(variant, embedding, "variant", scope=entry.scope, store=False)
        result = self.request_path.populate(item, should_stop)
        spend.answers += 1
        self._mark_done(entry.id, variant)
        if not result.text:
            return
        offered = parts.qa_bank.search(
            embedding,
            top_n=parts.config.tiers.verifier_candidates,
            similarity_threshold=-1.0,
            scope=entry.scope,
            binding=entry.binding,
        )
        spend.labels += self.request_path.records.label_offered(variant, offered, result, "variant")

    # -- composed chunk states of asked questions -----------------------------------------

    def _composed_runs(self, should_stop: Callable[[], bool], spend: CalibrationSpend) -> None:
        parts, config = self.parts, self.parts.config
        budget = config.bound.calibration_answers_per_round
        runner = parts.runtime.runner
        ladder = recompute_ladder(config.tiers)
        for asked in reversed(list(parts.activity.asked)):  # the latest first
            if spend.answers + len(ladder) > budget or should_stop():
                return
            key = f"{asked.text}\x1f{sorted((asked.scope or {}).items())}"
            if self._done("composed", key):
                continue
            entry = parts.qa_bank.find(asked.text, scope=asked.scope, binding=parts.binding())
            chunks = [parts.knowledge.get_chunk(chunk_id) for chunk_id in asked.chunk_ids]
            if entry is None or not entry.answer or entry.remembered or any(c is None for c in chunks):
                continue
            layout = runner.lay_out(asked.text, [c for c in chunks if c is not None], max_new_tokens=config.engine.max_new_tokens)
            for tokens in ladder:
                options = RunOptions(
                    config.engine.max_new_tokens, approximate=True, recompute_tokens=tokens, restore_depth=2, idle=True
                )
                result = drain(runner.run(layout, options, should_stop=should_stop))
                spend.answers += 1
                if not result.approximate:  # no independent state to compose from: nothing to learn
                    break
                right = parts.answers_agree(result.text, entry.answer)
                parts.calibration.add(Label(f"{COMPOSED}{tokens}", 1.0, right, "composed"))
                spend.labels += 1
            self._mark_done("composed", key)

    # -- what was labelled ----------------------------------------------------------------

    def _key(self, owner: str, text: str) -> str:
        return DONE + hashlib.sha256(f"{owner}\x1f{text}".encode()).hexdigest()[:32]

    def _done(self, owner: str, text: str) -> bool:
        return self.parts.meta.get(self._key(owner, text)) is not None

    def _mark_done(self, owner: str, text: str) -> None:
        self.parts.meta.put(self._key(owner, text), 1)
