"""Plain completion: a prompt on the engine without chunk states (the predictor's and the
abstract's LLM calls), streamed or whole."""

from __future__ import annotations

from collections.abc import Generator, Sequence

from ..kv.engine import Engine, Sampling
from .generation import Preempted, StopCheck, decode_text
from .stopping import StopStringFilter


def stream_text(
    engine: Engine,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Sequence[str] = (),
    chat: bool = False,
    should_stop: StopCheck | None = None,
) -> Generator[str | tuple[int, int], None, None]:
    """Complete *prompt* on *engine* without chunk states (plain LLM calls), yielding the
    shown text pieces as they are decoded and finally ``(prompt tokens, generated tokens)``.

    With ``chat=True`` the prompt came from ``engine.chat_prompt`` and its markup is
    tokenized as special tokens. Raises :class:`Preempted` when *should_stop* turns true.
    """
    with engine.lock:
        tokens = engine.tokenize_chat(prompt) if chat else engine.tokenize(prompt, True)
        tokens = tokens[-(engine.n_ctx - max_new_tokens) :]
        engine.reset()
        engine.eval(tokens, should_stop)
        if engine.n_past != len(tokens):
            raise Preempted("completion pre-empted by a user question")
        generated = [0]

        def count_token(token: int) -> None:
            if not engine.is_end_of_generation(token):
                generated[0] += 1

        sampling = Sampling(temperature, top_p, seed)
        yield from decode_text(
            engine,
            engine.generate(max_new_tokens=max_new_tokens, sampling=sampling),
            StopStringFilter(stop),
            should_stop,
            count_token,
        )
        yield (len(tokens), generated[0])


def complete_plain(
    engine: Engine,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    stop: Sequence[str] = (),
    chat: bool = False,
    should_stop: StopCheck | None = None,
) -> tuple[str, int, int]:
    """Complete *prompt* without chunk states: (text, prompt tokens, generated tokens)."""
    pieces = list(
        stream_text(
            engine,
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            stop=stop,
            chat=chat,
            should_stop=should_stop,
        )
    )
    text = "".join(piece for piece in pieces if isinstance(piece, str))
    counts = pieces[-1]
    assert isinstance(counts, tuple)
    return text, counts[0], counts[1]
