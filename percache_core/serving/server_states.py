"""Chunk states taken from a llama-server's slot: which states a request's prefill allows
(:meth:`SlotStates.wanted`), the slot saved once and cut to each state
(:meth:`SlotStates.save_early` on a sliding-window model, :meth:`SlotStates.store_later`
after the answer), and the cutting and storing done in a writer thread, off the answer's
time (:meth:`SlotStates.flush` waits for it).
"""

from __future__ import annotations

import logging
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from ..kv.llama_server import ServerError, UnexpectedReuse
from .prompting import PromptLayout
from .server_slot import ServerSlot
from .slot_files import slot_file_prefix, slot_file_tokens
from .state_runner import NewState, StateRunner, StopCheck

logger = logging.getLogger(__name__)


@dataclass
class EarlySave:
    """States a sliding-window model's prefill saved on the way: the slot file *saved* after
    a prefill from *start*, to be cut to the states of segments *indices* after the answer."""

    indices: list[int] = field(default_factory=list)
    start: int = 0
    saved: bytes = b""


class SlotStates:
    """Takes the states a request leaves in *slot* for *runner* (its stored states, its
    storage-failure count and ``_keep_states``, which stores them as tree nodes)."""

    def __init__(self, runner: StateRunner, slot: ServerSlot) -> None:
        self.runner = runner
        self.slot = slot
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="percache-server-states")
        self._pending: Future[None] | None = None

    def wanted(self, layout: PromptLayout, keys: list[str], start: int, end: int) -> list[int]:
        """The segments whose states are wanted, not stored, and may be taken from the slot
        after a request that prefilled from *start* to *end* (batches the rule allows)."""
        states, cuts = self.runner.states, self.slot.cuts
        assert states is not None
        return [
            index for index in range(len(keys))
            if layout.segments[index].keep_state and keys[index] not in states
            and start < layout.state_point(index) and cuts.state_allowed(start, layout.state_point(index), end)
        ]  # fmt: skip

    def save_early(
        self, layout: PromptLayout, keys: list[str], span: tuple[int, int], early: EarlySave, should_stop: StopCheck | None
    ) -> int:
        """On a sliding-window model, save the wanted states within the window on the way,
        before the rest of the prompt moves the window past their first cells (a slot saved
        later lacks them): the prefix up to the deepest of them that the rest of the prompt
        may go on from (*span*: the slot holds its first tokens, the prompt's end) is
        prefilled alone and the slot saved once, into *early*. Returns where the slot's
        prefill ends. Raises ``UnexpectedReuse`` when the server reused otherwise."""
        states, cuts = self.runner.states, self.slot.cuts
        assert states is not None
        point, end = span
        wanted = [
            index for index in range(len(keys))
            if layout.segments[index].keep_state and keys[index] not in states and layout.state_point(index) > point
        ]  # fmt: skip
        target = next((
            layout.state_point(index) for index in reversed(wanted)
            if cuts.state_allowed(point, layout.state_point(index), layout.state_point(index))
            and cuts.cut_allowed(layout.state_point(index), end)
        ), 0)  # fmt: skip
        if not target:
            return point
        try:
            self.slot.prefill(layout.tokens[:target], point, should_stop)
            saved = self.slot.save()
        except UnexpectedReuse:
            raise
        except (OSError, ServerError) as error:
            logger.warning("the slot could not be saved (%s): no chunk state kept", error)
            self.runner.storage_failures += 1
            return target
        early.start, early.saved = point, saved  # cut to each state off the answer's time
        early.indices = self.wanted(layout, keys, point, target)
        return target

    def _stored_parent_key(self, keys: list[str], point: int) -> str:
        """The deepest stored prefix among *keys* within the first *point* tokens (the
        parent of a state taken after it), or "" (the root)."""
        assert self.runner.states is not None
        tree = self.runner.states.tree
        return next((key for key in reversed(keys) if (node := tree.get(key)) and node.n_tokens <= point), "")

    def _taken(self, layout: PromptLayout, keys: list[str], wanted: list[int], start: int, saved: bytes) -> list[NewState]:
        """The states of the *wanted* segments, from the slot file *saved* after a request
        that prefilled from *start*: one slot file per state point, with the cells and the
        token list up to there (a restore then holds exactly those), where *saved* holds
        every cell of them."""
        states = self.runner.states
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

    def store_later(
        self, layout: PromptLayout, keys: list[str], early: EarlySave, span: tuple[int, int], idle: bool
    ) -> None:
        """Save the slot now if a state is to be taken from it after a request that
        prefilled *span* (the next request changes the slot), and cut and store the states
        in the background, off the answer's time; the next run (or :meth:`flush`) waits
        for them first."""
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
        if not wanted and not early.indices:
            return

        def store() -> None:
            taken = self._taken(layout, keys, wanted, start, saved) if wanted else []
            kept = self._taken(layout, keys, early.indices, early.start, early.saved) if early.indices else []
            self.runner._keep_states(layout, keys, [*kept, *taken], idle=idle)

        self.flush()
        self._pending = self._writer.submit(store)

    def flush(self) -> None:
        """Wait until the states of earlier runs are stored."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Store what is pending and stop the writer."""
        self.flush()
        self._writer.shutdown()
