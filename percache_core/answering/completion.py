"""Completion without a cache: a caller's prompt as stock llama.cpp completes it
(:class:`UncachedCompletion`, for an adapter's LLM used outside a cache)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..engines import engine_kind
from ..kv.engine import ModelEngine, Sampling
from ..serving.prompting import TextPrompt
from ..serving.state_runner import RunOptions, StateRunner
from ..serving.streaming import BackgroundStream


class UncachedCompletion:
    """Completes a caller's prompts on *engine* with no chunk states and no stored
    answers, as stock ``llama_cpp.Llama`` does: the context keeps the previous prompt's
    tokens up to their common prefix (where the output cannot change), the rest is
    prefilled, and the text is llama.cpp's as decoded.

    >>> completion = UncachedCompletion(open_engine(None, PerCacheConfig()))   # doctest: +SKIP
    >>> "".join(completion.stream(TextPrompt("Q: 2+2? A:"), max_new_tokens=4))   # doctest: +SKIP
    ' 4'
    """

    def __init__(self, engine: ModelEngine) -> None:
        self.engine = engine
        self._runner: StateRunner = engine_kind(engine).plain_runner(engine)

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
