"""Settings of a PerCache instance, as one frozen dataclass of documented defaults."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .kv.engine import Sampling
from .kv.stopping import stop_strings

CONTEXT_MODES = ("fixed", "adaptive")  # see percache_core.serving.context
SIGNALS = ("top_probability", "margin", "entropy")

DEFAULT_SYSTEM_PROMPT = (
    "You are a personal assistant. Answer the question briefly, using only the notes below."
)
DEFAULT_STOP = ("\n", "Question:", "Note:")

MB = 1024 * 1024
MAX_TEMPERATURE = 10.0
MIN_SECRET_CHARS = 16


@dataclass(frozen=True, kw_only=True)
class PerCacheConfig:
    """Every option of PerCache, with its default.

    Tiers:
        qa_bank: reuse the stored answers of similar questions (see ``qa_mode``).
        chunk_states: restore llama.cpp KV states of [system, chunk, ...] prompt prefixes.
        reuse: "exact" (default): only exact prefixes of a prompt are restored. "approximate"
            (opt-in): where the exact prefix ends, later chunks are taken from their
            independent [system, chunk] states (moved to their positions), with the
            first ``recompute_tokens`` of each prefilled live; such answers may differ from
            the cache-off answer, carry ``approximate=True`` and are never stored.
        recompute_tokens: approximate reuse: tokens of each composed chunk prefilled live.
        chunk_state_slices: store each prefix as only its own segment's positions (a slice)
            and rebuild a path from its slices; exact, checked by a round trip when the
            states are opened (whole states where the check fails). Off: whole states.
        prediction: predict questions in idle time (used by the predictor, when present).
        store_answers: keep the answers of user questions in the QA bank (off: the bank
            holds only predicted and follow-up answers, as in sleep-time compute).

    Retrieval and prompt:
        similarity_threshold: tau in [0, 1] for QA-bank hits.
        top_k: chunks retrieved per question.
        context: "fixed" (default): the prompt gets every retrieved chunk. "adaptive"
            (opt-in): chunks are added one at a time in retrieval order until the first
            answer token's ``adaptive_signal`` passes ``adaptive_threshold`` (see
            :mod:`percache_core.serving.context`; with the bundled model it did not beat fixed
            counts in our calibration, so it is off by default).
        adaptive_signal: "top_probability", "margin" or "entropy".
        adaptive_threshold: the signal's threshold (entropy: at or below it).
        chunk_words: target chunk length in words when documents are split.
        rrf_k: the constant of reciprocal-rank fusion of BM25 and dense rankings.
        system_prompt: the first prompt segment (shared by every question).

    How stored answers are reused:
        qa_mode: "exact" (default): stored answers of similar questions are drafts that
            the model verifies on the new question's own prompt, so every answer is token
            for token the cache-off answer; a fully accepted draft is served as
            ``source="qa_bank"``. "semantic" (the PerCache paper's behaviour, approximate):
            an entry at or above ``similarity_threshold`` is served without the model; it
            may be another question's answer (see the README for measured rates).
        draft_similarity: exact mode: entries at or above this cosine similarity are
            offered as drafts (a wrong draft costs one batched pass, never a wrong answer).
        prompt_lookup: with greedy decoding, also draft the next tokens from phrases of
            the prompt (lossless, opt-in: with the bundled model's small logit leads it is
            not faster on this build; see the README). Used when draft decoding is
            (``draft_decoding``: "on", or "auto" where the self-check measured a gain).
        draft_decoding: whether drafts (QA-bank answers, prompt lookup) are verified in
            batches while decoding; the output is the same either way. "auto" (default):
            only once the engine's self-check (``preload()`` or an idle round, never inside
            an answer) has measured the batched-logit bound and found that a batch row
            costs at most half a decode step; "on": always (the bound is measured on first
            use); "off": never. A wrong draft costs at most one batch.
        verifier: semantic mode: "lexical" rejects candidates that differ in negation,
            numbers, dates, names, name order, antonyms or the kind of answer; "none"
            serves on cosine alone. It only ever rejects; nothing below tau is served.
        verifier_candidates: candidates considered per question, best first.

    Approximate tiers within a bound (``qa_mode="semantic"``, ``reuse="approximate"``):
        max_error_rate: the share of approximate answers that may be wrong (default 0.02).
            An approximate answer is served only where the model's own labels (see
            :mod:`percache_core.qa.calibration`) give an error rate whose 95% upper bound
            is at most this: semantic hits above the calibrated similarity threshold and
            their entry's own floor, composed chunk states with the fewest recompute tokens
            that meet it. Elsewhere the model answers (exactly). Labels come free from the
            questions the model answers, and from idle work (served answers checked,
            variants of stored questions). 1.0: no bound (served at tau, unchecked).
        answer_equivalence: when an approximate answer counts as right: "text" (default:
            the same text the model gives to that question's own prompt) or "token_f1"
            (token F1 against it at least ``equivalence_min_f1``).
        equivalence_min_f1: the least token F1 of ``answer_equivalence="token_f1"``.
        calibration_answers_per_round: model answers an idle round spends on labels
            (variants of stored questions; composed runs of asked questions), at most.

    Shared tier (Redis; ``pip install "percache-core[redis]"``):
        shared_url: ``redis://host:port/db`` or ``redis+cluster://host:port``; None: local only.
        shared_namespace: tenant or user; other namespaces are invisible.
        shared_secret: HMAC key that signs shared entries (required with a URL).
        shared_write: also write local additions to the shared tier.
        shared_timeout_s: per-call timeout; failures switch to local-only mode for a while.
        shared_sync_interval_s: how often the local catalog and QA bank are synchronised.

    Generation (llama.cpp):
        model_path: a GGUF file; ``None`` uses the bundled Gemma 3 270M.
        n_ctx, n_batch, n_threads: llama.cpp context settings (``n_threads=None``: all cores).
        repack_weights: llama.cpp's CPU weight repacking (``use_extra_bufts``), its default.
            On: answers to framework prompts are those of stock ``llama_cpp.Llama`` on the
            same GGUF; off: prefill about 4% faster here, and framework answers differed from
            stock llama.cpp's on 2 of 8 prompts. Exact with or without a cache either way.
        max_new_tokens: the longest answer, in tokens.
        temperature: 0 is greedy decoding (deterministic); above 0 samples with top_p and seed.
        stop: strings that end an answer (not included in it).

    Budgets (bytes on disk, over every process using the folder; least frequently used
    entries are evicted beyond them):
        qa_bank_budget_bytes: for the QA bank's question entries, and again for its prompt
            answers (whole prompts answered before, served without the model).
        chunk_state_budget_bytes: for the chunk states; None (the default) sizes it from the
            knowledge: the bytes the knowledge prefill's states take ([system, chunk] and
            ``knowledge_prefill_neighbours`` pairs of every chunk, at the loaded model's
            bytes per token) over its 80% share, at least 1 GiB and at most a quarter of
            the free disk (see ``stats()["chunk_states"]``).
        min_free_disk_bytes: chunk states are not stored when the disk would keep less
            free space than this (answers are unaffected).

    Prediction and idle-time population (used when ``prediction`` is on):
        prediction_stride: questions predicted per prediction step.
        knowledge_kind: what the documents are ("personal e-mails and meeting notes").
        prediction_template: "completion" (base models), "chat" (instruction-tuned models,
            through the GGUF's chat template) or "auto" (chat when the model file name says
            it is instruction-tuned: "-it", "instruct", "chat").
        dedup_similarity: S_gen; a predicted question this similar to a known one is dropped.
        history_size: recent user questions kept for history-based prediction.
        abstract_max_lines: the knowledge abstract is condensed beyond this many lines.
        abstract_batch_chunks: chunks summarised per LLM call.
        strategy_cutoff: tau above it -> populate by prefill only (chunk states + pending
            QA entries); at or below it -> prefill and decode.
        knowledge_prediction_rounds: knowledge-based prediction steps the background worker
            runs per version of the abstract (an explicit ``warm()`` always runs one).
        knowledge_prefill: in idle rounds, also prefill and keep the [system, chunk] state
            of every chunk (recently retrieved first), so that every prompt restores at
            least its first chunk: the bulk prefill runs only where all of them fit the
            prefill's share of the chunk-state budget (80%); where they do not, idle time
            prefills the paths the demand estimate names instead.
        knowledge_prefill_neighbours: after those, also the [system, chunk, neighbour]
            states of each chunk for this many neighbours, the chunks retrieval ranks next
            when the chunk's own text is the question: a prompt whose first two chunks are
            such a pair restores both (the output is unchanged either way). Every chunk's
            nearest first, then every chunk's second, ..., so a small budget holds the
            nearest pairs. 0: none.
        abstract_batches_per_round: LLM summary calls per idle round at most.
        idle_after_s: the background worker starts a round after this long without a query.

    >>> PerCacheConfig(top_k=2).top_k
    2
    >>> PerCacheConfig(similarity_threshold=1.5)
    Traceback (most recent call last):
    ...
    ValueError: similarity_threshold must be in [0, 1], got 1.5
    """

    qa_bank: bool = True
    chunk_states: bool = True
    chunk_state_slices: bool = True
    reuse: str = "exact"
    recompute_tokens: int = 16
    prediction: bool = True
    store_answers: bool = True

    similarity_threshold: float = 0.85
    top_k: int = 3
    context: str = "fixed"
    adaptive_signal: str = "margin"
    adaptive_threshold: float = 0.12
    chunk_words: int = 100
    rrf_k: int = 60
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    qa_mode: str = "exact"
    draft_similarity: float = 0.7
    prompt_lookup: bool = False
    draft_decoding: str = "auto"
    verifier: str = "lexical"
    verifier_candidates: int = 3
    max_error_rate: float = 0.02
    answer_equivalence: str = "text"
    equivalence_min_f1: float = 0.8
    calibration_answers_per_round: int = 8

    shared_url: str | None = None
    shared_namespace: str = "default"
    shared_secret: str | None = field(default=None, repr=False)
    shared_write: bool = True
    shared_timeout_s: float = 0.1
    shared_sync_interval_s: float = 0.5

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

    qa_bank_budget_bytes: int = 100 * MB
    chunk_state_budget_bytes: int | None = None
    min_free_disk_bytes: int = 256 * MB

    prediction_stride: int = 5
    knowledge_kind: str = "personal e-mails and meeting notes"
    prediction_template: str = "auto"
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
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(f"similarity_threshold must be in [0, 1], got {self.similarity_threshold}")
        positive = {
            "top_k": self.top_k,
            "chunk_words": self.chunk_words,
            "rrf_k": self.rrf_k,
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
            "max_new_tokens": self.max_new_tokens,
            "qa_bank_budget_bytes": self.qa_bank_budget_bytes,
            "prediction_stride": self.prediction_stride,
            "history_size": self.history_size,
            "abstract_max_lines": self.abstract_max_lines,
            "abstract_batch_chunks": self.abstract_batch_chunks,
            "abstract_batches_per_round": self.abstract_batches_per_round,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("n_threads", "chunk_state_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        for name in ("min_free_disk_bytes", "knowledge_prefill_neighbours"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("temperature", "top_p", "similarity_threshold", "idle_after_s", "adaptive_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.shared_url is not None and not self.shared_secret:
            raise ValueError("shared_url needs shared_secret (the HMAC key that signs shared entries)")
        if self.shared_secret is not None and len(self.shared_secret) < MIN_SECRET_CHARS:
            raise ValueError(
                f"shared_secret must have at least {MIN_SECRET_CHARS} characters "
                '(e.g. python -c "import secrets; print(secrets.token_urlsafe(32))")'
            )
        if self.shared_timeout_s <= 0 or self.shared_sync_interval_s <= 0:
            raise ValueError("shared_timeout_s and shared_sync_interval_s must be positive")
        if self.verifier not in ("lexical", "none"):
            raise ValueError(f"verifier must be 'lexical' or 'none', got {self.verifier!r}")
        if self.verifier_candidates <= 0:
            raise ValueError(f"verifier_candidates must be positive, got {self.verifier_candidates}")
        if self.reuse not in ("exact", "approximate"):
            raise ValueError(f"reuse must be 'exact' or 'approximate', got {self.reuse!r}")
        if (
            not isinstance(self.recompute_tokens, int)
            or isinstance(self.recompute_tokens, bool)
            or self.recompute_tokens < 0
        ):
            raise ValueError(f"recompute_tokens must be an integer >= 0, got {self.recompute_tokens!r}")
        if self.context not in CONTEXT_MODES:
            raise ValueError(f"context must be one of {', '.join(CONTEXT_MODES)}, got {self.context!r}")
        if self.adaptive_signal not in SIGNALS:
            raise ValueError(
                f"adaptive_signal must be one of {', '.join(SIGNALS)}, got {self.adaptive_signal!r}"
            )
        if self.draft_decoding not in ("auto", "on", "off"):
            raise ValueError(f"draft_decoding must be 'auto', 'on' or 'off', got {self.draft_decoding!r}")
        if isinstance(self.max_error_rate, bool) or not isinstance(self.max_error_rate, (int, float)) or not (
            0.0 < self.max_error_rate <= 1.0
        ):
            raise ValueError(f"max_error_rate must be in (0, 1], got {self.max_error_rate!r}")
        if self.answer_equivalence not in ("text", "token_f1"):
            raise ValueError(f"answer_equivalence must be 'text' or 'token_f1', got {self.answer_equivalence!r}")
        if not 0.0 < self.equivalence_min_f1 <= 1.0:
            raise ValueError(f"equivalence_min_f1 must be in (0, 1], got {self.equivalence_min_f1}")
        if (
            not isinstance(self.calibration_answers_per_round, int)
            or isinstance(self.calibration_answers_per_round, bool)
            or self.calibration_answers_per_round < 0
        ):
            raise ValueError(
                f"calibration_answers_per_round must be an integer >= 0, got {self.calibration_answers_per_round!r}"
            )
        if self.qa_mode not in ("exact", "semantic"):
            raise ValueError(f"qa_mode must be 'exact' or 'semantic', got {self.qa_mode!r}")
        for name in ("dedup_similarity", "strategy_cutoff", "draft_similarity"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.prediction_template not in ("auto", "completion", "chat"):
            raise ValueError(
                f"prediction_template must be 'auto', 'completion' or 'chat', got {self.prediction_template!r}"
            )
        if self.idle_after_s < 0:
            raise ValueError(f"idle_after_s must be >= 0, got {self.idle_after_s}")
        if not self.system_prompt.strip():
            raise ValueError("system_prompt must not be empty")
        object.__setattr__(self, "stop", stop_strings(self.stop))

    @property
    def bounded(self) -> bool:
        """Whether approximate answers are held to ``max_error_rate`` (below 1)."""
        return self.max_error_rate < 1.0

    @property
    def sampling(self) -> Sampling:
        """How answers pick tokens: ``temperature``, ``top_p`` and ``seed``."""
        return Sampling(self.temperature, self.top_p, self.seed)

    def replace(self, **changes: object) -> PerCacheConfig:
        """A copy with some fields changed (validated again).

        >>> PerCacheConfig().replace(qa_bank=False).qa_bank
        False
        """
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)
