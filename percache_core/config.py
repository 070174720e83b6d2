"""Settings of a PerCache instance: seven typed, frozen sections, each validating itself.

:class:`PerCacheConfig` holds the sections (``tiers``, ``retrieval``, ``bound``, ``engine``,
``budgets``, ``idle``, ``shared``). Every setting also has a flat keyword of the same name,
so ``PerCacheConfig(top_k=2)`` is ``PerCacheConfig(retrieval=RetrievalSettings(top_k=2))``
and ``config.top_k`` reads ``config.retrieval.top_k``; :data:`SECTION_OF` maps each flat name
onto its section, one to one.

>>> config = PerCacheConfig(top_k=2, qa_mode="semantic")
>>> config.retrieval.top_k, config.tiers.qa_mode
(2, 'semantic')
>>> config == PerCacheConfig(retrieval=RetrievalSettings(top_k=2), tiers=TierSettings(qa_mode="semantic"))
True
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .kv.engine import Decoding, Sampling
from .kv.stopping import stop_strings

QAMode = Literal["exact", "semantic"]
StateReuse = Literal["exact", "approximate"]
ContextMode = Literal["fixed", "adaptive"]  # see percache_core.answering.context
Signal = Literal["top_probability", "margin", "entropy"]
DraftDecoding = Literal["auto", "on", "off"]
VerifierName = Literal["lexical", "none"]
Equivalence = Literal["text", "token_f1"]
PredictionTemplate = Literal["auto", "completion", "chat"]

DEFAULT_SYSTEM_PROMPT = (
    "You are a personal assistant. Answer the question briefly, using only the notes below."
)
DEFAULT_STOP = ("\n", "Question:", "Note:")

MB = 1024 * 1024
MAX_TEMPERATURE = 10.0
MIN_SECRET_CHARS = 16


# -- one helper per kind of check ---------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_positive_ints(section: object, *names: str, optional: bool = False) -> None:
    """Each setting in *names* is an integer above 0 (or None, when *optional*)."""
    for name in names:
        value = getattr(section, name)
        if optional and value is None:
            continue
        if not _is_int(value) or value <= 0:
            kind = "a positive integer or None" if optional else "a positive integer"
            raise ValueError(f"{name} must be {kind}, got {value!r}")


def check_counts(section: object, *names: str) -> None:
    """Each setting in *names* is an integer at or above 0."""
    for name in names:
        value = getattr(section, name)
        if not _is_int(value) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def check_range(section: object, name: str, low: float, high: float, *, open_low: bool = False) -> None:
    """Setting *name* is a finite number in [low, high] ((low, high] with *open_low*)."""
    value = getattr(section, name)
    if not _is_number(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (open_low and value == low):
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}")


def check_choice(section: object, name: str, mode: Any) -> None:
    """Setting *name* is one of the values of the ``Literal`` *mode*."""
    value, choices = getattr(section, name), get_args(mode)
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")


# -- the sections -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TierSettings:
    """Which tiers run and how what they store is reused.

    Attributes:
        qa_bank: reuse the stored answers of similar questions (see ``qa_mode``).
        chunk_states: restore llama.cpp KV states of [system, chunk, ...] prompt prefixes.
        chunk_state_slices: store each prefix as only its own segment's positions (a slice)
            and rebuild a path from its slices; exact, checked by a round trip when the
            states are opened (whole states where the check fails). Off: whole states.
        reuse: ``"exact"`` (default): only exact prefixes of a prompt are restored.
            ``"approximate"`` (opt-in): where the exact prefix ends, later chunks are taken
            from their independent [system, chunk] states (moved to their positions), with
            the first ``recompute_tokens`` of each prefilled live; such answers may differ
            from the cache-off answer, carry ``approximate=True`` and are never stored.
        recompute_tokens: approximate reuse: tokens of each composed chunk prefilled live.
        store_answers: keep the answers of user questions in the QA bank (off: the bank
            holds only predicted and follow-up answers, as in sleep-time compute).
        qa_mode: ``"exact"`` (default): stored answers of similar questions are drafts that
            the model verifies on the new question's own prompt, so every answer is token
            for token the cache-off answer. ``"semantic"`` (the PerCache paper's behaviour,
            approximate): an entry at or above ``similarity_threshold`` is served without the
            model; it may be another question's answer.
        similarity_threshold: tau in [0, 1], the least similarity of a semantic hit.
        draft_similarity: exact mode: entries at or above this cosine similarity are offered
            as drafts (a wrong draft costs one batched pass, never a wrong answer).
        verifier: semantic mode: ``"lexical"`` rejects candidates that differ in negation,
            numbers, dates, names, name order, antonyms or the kind of answer; ``"none"``
            serves on cosine alone. It only ever rejects; nothing below tau is served.
        verifier_candidates: candidates considered per question, best first.
    """

    qa_bank: bool = True
    chunk_states: bool = True
    chunk_state_slices: bool = True
    reuse: StateReuse = "exact"
    recompute_tokens: int = 16
    store_answers: bool = True
    qa_mode: QAMode = "exact"
    similarity_threshold: float = 0.85
    draft_similarity: float = 0.7
    verifier: VerifierName = "lexical"
    verifier_candidates: int = 3

    def __post_init__(self) -> None:
        check_range(self, "similarity_threshold", 0.0, 1.0)
        check_range(self, "draft_similarity", 0.0, 1.0)
        check_choice(self, "reuse", StateReuse)
        check_choice(self, "qa_mode", QAMode)
        check_choice(self, "verifier", VerifierName)
        check_counts(self, "recompute_tokens")
        check_positive_ints(self, "verifier_candidates")


@dataclass(frozen=True, kw_only=True)
class RetrievalSettings:
    """How documents are chunked and retrieved, and the prompt's first segment.

    Attributes:
        top_k: chunks retrieved per question.
        context: ``"fixed"`` (default): the prompt gets every retrieved chunk.
            ``"adaptive"`` (opt-in): chunks are added one at a time in retrieval order until
            the first answer token's ``adaptive_signal`` passes ``adaptive_threshold`` (see
            :mod:`percache_core.answering.context`; with the bundled model it did not beat
            fixed counts in our calibration, so it is off by default).
        adaptive_signal: ``"top_probability"``, ``"margin"`` or ``"entropy"``.
        adaptive_threshold: the signal's threshold (entropy: at or below it).
        chunk_words: target chunk length in words when documents are split.
        rrf_k: the constant of reciprocal-rank fusion of BM25 and dense rankings.
        system_prompt: the first prompt segment (shared by every question).
    """

    top_k: int = 3
    context: ContextMode = "fixed"
    adaptive_signal: Signal = "margin"
    adaptive_threshold: float = 0.12
    chunk_words: int = 100
    rrf_k: int = 60
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    def __post_init__(self) -> None:
        check_positive_ints(self, "top_k", "chunk_words", "rrf_k")
        check_choice(self, "context", ContextMode)
        check_choice(self, "adaptive_signal", Signal)
        check_range(self, "adaptive_threshold", -math.inf, math.inf)
        if not isinstance(self.system_prompt, str) or not self.system_prompt.strip():
            raise ValueError("system_prompt must not be empty")

    @property
    def adaptive(self) -> bool:
        """Whether the prompt's chunk count is chosen per question (``context="adaptive"``)."""
        return self.context == "adaptive"


