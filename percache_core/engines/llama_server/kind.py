"""The llama-server kind: a :class:`~percache_core.engines.llama_server.server.LlamaServer`
(started by PerCache or attached to by its URL), run with whole requests by
:class:`~percache_core.engines.llama_server.runner.ServerRunner`.

Its states are slot files at the state points of the server's own cut rule (measured
through it once, :func:`~percache_core.engines.llama_server.cuts.measure_server_cut_rule`):
slices, each with only the cells after its parent's and joined on restore, where the
server's files read back byte for byte (checked once), whole files otherwise;
a server that cannot hold exact states (no readable slot folder, or no rule) keeps stored
answers only. Every slot the server has is used (runs in different slots at once).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ...config import LiveConfig, PerCacheConfig
from ...kv.engine import EngineFeatures
from ...policies import state_policy
from ...serving.engine_kind import StatesPlace
from ...serving.prompting import TEMPLATE_VERSION
from .cuts import known_server_cut_rule, measure_server_cut_rule
from .runner import ServerRunner
from .server import LlamaServer
from .slot import ServerCuts, ServerSlot
from .slot_probe import FRESH, ISOLATED, slots_independent


class ServerKind:
    """A llama-server (see the module)."""

    name = "a LlamaServer"

    def accepts(self, engine: object) -> bool:
        return isinstance(engine, LlamaServer)

    def features(self, engine: LlamaServer) -> EngineFeatures:
        return engine.features

    def configured(self, engine: LlamaServer, config: PerCacheConfig) -> PerCacheConfig:
        """Without chunk states where the server cannot hold them exactly (with a warning
        that says why); composed chunk states refused."""
        if state_policy(config).approximate and not engine.features.composed_states:
            raise ValueError(
                'reuse="approximate" composes chunk states token by token: it needs the in-process '
                "engine (a LlamaEngine), not a llama-server"
            )
        _lease_slots(engine)  # (measured first: it may take the states away)
        problem = engine.chunk_state_problem if config.tiers.chunk_states else None
        if problem is not None:
            warnings.warn(
                f"no chunk states on the llama-server at {engine.url}: {problem}; stored answers still work",
                stacklevel=3,
            )
            return config.replace(chunk_states=False)
        return config

    def open_runner(
        self, engine: LlamaServer, place: StatesPlace, live: LiveConfig, budget: Callable[[], int]
    ) -> ServerRunner:
        _lease_slots(engine)
        settings = live.current.tiers
        rule = measure_server_cut_rule(engine) if engine.features.chunk_states and settings.chunk_states else None
        calls = "no-cuts" if rule is None else f"server-calls-{rule.min_tokens}-{rule.multiple}"
        slices = rule is not None and settings.chunk_state_slices and ServerSlot(engine, ServerCuts(rule)).slices_work()
        fingerprint = engine.fingerprint(f"{TEMPLATE_VERSION}|{'slices' if slices else 'whole'}|{calls}")
        states = place.open(fingerprint, slices=slices)
        return ServerRunner(engine, states, live, rule=rule, n_ubatch=engine.n_ubatch, budget=budget)

    def plain_runner(self, engine: LlamaServer) -> ServerRunner:
        _lease_slots(engine)
        return ServerRunner(engine, None, PerCacheConfig(chunk_states=False), rule=None, n_ubatch=engine.n_ubatch)  # fresh each time

    def waiting_runner(self, engine: LlamaServer, live: LiveConfig) -> ServerRunner:
        return self.plain_runner(engine)  # (never used: checks_ready)

    def checks_ready(self, engine: LlamaServer) -> bool:
        """Always: the runner's opening measures the server's cut rule (``percache serve``
        and ``preload()`` open it before the first request)."""
        return True

    def self_check(
        self,
        engine: LlamaServer,
        config: PerCacheConfig,
        should_stop: Callable[[], bool] | None = None,
        may_start: Callable[[], bool] | None = None,
    ) -> None:
        """The cuts that leave the server's output unchanged (where it holds states)."""
        if engine.features.chunk_states and config.tiers.chunk_states:
            measure_server_cut_rule(engine)

    def self_check_report(self, engine: LlamaServer, config: PerCacheConfig) -> dict[str, Any]:
        ran, rule = known_server_cut_rule(engine)
        return {
            "ran": ran,
            "engine": f"llama-server at {engine.url}",
            "features": engine.features.describe(),
            "cut_rule": None if rule is None else {"min_tokens": rule.min_tokens, "multiple": rule.multiple},
            "slots": {"server": engine.total_slots, "used": engine.leases.count},
        }


def _lease_slots(engine: LlamaServer) -> None:
    """Every slot of an attached server whose slots compute fresh requests independently
    (measured); where restored states do so once the other slots are erased, runs erase them;
    where not even then, no chunk states on it."""
    if engine.owns_process or engine.total_slots < 2 or engine.leases.count > 1:
        return
    verdict = slots_independent(engine)
    if verdict >= FRESH:
        engine.use_every_slot()
    engine.slots_shared = verdict == ISOLATED  # runs alone empty the other free slots first
    if verdict == FRESH and engine.chunk_state_problem is None:
        engine.slots_problem = (
            "a state restored in one of its slots does not give a fresh prefill's output (measured at start): start it "
            "with --no-kv-unified (-c as n_ctx times -np), and on a sliding-window model with --swa-full"
        )


KIND = ServerKind()
