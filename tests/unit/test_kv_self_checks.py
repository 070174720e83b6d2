"""The engine self-checks (state slices, prefill cuts, bytes per token) on the fake engine:
they run, pass where the fake's arithmetic says they must, and are remembered."""

from __future__ import annotations

import pytest

from percache_core.engines.llama_cpp.slicing import (
    StateLayout,
    known_state_layout,
    state_bytes_per_token,
    state_layout,
    state_round_trip,
)
from percache_core.errors import Preempted
from percache_core.kv.cuts import CutRule, known_cut_rule, measure_cut_rule
from percache_core.kv.engine import check_costs
from tests.fake_engine import FakeEngine


def test_the_self_checks_pass_on_the_fake_engine_and_are_remembered():
    engine = FakeEngine()
    n_ctx = engine.n_ctx
    assert state_round_trip(engine) == StateLayout(slices=True, reach=n_ctx, tried=n_ctx)  # short and long prompts
    assert known_state_layout(engine) is None
    assert state_layout(engine, 2048) == known_state_layout(engine) == StateLayout(True, 2048, 2048)
    assert state_layout(engine) == StateLayout(True, n_ctx, n_ctx)  # a shorter verdict is extended to n_ctx
    assert known_cut_rule(engine) == (False, None)
    assert measure_cut_rule(engine) == CutRule(min_tokens=8, multiple=1)  # one call's logits at any cut
    assert known_cut_rule(engine) == (True, CutRule(min_tokens=8, multiple=1))
    costs = check_costs(engine)  # what each check cost, and when
    assert set(costs) == {"state_layout", "cut_rule"} and all(c["measured_by"] == "this process" for c in costs.values())
    assert 0 < state_bytes_per_token(FakeEngine()) < 100
    assert engine.n_past == 0  # each check leaves the sequence empty


def test_a_context_of_one_to_three_windows_is_proved_to_its_end_by_two_trips():
    engine = FakeEngine(n_ctx=1024)
    engine.n_swa = 512  # no three pieces of 1,024 tokens each pass a window of 512
    assert state_round_trip(engine) == StateLayout(slices=True, reach=1024, tried=1024)
    assert engine.n_past == 0


def test_a_waiting_user_preempts_a_self_check_and_nothing_is_kept():
    engine = FakeEngine()
    calls = iter(range(1000))
    with pytest.raises(Preempted):  # the user arrives after a few engine calls
        measure_cut_rule(engine, should_stop=lambda: next(calls) > 3)
    with pytest.raises(Preempted):
        state_layout(engine, should_stop=lambda: next(calls) > 20)
    assert known_cut_rule(engine) == (False, None) and known_state_layout(engine) is None
    assert engine.n_past == 0 and check_costs(engine) == {}
    assert measure_cut_rule(engine, should_stop=lambda: False) is not None  # measured again, whole, later