@dataclass(frozen=True, kw_only=True)
class BoundSettings:
    """The error approximate tiers may cost (``qa_mode="semantic"``, ``reuse="approximate"``).

    Attributes:
        max_error_rate: the share of approximate answers that may be wrong (default 0.02).
            An approximate answer is served only where the model's own labels (see
            :mod:`percache_core.qa.calibration`) give an error rate whose 95% upper bound is
            at most this: semantic hits above the calibrated similarity threshold and their
            entry's own floor, composed chunk states with the fewest recompute tokens that
            meet it. Elsewhere the model answers (exactly). 1.0: no bound (served at tau,
            unchecked).
        answer_equivalence: when an approximate answer counts as right: ``"text"`` (the same
            text the model gives to that question's own prompt) or ``"token_f1"`` (token F1
            against it at least ``equivalence_min_f1``).
        equivalence_min_f1: the least token F1 of ``answer_equivalence="token_f1"``.
        calibration_answers_per_round: model answers an idle round spends on labels
            (variants of stored questions; composed runs of asked questions), at most.
    """

    max_error_rate: float = 0.02
    answer_equivalence: Equivalence = "text"
    equivalence_min_f1: float = 0.8
    calibration_answers_per_round: int = 8

    def __post_init__(self) -> None:
        check_range(self, "max_error_rate", 0.0, 1.0, open_low=True)
        check_choice(self, "answer_equivalence", Equivalence)
        check_range(self, "equivalence_min_f1", 0.0, 1.0, open_low=True)
        check_counts(self, "calibration_answers_per_round")

    @property
    def bounded(self) -> bool:
        """Whether approximate answers are held to ``max_error_rate`` (below 1)."""
        return self.max_error_rate < 1.0


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """The model, llama.cpp's context and how answers are decoded.

    Attributes:
        model_path: a GGUF file; ``None`` uses the bundled Gemma 3 270M.
        n_ctx: llama.cpp's context length in tokens.
        n_batch: llama.cpp's logical batch size.
        n_threads: threads for llama.cpp (``None``: all cores).
        repack_weights: llama.cpp's CPU weight repacking (``use_extra_bufts``), its default.
            On: answers to framework prompts are those of stock ``llama_cpp.Llama`` on the
            same GGUF; off: prefill about 4% faster here, and framework answers differed from
            stock llama.cpp's on 2 of 8 prompts. Exact with or without a cache either way.
        max_new_tokens: the longest answer, in tokens.
        temperature: 0 is greedy decoding (deterministic); above 0 samples with top_p and seed.
        top_p: nucleus sampling's probability mass (with ``temperature`` above 0).
        seed: the sampler's seed (with ``temperature`` above 0).
        stop: strings that end an answer (not included in it).
        prompt_lookup: with greedy decoding, also draft the next tokens from phrases of the
            prompt (lossless, opt-in: with the bundled model's small logit leads it is not
            faster on this build). Used when draft decoding is.
        draft_decoding: whether drafts (QA-bank answers, prompt lookup) are verified in
            batches while decoding; the output is the same either way. ``"auto"`` (default):
            only once the engine's self-check (``preload()`` or an idle round, never inside an
            answer) has found that a batch row costs at most half a decode step; ``"on"``:
            always; ``"off"``: never.
    """

    model_path: str | None = None
    n_ctx: int = 2048
    n_batch: int = 512
    n_threads: int | None = None
    repack_weights: bool = True
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = field(default=DEFAULT_STOP)
    prompt_lookup: bool = False
    draft_decoding: DraftDecoding = "auto"

    def __post_init__(self) -> None:
        check_positive_ints(self, "n_ctx", "n_batch", "max_new_tokens")
        check_positive_ints(self, "n_threads", optional=True)
        check_range(self, "temperature", 0.0, MAX_TEMPERATURE)
        check_range(self, "top_p", 0.0, 1.0, open_low=True)
        check_choice(self, "draft_decoding", DraftDecoding)
        object.__setattr__(self, "stop", stop_strings(self.stop))

    @property
    def sampling(self) -> Sampling:
        """How answers pick tokens: ``temperature``, ``top_p`` and ``seed``."""
        return Sampling(self.temperature, self.top_p, self.seed)

    def resolve(self, decoding: Decoding | None) -> Decoding:
        """*decoding* with these settings' tokens and sampling where it has none.

        Raises:
            ValueError: ``max_new_tokens`` that is not a positive integer.

        >>> EngineSettings().resolve(Decoding(stop=["."])).max_new_tokens
        128
        """
        decoding = decoding or Decoding()
        tokens = self.max_new_tokens if decoding.max_new_tokens is None else decoding.max_new_tokens
        if not _is_int(tokens) or tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {tokens!r}")
        return dataclasses.replace(decoding, max_new_tokens=tokens, sampling=decoding.sampling or self.sampling)


