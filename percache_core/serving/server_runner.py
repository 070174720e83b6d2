"""Running prompts on a llama-server through the chunk-state tree, with the server's own text.

The promise is the in-process one: an answer's text is what the same server gives the same
prompt with nothing reused (a fresh prefill, ``cache_prompt: false``). A server prefills
from the point its slot's tokens stop matching, in batches of ``n_ubatch`` tokens from
there, so where a prefill starts decides its batches. :class:`ServerRunner` therefore lets
a prefill start only where a cut changes nothing:

- at 0 (nothing reused);
- at a stored state's end, a *state point* (restored from its slot file), or at the end of
  what the slot holds from the previous prompt; either only where the server's cut rule
  allows it (:func:`~percache_core.kv.cuts.measure_server_cut_rule`, measured through the
  server: a multiple of ``rule.multiple``, at least ``rule.min_tokens`` from the start and
  the end) and where the batches after it end as a fresh prefill's do (when a fresh
  prefill's last batch is shorter than ``rule.min_tokens``, only a cut at a multiple of
  ``n_ubatch`` keeps it whole);
- a state is saved only where it was prefilled so (a prefill of the prefix alone, from
  such a start), so that restoring it later is such a start too.

The server reports how many tokens it reused before any text arrives; a request whose
reuse is not the planned one is cancelled and run again from nothing: a miss, never a
different answer. Generated tokens are never reused (they were decoded one at a time).
Drafts, state slices and composed (approximate) states need the in-process engine.
"""

from __future__ import annotations

import logging
import struct
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..config import LiveConfig, PerCacheConfig
from ..errors import ContextOverflowError
from ..kv.cuts import CutRule
from ..kv.engine import Decoding
from ..kv.llama_server import LlamaServer, ServerError, UnexpectedReuse
from ..kv.stopping import StopStringFilter, stop_strings
from ..kv.tiers import TieredStateStore
from ..kv.tree import StateNode, prefix_keys
from ..types import Chunk
from .prompting import PromptLayout, PromptSpec, Segment, TextPrompt, lay_out, lay_out_text, rag_prompt
from .state_runner import NewState, Preempted, RunOptions, RunResult, StateRunner, StopCheck

logger = logging.getLogger(__name__)

NO_WINDOW = 1 << 30  # a model without a sliding window: states of any length
LIVE_CUT_GAIN = 128  # the slot is cut back (a save and a restore) only to keep this many more tokens


@dataclass
class EarlySave:
    """States a sliding-window model's prefill saved on the way: the slot file *saved* after
    a prefill from *start*, to be cut to the states of segments *indices* after the answer."""

    indices: list[int] = field(default_factory=list)
    start: int = 0
    saved: bytes = b""


@dataclass(frozen=True)
class SlotContent:
    """What slot 0 holds as far as this runner knows: *prompt* tokens, of which the first
    *valid* were prefilled in batches the cut rule allows (their cells are what a fresh
    prefill computes), then *generated* ones."""

    prompt: tuple[int, ...]
    valid: int
    generated: tuple[int, ...] | None = ()  # None: not known (a relayed request's reply)


def slot_file_prefix(saved: bytes, tokens: Sequence[int]) -> bytes | None:
    """The slot file of the first ``len(tokens)`` tokens of the slot file *saved*, or None
    where *saved* does not hold every cell of those positions (a sliding-window cache drops
    the cells its window has passed when a slot is saved; an unknown cache layout cannot
    be read). The file is llama.cpp's sequence-state file: magic, version, token count,
    tokens (*tokens* here, as a plain list), then each KV cache's cells (see
    :func:`_prefix_cells`), kept only for positions before ``len(tokens)``."""
    try:
        magic, version, count = struct.unpack_from("<III", saved)
        if slot_file_tokens(saved)[: len(tokens)] != tuple(tokens):
            return None  # the slot holds other tokens
        cells = _prefix_cells(memoryview(saved)[12 + 4 * count :], len(tokens))
    except (struct.error, ValueError):
        return None
    if cells is None:
        return None
    return struct.pack("<III", magic, version, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens) + cells


