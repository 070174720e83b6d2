"""Chunk states taken from a llama-server's slot: which states a request's prefill allows
(:meth:`SlotStates.wanted`), the slot saved once and cut to each state
(:meth:`SlotStates.save_early` on a sliding-window model, :meth:`SlotStates.store_later`
after the answer), and the cutting and storing done in the runner's writer thread, off the
answer's time (:class:`~percache_core.serving.state_writer.StateWriter`).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

from ...serving.prompting import PromptLayout
from ...serving.state_runner import NewState, StateRunner, StopCheck
from .server import ServerError, UnexpectedReuse
from .slot import SavedSlot, ServerSlot
from .slot_files import slot_file_slice, slot_file_tokens

logger = logging.getLogger(__name__)


@dataclass
class EarlySave:
    """States a sliding-window model's prefill saved on the way: per save, where the prefill
    before it started, the slot file saved (left on disk: it is read after the answer, in
    the writer thread), and the segments whose states are cut from it then."""

    saves: list[tuple[int, SavedSlot, list[int]]] = field(default_factory=list)

    def discard(self) -> None:
        """Remove the files of saves that will not be stored (a run that did not finish)."""
        for _, saved, _ in self.saves:
            saved.discard()
        self.saves = []


class SlotStates:
    """Takes the states a request leaves in *slot* for *runner* (its stored states, its
    storage-failure count and ``_keep_states``, which stores them as tree nodes)."""

    def __init__(self, runner: StateRunner, slot: ServerSlot, store_lock: AbstractContextManager[Any] | None = None) -> None:
        self.runner = runner
        self.slot = slot
        self.store_lock = store_lock or nullcontext()  # the stored states' lock (runs in other slots read them)
        # a slot save left for after a reply (settle): _save_and_store's arguments
        self._pending: tuple[PromptLayout, list[str], EarlySave, tuple[int, int], bool] | None = None

    def wanted(self, layout: PromptLayout, keys: list[str], start: int, end: int, *, past_window: bool = False) -> list[int]:
        """The segments whose states are wanted, not stored, and may be taken from the slot
        after a request that prefilled from *start* to *end* (batches the rule allows; on a
        sliding-window model within the window unless *past_window*)."""
        cuts = self.slot.cuts
        return [
            index for index in self._unstored(layout, keys, start)
            if cuts.state_allowed(start, layout.state_point(index), end, past_window=past_window)
        ]  # fmt: skip

    def _unstored(self, layout: PromptLayout, keys: list[str], after: int) -> list[int]:
        """The segments whose states are wanted and not stored, ending past *after* tokens."""
        states = self.runner.states
        assert states is not None
        return [
            index for index in range(len(keys))
            if layout.segments[index].keep_state and keys[index] not in states and layout.state_point(index) > after
        ]  # fmt: skip

    def save_early(
        self, layout: PromptLayout, keys: list[str], span: tuple[int, int], early: EarlySave, should_stop: StopCheck | None
    ) -> int:
        """On a sliding-window model, save wanted states on the way, before the rest of the
        prompt moves the window past their cells (a slot saved later lacks them): the
        deepest wanted state that the rest of the prompt may go on from (*span*: the slot
        holds its first tokens, the prompt's end), past the window too, and the deepest
        batch boundary before it (a later prompt whose fresh prefill ends with a short
        batch may go on only from one), each prefilled to and saved once, into *early*;
        the states a save holds every needed cell of are cut from it after the answer.
        Returns where the slot's prefill ends. Raises ``UnexpectedReuse`` when the server
        reused otherwise."""
        point, end = span
        for target in self.early_targets(layout, keys, point, end):
            try:
                self.slot.prefill(layout.tokens[:target], point, should_stop)
                saved = self.slot.save_file()
            except UnexpectedReuse:
                raise
            except (OSError, ServerError) as error:
                logger.warning("the slot could not be saved (%s): no chunk state kept", error)
                self.runner.storage_failures += 1
                return target
            early.saves.append((point, saved, self.wanted(layout, keys, point, target, past_window=True)))
            point = target  # cut to each state off the answer's time
        return point

    def early_targets(self, layout: PromptLayout, keys: list[str], point: int, end: int) -> list[int]:
        """Where :meth:`save_early` saves the slot, in order (see there)."""
        cuts = self.slot.cuts
        points = [layout.state_point(index) for index in self._unstored(layout, keys, point)]

        def reachable(start: int, target: int) -> bool:
            return cuts.state_allowed(start, target, target, past_window=True) and cuts.cut_allowed(target, end, past_window=True)

        deepest = next((q for q in reversed(points) if reachable(point, q)), 0)
        boundary = next((
            q for q in reversed(points)
            if q < deepest and q % cuts.n_ubatch == 0 and reachable(point, q) and reachable(q, deepest)
        ), 0)  # fmt: skip
        return [q for q in (boundary, deepest) if q]

    def _stored_parent_key(self, keys: list[str], point: int) -> str:
        """The deepest stored prefix among *keys* within the first *point* tokens (the
        parent of a state taken after it), or "" (the root)."""
        assert self.runner.states is not None
        tree = self.runner.states.tree
        return next((key for key in reversed(keys) if (node := tree.get(key)) and node.n_tokens <= point), "")

    def _taken(self, layout: PromptLayout, keys: list[str], wanted: list[int], start: int, saved: bytes) -> list[NewState]:
        """The states of the *wanted* segments, from the slot file *saved* after a request
        that prefilled from *start*, where *saved* holds every cell of them: per state point
        a slot file with the cells and tokens after its parent's (slices: the path's files
        joined are the prefix's file), or up to there (whole states; a restore then holds
        exactly those)."""
        states = self.runner.states
        assert states is not None
        tokens = layout.tokens
        parent = self._stored_parent_key(keys, start)
        parent_node = states.tree.get(parent) if parent else None
        parent_end = parent_node.n_tokens if parent_node is not None else 0
        taken = []
        for index in wanted:
            point = layout.state_point(index)
            data = slot_file_slice(saved, tokens[:point], parent_end if states.slices else 0, self.slot.cuts.sliding)
            if data is None:  # e.g. a sliding window passed it: no state there
                continue
            taken.append(NewState(index, parent or states.root_key, data, point))
            parent, parent_end = keys[index], point
        return taken

    def store_later(
        self, layout: PromptLayout, keys: list[str], early: EarlySave, span: tuple[int, int], idle: bool,
        *, after_reply: bool = False,
    ) -> None:
        """Save the slot now if a state is to be taken from it after a request that
        prefilled *span* (the next request changes the slot), and cut and store the states
        in the runner's writer thread, off the answer's time; the next run (or the
        runner's ``flush``) waits for them first. With *after_reply* (a relayed client's
        request, whose reply waits for the run's end), the slot is saved by :meth:`settle`
        instead: once the reply is sent, or by whatever uses the server next, first."""
        if after_reply:
            owned, early.saves = EarlySave(early.saves), []
            self._pending = (layout, keys, owned, span, idle)
            return
        self._save_and_store(layout, keys, early, span, idle)

    @property
    def pending(self) -> bool:
        """Whether a slot save waits for :meth:`settle`."""
        return self._pending is not None

    def settle(self) -> None:
        """Run the slot save that :meth:`store_later` left for after a reply, before
        anything else changes the slot (the caller holds the slot's lease: the pool's
        lease and settle call this; a slot that holds other tokens by then gives no
        state: the slices check the tokens they are cut from)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._save_and_store(*pending)

    def drop_pending(self) -> None:
        """Forget the slot save left for after a reply (the cache closes), removing the
        files its early saves left."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[2].discard()

    def _save_and_store(
        self, layout: PromptLayout, keys: list[str], early: EarlySave, span: tuple[int, int], idle: bool
    ) -> None:
        start, end = span
        wanted = self.wanted(layout, keys, start, end)
        saved = b""
        if wanted:
            try:
                saved = self.slot.save()
                slot = self.slot.content
                if slot is not None and slot.generated is None:  # a relayed reply's tokens
                    held = slot_file_tokens(saved)
                    if held[: len(slot.prompt)] == slot.prompt:
                        self.slot.content = replace(slot, generated=held[len(slot.prompt) :])
            except (OSError, ServerError, struct.error) as error:
                logger.warning("the slot could not be saved (%s): no chunk states kept", error)
                self.runner.storage_failures += 1
                wanted = []
        if not wanted and not early.saves:
            return
        saves, early.saves = [*early.saves, (start, saved, wanted)], []
        self._submit(layout, keys, saves, idle)

    def store_early(self, layout: PromptLayout, keys: list[str], early: EarlySave, idle: bool, then: Callable[[], None]) -> None:
        """Cut and store the states :meth:`save_early` saved now, in the writer thread,
        rather than after the answer (*early* is emptied), and call *then* once they are
        stored or failed: a run in another slot may be waiting for them."""
        saves, early.saves = list(early.saves), []
        self._submit(layout, keys, saves, idle, then)

    def _submit(
        self, layout: PromptLayout, keys: list[str], saves: list[tuple[int, bytes | SavedSlot, list[int]]], idle: bool,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Cut the states of each of *saves* (where its prefill started, the slot file or
        its bytes, the segments) and store them in the writer thread, save by save, so that
        each finds the one before as its parent; then *then*."""

        def store() -> None:
            try:
                read = [(first, self._read(file) if indices else b"", indices) for first, file, indices in saves]
                with self.store_lock:  # (the files read first: runs in other slots wait for this lock)
                    for first, data, indices in read:
                        if data:
                            self.runner._keep_states(layout, keys, self._taken(layout, keys, indices, first, data), idle=idle)
            finally:
                for _, file, _ in saves:
                    if isinstance(file, SavedSlot):
                        file.discard()
                if then is not None:
                    then()

        self.runner.writer.submit(store)

    def _read(self, file: bytes | SavedSlot) -> bytes:
        """A save's bytes (an early save's file read now); b"" when it cannot be read."""
        if isinstance(file, bytes):
            return file
        try:
            return file.read()
        except OSError as error:
            logger.warning("a saved slot file could not be read (%s): no chunk state kept", error)
            self.runner.storage_failures += 1
            return b""