@dataclass(frozen=True, kw_only=True)
class BudgetSettings:
    """Bytes on disk, over every process using the folder (least frequently used entries
    are evicted beyond them).

    Attributes:
        qa_bank_budget_bytes: for the QA bank's question entries, and again for its prompt
            answers (whole prompts answered before, served without the model).
        chunk_state_budget_bytes: for the chunk states; None (the default) sizes it from the
            knowledge: the bytes the knowledge prefill's states take ([system, chunk] and
            ``knowledge_prefill_neighbours`` pairs of every chunk, at the loaded model's bytes
            per token) over its 80% share, at least 1 GiB and at most a quarter of the free
            disk (see ``stats()["chunk_states"]``).
        min_free_disk_bytes: chunk states are not stored when the disk would keep less free
            space than this (answers are unaffected).
    """

    qa_bank_budget_bytes: int = 100 * MB
    chunk_state_budget_bytes: int | None = None
    min_free_disk_bytes: int = 256 * MB

    def __post_init__(self) -> None:
        check_positive_ints(self, "qa_bank_budget_bytes")
        check_positive_ints(self, "chunk_state_budget_bytes", optional=True)
        check_counts(self, "min_free_disk_bytes")


@dataclass(frozen=True, kw_only=True)
class IdleSettings:
    """Prediction and idle-time population.

    Attributes:
        prediction: predict questions in idle time (used by the predictor, when present).
        prediction_stride: questions predicted per prediction step.
        knowledge_kind: what the documents are ("personal e-mails and meeting notes").
        prediction_template: ``"completion"`` (base models), ``"chat"`` (instruction-tuned
            models, through the GGUF's chat template) or ``"auto"`` (chat when the model file
            name says it is instruction-tuned: "-it", "instruct", "chat").
        dedup_similarity: S_gen; a predicted question this similar to a known one is dropped.
        history_size: recent user questions kept for history-based prediction.
        abstract_max_lines: the knowledge abstract is condensed beyond this many lines.
        abstract_batch_chunks: chunks summarised per LLM call.
        strategy_cutoff: tau above it: populate by prefill only (chunk states and pending QA
            entries); at or below it: prefill and decode.
        knowledge_prediction_rounds: knowledge-based prediction steps the background worker
            runs per version of the abstract (an explicit ``warm()`` always runs one).
        knowledge_prefill: in idle rounds, also prefill and keep the [system, chunk] state of
            every chunk (recently retrieved first), so that every prompt restores at least its
            first chunk. The bulk prefill runs only where all of them fit the prefill's share
            of the chunk-state budget (80%); where they do not, idle time prefills the paths
            the demand estimate names instead.
        knowledge_prefill_neighbours: after those, also the [system, chunk, neighbour] states
            of each chunk for this many neighbours (the chunks retrieval ranks next when the
            chunk's own text is the question), every chunk's nearest first. 0: none.
        abstract_batches_per_round: LLM summary calls per idle round at most.
        idle_after_s: the background worker starts a round after this long without a query.
    """

    prediction: bool = True
    prediction_stride: int = 5
    knowledge_kind: str = "personal e-mails and meeting notes"
    prediction_template: PredictionTemplate = "auto"
    dedup_similarity: float = 0.99
    history_size: int = 10
    abstract_max_lines: int = 40
    abstract_batch_chunks: int = 3
    strategy_cutoff: float = 0.875
    knowledge_prediction_rounds: int = 2
    knowledge_prefill: bool = True
    knowledge_prefill_neighbours: int = 8
    abstract_batches_per_round: int = 8
    idle_after_s: float = 30.0

    def __post_init__(self) -> None:
        check_positive_ints(
            self,
            "prediction_stride",
            "history_size",
            "abstract_max_lines",
            "abstract_batch_chunks",
            "abstract_batches_per_round",
        )
        check_counts(self, "knowledge_prediction_rounds", "knowledge_prefill_neighbours")
        check_choice(self, "prediction_template", PredictionTemplate)
        check_range(self, "dedup_similarity", 0.0, 1.0)
        check_range(self, "strategy_cutoff", 0.0, 1.0)
        check_range(self, "idle_after_s", 0.0, math.inf)


