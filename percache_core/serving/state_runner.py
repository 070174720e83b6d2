"""What every prompt runner shares: the run's options and result, and the stored states.

A runner runs PerCache's and callers' prompts on one engine through the chunk-state tree.
:class:`~percache_core.engines.llama_cpp.runner.PromptRunner` does it token by token on an
in-process engine (llama-cpp-python); :class:`~percache_core.engines.llama_server.runner.ServerRunner`
does it with whole requests on a llama-server. Both take :class:`RunOptions`, return a
:class:`RunResult`, and keep and find states the same way (this module's :class:`StateRunner`):
``run``, ``lay_out``, ``prefill_prefix``, ``path_is_stored``, ``stored_order``,
``evict_to_budget`` and ``complete_plain`` are the verbs the request path, the callers'
verbs and idle work use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import LiveConfig, PerCacheConfig
from ..errors import PerCacheError, StorageWriteError
from ..kv.budget import BUDGET_FLOOR_BYTES
from ..kv.engine import Completion, Decoding, Sampling
from ..kv.tiers import TieredStateStore
from ..kv.tree import StateNode, path_keys, prefix_keys
from ..types import Chunk
from .prompting import PromptLayout, PromptSpec, TextPrompt, chunk_text, system_text
from .state_writer import StateWriter
from .streaming import drain

logger = logging.getLogger(__name__)

StopCheck = Callable[[], bool]


IDLE_PIECE_TOKENS = 128  # idle work's plain prompts are fed this many tokens between pre-emption checks

@dataclass
class DraftStats:
    """What draft decoding did for one answer."""

    proposed: int = 0  # draft tokens fed
    accepted: int = 0  # draft tokens accepted
    batches: int = 0  # batched verification calls
    replays: int = 0  # near ties decided again on exact logits


@dataclass
class RunResult:
    """What one prompt run did."""

    layout: PromptLayout
    text: str = ""
    depth: int = 0  # segments restored
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)  # decoded ids, end of generation included
    drafts: DraftStats = field(default_factory=DraftStats)
    next_token_logits: np.ndarray | None = None  # after the prompt, when asked for (keep_logits)
    moved_tokens: int = 0  # chunk tokens taken from independent states (approximate reuse)
    approximate: bool = False  # some chunk was reused approximately: may differ from cache-off
    idle_reused_chunks: int = 0  # of the restored chunks, those whose states idle work stored
    idle_reused_tokens: int = 0  # their prompt tokens
    live_tokens: int = 0  # of the reused tokens, those kept from the previous prompt in the context
    batched: bool = False  # it shared a server's batches with another request: its text is kept nowhere

    @property
    def reused_chunks(self) -> int:
        return max(0, self.depth - 1)


@dataclass
class RelayedRequest:
    """A client's own OpenAI request, run by a server runner as a prompt's last request on
    the server's own endpoint (:meth:`~percache_core.engines.llama_server.server.LlamaServer.relay`), so
    the server lays out, samples, stops and parses the reply as for the client alone.

    *path* and *body* are the request; the run fills in *chunks* (the server's chunks for
    the client, as they arrive) and *reply* (its finish reason, the server's usage, and
    whether it held nothing but text; a stored answer's are those of the run that stored
    it)."""

    path: str
    body: dict[str, Any]
    chunks: list[dict[str, Any]] = field(default_factory=list)
    reply: Completion = field(default_factory=Completion)

    @property
    def most_new_tokens(self) -> int | None:
        """The most tokens the server may generate for the request: the largest of its
        ``max_tokens``, ``max_completion_tokens`` and ``n_predict`` (the server takes them as
        one setting); None when none bounds it (absent, or negative: until the context ends).

        >>> RelayedRequest("/v1/chat/completions", {"max_tokens": 32}).most_new_tokens
        32
        >>> RelayedRequest("/v1/chat/completions", {"n_predict": -1}).most_new_tokens is None
        True
        """
        given = [self.body.get(name) for name in ("max_tokens", "max_completion_tokens", "n_predict")]
        given = [value for value in given if value is not None]
        if not given or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in given):
            return None
        return max(given)


@dataclass(frozen=True)
class NewState:
    """A prefix state saved during a prefill, stored after the answer."""

    index: int  # its last segment
    parent_key: str  # the nearest stored (or newly saved) shorter prefix, or the root key
    data: bytes  # whole, or with slices only the positions after the parent's
    n_tokens: int


@dataclass(frozen=True)
class RunOptions:
    """How one prompt runs (``run`` of a :class:`StateRunner`): what it decodes and how, and what
    its prefill keeps. ``None`` settings take the configured ones when the run starts.

    >>> RunOptions(max_new_tokens=8, decode=False, keep_logits=True).decode
    False
    """

    max_new_tokens: int
    decode: bool = True  # False: only the prefill runs (to populate chunk states)
    prefix_only: bool = False  # without decoding, and without the question's segment either
    stop: Sequence[str] | None = None  # None: the configured stop strings
    sampling: Sampling | None = None  # None: the configured sampling
    prompt_lookup: bool | None = None  # None: the configured prompt lookup
    answer_drafts: Sequence[Sequence[int]] = ()  # stored answers' token ids, verified as drafts
    trim: bool = True  # drop white space around the answer (else llama.cpp's text as decoded)
    keep_logits: bool = False  # keep a copy of the logits after the prompt in the result
    approximate: bool = False  # compose chunks from independent states (reuse="approximate")
    recompute_tokens: int | None = None  # of each composed chunk, prefilled live (None: configured)
    restore_depth: int | None = None  # restore at most this many segments, keep nothing of the context
    idle: bool = False  # the states kept are idle work's (StateNode.idle)
    relay: RelayedRequest | None = None  # a server's own endpoint runs the last request

    @property
    def drafting(self) -> bool:
        """Whether decoding verifies drafts (greedy only; sampling decodes one at a time).
        Only for resolved options (sampling set)."""
        greedy = self.sampling is not None and self.sampling.temperature == 0
        return greedy and (bool(self.prompt_lookup) or bool(self.answer_drafts))


class StateRunner:
    """Runs prompts on *engine*, reusing and filling the stored chunk *states* (None: the
    chunk-state tier is off for this engine). Subclasses give ``run``, ``lay_out`` and
    ``complete_plain``."""

    def __init__(
        self,
        engine: Any,
        states: TieredStateStore | None,
        config: PerCacheConfig | LiveConfig,
        *,
        budget: Callable[[], int] | None = None,
    ) -> None:
        self.engine = engine
        self.states = states
        self._settings = config if isinstance(config, LiveConfig) else LiveConfig(config)
        # the chunk-state budget in force (the configured one, or the one ModelRuntime
        # sized from the knowledge)
        self._budget = budget or (lambda: self.config.budgets.chunk_state_budget_bytes or BUDGET_FLOOR_BYTES)
        self.restore_failures = 0
        self.storage_failures = 0
        self.batched_runs = 0  # runs that shared a server's batches with another (nothing of them kept)
        self.prefix_waits = 0  # runs that waited for a prefix another run computed, then restored it
        self.company_waits = 0  # runs that would have started alone under load, joined by another while waiting
        self.writer = StateWriter("percache-states")  # new states stored off the answer's time

    @property
    def config(self) -> PerCacheConfig:
        """The configuration in force now."""
        return self._settings.current

    @property
    def budget_bytes(self) -> int:
        """The chunk-state budget in force."""
        return self._budget()

    def run(
        self,
        layout: PromptLayout,
        options: RunOptions,
        *,
        should_stop: StopCheck | None = None,
        started: float | None = None,
    ) -> Generator[str, None, RunResult]:
        """Run the prompt *layout* as *options* say; yields answer text, returns a
        :class:`RunResult`."""
        raise NotImplementedError

    def lay_out(
        self,
        question: str,
        chunks: Sequence[Chunk],
        *,
        spec: PromptSpec | TextPrompt | None = None,
        max_new_tokens: int,
    ) -> PromptLayout:
        """The pieces ``run`` feeds for PerCache's own prompt of *question* and *chunks*, or for *spec*."""
        raise NotImplementedError

    def complete_plain(
        self, prompt: str, decoding: Decoding, *, chat: bool = False, should_stop: StopCheck | None = None
    ) -> tuple[str, int, int]:
        """Idle work's free-form completion of *prompt* with *decoding* (no chunk states,
        no stored answers): (text, prompt tokens, generated tokens)."""
        raise NotImplementedError

    def bytes_per_token(self) -> float:
        """The bytes one prompt token's state takes on this engine, measured once."""
        raise NotImplementedError

    def reinstate_asked(self) -> int:
        """After idle work, bring the last user prompt's stored prefix back into the engine
        as the context a next question keeps (an in-process engine:
        :meth:`~percache_core.engines.llama_cpp.runner.PromptRunner.reinstate_asked`);
        the tokens reinstated (none here)."""
        return 0

    def settle(self) -> None:
        """Take from the engine what a run left for after its reply (a llama-server's slot
        save: ``ServerRunner.settle``); an in-process run leaves nothing."""

    def flush(self) -> None:
        """Settle what runs left for after their replies (:meth:`settle`), then wait until
        the states of earlier runs are stored (:class:`StateWriter`)."""
        self.settle()
        self.writer.flush()

    def close(self) -> None:
        """Store what is pending and stop the writer."""
        self.writer.close()

    def _keys(self, layout: PromptLayout, states: TieredStateStore | None) -> list[str]:
        """The stored-state keys of the layout's prefixes (all but the whole prompt): a
        caller's prompt keyed by its leading tokens whatever the cuts before them,
        PerCache's own by its segments."""
        if states is None:
            return []
        if layout.caller_prompt:
            return prefix_keys(states.root_key, layout.tokens, layout.ends[:-1])
        return path_keys(states.root_key, [list(s.tokens) for s in layout.segments[:-1]])

    def prefill_prefix(self, chunks: Sequence[Chunk], *, should_stop: StopCheck | None = None) -> int:
        """Prefill [system, *chunks] and keep its states, with no question and no decode
        (idle-time population of the tree); returns the tokens prefilled (0 when stored)."""
        layout = self.lay_out("", chunks, max_new_tokens=1)
        events = self.run(layout, RunOptions(max_new_tokens=1, prefix_only=True, idle=True), should_stop=should_stop)
        return drain(events).prefilled_tokens

    def prefill_text(self, spec: TextPrompt, *, should_stop: StopCheck | None = None) -> int:
        """Prefill a caller's prompt *spec* through its last kept cut (the end of its last
        document) and keep the states there, with no decode (idle work's population of an
        app's leading states); returns the tokens prefilled (0 where
        :meth:`text_needs_prefill` says no)."""
        layout = self.lay_out("", [], spec=spec, max_new_tokens=1)
        if not self._needs_prefill(layout):
            return 0
        events = self.run(layout, RunOptions(max_new_tokens=1, prefix_only=True, idle=True), should_stop=should_stop)
        return drain(events).prefilled_tokens

    def text_needs_prefill(self, spec: TextPrompt) -> bool:
        """Whether *spec* (a caller's prompt) keeps a state at a cut whose state is not stored."""
        return self._needs_prefill(self.lay_out("", [], spec=spec, max_new_tokens=1))

    def _needs_prefill(self, layout: PromptLayout) -> bool:
        self.flush()
        keys = self._keys(layout, self.states if self.config.tiers.chunk_states else None)
        return len(layout.segments) >= 2 and bool(keys) and keys[-1] not in self.states

    def path_is_stored(self, question: str, chunks: Sequence[Chunk], max_new_tokens: int) -> bool:
        """Whether the full [system, *chunks] prefix of this prompt has a stored state."""
        self.flush()
        layout = self.lay_out(question, chunks, max_new_tokens=max_new_tokens)
        keys = path_keys(self.states.root_key, [list(s.tokens) for s in layout.segments[:-1]])
        return keys[-1] in self.states

    def stored_order(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        """*chunks* reordered to follow the deepest stored path of PerCache's prompt: at each
        position, a chunk whose prefix state is stored comes first; the rest keep their order
        (as given where no states are held)."""
        if self.states is None:
            return list(chunks)
        self.flush()
        tokenize = self.engine.tokenize
        parent = path_keys(self.states.root_key, [tokenize(system_text(self.config.retrieval.system_prompt), True)])[0]
        remaining = list(chunks)
        ordered: list[Chunk] = []
        while remaining and parent in self.states:
            for chunk in remaining:
                key = path_keys(parent, [tokenize(chunk_text(chunk), False)])[0]
                if key in self.states:
                    ordered.append(chunk)
                    remaining.remove(chunk)
                    parent = key
                    break
            else:
                break
        return ordered + remaining

    def _keep_states(
        self, layout: PromptLayout, keys: list[str], new_states: list[NewState], *, idle: bool = False
    ) -> None:
        """Store the states of new prefixes, parents first (as complete nodes: file, record,
        tree). A failed write (disk full, read-only) is logged and counted, and the deeper
        ones are not stored (their slices would lack a parent); the answer is kept."""
        segments = layout.segments
        for new in new_states:
            index = new.index
            label = segments[index].chunk_id or segments[index].kind
            node = StateNode(keys[index], new.parent_key, index + 1, new.n_tokens, label, len(new.data), idle=idle)
            try:
                self.states.put(node, new.data, budget_bytes=self.budget_bytes)
            except StorageWriteError as error:
                self.storage_failures += 1
                logger.warning("chunk state not stored (%s); the answer is unaffected", error)
                return

    def lend_engine(self) -> AbstractContextManager[None]:
        """Hold the engine for a request run outside PerCache (a server's only)."""
        raise PerCacheError("only a llama-server engine runs requests outside PerCache")

    def evict_to_budget(self) -> None:
        """Evict least frequently used unpinned leaves down to the chunk-state budget."""
        self.flush()
        self.states.evict_to(self.budget_bytes)