def slot_file_tokens(saved: bytes) -> tuple[int, ...]:
    """The tokens the slot file *saved* holds. The server writes its token list packed: -1,
    the packing's version, the count, the tokens, then its media (none here); a plain list
    (as :func:`slot_file_prefix` writes, and older servers wrote) is read as it is."""
    (count,) = struct.unpack_from("<I", saved, 8)
    listed = struct.unpack_from(f"<{count}i", saved, 12)
    if count >= 3 and listed[0] == -1:
        return listed[3 : 3 + listed[2]]
    return listed


def _prefix_cells(data: memoryview, n_tokens: int) -> bytes | None:
    """The KV caches' state of one sequence (llama.cpp's ``state_write``: per cache, per
    stream, the cells' positions and sequence ids, then per layer the K rows and the V rows,
    or V by element when transposed) with only the cells of positions ``0 .. n_tokens-1``;
    None when a cache lacks one of them. Raises ValueError on what it cannot read."""
    out: list[bytes] = []
    offset = 0

    def take(fmt: str) -> tuple[int, ...]:
        nonlocal offset
        values = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return values

    while offset < len(data):
        (n_stream,) = take("<I")
        if n_stream != 1:
            raise ValueError(f"{n_stream} streams")
        (cell_count,) = take("<I")
        cells = []
        for _ in range(cell_count):
            pos, n_seq = take("<iI")
            if n_seq != 1:
                raise ValueError("a cell of several sequences")
            cells.append((pos, *take("<i")))
        keep = [i for i, (pos, _) in enumerate(cells) if pos < n_tokens]
        if sorted(cells[i][0] for i in keep) != list(range(n_tokens)):
            return None  # a cell of the prefix is missing (or doubled)
        section = [struct.pack("<II", 1, len(keep))]
        section += [struct.pack("<iIi", cells[i][0], 1, cells[i][1]) for i in keep]
        v_trans, n_layer = take("<II")
        section.append(struct.pack("<II", v_trans, n_layer))
        for _ in range(n_layer):
            k_type, k_row = take("<iQ")
            section += [struct.pack("<iQ", k_type, k_row), _rows(data, offset, k_row, cell_count, keep)]
            offset += k_row * cell_count
        for _ in range(n_layer):
            if not v_trans:
                v_type, v_row = take("<iQ")
                section += [struct.pack("<iQ", v_type, v_row), _rows(data, offset, v_row, cell_count, keep)]
                offset += v_row * cell_count
                continue
            v_type, v_el, n_embd = take("<iII")
            section.append(struct.pack("<iII", v_type, v_el, n_embd))
            for _ in range(n_embd):
                section.append(_rows(data, offset, v_el, cell_count, keep))
                offset += v_el * cell_count
        out.append(b"".join(section))
    if offset != len(data) or not out:
        raise ValueError("unread bytes")
    return b"".join(out)