@dataclass(frozen=True, kw_only=True)
class SharedSettings:
    """The shared tier on Redis (``pip install "percache-core[redis]"``).

    Attributes:
        shared_url: ``redis://host:port/db`` or ``redis+cluster://host:port``; None: local only.
        shared_namespace: tenant or user; other namespaces are invisible.
        shared_secret: HMAC key that signs shared entries (required with a URL).
        shared_write: also write local additions to the shared tier.
        shared_timeout_s: per-call timeout; failures switch to local-only mode for a while.
        shared_sync_interval_s: how often the local catalog and QA bank are synchronised.
    """

    shared_url: str | None = None
    shared_namespace: str = "default"
    shared_secret: str | None = field(default=None, repr=False)
    shared_write: bool = True
    shared_timeout_s: float = 0.1
    shared_sync_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.shared_url is not None and not self.shared_secret:
            raise ValueError("shared_url needs shared_secret (the HMAC key that signs shared entries)")
        if self.shared_secret is not None and len(self.shared_secret) < MIN_SECRET_CHARS:
            raise ValueError(
                f"shared_secret must have at least {MIN_SECRET_CHARS} characters "
                '(e.g. python -c "import secrets; print(secrets.token_urlsafe(32))")'
            )
        check_range(self, "shared_timeout_s", 0.0, math.inf, open_low=True)
        check_range(self, "shared_sync_interval_s", 0.0, math.inf, open_low=True)


