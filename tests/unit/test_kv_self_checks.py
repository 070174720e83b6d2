"""The engine self-checks (state slices, prefill cuts, bytes per token) on the fake engine:
they run, pass where the fake's arithmetic says they must, and are remembered."""

from __future__ import annotations

from percache_core.engines.llama_cpp.slicing import (
    StateLayout,
    known_state_layout,
    state_bytes_per_token,
    state_layout,
    state_round_trip,
)
from percache_core.kv.cuts import CutRule, known_cut_rule, measure_cut_rule
from tests.fake_engine import FakeEngine


def test_the_self_checks_pass_on_the_fake_engine_and_are_remembered():
    engine = FakeEngine()
    assert state_round_trip(engine) == StateLayout(slices=True, reach=2048, tried=2048)  # short and long prompts
    assert known_state_layout(engine) is None
    assert state_layout(engine).slices and known_state_layout(engine) == StateLayout(True, 2048, 2048)
    assert state_layout(engine, 4096) == StateLayout(True, 4096, 4096)  # the self-check's longer reach
    assert known_cut_rule(engine) == (False, None)
    assert measure_cut_rule(engine) == CutRule(min_tokens=8, multiple=1)  # one call's logits at any cut
    assert known_cut_rule(engine) == (True, CutRule(min_tokens=8, multiple=1))
    assert 0 < state_bytes_per_token(FakeEngine()) < 100
    assert engine.n_past == 0  # each check leaves the sequence empty
