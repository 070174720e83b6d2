"""Decoding an answer on an in-process engine after its prompt: sampled, or greedy with
drafts (stored answers, prompt phrases) verified in batches where the engine's self-check
found that batches pay (:mod:`percache_core.engines.llama_cpp.drafting`); the tokens turned into text
through the stop strings (:func:`decode_text`); and the plain completions of idle work (the
predictor's and the abstract's LLM calls: :func:`complete_plain`).
"""

from __future__ import annotations

import codecs
import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace

from ...config import PerCacheConfig
from ...errors import Preempted
from ...kv.engine import Decoding, Engine, Sampling
from ...kv.stopping import StopStringFilter
from ...serving.state_runner import IDLE_PIECE_TOKENS, RunOptions, RunResult, StopCheck
from ...serving.text_stream import close_source, shown_text
from .drafting import (
    AnswerDraft,
    DraftPlan,
    DraftSource,
    PromptLookup,
    SequenceLost,
    deviation_bound,
    greedy_tokens,
    known_bound,
    known_drafts_pay,
)

logger = logging.getLogger(__name__)



class AnswerDecoder:
    """Decodes answers on *engine* with the configuration *config* returns now:
    :meth:`draft_bound` and :meth:`decode`."""

    def __init__(self, engine: Engine, config: Callable[[], PerCacheConfig]) -> None:
        self.engine = engine
        self._config = config

    def draft_bound(self, options: RunOptions) -> float | None:
        """The lead a batched logit needs for drafts to be verified (None: decode one token
        at a time). ``draft_decoding="auto"`` drafts only where the engine's self-check
        (run by ``preload()`` and idle rounds, never inside an answer) measured the bound
        and found that batches pay; "on" measures the bound on first use; "off" never."""
        mode = self._config().engine.draft_decoding
        if not options.drafting or mode == "off":
            return None
        if mode == "on":
            return deviation_bound(self.engine)
        return known_bound(self.engine) if known_drafts_pay(self.engine) else None

    def decode(
        self, result: RunResult, options: RunOptions, should_stop: StopCheck | None, started: float,
        bound: float | None, rebuild: Callable[[], None],
    ) -> Generator[str, None, None]:
        """Decode the answer after the evaluated prompt into *result*, as *options* say,
        with drafts verified at *bound* (:meth:`draft_bound`, taken before the prompt was
        prefilled: measuring it runs the engine; None: one token at a time); *rebuild*
        brings the sequence back when draft decoding lost it. Yields its text. *started*
        is when the request began (for the time to first token)."""
        clock = time.perf_counter()
        stop = StopStringFilter(self._config().engine.stop if options.stop is None else options.stop, strip=options.trim)
        max_new_tokens = options.max_new_tokens

        def count_token(token: int) -> None:
            result.tokens.append(token)
            if self.engine.is_end_of_generation(token):
                return
            result.generated_tokens += 1
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - started

        if bound is None:
            assert options.sampling is not None  # resolved by run()
            tokens = self.engine.generate(max_new_tokens=max_new_tokens, sampling=options.sampling)
        else:
            sources: list[DraftSource] = [AnswerDraft(options.answer_drafts)]
            if options.prompt_lookup:
                sources.append(PromptLookup(result.layout.tokens))
            plan = DraftPlan(max_new_tokens, sources, bound, should_stop, result.drafts)
            tokens = self._greedy_with_drafts(plan, rebuild)
        yield from decode_text(self.engine, tokens, stop, should_stop, count_token)
        result.text = stop.text.strip() if options.trim else stop.text
        result.timings["decode"] = time.perf_counter() - clock

    def _greedy_with_drafts(self, plan: DraftPlan, rebuild: Callable[[], None]) -> Iterator[int]:
        """Greedy tokens with drafts; if the sequence is lost, rebuild it and go on."""
        produced: list[int] = []
        while True:
            try:
                for token in greedy_tokens(self.engine, plan):
                    produced.append(token)
                    yield token
                return
            except SequenceLost:
                logger.debug("draft decoding lost the sequence after %d tokens: rebuilt", len(produced))
                rebuild()
                plan = replace(plan, replay=list(produced))


def decode_text(
    engine: Engine,
    tokens: Iterator[int],
    stop: StopStringFilter,
    should_stop: StopCheck | None,
    on_token: Callable[[int], None],
) -> Generator[str, None, None]:
    """Turn decoded *tokens* into text, yielding what *stop* lets through (held back while
    it may begin a stop string); *on_token* sees every token, end of generation included.
    Raises :class:`Preempted` when *should_stop* turns true (see
    :func:`~percache_core.serving.text_stream.shown_text`)."""
    return shown_text(token_pieces(engine, tokens, on_token), stop, should_stop)


def token_pieces(engine: Engine, tokens: Iterator[int], on_token: Callable[[int], None]) -> Iterator[str]:
    """The text of each of *tokens* (one piece per token, "" while a character is still
    incomplete), up to the end of generation; *tokens* is closed when this is."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        for token in tokens:
            on_token(token)
            if engine.is_end_of_generation(token):
                return
            yield decoder.decode(engine.token_bytes(token))
    finally:
        close_source(tokens)


def complete_plain(
    engine: Engine, prompt: str, decoding: Decoding, *, chat: bool = False, should_stop: StopCheck | None = None
) -> tuple[str, int, int]:
    """Complete *prompt* on *engine* with *decoding* (its tokens, sampling and stop strings
    set) without chunk states or stored answers (idle work's plain LLM calls: the
    predictor's and the abstract's): (text, prompt tokens, generated tokens). The prompt
    keeps its last ``n_ctx - max_new_tokens`` tokens, fed :data:`IDLE_PIECE_TOKENS` at a time
    so that a user's request waits for one such piece at most (nothing reuses these calls'
    context, and their text only proposes questions, so their batches need not be the
    answers' batches; measured: a 500-token predictor prompt in one call held a request for
    1.0 s).

    With ``chat=True`` the prompt came from ``engine.chat_prompt`` and its markup is
    tokenized as special tokens. Raises :class:`Preempted` when *should_stop* turns true.
    """
    max_new_tokens, sampling = decoding.required_tokens(), decoding.sampling or Sampling()
    with engine.lock:
        tokens = engine.tokenize_chat(prompt) if chat else engine.tokenize(prompt, True)
        tokens = tokens[-(engine.n_ctx - max_new_tokens) :]
        engine.reset()
        for start in range(0, len(tokens), IDLE_PIECE_TOKENS):
            if engine.n_past != start:  # pre-empted before the last piece
                break
            engine.eval(tokens[start : start + IDLE_PIECE_TOKENS], should_stop)
        if engine.n_past != len(tokens):
            raise Preempted("completion pre-empted by a user question")
        generated = 0

        def count_token(token: int) -> None:
            nonlocal generated
            if not engine.is_end_of_generation(token):
                generated += 1

        stops = StopStringFilter(decoding.stop or ())
        text = "".join(
            decode_text(
                engine,
                engine.generate(max_new_tokens=max_new_tokens, sampling=sampling),
                stops,
                should_stop,
                count_token,
            )
        )
        return text, len(tokens), generated