SECTIONS: dict[str, type] = {
    "tiers": TierSettings,
    "retrieval": RetrievalSettings,
    "bound": BoundSettings,
    "engine": EngineSettings,
    "budgets": BudgetSettings,
    "idle": IdleSettings,
    "shared": SharedSettings,
}
SECTION_OF: dict[str, str] = {
    f.name: section for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)
}
"""Each flat setting's section: ``SECTION_OF["top_k"] == "retrieval"``."""


@dataclass(frozen=True, init=False)
class PerCacheConfig:
    """Every option of PerCache, in seven sections (see each section for its settings and
    defaults). Give sections by name (``tiers=TierSettings(...)``), any setting by its
    flat name (``top_k=2``, placed in its section), or both.

    Attributes:
        tiers: which tiers run and how stored answers and states are reused.
        retrieval: chunking, retrieval and the system prompt.
        bound: the error approximate tiers may cost.
        engine: the model, its context and decoding.
        budgets: bytes on disk.
        idle: prediction and idle-time work.
        shared: the Redis tier.

    Args:
        **settings: sections by name, and settings by their flat names.

    Raises:
        TypeError: an unknown setting, or a section of the wrong type.
        ValueError: a value out of range (each section checks its own).

    >>> PerCacheConfig(top_k=2).top_k
    2
    >>> PerCacheConfig(similarity_threshold=1.5)
    Traceback (most recent call last):
    ...
    ValueError: similarity_threshold must be in [0, 1], got 1.5
    """

    tiers: TierSettings
    retrieval: RetrievalSettings
    bound: BoundSettings
    engine: EngineSettings
    budgets: BudgetSettings
    idle: IdleSettings
    shared: SharedSettings

    def __init__(self, **settings: Any) -> None:
        flat: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for name, value in settings.items():
            if name in SECTIONS:
                continue
            if name not in SECTION_OF:
                raise TypeError(f"unknown setting: {name}")
            flat[SECTION_OF[name]][name] = value
        for name, kind in SECTIONS.items():
            given = settings.get(name)
            if given is None:
                section = kind(**flat[name])
            elif not isinstance(given, kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {type(given).__name__}")
            else:
                section = dataclasses.replace(given, **flat[name]) if flat[name] else given
            object.__setattr__(self, name, section)

    def __getattr__(self, name: str) -> Any:
        """A setting by its flat name (``config.top_k`` is ``config.retrieval.top_k``)."""
        section = SECTION_OF.get(name)
        if section is None:
            raise AttributeError(f"{type(self).__name__!r} has no setting {name!r}")
        return getattr(object.__getattribute__(self, section), name)

    def __repr__(self) -> str:
        changed = [
            f"{f.name}={getattr(section, f.name)!r}"
            for section in self.sections()
            for f in dataclasses.fields(section)
            if f.repr and getattr(section, f.name) != f.default
        ]
        return f"PerCacheConfig({', '.join(changed)})"

    def sections(self) -> tuple[Any, ...]:
        """The seven sections, in order.

        Returns:
            (tiers, retrieval, bound, engine, budgets, idle, shared).

        >>> type(PerCacheConfig().sections()[0]).__name__
        'TierSettings'
        """
        return tuple(getattr(self, name) for name in SECTIONS)

    def replace(self, **changes: Any) -> PerCacheConfig:
        """A copy with some settings changed (flat names or whole sections), validated again.

        Args:
            **changes: settings by flat name, or sections by name.

        Returns:
            The new configuration.

        Raises:
            TypeError: an unknown setting.
            ValueError: a value out of range.

        >>> PerCacheConfig().replace(qa_bank=False).qa_bank
        False
        """
        current = {name: getattr(self, name) for name in SECTIONS if name not in changes}
        return PerCacheConfig(**current, **changes)

    def as_flat(self) -> dict[str, Any]:
        """Every setting by its flat name (secrets included).

        Returns:
            ``{flat name: value}`` for all the settings.

        >>> PerCacheConfig(top_k=2).as_flat()["top_k"]
        2
        """
        return {name: getattr(getattr(self, section), name) for name, section in SECTION_OF.items()}


class LiveConfig:
    """The configuration in force in one open cache, shared by its parts: each part reads
    the section it needs when it needs it (``live.current.budgets.qa_bank_budget_bytes``),
    so a change (``PerCache.configure``) is one assignment and nothing is pushed into the
    parts.

    >>> live = LiveConfig(PerCacheConfig(top_k=2))
    >>> read_top_k = lambda: live.current.retrieval.top_k
    >>> live.current = live.current.replace(top_k=4)
    >>> read_top_k()
    4
    """

    def __init__(self, config: PerCacheConfig) -> None:
        self.current = config
