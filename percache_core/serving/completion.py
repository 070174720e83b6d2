"""Completion without a cache: a caller's prompt as stock llama.cpp completes it
(:class:`UncachedCompletion`, for an adapter's LLM used outside a cache), and the plain
completions of idle work (the predictor's and the abstract's LLM calls:
:func:`complete_plain`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..config import PerCacheConfig
from ..kv.engine import Decoding, Engine, Sampling
from ..kv.llama_server import LlamaServer
from ..kv.stopping import StopStringFilter
from .answer_decoder import decode_text
from .generation import PromptRunner
from .prompting import TextPrompt
from .server_runner import ServerRunner
from .state_runner import Preempted, RunOptions, StateRunner, StopCheck
from .streaming import BackgroundStream


class UncachedCompletion:
    """Completes a caller's prompts on *engine* with no chunk states and no stored
    answers, as stock ``llama_cpp.Llama`` does: the context keeps the previous prompt's
    tokens up to their common prefix (where the output cannot change), the rest is
    prefilled, and the text is llama.cpp's as decoded.

    >>> completion = UncachedCompletion(open_engine(None, PerCacheConfig()))   # doctest: +SKIP
    >>> "".join(completion.stream(TextPrompt("Q: 2+2? A:"), max_new_tokens=4))   # doctest: +SKIP
    ' 4'
    """

    def __init__(self, engine: Engine | LlamaServer) -> None:
        self.engine = engine
        config = PerCacheConfig(chunk_states=False)
        self._runner: StateRunner = (
            ServerRunner(engine, None, config, rule=None)  # a fresh prefill each time
            if isinstance(engine, LlamaServer)
            else PromptRunner(engine, None, config)
        )

    def stream(
        self,
        prompt: TextPrompt,
        *,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop: Sequence[str] = (),
        prompt_lookup: bool = False,
    ) -> Iterator[str]:
        """The completion's text pieces, produced by a thread of their own (an abandoned
        stream never keeps the engine from other calls)."""
        layout = self._runner.lay_out(prompt.text, [], spec=prompt, max_new_tokens=max_new_tokens)
        options = RunOptions(
            max_new_tokens, sampling=sampling, stop=list(stop), prompt_lookup=prompt_lookup, trim=False
        )
        events = self._runner.run(layout, options)
        return BackgroundStream(events)


def complete_plain(
    engine: Engine, prompt: str, decoding: Decoding, *, chat: bool = False, should_stop: StopCheck | None = None
) -> tuple[str, int, int]:
    """Complete *prompt* on *engine* with *decoding* (its tokens, sampling and stop strings
    set) without chunk states or stored answers (idle work's plain LLM calls: the
    predictor's and the abstract's): (text, prompt tokens, generated tokens). The prompt
    keeps its last ``n_ctx - max_new_tokens`` tokens.

    With ``chat=True`` the prompt came from ``engine.chat_prompt`` and its markup is
    tokenized as special tokens. Raises :class:`Preempted` when *should_stop* turns true.
    """
    max_new_tokens, sampling = decoding.required_tokens(), decoding.sampling or Sampling()
    with engine.lock:
        tokens = engine.tokenize_chat(prompt) if chat else engine.tokenize(prompt, True)
        tokens = tokens[-(engine.n_ctx - max_new_tokens) :]
        engine.reset()
        engine.eval(tokens, should_stop)
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
