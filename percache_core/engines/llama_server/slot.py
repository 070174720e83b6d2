"""A slot of a llama-server as :class:`~percache_core.engines.llama_server.runner.ServerRunner`
sees it: where a prefill may start and a state be taken (:class:`ServerCuts`), what the
slot holds (:class:`SlotContent`), and the slot's verbs (:class:`ServerSlot`): prefill,
save, load, cut back, measure and complete with nothing reused.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ...errors import Preempted
from ...kv.cuts import CutRule, short_call_start
from ...kv.engine import Decoding, EngineVerdicts
from ...kv.stopping import StopStringFilter
from ...kv.tiers import TieredStateStore
from ...kv.tree import StateNode
from ...serving.live_prefix import common_prefix
from ...serving.prompting import PromptLayout, split_at
from ...serving.state_runner import IDLE_PIECE_TOKENS, StopCheck
from ...serving.text_stream import shown_text
from .server import Completion, InSlot, LlamaServer, ServerError
from .slot_files import slot_file_cells, slot_file_join, slot_file_prefix, slot_file_slice

logger = logging.getLogger(__name__)

NO_WINDOW = 1 << 30  # a model without a sliding window: states of any length
_slices_verdicts: EngineVerdicts[bool] = EngineVerdicts("server_slot_slices_streams", decode=bool)  # (slot files of every stream count)


@dataclass
class SavedSlot:
    """A slot file the server saved, read once (then removed) or discarded.

    >>> import tempfile; folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "s.bin").write_bytes(b"cells")
    >>> saved = SavedSlot(folder / "s.bin")
    >>> saved.read(), (folder / "s.bin").exists()
    (b'cells', False)
    """

    path: Path

    def read(self) -> bytes:
        try:
            return self.path.read_bytes()
        finally:
            self.discard()

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass
class ServerCuts:
    """Where a server's prefill may start and its states be taken.

    Attributes:
        rule: the server's cut rule (None: no cut is safe).
        n_ubatch: the server's micro-batch (``-ub``).
        window: on a sliding-window model, its window: the slot's own cells, and a slot
            saved after the prompt went on, are exact up to there (a restored slot file with
            the cells the window passed put back as zero cells is exact past it: see
            :mod:`~percache_core.engines.llama_server.slot_files`).

    >>> cuts = ServerCuts(CutRule(64, 4), 512)
    >>> cuts.cut_allowed(128, 800), cuts.cut_allowed(130, 800), cuts.valid_end(0, 520)
    (True, False, 512)
    """

    rule: CutRule | None
    n_ubatch: int = 512
    window: int = NO_WINDOW

    def valid_end(self, start: int, end: int) -> int:
        """How far the cells of a prefill from *start* (an allowed cut) to *end* are what a
        fresh prefill computes: the server's batches of ``n_ubatch`` tokens from *start*
        must be at least ``rule.min_tokens`` long, so a short last batch's cells are not."""
        assert self.rule is not None
        rest = (end - start) % self.n_ubatch
        if end - start < self.rule.min_tokens:
            return start
        return end - rest if 0 < rest < self.rule.min_tokens else end

    @property
    def sliding(self) -> int:
        """The model's sliding window (0: none)."""
        return 0 if self.window >= NO_WINDOW else self.window

    def state_allowed(self, start: int, point: int, end: int, *, past_window: bool = False) -> bool:
        """Whether the state of the first *point* tokens may be taken after a prefill from
        *start* to *end*: a multiple of the rule's, within the prefill's valid cells (and,
        on a sliding-window model, within the window unless *past_window*: the slot is
        saved at *point* itself)."""
        rule = self.rule
        if rule is None or point % rule.multiple or (point > self.window and not past_window):
            return False
        return rule.min_tokens <= point <= self.valid_end(start, end)

    def cut_allowed(self, cut: int, end: int, *, past_window: bool = False) -> bool:
        """Whether a prompt of *end* tokens may be prefilled from *cut* on (its cells before
        *cut* valid: a stored state, or what the slot holds) and give a fresh prefill's
        output: the batches after the cut are allowed ones; where a fresh prefill's own last
        batch is short, the cut must keep that batch as it is: a multiple of ``n_ubatch``, or
        a cut from which the prefill may go to that batch's start, in a request of its own
        (:meth:`last_batch_start`). On a sliding-window model, within the window unless
        *past_window* (a restored slot file, laid out as a fresh prefill's)."""
        rule = self.rule
        if cut == 0:
            return True
        if rule is None or cut % rule.multiple or cut < rule.min_tokens or cut >= end:
            return False
        if cut > self.window and not past_window:
            return False
        boundary = short_call_start(end, self.n_ubatch, rule.min_tokens)
        if boundary is not None:
            return cut % self.n_ubatch == 0 or (cut < boundary and self.valid_end(cut, boundary) == boundary)
        return self.valid_end(cut, end) == end

    def last_batch_start(self, cut: int, end: int) -> int | None:
        """Where a prefill from *cut* (an allowed cut) of a prompt of *end* tokens stops one
        request before the end: the start of a fresh prefill's short last batch (shorter
        than ``rule.min_tokens``), so that the last request prefills that batch as a fresh
        prefill does; None where one request gives a fresh prefill's batches.

        >>> cuts = ServerCuts(CutRule(64, 4), 512)
        >>> cuts.last_batch_start(128, 530), cuts.last_batch_start(512, 530), cuts.last_batch_start(128, 600)
        (512, None, None)
        """
        rule = self.rule
        boundary = None if rule is None or cut == 0 else short_call_start(end, self.n_ubatch, rule.min_tokens)
        return boundary if boundary is not None and cut < boundary and cut % self.n_ubatch else None

    def with_tail_cut(self, layout: PromptLayout, start: int) -> PromptLayout:
        """A caller's prompt with states kept near its end, so that the next prompt that
        continues this one (a chat's next turn) restores one and prefills only what follows
        (in the process the context itself is kept; a server's slot also holds the generated
        tokens, whose cells a fresh prefill would not compute, and a server cannot be told to
        reuse less than it holds):

        - as near the end as a prefill from *start* leaves valid cells;
        - at the prompt's last batch boundary (a multiple of ``n_ubatch``), splitting
          whichever piece holds it: a later prompt whose fresh prefill ends with a batch
          shorter than ``rule.min_tokens`` may go on only from such a boundary.

        Past a sliding window the states are saved on the way, so the one near the end is
        kept where the rest of the prompt may go on from it."""
        rule, ends = self.rule, layout.ends
        assert rule is not None
        end = ends[-1]
        tail = self.valid_end(start, end) // rule.multiple * rule.multiple
        boundary = (end - 1) // self.n_ubatch * self.n_ubatch
        cuts = {tail, boundary} if self.state_allowed(start, boundary, end) else {tail}
        if end > self.window:  # saved on the way: near the end where allowed, and the last batch boundary
            floor = max(ends[-2] if len(ends) > 1 else 0, start)
            latest = min(tail, end - rule.min_tokens) // rule.multiple * rule.multiple
            near = next((c for c in range(latest, floor, -rule.multiple) if self.cut_allowed(c, end, past_window=True)), 0)
            cuts = {c for c in (near, boundary) if self.cut_allowed(c, end, past_window=True)}
        inside = sorted(c for c in cuts if start < c < end and c not in ends)
        return split_at(layout, inside) if inside else layout


