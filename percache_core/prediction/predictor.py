"""Predicting the questions a user is likely to ask, with the local LLM.

Two views (PerCache, section 4.1.2): from the knowledge abstract (general and detailed
questions about the user's documents) and from the user's recent questions (their style
and current interests). Generation is deduplicated as in StorInfer (section 3.2):

- adaptive query masking: recently generated questions are put in the prompt, whole
  ones only, newest first, while they fit the remaining token budget;
- adaptive sampling: a candidate whose similarity to a known question reaches S_gen
  (``dedup_similarity``) is dropped and the temperature rises by 0.1, from 0.7 to 1.0.

Empty, malformed, overlong and repeated outputs are dropped. Prompts are completion-style
numbered lists for base models, or chat messages for instruction-tuned models.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..answering.parts import CacheParts
from ..config import PerCacheConfig
from ..knowledge.embedding import Embedder
from ..kv.engine import Decoding, Sampling
from ..types import live

START_TEMPERATURE = 0.7
MAX_TEMPERATURE = 1.0
TEMPERATURE_STEP = 0.1
MIN_QUESTION_WORDS = 3
MAX_QUESTION_WORDS = 40
MAX_PREDICTED_QUESTION_CHARS = 300
PROMPT_TOKEN_BUDGET = 900  # prompt tokens for prediction prompts, masking included

_LIST_ITEM = re.compile(r"^\s*(?:\d{1,3}\s*[.):]|[-*\u2022])\s*(.*)$")
_QUESTION_WORDS = frozenset(
    "what when where who whom whose which why how is are was were do does did can could "
    "should would will has have had may might shall".split()
)

# complete(prompt, decoding) -> text
Complete = Callable[[str, Decoding], str]
# token_count(text) -> number of tokens
TokenCount = Callable[[str], int]
# known_similarity(embedding) -> highest similarity to any known question
KnownSimilarity = Callable[[np.ndarray], float]


@dataclass(frozen=True)
class PredictedQuestion:
    """A predicted question with its embedding and the view it came from."""

    text: str
    embedding: np.ndarray = field(repr=False, compare=False)
    origin: str  # "knowledge" or "history"


@dataclass
class PredictionTally:
    """Counts of one or more prediction steps."""

    llm_calls: int = 0
    candidates: int = 0
    accepted: int = 0
    duplicates: int = 0
    malformed: int = 0

    def add(self, other: PredictionTally) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def clean_question(text: str) -> str | None:
    """A predicted line made into one question, or None if it is not a usable question.

    >>> clean_question('  "When is the rehearsal?" Also, ')
    'When is the rehearsal?'
    >>> clean_question("Who approved the budget")
    'Who approved the budget?'
    >>> clean_question("The budget.") is None, clean_question("???") is None
    (True, True)
    """
    text = " ".join(text.replace("**", "").split()).strip(" \"'`")
    if "?" in text:
        text = text[: text.index("?") + 1].strip(" \"'`")
    elif text.split() and text.split()[0].lower() in _QUESTION_WORDS:
        text = text.rstrip(".!,;:") + "?"
    else:
        return None
    words = text.split()
    if not MIN_QUESTION_WORDS <= len(words) <= MAX_QUESTION_WORDS or len(text) > MAX_PREDICTED_QUESTION_CHARS:
        return None
    if sum(ch.isalpha() for ch in text) < 8:
        return None
    return text[0].upper() + text[1:]


def parse_list(text: str, *, first_item_open: bool) -> list[str]:
    """Items of a numbered or bulleted list. With *first_item_open*, the text continues an
    item whose number was already in the prompt, so its first line is an item too.

    >>> parse_list(" When is it?\\n7. Who comes?\\nnoise", first_item_open=True)
    ['When is it?', 'Who comes?']
    """
    items: list[str] = []
    for number, line in enumerate(text.splitlines()):
        match = _LIST_ITEM.match(line)
        if match:
            items.append(match.group(1).strip())
        elif number == 0 and first_item_open and line.strip():
            items.append(line.strip())
    return [item for item in items if item]


def use_chat_template(config: PerCacheConfig, model_name: str, has_chat_template: bool) -> bool:
    """Whether prompts go through the model's chat template.

    >>> use_chat_template(PerCacheConfig(), "gemma-3-270m-q4_k_m.gguf", True)
    False
    >>> use_chat_template(PerCacheConfig(), "qwen2.5-0.5b-instruct-q4.gguf", True)
    True
    """
    if config.idle.prediction_template != "auto":
        return config.idle.prediction_template == "chat"
    name = model_name.lower()
    tuned = any(mark in name for mark in ("-it", "_it", "instruct", "chat"))
    return tuned and has_chat_template


class QueryPredictor:
    """Generates new, deduplicated questions with the local LLM.

    Args:
        complete: runs a text prompt on the LLM (see ``Complete``).
        count_tokens: counts tokens of a text (for the masking budget).
        embedder: embeds candidates for deduplication.
        known_similarity: best similarity of an embedding to questions already known
            (the QA bank, pending entries included).
        config: ``prediction_stride``, ``knowledge_kind``, ``dedup_similarity``.
        chat: wrap prompts as chat messages (``chat_format`` turns messages into text).
    """

    def __init__(
        self,
        *,
        complete: Complete,
        count_tokens: TokenCount,
        embedder: Embedder,
        known_similarity: KnownSimilarity,
        config: PerCacheConfig | Callable[[], PerCacheConfig],
        chat_format: Callable[[str], str] | None = None,
    ) -> None:
        self._complete = complete
        self._count_tokens = count_tokens
        self._embedder = embedder
        self._known_similarity = known_similarity
        self._config = live(config)
        self._chat_format = chat_format
        self.temperature = START_TEMPERATURE
        self.recent: deque[str] = deque(maxlen=64)
        self._calls = 0

    # -- prompts --------------------------------------------------------------------------

    def _masked(self, budget_tokens: int) -> list[str]:
        """Recently generated questions, newest first, whole ones only, within the budget."""
        chosen: list[str] = []
        used = 0
        for question in reversed(self.recent):
            cost = self._count_tokens(question) + 3
            if used + cost > budget_tokens:
                break
            chosen.append(question)
            used += cost
        return list(reversed(chosen))

    def knowledge_prompt(self, abstract: Sequence[str], n: int) -> tuple[str, bool]:
        """The knowledge-based prompt and whether its last list item is left open."""
        kind = self._config().idle.knowledge_kind
        facts = "\n".join(f"- {line}" for line in abstract) or "- (no summary yet)"
        if self._chat_format is not None:
            avoid = self._masked(PROMPT_TOKEN_BUDGET - self._count_tokens(facts) - 80)
            avoid_text = (
                ("\nDo not repeat these questions:\n" + "\n".join(f"- {q}" for q in avoid)) if avoid else ""
            )
            message = (
                f"Here are key facts from a person's {kind}:\n{facts}\n\nWrite {n} different "
                f"questions this person might ask an assistant about them: some general, some "
                f"about specific details. Reply with a numbered list of questions only.{avoid_text}"
            )
            return self._chat_format(message), False
        head = (
            f"Facts from a person's {kind}:\n{facts}\n\n"
            f"Questions the person asked their assistant about these facts, some general and "
            f"some about specific details:\n"
        )
        masked = self._masked(PROMPT_TOKEN_BUDGET - self._count_tokens(head))
        if not masked and abstract:
            # a base model continues a list far better than it starts one
            masked = [f"What do my notes say about {abstract[0][0].lower()}{abstract[0][1:].rstrip('.')}?"]
        listed = "".join(f"{i}. {q}\n" for i, q in enumerate(masked, 1))
        return f"{head}{listed}{len(masked) + 1}.", True

    def history_prompt(self, history: Sequence[str], n: int) -> tuple[str, bool]:
        """The history-based prompt and whether its last list item is left open."""
        kind = self._config().idle.knowledge_kind
        asked = "\n".join(f"{i}. {q}" for i, q in enumerate(history, 1))
        if self._chat_format is not None:
            avoid = self._masked(PROMPT_TOKEN_BUDGET - self._count_tokens(asked) - 80)
            avoid_text = ("\nDo not repeat these:\n" + "\n".join(f"- {q}" for q in avoid)) if avoid else ""
            message = (
                f"A person asked an assistant these questions about their {kind}:\n{asked}\n\n"
                f"Predict {n} other questions the same person is likely to ask next, in the same "
                f"style, tone and formality, about the same interests. Reply with a numbered "
                f"list of questions only.{avoid_text}"
            )
            return self._chat_format(message), False
        head = f"Questions a person asked their assistant about their {kind}:\n"
        asked_items = list(history)
        masked = self._masked(PROMPT_TOKEN_BUDGET - self._count_tokens(head + asked))
        items = asked_items + [q for q in masked if q not in asked_items]
        listed = "".join(f"{i}. {q}\n" for i, q in enumerate(items, 1))
        return f"{head}{listed}{len(items) + 1}.", True

    # -- generation -----------------------------------------------------------------------

    def predict_from_knowledge(
        self, abstract: Sequence[str], n: int, max_calls: int = 3
    ) -> tuple[list[PredictedQuestion], PredictionTally]:
        """Up to *n* new questions about the knowledge described by *abstract*."""
        return self._predict(lambda: self.knowledge_prompt(abstract, n), n, "knowledge", max_calls)

    def predict_from_history(
        self, history: Sequence[str], n: int, max_calls: int = 3
    ) -> tuple[list[PredictedQuestion], PredictionTally]:
        """Up to *n* new questions in the style and interests of *history*."""
        if not history:
            return [], PredictionTally()
        return self._predict(lambda: self.history_prompt(history, n), n, "history", max_calls)

    def _predict(
        self, build_prompt: Callable[[], tuple[str, bool]], n: int, origin: str, max_calls: int
    ) -> tuple[list[PredictedQuestion], PredictionTally]:
        tally = PredictionTally()
        accepted: list[PredictedQuestion] = []
        for _ in range(max_calls):
            if len(accepted) >= n:
                break
            prompt, open_item = build_prompt()
            self._calls += 1
            tally.llm_calls += 1
            sampling = Sampling(self.temperature, 1.0, self._config().engine.seed + self._calls)
            text = self._complete(prompt, Decoding(min(48 * n, 320), sampling, ("\n\n",)))
            lines = parse_list(text, first_item_open=open_item)
            tally.candidates += len(lines)
            for line in lines:
                if len(accepted) >= n:
                    break
                question = clean_question(line)
                if question is None:
                    tally.malformed += 1
                    continue
                embedding = self._embedder.embed([question])[0]
                if self._is_duplicate(embedding, accepted):
                    tally.duplicates += 1
                    self.temperature = min(MAX_TEMPERATURE, round(self.temperature + TEMPERATURE_STEP, 2))
                    continue
                accepted.append(PredictedQuestion(question, embedding, origin))
                self.recent.append(question)
        tally.accepted = len(accepted)
        return accepted, tally

    def _is_duplicate(self, embedding: np.ndarray, accepted: list[PredictedQuestion]) -> bool:
        threshold = self._config().idle.dedup_similarity
        if self._known_similarity(embedding) >= threshold:
            return True
        return any(float(p.embedding @ embedding) >= threshold for p in accepted)


def predictor_for(parts: CacheParts, complete: Complete, chat_format: Callable[[str], str] | None) -> QueryPredictor:
    """The query predictor of one cache's *parts*, calling the model through *complete*;
    a question is known as well as its nearest QA entry anywhere in the bank is similar."""
    return QueryPredictor(
        complete=complete,
        count_tokens=lambda text: len(parts.runtime.engine.tokenize(text)),
        embedder=parts.embedder,
        known_similarity=lambda embedding: max(
            (
                h.similarity
                for h in parts.qa_bank.search(
                    embedding, top_n=1, similarity_threshold=-1.0, everywhere=True
                )
            ),
            default=-1.0,
        ),
        config=lambda: parts.config,
        chat_format=chat_format,
    )
