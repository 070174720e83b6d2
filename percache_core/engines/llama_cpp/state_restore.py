"""Bringing an in-process engine's sequence to the deepest known prefix of a prompt: what
the context still holds of the previous prompt (kept, cut back to; :meth:`StateRestorer.reuse_point`),
or the deepest stored state (restored, slices appended along its chain), else nothing; and,
for ``reuse="approximate"``, a chunk composed from its independent state moved into place
(:meth:`StateRestorer.compose`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ...kv.cuts import CutRule, known_cut_rule, prefill_start_allowed
from ...kv.tiers import TieredStateStore
from ...kv.tree import StateNode, path_keys, prefix_keys
from ...serving.live_prefix import LiveContext, call_starts, segment_cut, text_cut
from ...serving.prompting import PromptLayout, with_cut
from ...serving.state_runner import StateRunner

logger = logging.getLogger(__name__)


class StateRestorer:
    """Restores prefixes for *runner* (its engine, stored states and budget; only states
    within the reach its engine's round trip proved, :attr:`PromptRunner.reach`; a failed
    restore is counted in its ``restore_failures``): :meth:`reuse_point`,
    :meth:`keep_or_restore`, :meth:`restore_or_reset`, :meth:`restore`, :meth:`usable`,
    :meth:`independent_state` and :meth:`compose`."""

    def __init__(self, runner: StateRunner) -> None:
        self.runner = runner

    def keep_or_restore(
        self, layout: PromptLayout, keys: list[str], kept: int, live: LiveContext | None, end: int
    ) -> tuple[int, int, bool]:
        """Bring the sequence to the deepest prefix of *layout* (prefilled up to *end*) that
        a stored state restores or the context holds (its first *kept* tokens, cut back to;
        used where no stored state is as deep, or none deeper when an idle round reinstated
        it), else empty it: (segments, tokens) in place, and whether they are the context's
        (stock's reuse: a reinstated state counts as restored)."""
        ends = layout.ends
        candidates = self.runner.stored_prefixes(keys)
        live_ok = live is not None and live.changes == self.runner.engine.changes
        reinstated = live is not None and live.reinstated

        def kept_wins(stored: int, depth: int) -> bool:  # a reinstated state also where as deep
            return stored <= depth if reinstated else stored < depth

        if layout.stock_calls:  # the context is kept where it holds more state points
            assert layout.rule is not None
            candidates = self.usable(layout, keys, candidates, end)
            depth = sum(1 for index in range(len(layout.segments) - 1) if 0 < layout.state_point(index) <= kept)
            stored = keys.index(candidates[0].key) + 1 if candidates else 0
            keep = kept and prefill_start_allowed(kept, end, self.runner.engine.n_batch, layout.rule.min_tokens) \
                and (kept_wins(stored, depth) or not candidates)
            if keep and live_ok and self.runner.engine.truncate(kept):
                return depth, kept, not reinstated
        elif kept and kept in ends and live_ok:
            depth = ends.index(kept) + 1
            stored = keys.index(candidates[0].key) + 1 if candidates else 0
            if kept_wins(stored, depth) and self.runner.engine.truncate(kept):
                return depth, kept, not reinstated
        return (*self.restore_or_reset(keys, candidates), False)

    def usable(self, layout: PromptLayout, keys: list[str], candidates: list[StateNode], end: int) -> list[StateNode]:
        """Of the stored prefixes *candidates* of a prompt in stock's calls,
        those that end at their state point in *layout* and from which a prefill to *end*
        computes as stock's calls do (:func:`~percache_core.kv.cuts.prefill_start_allowed`:
        the cut a restore makes is then one the rule allows)."""
        assert layout.rule is not None
        least, n_batch = layout.rule.min_tokens, self.runner.engine.n_batch
        return [
            node for node in candidates
            if layout.state_point(keys.index(node.key)) == node.n_tokens
            and prefill_start_allowed(node.n_tokens, end, n_batch, least)
        ]

    def restore_or_reset(self, keys: list[str], candidates: list[StateNode] | None = None) -> tuple[int, int]:
        """Restore the deepest usable stored prefix of *keys* (of *candidates*, the stored
        ones among them when already looked up), or empty the sequence when none is
        stored: (segments, tokens) restored."""
        depth, reused = self.restore(keys, candidates) if keys else (0, 0)
        if depth == 0:
            self.runner.engine.reset()
        return depth, reused

    def restore(self, keys: list[str], candidates: list[StateNode] | None = None) -> tuple[int, int]:
        """Restore the deepest usable stored prefix of *keys* (from any tier; *candidates*:
        the stored ones among them, when already looked up): (segments, tokens) restored.
        A node's depth is its place among *keys* (a caller's prompt is keyed by its leading
        tokens, so the same node ends other segments in other layouts)."""
        if candidates is None:
            candidates = self.runner.stored_prefixes(keys)
        for node in candidates:
            chain = self.runner.states.chain(node)
            if chain is None:
                continue  # a slice whose ancestor was evicted: a shorter prefix may do
            restored = self._restore_chain(chain)
            if restored is not None and restored.key in keys:
                return keys.index(restored.key) + 1, restored.n_tokens
            # a link failed and what was restored ends inside a segment here: look further
        return 0, 0

    def reinstate(self, tokens: tuple[int, ...], keys: list[str]) -> LiveContext | None:
        """The deepest stored prefix of a prompt (*tokens*, its state *keys*) restored, as
        the context a next prompt may keep (None: none stored). A stored state holds what a
        fresh prefill computes (its calls cut only where the cut rule allows), as the same
        restore inside the next answer would."""
        depth, reused = self.restore(keys, self.runner.stored_prefixes(keys))
        return LiveContext(tokens[:reused], (), self.runner.engine.changes, reinstated=True) if depth else None

    def _restore_chain(self, chain: list[StateNode]) -> StateNode | None:
        """Load the first state of *chain* and append the others' slices; the deepest node
        restored (the sequence then holds exactly its prefix), or None. A state that cannot
        be read or restored is dropped (and counted); the prefix before it stays."""
        restored: StateNode | None = None
        for node in chain:
            data = self.runner.states.get(node)
            if restored is None:
                loaded = data is not None and self.runner.engine.load_state(data, node.n_tokens)
            else:
                loaded = data is not None and self.runner.engine.append_slice(data, node.n_tokens)
            if not loaded:
                logger.warning("chunk state %s could not be restored: treated as a miss", node.key)
                self.runner.states.delete(node.key)
                self.runner.restore_failures += 1
                break
            self.runner.states.record_use(node)
            restored = node
        return restored

    def reuse_point(
        self, layout: PromptLayout, states: TieredStateStore | None, live: LiveContext | None
    ) -> tuple[PromptLayout, int]:
        """*layout* and how many of its leading tokens the engine's sequence already holds,
        exactly as this prompt's own prefill would compute them, of the previous prompt
        *live* (None: unknown; 0: none; see :mod:`percache_core.serving.live_prefix`). A caller's prompt also gets a cut at the
        end of the longest stored state it starts with, when that is deeper."""
        engine = self.runner.engine
        tokens = layout.tokens
        rule = known_cut_rule(engine)[1] if layout.caller_prompt else layout.rule
        if rule is None:  # PerCache's own prompt on a build without a rule: same calls only
            if live is None:
                return layout, 0
            starts = call_starts(engine, [len(s.tokens) for s in layout.segments])
            return layout, segment_cut(live, tokens, starts, layout.ends[:-1])
        kept = text_cut(live, tokens, rule, engine.n_batch) if live is not None else 0
        if not layout.caller_prompt:  # PerCache's own prompt: its states are at its state points
            return layout, kept
        stored = self._stored_text_prefix(tokens, rule) if states is not None else 0
        point = max(kept, stored)
        if point and point not in layout.ends:
            layout = with_cut(layout, point, rule)
        return layout, kept

    def _stored_text_prefix(self, tokens: Sequence[int], rule: CutRule) -> int:
        """The length of the longest stored state of a caller's prompt that *tokens* start
        with and that leaves at least ``rule.min_tokens`` to prefill (0: none)."""
        limit = min(len(tokens) - rule.min_tokens, self.runner.reach)
        lengths = sorted({n.n_tokens for n in self.runner.states.tree.nodes if n.label == "text" and n.n_tokens <= limit})
        lengths = [n for n in lengths if n % rule.multiple == 0 and n >= rule.min_tokens]
        if not lengths:
            return 0
        keys = prefix_keys(self.runner.states.root_key, tokens, lengths)
        return next((n for n, key in zip(reversed(lengths), reversed(keys)) if key in self.runner.states), 0)

    def independent_state(self, layout: PromptLayout, segments: list[list[int]], index: int) -> StateNode | None:
        """The stored [system, chunk] state of chunk segment *index* (index >= 2: the first
        chunk's is an exact prefix, restored as such), or None."""
        if self.runner.states is None or index < 2 or layout.segments[index].kind != "chunk":
            return None
        if layout.segments[0].kind != "system":
            return None
        key = path_keys(self.runner.states.root_key, [segments[0], segments[index]])[1]
        return self.runner.states.tree.get(key)

    def compose(self, node: StateNode, tokens: list[int], recompute: int, offset: int) -> int:
        """Prefill a chunk segment of *tokens* from its independent [system, chunk] state
        *node* (where the chunk starts at *offset*): its first *recompute* tokens live (they
        see the real context before them), the rest the state holds moved in, and what it
        does not hold (a state taken at a state point before the chunk's end) live. Falls
        back to a live prefill of the rest when the state cannot be used. Returns the tokens
        moved in."""
        engine = self.runner.engine
        held = min(len(tokens), node.n_tokens - offset)  # of the chunk's tokens, in the state
        head = min(recompute, held)
        if head:
            engine.eval(tokens[:head])
        data = self.runner.states.get(node) if head < held else None
        if data is None or not engine.append_moved(data, node.n_tokens, offset + head):
            if head < len(tokens):
                engine.eval(tokens[head:])
            return 0
        self.runner.states.record_use(node)
        if held < len(tokens):
            engine.eval(tokens[held:])
        return held - head

    def stored_parent(self, keys: list[str], depth: int) -> tuple[str, int]:
        """The deepest stored prefix among the first *depth* (key, tokens) that a new slice
        may follow, or ("", 0) (a whole state then)."""
        for key in reversed(keys[:depth]):
            node = self.runner.states.tree.get(key) if self.runner.states is not None else None
            if node is not None:
                return key, node.n_tokens
        return "", 0