def _rows(data: memoryview, offset: int, size: int, count: int, keep: list[int]) -> bytes:
    """Of the *count* rows of *size* bytes at *offset*, those of the cells *keep*."""
    if offset + size * count > len(data):
        raise ValueError("truncated rows")
    if keep and keep[-1] == len(keep) - 1:  # the leading cells (*keep* ascends): one copy
        return bytes(data[offset : offset + size * len(keep)])
    return b"".join(data[offset + i * size : offset + (i + 1) * size] for i in keep)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists.

    >>> common_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ServerRunner(StateRunner):
    """Runs prompts on a :class:`~percache_core.kv.llama_server.LlamaServer`, restoring and
    keeping chunk states as slot files (see the module docstring). *rule*: the server's cut
    rule (None: no cut is safe, so every prompt is prefilled whole and no state is kept);
    *n_ubatch*: the server's micro-batch (``-ub``)."""

    engine: LlamaServer

    def __init__(
        self,
        server: LlamaServer,
        states: TieredStateStore | None,
        config: PerCacheConfig | LiveConfig,
        *,
        rule: CutRule | None,
        n_ubatch: int = 512,
        budget: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(server, states, config, budget=budget)
        self.rule = rule
        self.n_ubatch = n_ubatch
        # On a sliding-window model a state restores exactly only within the window
        # (measured with Gemma 3, window 512: states of up to 512 tokens gave the fresh
        # prefill's output when the prompt went on past 512, 6 of 6; longer ones 0 of 6)
        window = server.sliding_window if rule is not None else 0
        self.window = window or NO_WINDOW
        self.unexpected_reuse = 0  # requests the server reused otherwise than planned (run again)
        self._slot: SlotContent | None = None
        self._bytes_per_token: float | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="percache-server-states")
        self._pending: Future[None] | None = None

    # -- laying prompts out -------------------------------------------------------------------

    def lay_out(
        self,
        question: str,
        chunks: Sequence[Chunk],
        *,
        spec: PromptSpec | TextPrompt | None = None,
        max_new_tokens: int,
    ) -> PromptLayout:
        """The prompt's pieces: PerCache's own [system, *chunks, question] with states at the
        rule's state points, or a caller's *spec* cut after its documents."""
        server = self.engine
        spec = spec or rag_prompt(self.config.retrieval.system_prompt, chunks, question)
        max_prompt_tokens = server.n_ctx - max_new_tokens
        if max_prompt_tokens <= 0:
            raise ContextOverflowError(f"max_new_tokens {max_new_tokens} leaves no room in the server's n_ctx {server.n_ctx}")
        rule = self.rule if self.states is not None else None
        if isinstance(spec, TextPrompt):
            # a state is taken after the request, not where a request starts: cut at every
            # document's end (at a multiple of the rule's), and the rule's least piece before
            # the last one (a later prompt may follow the same documents with a question
            # shorter than that); which of them a later prompt may restore is decided then
            # (cut_allowed)
            cuts = CutRule(1, rule.multiple) if rule is not None and spec.documents else None
            lead = rule.min_tokens if rule is not None else 0
            return lay_out_text(spec, server, max_prompt_tokens=max_prompt_tokens, rule=cuts, lead=lead)
        return lay_out(spec, tokenize=server.tokenize, max_prompt_tokens=max_prompt_tokens, rule=rule)

    # -- where a prefill may start ---------------------------------------------------------

    def valid_end(self, start: int, end: int) -> int:
        """How far the cells of a prefill from *start* (an allowed cut) to *end* are what a
        fresh prefill computes: the server's batches of ``n_ubatch`` tokens from *start*
        must be at least ``rule.min_tokens`` long, so a short last batch's cells are not."""
        assert self.rule is not None
        rest = (end - start) % self.n_ubatch
        if end - start < self.rule.min_tokens:
            return start
        return end - rest if 0 < rest < self.rule.min_tokens else end

    def state_allowed(self, start: int, point: int, end: int) -> bool:
        """Whether the state of the first *point* tokens may be taken after a prefill from
        *start* to *end*: a multiple of the rule's, within the prefill's valid cells (and,
        on a sliding-window model, within the window: see :attr:`window`)."""
        rule = self.rule
        if rule is None or point % rule.multiple or point > self.window:
            return False
        return rule.min_tokens <= point <= self.valid_end(start, end)

    def cut_allowed(self, cut: int, end: int) -> bool:
        """Whether a prompt of *end* tokens may be prefilled from *cut* on (its cells before
        *cut* valid: a stored state, or what the slot holds) and give a fresh prefill's
        output: the batches after the cut are allowed ones; where a fresh prefill's own last
        batch is short, the cut must keep that batch as it is (a multiple of ``n_ubatch``)."""
        rule = self.rule
        if cut == 0:
            return True
        if rule is None or cut % rule.multiple or cut < rule.min_tokens or cut >= end or cut > self.window:
            return False
        last = end % self.n_ubatch
        if 0 < last < rule.min_tokens:
            return cut % self.n_ubatch == 0
        return self.valid_end(cut, end) == end

    def _live_reuse(self, tokens: Sequence[int]) -> int:
        """The tokens the server would reuse of what its slot holds: that many where the
        cut is allowed, 0 when nothing would be reused, -1 when the reuse would not be
        allowed (the next request must then restore a state or reuse nothing)."""
        slot = self._slot
        if slot is None:
            return -1
        if slot.generated is None:  # what follows the prompt is not known
            held = common_prefix(slot.prompt, tokens)
            if held == len(slot.prompt) and len(tokens) > held + 1:
                return -1  # the server may reuse some of the reply too
        else:
            held = common_prefix((*slot.prompt, *slot.generated), tokens)
        held = min(held, len(tokens) - 1)  # the server prefills at least one token
        if held == 0:
            return 0
        if held > len(slot.prompt):
            return -1
        return held if held <= slot.valid and self.cut_allowed(held, len(tokens)) else -1

    # -- running a prompt -------------------------------------------------------------------

    def run(
        self,
        layout: PromptLayout,
        options: RunOptions,
        *,
        should_stop: StopCheck | None = None,
        started: float | None = None,
    ) -> Generator[str, None, RunResult]:
        """Run *layout*: restore the deepest usable stored state (or keep the slot's prefix,
        where allowed), prefill to each new state point and save it, then complete the
        prompt; yields answer text, returns a :class:`RunResult`. Drafts, logits and
        composed states are in-process features: options asking for them run without."""
        started = time.perf_counter() if started is None else started
        config = self.config
        options = replace(
            options,
            sampling=options.sampling or config.engine.sampling,
            decode=options.decode and not options.prefix_only,
            approximate=False,
        )
        states = self.states if config.tiers.chunk_states and self.rule is not None else None
        server = self.engine
        with server.lock:
            self.flush()
            if states is not None and states.bytes > self.budget_bytes:
                super().evict_to_budget()  # the budget was lowered: new states evict on their own
            result = RunResult(layout)
            keys = self._keys(layout, states)
            if options.restore_depth is not None:
                keys = keys[: options.restore_depth]
            end = len(layout.tokens)
            if options.prefix_only:  # to the last state point before the question
                end = layout.state_point(len(layout.segments) - 2) if len(layout.segments) > 1 else 0
            with states.pinned(keys) if states is not None else nullcontext():
                yield from self._run(result, layout, keys, options, should_stop, started, end)
        return result

    def _run(
        self,
        result: RunResult,
        layout: PromptLayout,
        keys: list[str],
        options: RunOptions,
        should_stop: StopCheck | None,
        started: float,
        end: int,
    ) -> Generator[str, None, None]:
        tokens = layout.tokens
        clock = time.perf_counter()
        fresh = options.restore_depth is not None or not self.config.tiers.chunk_states  # caches off: nothing reused
        point, depth = self._start(layout, keys, end, fresh=fresh)
        result.depth, result.reused_tokens = depth, point
        if self.states is not None and self.rule is not None and layout.caller_prompt and options.decode:
            layout = result.layout = self._with_tail_cut(layout, point)
            keys = self._keys(layout, self.states)
        result.timings["restore"] = time.perf_counter() - clock
        clock = time.perf_counter()
        complete = False
        early = EarlySave()
        if self.states is not None and self.rule is not None and self.window < NO_WINDOW:
            point = self._save_early(result, layout, keys, point, end, early, should_stop)
        start = point  # where the last request's prefill started (0 where it was run again)
        try:
            if options.decode:
                start = yield from self._complete(result, tokens, point, options, should_stop, started)
                complete = self._slot is not None  # the request ran to its end
            else:
                if end > point:  # (a prefix with no state point to reach has nothing to prefill)
                    start = self._prefill_to(result, tokens[:end], point, should_stop)
                complete = True
            result.prefilled_tokens = max(0, end - result.reused_tokens)
        finally:
            result.timings["prefill"] = result.timings.get("prefill", time.perf_counter() - clock)
            clock = time.perf_counter()
            if complete and self.states is not None and self.rule is not None:
                self._store_later(layout, keys, early, start, end, options.idle)
            result.timings["store_states"] = time.perf_counter() - clock

    def _save_early(
        self,
        result: RunResult,
        layout: PromptLayout,
        keys: list[str],
        point: int,
        end: int,
        early: EarlySave,
        should_stop: StopCheck | None,
    ) -> int:
        """On a sliding-window model, save the wanted states within the window on the way,
        before the rest of the prompt moves the window past their first cells (a slot saved
        later lacks them): the prefix up to the deepest of them that the rest of the prompt
        may go on from is prefilled alone and the slot saved once, then cut to each state.
        Returns where the slot's prefill ends."""
        states = self.states
        assert states is not None
        wanted = [
            index for index in range(len(keys))
            if layout.segments[index].keep_state and keys[index] not in states and layout.state_point(index) > point
        ]
        target = next((
            layout.state_point(index) for index in reversed(wanted)
            if self.state_allowed(point, layout.state_point(index), layout.state_point(index))
            and self.cut_allowed(layout.state_point(index), end)
        ), 0)
        if not target:
            return point
        try:
            self._prefill(layout.tokens[:target], point, should_stop)
            saved = self._save()
        except UnexpectedReuse as error:  # the slot held other than planned: from nothing
            logger.warning("%s; the prompt is prefilled from the start", error)
            self.unexpected_reuse += 1
            result.reused_tokens = result.depth = 0
            self._slot = None
            return 0
        except (OSError, ServerError) as error:
            logger.warning("the slot could not be saved (%s): no chunk state kept", error)
            self.storage_failures += 1
            return target
        early.start, early.saved = point, saved  # cut to each state off the answer's time
        early.indices = self._wanted(layout, keys, point, target)
        return target

    def _prefill_to(self, result: RunResult, tokens: Sequence[int], point: int, should_stop: StopCheck | None) -> int:
        """Prefill *tokens* from *point* (from 0 when the server reused otherwise);
        returns where the prefill started."""
        try:
            self._prefill(tokens, point, should_stop)
            return point
        except UnexpectedReuse as error:
            logger.warning("%s; the prompt is prefilled from the start", error)
            self.unexpected_reuse += 1
            result.reused_tokens = result.depth = 0
            self._prefill(tokens, 0, should_stop)
            return 0

    def _stored_parent_key(self, keys: list[str], point: int) -> str:
        """The deepest stored prefix among *keys* within the first *point* tokens (the
        parent of a state taken after it), or "" (the root)."""
        assert self.states is not None
        tree = self.states.tree
        return next((key for key in reversed(keys) if (node := tree.get(key)) and node.n_tokens <= point), "")

    def _wanted(self, layout: PromptLayout, keys: list[str], start: int, end: int) -> list[int]:
        """The segments whose states are wanted, not stored, and may be taken from the slot
        after a request that prefilled from *start* to *end* (batches the rule allows)."""
        states = self.states
        assert states is not None
        return [
            index for index in range(len(keys))
            if layout.segments[index].keep_state and keys[index] not in states
            and start < layout.state_point(index) and self.state_allowed(start, layout.state_point(index), end)
        ]

    def _taken_states(
        self, layout: PromptLayout, keys: list[str], wanted: list[int], start: int, saved: bytes
    ) -> list[NewState]:
        """The states of the *wanted* segments, from the slot file *saved* after a request
        that prefilled from *start*: one slot file per state point, with the cells and the
        token list up to there (a restore then holds exactly those), where *saved* holds
        every cell of them."""
        states = self.states
        assert states is not None
        tokens = layout.tokens
        parent = self._stored_parent_key(keys, start)
        taken = []
        for index in wanted:
            point = layout.state_point(index)
            data = slot_file_prefix(saved, tokens[:point])
            if data is None:  # e.g. a sliding window passed it: no state there
                continue
            taken.append(NewState(index, parent or states.root_key, data, point))
            parent = keys[index]
        return taken

    def _store_later(
        self, layout: PromptLayout, keys: list[str], early: EarlySave, start: int, end: int, idle: bool
    ) -> None:
        """Save the slot now if a state is to be taken from it (the next request changes
        it), and cut and store the states in the background, off the answer's time; the
        next run (or :meth:`flush`) waits for them first."""
        wanted = self._wanted(layout, keys, start, end)
        saved = b""
        if wanted:
            try:
                saved = self._save()
                slot = self._slot
                if slot is not None and slot.generated is None:  # a relayed reply's tokens
                    held = slot_file_tokens(saved)
                    if held[: len(slot.prompt)] == slot.prompt:
                        self._slot = replace(slot, generated=held[len(slot.prompt) :])
            except (OSError, ServerError, struct.error) as error:
                logger.warning("the slot could not be saved (%s): no chunk states kept", error)
                self.storage_failures += 1
                wanted = []
        if not wanted and not early.indices:
            return

        def store() -> None:
            taken = self._taken_states(layout, keys, wanted, start, saved) if wanted else []
            kept = self._taken_states(layout, keys, early.indices, early.start, early.saved) if early.indices else []
            self._keep_states(layout, keys, [*kept, *taken], idle=idle)

        self.flush()
        self._pending = self._writer.submit(store)

    def flush(self) -> None:
        """Wait until the states of earlier runs are stored."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _start(self, layout: PromptLayout, keys: list[str], end: int, *, fresh: bool) -> tuple[int, int]:
        """Bring the slot to the deepest allowed start: a stored state restored, or the
        slot's own prefix when it reaches further (kept as is), else nothing (the next
        request prefills from 0). Returns (tokens in place, segments they end)."""
        live = 0 if fresh else self._live_reuse(layout.tokens[:end])
        stored: list[StateNode] = []
        if keys and self.states is not None:
            stored = [
                node for node in self.states.candidates(keys, budget_bytes=self.budget_bytes)
                if layout.state_point(keys.index(node.key)) == node.n_tokens
            ]
            if layout.caller_prompt:  # a caller's prompt: any stored state of its leading tokens
                found = {node.key: node for node in (*stored, *self._stored_text_prefixes(layout.tokens, end))}
                stored = sorted(found.values(), key=lambda node: -node.n_tokens)
        usable = [node for node in stored if self.cut_allowed(node.n_tokens, end)]
        deepest = usable[0].n_tokens if usable else 0
        if live < 0 and not fresh:  # the slot holds more than may be kept: cut it back
            kept = self._cut_slot_back(layout.tokens[:end], deepest + LIVE_CUT_GAIN)
            if kept:
                return kept, self._depth(layout, kept)
        for node in usable:
            if live > 0 and live >= node.n_tokens:
                break
            if self._restore(node, layout.tokens):
                return node.n_tokens, self._depth(layout, node.n_tokens)
        if live > 0:
            return live, self._depth(layout, live)
        self._slot = None  # whatever it holds, the next request is fresh
        return 0, 0

    def _cut_slot_back(self, tokens: Sequence[int], least: int) -> int:
        """Keep the slot's cells of *tokens*' first tokens up to the last allowed cut
        within what it holds (at least *least* tokens, else nothing is done): the slot is
        saved and restored with its token list cut there (the server then drops the later
        cells itself), as the in-process engine truncates its sequence. Returns the tokens
        kept (0: none)."""
        slot = self._slot
        if slot is None or self.rule is None:
            return 0
        held = min(common_prefix(slot.prompt, tokens), slot.valid, len(tokens) - 1)
        cut = held // self.rule.multiple * self.rule.multiple
        while cut >= least and not self.cut_allowed(cut, len(tokens)):
            cut -= self.rule.multiple
        if cut < least:
            return 0
        try:
            data = slot_file_prefix(self._save(), tokens[:cut])
            if data is None:
                return 0
            restored = self._load(data)
        except (OSError, ServerError) as error:
            logger.warning("the slot could not be cut back (%s)", error)
            self._slot = None
            return 0
        if restored != cut:
            self._slot = None
            return 0
        self._slot = SlotContent(tuple(tokens[:cut]), cut)
        return cut

    @staticmethod
    def _depth(layout: PromptLayout, point: int) -> int:
        """The segments whose state points lie within the first *point* tokens."""
        return sum(1 for i in range(len(layout.segments) - 1) if 0 < layout.state_point(i) <= point)

    def _stored_text_prefixes(self, tokens: Sequence[int], end: int) -> list[StateNode]:
        """Stored states of a caller's prompts that *tokens* start with (keyed by leading
        tokens), wherever the earlier prompt's cuts were."""
        assert self.states is not None and self.rule is not None
        lengths = sorted({
            n.n_tokens for n in self.states.tree.nodes
            if n.label == "text" and n.n_tokens <= end - self.rule.min_tokens
        })
        keys = prefix_keys(self.states.root_key, tokens, lengths) if lengths else []
        return [node for key in keys if key in self.states and (node := self.states.tree.get(key)) is not None]

    def _with_tail_cut(self, layout: PromptLayout, start: int) -> PromptLayout:
        """A caller's prompt with one more state kept, as near its end as a prefill from
        *start* leaves valid cells, so that the next prompt that continues this one (a
        chat's next turn) restores it and prefills only what follows. (In the process the
        context itself is kept; a server's slot also holds the generated tokens, whose cells
        a fresh prefill would not compute, and a server cannot be told to reuse less than
        it holds.)"""
        rule, ends = self.rule, layout.ends
        assert rule is not None
        end = ends[-1]
        tail = self.valid_end(start, end) // rule.multiple * rule.multiple
        before = ends[-2] if len(ends) > 1 else 0
        if tail <= max(before, start) or tail >= end:
            return layout
        last = layout.segments[-1]
        head = Segment("text", "", last.tokens[: tail - before], keep_state=True)
        rest = Segment("text", last.text, last.tokens[tail - before :], keep_state=False)
        return PromptLayout((*layout.segments[:-1], head, rest), layout.dropped_chunk_ids, layout.rule)

    def _restore(self, node: StateNode, tokens: Sequence[int]) -> bool:
        """Load *node*'s slot file into the slot; False (counted, the state dropped) when
        it cannot be read or the server refuses it."""
        assert self.states is not None
        data = self.states.get(node)
        if data is not None:
            try:
                restored = self._load(data)
            except (OSError, ServerError) as error:
                logger.warning("chunk state %s could not be restored (%s): treated as a miss", node.key, error)
                restored = -1
            if restored == node.n_tokens:
                self.states.record_use(node)
                self._slot = SlotContent(tuple(tokens[: node.n_tokens]), node.n_tokens)  # its key names its tokens
                return True
        self.states.delete(node.key)
        self.restore_failures += 1
        self._slot = None
        return False

    def _slot_folder(self) -> Path:
        folder = self.engine.slot_save_path
        assert folder is not None  # chunk states are on only with a slot-save folder
        return folder

    def _prefill(self, tokens: Sequence[int], point: int, should_stop: StopCheck | None) -> None:
        """Prefill *tokens* in the slot from *point* (the slot holds their first *point*),
        generating nothing."""
        if should_stop is not None and should_stop():
            raise Preempted("prefill pre-empted by a user question")
        self._slot = None
        for _ in self.engine.complete(tokens, Decoding(0), cache_prompt=point > 0, expected_cached=point):
            pass
        self._slot = SlotContent(tuple(tokens), self.valid_end(point, len(tokens)) if self.rule else 0)

    @contextmanager
    def _slot_file(self) -> Iterator[tuple[str, Path]]:
        """A fresh file name in the slot-save folder and its path (removed afterwards)."""
        name = f"percache-{uuid.uuid4().hex}.bin"
        path = self._slot_folder() / name
        try:
            yield name, path
        finally:
            path.unlink(missing_ok=True)

    def _save(self) -> bytes:
        """The slot's state as a slot file's bytes (saved by the server, read, removed)."""
        with self._slot_file() as (name, path):
            self.engine.save_slot(name)
            return path.read_bytes()

    def _load(self, data: bytes) -> int:
        """Load the slot file *data* into the slot; the tokens the server restored."""
        with self._slot_file() as (name, path):
            path.write_bytes(data)
            return self.engine.restore_slot(name)

    def _complete(
        self,
        result: RunResult,
        tokens: Sequence[int],
        point: int,
        options: RunOptions,
        should_stop: StopCheck | None,
        started: float,
    ) -> Generator[str, None, int]:
        """Complete the prompt from *point*; on a reuse other than planned, from 0.
        Returns where its prefill started."""
        assert options.sampling is not None
        relay = options.relay
        stops = stop_strings(self.config.engine.stop if options.stop is None else options.stop) if relay is None else ()
        stop = StopStringFilter(stops, strip=options.trim and relay is None)
        server = self.engine
        clock = time.perf_counter()
        for attempt in (0, 1):
            self._slot = None
            if relay is None:
                decoding = Decoding(options.max_new_tokens, options.sampling, list(stops))
                pieces = server.complete(tokens, decoding, cache_prompt=point > 0, expected_cached=point)
            else:  # the server's own endpoint lays out, stops and parses the reply
                relay.chunks.clear()
                pieces = server.relay(
                    relay.path, relay.body, cache_prompt=point > 0, expected_cached=point,
                    expected_total=len(tokens), chunks=relay.chunks,
                )
            try:
                for piece in pieces:
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - started
                        result.timings["prefill"] = time.perf_counter() - clock
                        clock = time.perf_counter()
                    shown = stop.feed(piece)
                    if shown:
                        yield shown
                    if stop.stopped:
                        break
                    if should_stop is not None and should_stop():
                        raise Preempted("decoding pre-empted by a user question")
                break
            except UnexpectedReuse as error:
                if attempt:
                    raise
                logger.warning("%s; the prompt is prefilled from the start", error)
                self.unexpected_reuse += 1
                point = result.reused_tokens = result.depth = 0
            finally:
                pieces.close()
        completion = server.last
        tail = stop.finish()
        if tail:
            yield tail
        result.text = stop.text.strip() if options.trim and relay is None else stop.text
        result.tokens = list(completion.tokens)
        result.generated_tokens = len(completion.tokens)
        result.timings["decode"] = time.perf_counter() - clock
        valid = self.valid_end(point, len(tokens)) if self.rule else 0
        if relay is not None:
            relay.reply = completion
            result.generated_tokens = int(completion.usage.get("completion_tokens", 0))
            if completion.finish_reason:  # it ran to its end: the slot holds the prompt and a reply
                self._slot = SlotContent(tuple(tokens), valid, None)
        elif completion.stop_type:  # the request ran to its end: the slot holds prompt and answer
            self._slot = SlotContent(tuple(tokens), valid, tuple(completion.tokens[:-1]))
        return point

    def path_is_stored(self, question: str, chunks: Sequence[Chunk], max_new_tokens: int) -> bool:
        self.flush()
        return super().path_is_stored(question, chunks, max_new_tokens)

    def stored_order(self, chunks: Sequence[Chunk]) -> list[Chunk]:
        self.flush()
        return super().stored_order(chunks)

    def evict_to_budget(self) -> None:
        self.flush()
        super().evict_to_budget()

    @contextmanager
    def lend_engine(self) -> Iterator[None]:
        """Hold the server for a request run outside PerCache (a passed-through one): the
        states of earlier runs are stored first, and the slot's content is unknown after."""
        with self.engine.lock:
            self.flush()
            self._slot = None
            try:
                yield
            finally:
                self._slot = None

    def close(self) -> None:
        """Store what is pending and stop the writer."""
        self.flush()
        self._writer.shutdown()

    def bytes_per_token(self) -> float:
        """The bytes a slot file takes per token, measured once (a 128-token prefill saved)."""
        if self._bytes_per_token is None:
            server = self.engine
            with server.lock:
                tokens = server.tokenize("Minutes of the planning call. " * 40, True)[:128]
                self._prefill(tokens, 0, None)
                self._bytes_per_token = len(self._save()) / len(tokens)
        return self._bytes_per_token

    # -- idle work's plain completions -------------------------------------------------------

    def complete_plain(
        self, prompt: str, decoding: Decoding, *, chat: bool = False, should_stop: StopCheck | None = None
    ) -> tuple[str, int, int]:
        """Complete *prompt* on the server with *decoding* and nothing reused (idle work's
        LLM calls): (text, prompt tokens, generated tokens). The prompt keeps its last
        ``n_ctx - max_new_tokens`` tokens. Raises :class:`Preempted` when *should_stop*
        turns true."""
        if decoding.max_new_tokens is None:
            raise ValueError("a plain completion needs max_new_tokens")
        max_new_tokens, stop = decoding.max_new_tokens, list(decoding.stop or ())
        server = self.engine
        with server.lock:
            if should_stop is not None and should_stop():
                raise Preempted("completion pre-empted by a user question")
            tokens = server.tokenize_chat(prompt) if chat else server.tokenize(prompt, True)
            tokens = tokens[-(server.n_ctx - max_new_tokens) :]
            self._slot = None
            filter_ = StopStringFilter(stop, strip=False)
            pieces = server.complete(tokens, decoding, cache_prompt=False)
            try:
                for piece in pieces:
                    filter_.feed(piece)
                    if filter_.stopped:
                        break
                    if should_stop is not None and should_stop():
                        raise Preempted("completion pre-empted by a user question")
            finally:
                pieces.close()
            filter_.finish()
            return filter_.text, len(tokens), len(server.last.tokens)
