"""What PerCache needs of a model runtime: the ``Engine`` protocol.

Generation, draft verification, the scheduler and the adapters use only these members.
:class:`~percache_core.engines.llama_cpp.engine.LlamaEngine` is the real one;
``tests/fake_engine.py``'s ``FakeEngine`` is a deterministic stand-in for tests of
pure logic (no model file, answers in microseconds).

One engine holds one sequence. Callers hold ``engine.lock`` around any run of calls that
must not interleave (restore, prefill, decode).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from ..memo import Memo

T = TypeVar("T")
SELF_CHECK_MEMO = "self_checks"  # engine fingerprint -> {self-check name: verdict}
_memo_lock = threading.Lock()
_ALL_VERDICTS: dict[str, EngineVerdicts[Any]] = {}  # every self-check by name (for check_costs)


COSTS_KEY = "costs"  # in a self_checks record: self-check name -> [seconds, unix time measured]


@dataclass(frozen=True)
class CheckCost:
    """What one self-check of an engine cost: *seconds* of the engine's time, measured at
    *at* (Unix time), in this process (*here*) or by an earlier one."""

    seconds: float
    at: float
    here: bool

    def report(self) -> dict[str, Any]:
        """As ``stats()`` shows it.

        >>> CheckCost(2.5, 0.0, True).report()
        {'seconds': 2.5, 'measured_at': '1970-01-01T00:00:00Z', 'measured_by': 'this process'}
        """
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))
        return {"seconds": round(self.seconds, 3), "measured_at": stamp,
                "measured_by": "this process" if self.here else "an earlier process"}


class EngineVerdicts(Generic[T]):
    """What a self-check measured, remembered per engine object and forgotten with it (so
    a new engine, even one at a recycled address, is measured afresh). An engine loaded
    from a model file names a ``verdict_key`` (its fingerprint: model file, llama.cpp
    build, context settings): its verdicts are also kept on disk under that key (in the
    ``self_checks`` memo of :mod:`percache_core.memo`), so a new process with the same
    build and model measures nothing. *name* tells one self-check from another there;
    *encode*/*decode* turn a verdict into JSON and back (a record that does not decode is
    measured again).

    >>> class Probe: ...
    >>> verdicts, engine = EngineVerdicts("probe"), Probe()
    >>> verdicts.known(engine)
    (False, None)
    >>> verdicts.keep(engine, 2.5)
    >>> verdicts.known(engine)
    (True, 2.5)
    """

    def __init__(
        self,
        name: str,
        *,
        encode: Callable[[T], Any] = lambda value: value,
        decode: Callable[[Any], T] = lambda value: value,
    ) -> None:
        self.name = name
        self._encode, self._decode = encode, decode
        self._lock = threading.Lock()
        self._values: weakref.WeakKeyDictionary[object, T] = weakref.WeakKeyDictionary()
        self._costs: weakref.WeakKeyDictionary[object, CheckCost] = weakref.WeakKeyDictionary()
        _ALL_VERDICTS[name] = self

    def known(self, engine: object) -> tuple[bool, T | None]:
        """Whether *engine* was measured (in this process, or by an earlier one with the
        same ``verdict_key``), and the verdict (no measuring)."""
        with self._lock:
            try:
                return True, self._values[engine]
            except (KeyError, TypeError):  # TypeError: an engine without weak references
                pass
        key = getattr(engine, "verdict_key", None)
        record = Memo(SELF_CHECK_MEMO).get(key) if isinstance(key, str) else None
        if not isinstance(record, dict) or self.name not in record:
            return False, None
        try:
            value = self._decode(record[self.name])
        except (TypeError, ValueError, KeyError):
            return False, None
        self._remember(engine, value)
        return True, value

    def keep(self, engine: object, value: T, *, since: float | None = None) -> None:
        """Remember *value* for *engine*, on disk too where it names a ``verdict_key`` (an
        engine without weak references is measured each time instead); *since*: the
        ``time.perf_counter()`` at which measuring it began (what it cost is kept beside it,
        :meth:`cost`)."""
        self._remember(engine, value)
        cost = None if since is None else CheckCost(time.perf_counter() - since, time.time(), True)
        if cost is not None:
            self._remember_cost(engine, cost)
        key = getattr(engine, "verdict_key", None)
        if isinstance(key, str):
            memo = Memo(SELF_CHECK_MEMO)
            with _memo_lock:
                record = memo.get(key)
                record = dict(record) if isinstance(record, dict) else {}
                record[self.name] = self._encode(value)
                if cost is not None:
                    costs = record.get(COSTS_KEY)
                    record[COSTS_KEY] = {**(costs if isinstance(costs, dict) else {}), self.name: [cost.seconds, cost.at]}
                memo.put(key, record)

    def cost(self, engine: object) -> CheckCost | None:
        """What measuring *engine*'s verdict cost and when (in this process, or as an
        earlier process recorded it on disk); None where it is not known."""
        with self._lock:
            try:
                found = self._costs.get(engine)
            except TypeError:
                found = None
        if found is not None:
            return found
        key = getattr(engine, "verdict_key", None)
        record = Memo(SELF_CHECK_MEMO).get(key) if isinstance(key, str) else None
        costs = record.get(COSTS_KEY) if isinstance(record, dict) else None
        value = costs.get(self.name) if isinstance(costs, dict) else None
        try:
            found = CheckCost(float(value[0]), float(value[1]), False) if value is not None else None
        except (TypeError, ValueError, IndexError):
            return None
        if found is not None:  # read once, as known() remembers the verdict
            self._remember_cost(engine, found)
        return found

    def _remember_cost(self, engine: object, cost: CheckCost) -> None:
        self._put(self._costs, engine, cost)

    def _remember(self, engine: object, value: T) -> None:
        self._put(self._values, engine, value)

    def _put(self, memory: weakref.WeakKeyDictionary[object, Any], engine: object, value: Any) -> None:
        """Keep *value* for *engine* in *memory* (nothing for an engine without weak references)."""
        with self._lock:
            try:
                memory[engine] = value
            except TypeError:
                pass


def check_costs(engine: object) -> dict[str, dict[str, Any]]:
    """Every self-check *engine* has a verdict of, with what it cost and when
    (:meth:`CheckCost.report`; ``{}`` where the cost was not recorded), by name."""
    found: dict[str, dict[str, Any]] = {}
    for name, verdicts in list(_ALL_VERDICTS.items()):
        if verdicts.known(engine)[0]:
            cost = verdicts.cost(engine)
            found[name] = cost.report() if cost is not None else {}
    return found


@dataclass(frozen=True)
class EngineFeatures:
    """What an engine can do, read once when it is opened (never tested call by call).

    Attributes:
        chunk_states: stored prefix states are restored exactly (for a server, where it runs
            with a slot-save folder PerCache can read and its start-up check held).
        drafts: logits of a batch of tokens, so that stored answers and prompt phrases are
            verified as drafts while decoding (in the process).
        slices: a state can be saved and loaded as one segment's positions (in the process;
            whether this build's layout allows it is checked when the states open).
        composed_states: independent chunk states can be moved to new positions and
            composed (``reuse="approximate"``; in the process).

    >>> EngineFeatures(chunk_states=True).describe()
    'chunk states'
    """

    chunk_states: bool
    drafts: bool = False
    slices: bool = False
    composed_states: bool = False

    def describe(self) -> str:
        """The features that are on, in words ("stored answers only" when none is)."""
        names = [f.name.replace("_", " ") for f in dataclasses.fields(self) if getattr(self, f.name)]
        return ", ".join(names) or "stored answers only"



TOKEN_LEVEL = EngineFeatures(chunk_states=True, drafts=True, slices=True, composed_states=True)  # in the process


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy when ``temperature == 0``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Decoding:
    """How one call decodes, where it differs from the configured settings.

    Attributes:
        max_new_tokens: the longest answer (None: the configured; 0: prefill only, where
            the call allows it).
        sampling: temperature, top_p and seed (None: the configured; greedy where there
            is no configuration).
        stop: strings that end the answer, replacing the configured ones (None: those).
        prompt_lookup: verify drafts taken from the prompt (in-process engines).
        trim: drop the white space around the answer (a chat reply); off, the text is
            llama.cpp's as decoded.

    >>> Decoding(max_new_tokens=24, stop=["."]).trim
    False
    """

    max_new_tokens: int | None = None
    sampling: Sampling | None = None
    stop: Sequence[str] | None = None
    prompt_lookup: bool = False
    trim: bool = False

    def required_tokens(self) -> int:
        """``max_new_tokens``, which a call straight on an engine needs (no configuration
        fills it in).

        Raises:
            ValueError: it is None.

        >>> Decoding(0).required_tokens()
        0
        """
        if self.max_new_tokens is None:
            raise ValueError("this call needs max_new_tokens (Decoding(max_new_tokens=...))")
        return self.max_new_tokens


@dataclass(frozen=True)
class ChatPrompt:
    """A chat laid out for the assistant's reply: the prompt *text*, whether tokenizing it
    adds BOS (*add_bos*; markup in the text is always special tokens) and the stop strings
    the chat format adds (*stop*)."""

    text: str
    add_bos: bool | None  # None: BOS unless the text starts with it
    stop: tuple[str, ...] = ()


@dataclass
class Completion:
    """What one request to a server engine did, filled in as it streams (a llama-server's
    ``/completion`` or a client's relayed OpenAI request; a stored reply read back)."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)  # generated ids (the server's, without stop text trimming)
    cached: int | None = None  # prompt tokens the server reused (prompt_progress.cache / timings.cache_n)
    prompt_tokens: int = 0  # tokens it prefilled
    stop_type: str = ""  # "eos", "limit", "word", or "" while streaming
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # first token's, with n_probs
    timings: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""  # a relayed OpenAI request's: "stop" or "length"
    usage: dict[str, Any] = field(default_factory=dict)  # a relayed OpenAI request's, as the server sent it
    plain: bool = True  # a relayed chat's deltas held nothing but its text (no reasoning, no tool calls)
    whole: dict[str, Any] | None = None  # a relayed request asked whole: the server's reply as it sent it


@runtime_checkable
class TextModel(Protocol):
    """The text side of a model: tokenizer and chat template. Laying out a prompt and
    formatting a chat need only this."""

    n_vocab: int

    @property
    def model_name(self) -> str: ...

    @property
    def chat_template(self) -> str | None: ...

    def chat_prompt(self, user_message: str) -> str: ...

    def format_chat(self, messages: Sequence[tuple[str, str]], *, template: str | None = None) -> str: ...

    def stock_chat(self, messages: Sequence[tuple[str, str]]) -> ChatPrompt:
        """The chat laid out as stock ``llama_cpp.Llama.create_chat_completion`` does."""
        ...

    def tokenize(self, text: str, add_bos: bool = False, *, special: bool = False) -> list[int]: ...

    def tokenize_chat(self, prompt: str) -> list[int]: ...

    def token_bytes(self, token: int, *, special: bool = False) -> bytes: ...

    def is_end_of_generation(self, token: int) -> bool: ...


@runtime_checkable
class KVSequence(Protocol):
    """The sequence side of a model: one token sequence, its KV state and its logits."""

    lock: threading.Lock
    n_ctx: int  # the most tokens the sequence can hold
    n_past: int  # tokens in the sequence now
    n_batch: int  # the most tokens one call feeds (longer pieces are split: kv.cuts.batch_bounds)
    changes: int  # bumped by every call that changes the sequence (reset, eval, load, truncate, ...)

    def fingerprint(self, extra: str = "") -> str:
        """A digest of everything that changes state bytes and logits, plus *extra*."""
        ...

    def warm_up(self) -> None: ...

    def reset(self) -> None:
        """Empty the sequence."""
        ...

    def save_state(self) -> bytes:
        """The sequence's state (everything needed to continue from ``n_past``)."""
        ...

    def load_state(self, data: bytes, n_tokens: int) -> bool:
        """Replace the sequence with a saved state of *n_tokens*; False if refused."""
        ...

    def save_slice(self, start: int) -> bytes:
        """The state of positions *start* .. ``n_past`` only (a slice of the sequence)."""
        ...

    def save_prefix(self, end: int, start: int = 0) -> bytes | None:
        """The state of positions *start* .. *end* (a whole prefix state with *start* 0,
        else a slice), taken after the sequence went further: what a prefill stopped at
        *end* would have saved. None when the sequence no longer holds all of it."""
        ...

    def append_slice(self, data: bytes, n_tokens: int) -> bool:
        """Add a slice that starts at ``n_past`` and ends at *n_tokens*; False (sequence
        unchanged) if refused."""
        ...

    def append_moved(self, data: bytes, n_tokens: int, start: int) -> bool:
        """Approximate reuse: add positions *start* .. *n_tokens* of a saved state, moved to
        begin at ``n_past``; False (sequence unchanged) if refused."""
        ...

    def eval(
        self, tokens: Sequence[int], should_stop: Callable[[], bool] | None = None, *, ends_prompt: bool = False
    ) -> None:
        """Feed *tokens* after the current position (logits kept for the last); with
        *ends_prompt* they end a prompt (its last call may be stock's:
        :func:`~percache_core.kv.cuts.feed_calls`)."""
        ...

    def eval_with_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed *tokens* in one batch, returning every position's logits."""
        ...

    def truncate(self, n_tokens: int) -> bool:
        """Keep the first *n_tokens*; False when the sequence cannot continue exactly."""
        ...

    def last_logits(self) -> np.ndarray: ...

    def generate(
        self,
        *,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[int]:
        """Decode up to *max_new_tokens* token ids (an end-of-generation id included)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ModelEngine(Protocol):
    """What every engine PerCache runs on has, in the process or behind a server (an
    :class:`Engine`, or a llama-server): a fingerprint, a tokenizer, a warm-up and a close.
    What else it can do is its kind's (:mod:`percache_core.engines`)."""

    def fingerprint(self, extra: str = "") -> str: ...

    def tokenize(self, text: str, add_bos: bool = False, *, special: bool = False) -> list[int]: ...

    def warm_up(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Engine(TextModel, KVSequence, Protocol):
    """A loaded model: its :class:`TextModel` side (tokenizer, chat template) and its
    :class:`KVSequence` side (eval, logits, states). ``LlamaEngine`` is one, and
    ``FakeEngine`` in tests."""
