"""``FakeEngine``: a deterministic :class:`~percache_core.kv.engine.Engine` without a model.

For tests of pure logic (the scheduler, the idle worker, the adapters' control flow) and
for trying PerCache's wiring in a notebook without loading a GGUF file. It is not a
language model: tokens are UTF-8 bytes, and the logits after a sequence are a fixed
pseudo-random function of every token in it (a rolling hash seeds them). So, as with a real
model, the same prompt always gives the same answer, a different prompt a different one,
a restored state continues exactly like the live sequence, and batched logits equal
one-at-a-time logits (the draft bound is the minimum).

>>> engine = FakeEngine()
>>> engine.reset(); engine.eval(engine.tokenize("When is the rehearsal?", True))
>>> first = list(engine.generate(max_new_tokens=8))
>>> engine.reset(); engine.eval(engine.tokenize("When is the rehearsal?", True))
>>> list(engine.generate(max_new_tokens=8)) == first
True
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from percache_core.errors import EngineError
from percache_core.kv.engine import ChatPrompt, Sampling

BOS, EOS, START_TURN, END_TURN = 0, 1, 2, 3
_BYTE_OFFSET = 4  # token id of byte b is b + 4
_VOCAB = 256 + _BYTE_OFFSET
_ANSWER_BYTES = np.frombuffer(b" abcdefghijklmnopqrstuvwxyz.", dtype=np.uint8)
_STATE_MAGIC = b"PCFAKE1\0"
_SLICE_MAGIC = b"PCFAKS1\0"
_SPECIAL_TEXT = {"<bos>": BOS, "<eos>": EOS, "<start_of_turn>": START_TURN, "<end_of_turn>": END_TURN}


def _roll(previous: int, token: int) -> int:
    return int.from_bytes(hashlib.blake2b(struct.pack("<qi", previous, token), digest_size=8).digest(), "little") >> 1


def _saved_positions(data: bytes) -> tuple[int, np.ndarray] | None:
    """The first position and the rolling hashes a saved state or slice holds, or None."""
    if data.startswith(_SLICE_MAGIC) and len(data) >= len(_SLICE_MAGIC) + 8:
        (first,) = struct.unpack("<q", data[len(_SLICE_MAGIC) : len(_SLICE_MAGIC) + 8])
        body = data[len(_SLICE_MAGIC) + 8 :]
    elif data.startswith(_STATE_MAGIC):
        first, body = 0, data[len(_STATE_MAGIC) :]
    else:
        return None
    if len(body) % 8:
        return None
    return first, np.frombuffer(body, dtype=np.uint64)


class FakeTextModel:
    """A byte-level tokenizer with Gemma-like chat markup: the text side of
    :class:`FakeEngine`, usable alone where only tokens are needed.

    >>> FakeTextModel().tokenize("hi")
    [108, 109]
    """

    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.n_vocab = _VOCAB

    @property
    def model_name(self) -> str:
        return f"{self.name}.fake"

    @property
    def chat_template(self) -> str | None:
        return None

    def chat_prompt(self, user_message: str) -> str:
        return self.format_chat([("user", user_message)])

    def stock_chat(self, messages: Sequence[tuple[str, str]]) -> ChatPrompt:
        if not messages:
            raise ValueError("no messages to format")
        return ChatPrompt(self.format_chat(messages), add_bos=True)

    def format_chat(self, messages: Sequence[tuple[str, str]], *, template: str | None = None) -> str:
        turns = "".join(f"<start_of_turn>{role}\n{content}<end_of_turn>\n" for role, content in messages)
        return f"{turns}<start_of_turn>model\n"

    # -- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = False, *, special: bool = False) -> list[int]:
        tokens = [BOS] if add_bos else []
        rest = text
        while rest:
            marker = next((m for m in _SPECIAL_TEXT if special and rest.startswith(m)), None)
            if marker is not None:
                tokens.append(_SPECIAL_TEXT[marker])
                rest = rest[len(marker) :]
                continue
            tokens.extend(b + _BYTE_OFFSET for b in rest[0].encode("utf-8"))
            rest = rest[1:]
        return tokens

    def tokenize_chat(self, prompt: str) -> list[int]:
        return self.tokenize(prompt, not prompt.startswith("<bos>"), special=True)

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        if token >= _BYTE_OFFSET:
            return bytes([token - _BYTE_OFFSET])
        if not special:
            return b""
        return next(text for text, t in _SPECIAL_TEXT.items() if t == token).encode("utf-8")

    def is_end_of_generation(self, token: int) -> bool:
        return token in (EOS, END_TURN)


class FakeEngine(FakeTextModel):
    """A byte-level, deterministic engine with one sequence (its text side:
    :class:`FakeTextModel`).

    Args:
        n_ctx: the most tokens the sequence holds.
        answer_tokens: the mean answer length in tokens (the end-of-generation token is
            the greedy choice at about one position in this many, so answers end).
        name: part of the fingerprint (two fakes with different names never share states).
    """

    def __init__(self, *, n_ctx: int = 4096, answer_tokens: int = 12, name: str = "fake") -> None:
        super().__init__(name)
        self.lock = threading.Lock()
        self.n_ctx = n_ctx
        self.n_past = 0
        self.n_batch = 512
        self.n_swa = 0
        self.answer_tokens = answer_tokens
        self._hashes: list[int] = []  # rolling hash after each position
        self.changes = 0  # bumped by every call that changes the sequence
        self.calls: dict[str, int] = {"eval": 0, "eval_with_logits": 0, "load_state": 0, "generate": 0}

    # -- identity -------------------------------------------------------------------------

    def fingerprint(self, extra: str = "") -> str:
        payload = f"fake-engine|{self.name}|{self.n_ctx}|{self.answer_tokens}|{extra}"
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def warm_up(self) -> None:
        return None

    # -- sequence state -------------------------------------------------------------------

    def reset(self) -> None:
        self.changes += 1
        self._hashes = []
        self.n_past = 0

    def save_state(self) -> bytes:
        return _STATE_MAGIC + np.asarray(self._hashes, dtype=np.uint64).tobytes()

    def load_state(self, data: bytes, n_tokens: int) -> bool:
        self.calls["load_state"] += 1
        self.reset()  # counts as a change
        saved = _saved_positions(data)
        if saved is None or saved[0] != 0 or len(saved[1]) != n_tokens:
            return False
        self._hashes = [int(h) for h in saved[1]]
        self.n_past = n_tokens
        return True

    def save_slice(self, start: int) -> bytes:
        if not 0 <= start < self.n_past:
            raise ValueError(f"no positions from {start} in a sequence of {self.n_past}")
        return _SLICE_MAGIC + struct.pack("<q", start) + np.asarray(self._hashes[start:], dtype=np.uint64).tobytes()

    def save_prefix(self, end: int, start: int = 0) -> bytes | None:
        if not 0 <= start < end <= self.n_past:
            raise ValueError(f"no positions {start}..{end} in a sequence of {self.n_past}")
        hashes = np.asarray(self._hashes[start:end], dtype=np.uint64).tobytes()
        return _STATE_MAGIC + hashes if start == 0 else _SLICE_MAGIC + struct.pack("<q", start) + hashes

    def append_slice(self, data: bytes, n_tokens: int) -> bool:
        self.calls["load_state"] += 1
        self.changes += 1
        saved = _saved_positions(data)
        if saved is None or saved[0] != self.n_past or len(saved[1]) != n_tokens - self.n_past:
            return False
        if n_tokens > self.n_ctx:
            return False
        self._hashes.extend(int(h) for h in saved[1])
        self.n_past = n_tokens
        return True

    def append_moved(self, data: bytes, n_tokens: int, start: int) -> bool:
        """Add positions *start* .. *n_tokens* of a saved state, moved to ``n_past``; the
        fake continues from their hashes, so what follows differs from a live prefill
        (as approximate reuse may)."""
        self.calls["load_state"] += 1
        self.changes += 1
        saved = _saved_positions(data)
        if saved is None or len(saved[1]) != n_tokens - saved[0] or not saved[0] <= start < n_tokens:
            return False
        if self.n_past + n_tokens - start > self.n_ctx:
            return False
        self._hashes.extend(int(h) for h in saved[1][start - saved[0] :])
        self.n_past = len(self._hashes)
        return True

    # -- evaluation -----------------------------------------------------------------------

    def _push(self, tokens: Sequence[int]) -> None:
        self.changes += 1
        if self.n_past + len(tokens) > self.n_ctx:
            raise EngineError(f"{self.n_past + len(tokens)} tokens do not fit the context of {self.n_ctx}")
        for token in tokens:
            if not 0 <= int(token) < _VOCAB:
                raise EngineError(f"token {token} is outside the vocabulary")
            self._hashes.append(_roll(self._hashes[-1] if self._hashes else 0, int(token)))
        self.n_past = len(self._hashes)

    def eval(
        self, tokens: Sequence[int], should_stop: Callable[[], bool] | None = None, *, ends_prompt: bool = False
    ) -> None:
        self.calls["eval"] += 1
        if should_stop is not None and should_stop():
            return
        self._push(tokens)

    def eval_with_logits(self, tokens: Sequence[int]) -> np.ndarray:
        if not tokens:
            raise ValueError("tokens must not be empty")
        self.calls["eval_with_logits"] += 1
        self._push(tokens)
        return np.stack([self._logits(i) for i in range(self.n_past - len(tokens), self.n_past)])

    def truncate(self, n_tokens: int) -> bool:
        if not 0 <= n_tokens <= self.n_past:
            raise ValueError(f"cannot keep {n_tokens} of {self.n_past} tokens")
        self.changes += 1
        del self._hashes[n_tokens:]
        self.n_past = n_tokens
        return True

    def _logits(self, position: int) -> np.ndarray:
        """The logits after the token at *position*, a function of the sequence up to it:
        a letter, a space or a full stop wins, and the end-of-generation token at about one
        position in ``answer_tokens``."""
        seed = self._hashes[position]
        rng = np.random.default_rng(seed)
        logits = np.full(_VOCAB, -10.0, dtype=np.float32)
        logits[_ANSWER_BYTES + _BYTE_OFFSET] = rng.standard_normal(len(_ANSWER_BYTES)).astype(np.float32)
        logits[EOS] = 4.0 if seed % self.answer_tokens == 0 else -5.0
        return logits

    def last_logits(self) -> np.ndarray:
        if not self._hashes:
            raise EngineError("no token has been evaluated")
        return self._logits(self.n_past - 1)

    def generate(
        self,
        *,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[int]:
        self.calls["generate"] += 1
        rng = np.random.default_rng(sampling.seed)
        previous: int | None = None
        for _ in range(max_new_tokens):
            if previous is not None:
                if self.n_past >= self.n_ctx or (should_stop is not None and should_stop()):
                    break
                self._push([previous])
            logits = self.last_logits()
            if sampling.temperature <= 0:
                token = int(np.argmax(logits))
            else:
                weights = np.exp((logits - logits.max()) / sampling.temperature)
                token = int(rng.choice(_VOCAB, p=weights / weights.sum()))
            yield token
            if self.is_end_of_generation(token):
                break
            previous = token

    def close(self) -> None:
        return None