@dataclass(frozen=True)
class SlotContent:
    """What a slot holds as far as this runner knows: *prompt* tokens, of which the first
    *valid* were prefilled in batches the cut rule allows (their cells are what a fresh
    prefill computes), then *generated* ones."""

    prompt: tuple[int, ...]
    valid: int
    generated: tuple[int, ...] | None = ()  # None: not known (a relayed reply)


class ServerSlot:
    """Slot *index* of *server*, and what it holds (:attr:`content`; None: unknown, so the
    next request reuses nothing): :meth:`live_reuse`, :meth:`prefill`, :meth:`save`,
    :meth:`load`, :meth:`cut_back`, :meth:`bytes_per_token`, :meth:`complete_plain`. Its
    user holds its lease (:class:`~percache_core.engines.llama_server.slot_leases.SlotLeases`)."""

    def __init__(self, server: LlamaServer, cuts: ServerCuts, index: int = 0) -> None:
        self.server = server
        self.cuts = cuts
        self.index = index
        self._content: SlotContent | None = None
        # the prompt a run batched with another left (its cells are the server's under that
        # batching: only another such run goes on from them); any write of content forgets it
        self.loose: tuple[int, ...] = ()
        self.last_used = 0  # when a run last leased it (the runner's count of leases)
        self._bytes_per_token: float | None = None

    @property
    def content(self) -> SlotContent | None:
        """What the slot holds of exact cells, as far as known (None: nothing known)."""
        return self._content

    @content.setter
    def content(self, held: SlotContent | None) -> None:
        self._content, self.loose = held, ()  # the slot is written (or forgotten): no batched run's cells

    def keep_loose(self, tokens: Sequence[int]) -> None:
        """Note that the run of prompt *tokens* just ended here was batched with another: what
        the slot holds is known only as :attr:`loose` (where the run ran to its end)."""
        finished = self._content is not None
        self.content = None
        self.loose = tuple(tokens) if finished else ()

    def held_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of *tokens* the slot holds, as far as known (0: none),
        those a batched run left included."""
        slot = self.content
        return common_prefix(self.loose, tokens) if slot is None else common_prefix(slot.prompt, tokens)

    def live_reuse(self, tokens: Sequence[int]) -> int:
        """The tokens the server would reuse of what the slot holds: that many where the
        cut is allowed, 0 when nothing would be reused, -1 when the reuse would not be
        allowed (the next request must then restore a state or reuse nothing)."""
        slot = self.content
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
        return held if held <= slot.valid and self.cuts.cut_allowed(held, len(tokens)) else -1

    def prefill(self, tokens: Sequence[int], point: int, should_stop: StopCheck | None) -> None:
        """Prefill *tokens* in the slot from *point* (the slot holds their first *point*),
        generating nothing."""
        if should_stop is not None and should_stop():
            raise Preempted("prefill pre-empted by a user question")
        self.content = None
        for _ in self.server.complete(tokens, Decoding(0), cache_prompt=point > 0, expected_cached=point, slot=InSlot(self.index)):
            pass
        valid = self.cuts.valid_end(point, len(tokens)) if self.cuts.rule else 0
        self.content = SlotContent(tuple(tokens), valid)

    @contextmanager
    def _file(self) -> Iterator[tuple[str, Path]]:
        """A fresh file name in the slot-save folder and its path (removed afterwards)."""
        name, path = self._fresh_file()
        try:
            yield name, path
        finally:
            path.unlink(missing_ok=True)

    def save(self) -> bytes:
        """The slot's state as a slot file's bytes (saved by the server, read, removed)."""
        return self.save_file().read()

    def save_file(self) -> SavedSlot:
        """The slot saved by the server as a file left in the slot-save folder, to be read
        (or discarded) later, off a request's time."""
        name, path = self._fresh_file()
        try:
            self.server.save_slot(name, self.index)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return SavedSlot(path)

    def _fresh_file(self) -> tuple[str, Path]:
        """A fresh file name in the slot-save folder, and its path."""
        folder = self.server.slot_save_path
        assert folder is not None  # chunk states are on only with a slot-save folder
        name = f"percache-{uuid.uuid4().hex}.bin"
        return name, folder / name

    def load(self, data: bytes) -> int:
        """Load the slot file *data* into the slot; the tokens the server restored."""
        with self._file() as (name, path):
            path.write_bytes(data)
            return self.server.restore_slot(name, self.index)

    def restore(self, node: StateNode, tokens: Sequence[int], states: TieredStateStore) -> bool:
        """Load *node*'s slot file (its key names *tokens*' first ``node.n_tokens``) from
        *states* into the slot, joined from its path's slices where states are slices;
        False when it cannot be read, a slice is missing or the server refuses it (the state
        dropped, except where an evicted ancestor left a shorter prefix to try)."""
        chain = states.chain(node)
        if chain is None:
            return False  # a slice whose ancestor was evicted
        parts = [states.get(link) for link in chain]
        data = None if None in parts else slot_file_join(parts, self.cuts.sliding)  # type: ignore[arg-type]
        if data is not None:
            try:
                restored = self.load(data)
            except (OSError, ServerError) as error:
                logger.warning("chunk state %s could not be restored (%s): treated as a miss", node.key, error)
                restored = -1
            if restored == node.n_tokens:
                for link in chain:
                    states.record_use(link)
                self.content = SlotContent(tuple(tokens[: node.n_tokens]), node.n_tokens)
                return True
        states.delete(node.key)
        self.content = None
        return False

    def cut_back(self, tokens: Sequence[int], least: int) -> int:
        """Keep the slot's cells of *tokens*' first tokens up to the last allowed cut
        within what it holds (at least *least* tokens, else nothing is done): the slot is
        saved and restored with its token list cut there (the server then drops the later
        cells itself), as the in-process engine truncates its sequence. Returns the tokens
        kept (0: none)."""
        slot, rule = self.content, self.cuts.rule
        if slot is None or rule is None:
            return 0
        held = min(common_prefix(slot.prompt, tokens), slot.valid, len(tokens) - 1)
        cut = held // rule.multiple * rule.multiple
        while cut >= least and not self.cuts.cut_allowed(cut, len(tokens)):
            cut -= rule.multiple
        if cut < least:
            return 0
        try:
            data = slot_file_prefix(self.save(), tokens[:cut], self.cuts.sliding)
            if data is None:
                return 0
            restored = self.load(data)
        except (OSError, ServerError) as error:
            logger.warning("the slot could not be cut back (%s)", error)
            self.content = None
            return 0
        if restored != cut:
            self.content = None
            return 0
        self.content = SlotContent(tuple(tokens[:cut]), cut)
        return cut

    def bytes_per_token(self) -> float:
        """The bytes a slot file takes per token, measured once (a 128-token prefill saved)."""
        if self._bytes_per_token is None:
            tokens, saved = self._sample()
            self._bytes_per_token = len(saved) / len(tokens)
        return self._bytes_per_token

    def slices_work(self) -> bool:
        """Whether this server's slot files are read and written back byte for byte: a
        saved slot cut into two slices and joined again must hold the saved cells exactly
        (an unknown layout keeps whole states). Measured once per server (remembered on
        disk for a server PerCache started)."""
        known, works = _slices_verdicts.known(self.server)
        if known:
            return bool(works)
        tokens, saved = self._sample()
        half = len(tokens) // 2
        parts = [slot_file_slice(saved, tokens[:half], 0), slot_file_slice(saved, tokens, half)]
        joined = None if None in parts else slot_file_join(parts)  # type: ignore[arg-type]
        works = joined is not None and slot_file_cells(joined) == slot_file_cells(saved)
        _slices_verdicts.keep(self.server, works)
        return works

    def _sample(self) -> tuple[list[int], bytes]:
        """The slot after a 128-token prefill: its tokens and its saved file."""
        server = self.server
        with server.lock:
            tokens = server.tokenize("Minutes of the planning call. " * 40, True)[:128]
            self.prefill(tokens, 0, None)
            return tokens, self.save()

    def complete_plain(
        self, prompt: str, decoding: Decoding, *, chat: bool = False, should_stop: StopCheck | None = None
    ) -> tuple[str, int, int]:
        """Complete *prompt* on the server with *decoding* (idle work's LLM calls: the
        predictor's and the abstract's): (text, prompt tokens, generated tokens). The prompt
        keeps its last ``n_ctx - max_new_tokens`` tokens and is prefilled
        :data:`IDLE_PIECE_TOKENS` at a time, a request each that goes on from the slot's
        cache, so that a client's request waits for one piece at most (their text only
        proposes questions: their batches need not be an answer's). Raises
        :class:`Preempted` when *should_stop* turns true. The caller holds the slot's lease."""
        max_new_tokens = decoding.required_tokens()
        server, slot = self.server, self.index
        tokens = server.tokenize_chat(prompt) if chat else server.tokenize(prompt, True)
        tokens = tokens[-(server.n_ctx - max_new_tokens) :]
        self.content = None
        for end in [*range(IDLE_PIECE_TOKENS, len(tokens), IDLE_PIECE_TOKENS), None]:
            if should_stop is not None and should_stop():
                raise Preempted("completion pre-empted by a user question")
            if end is not None:  # a piece, nothing generated
                for _ in server.complete(tokens[:end], Decoding(0), cache_prompt=end > IDLE_PIECE_TOKENS, slot=InSlot(slot)):
                    pass
        filter_ = StopStringFilter(list(decoding.stop or ()), strip=False)
        completion = Completion()
        pieces = server.complete(tokens, decoding, cache_prompt=len(tokens) > IDLE_PIECE_TOKENS, slot=InSlot(slot, completion))
        for _ in shown_text(pieces, filter_, should_stop, what="completion"):
            pass
        return filter_.text, len(tokens), len(completion.tokens)
