"""The in-process kind: llama.cpp through llama-cpp-python (:class:`LlamaEngine`), or any
other :class:`~percache_core.kv.engine.Engine` (the tests' ``FakeEngine``), run token by
token by :class:`~percache_core.engines.llama_cpp.runner.PromptRunner`.

Its states are kept at the state points of the engine's cut rule (measured once, see
:func:`~percache_core.kv.cuts.measure_cut_rule`), as slices where the engine passes a
round trip at opening (:mod:`percache_core.engines.llama_cpp.slicing`) and whole otherwise,
and only as deep as that round trip proved exact.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...config import LiveConfig, PerCacheConfig
from ...errors import Preempted
from ...kv.cuts import known_cut_rule, measure_cut_rule
from ...kv.engine import TOKEN_LEVEL, Engine, EngineFeatures, check_costs
from ...models import resolve_model_path
from ...serving.engine_kind import StatesPlace
from ...serving.prompting import TEMPLATE_VERSION
from .drafting import deviation_bound, drafts_pay, known_bound, known_drafts_pay
from .engine import LlamaEngine, load_identity
from .runner import PromptRunner
from .slicing import known_state_layout, state_layout


def open_engine(model_path: str | Path | None, config: PerCacheConfig, *, verbose: bool = False) -> LlamaEngine:
    """Load a llama.cpp engine for *model_path* (None: the bundled model) with *config*'s
    context, batch, threads and weight repacking: the one way every part of PerCache and
    the adapters load a GGUF.

    >>> engine = open_engine(None, PerCacheConfig(n_ctx=2048))   # doctest: +SKIP
    """
    return LlamaEngine(
        resolve_model_path(None if model_path is None else str(model_path)),
        n_ctx=config.engine.n_ctx,
        n_batch=config.engine.n_batch,
        n_threads=config.engine.n_threads,
        repack_weights=config.engine.repack_weights,
        verbose=verbose,
    )


class InProcessKind:
    """An :class:`~percache_core.kv.engine.Engine` in this process (see the module)."""

    name = "an in-process engine (e.g. LlamaEngine)"

    def accepts(self, engine: object) -> bool:
        return isinstance(engine, Engine)

    def features(self, engine: Any) -> EngineFeatures:
        return TOKEN_LEVEL

    def configured(self, engine: Any, config: PerCacheConfig) -> PerCacheConfig:
        return config

    def open_runner(
        self, engine: Engine, place: StatesPlace, live: LiveConfig, budget: Callable[[], int]
    ) -> PromptRunner:
        # PerCache's own prompt takes its states at the cut rule's state points (in stock's
        # calls), or at segment ends without a rule: the two are never mixed. The runtime
        # opens this runner once the checks are known (checks_ready); measured here otherwise
        rule = measure_cut_rule(engine)
        layout = known_state_layout(engine) or state_layout(engine)
        slices = layout.slices and live.current.tiers.chunk_state_slices
        calls = "segment-calls" if rule is None else f"stock-calls-{rule.min_tokens}-{rule.multiple}"
        fingerprint = engine.fingerprint(f"{TEMPLATE_VERSION}|{'slices' if slices else 'whole'}|{calls}")
        return PromptRunner(engine, place.open(fingerprint, slices=slices), live, budget=budget)

    def plain_runner(self, engine: Engine) -> PromptRunner:
        return PromptRunner(engine, None, PerCacheConfig(chunk_states=False))

    def waiting_runner(self, engine: Engine, live: LiveConfig) -> PromptRunner:
        """Answers before :meth:`checks_ready`: *live*'s settings, no stored states, every
        prompt in one call (stock's), so that no answer waits for a self-check."""
        return PromptRunner(engine, None, live)

    def checks_ready(self, engine: Engine) -> bool:
        """Whether the verdicts the stored states depend on are known (the cut rule and the
        state layout, measured in this process or read from disk)."""
        return known_cut_rule(engine)[0] and known_state_layout(engine) is not None

    def self_check(
        self,
        engine: Engine,
        config: PerCacheConfig,
        should_stop: Callable[[], bool] | None = None,
        may_start: Callable[[], bool] | None = None,
    ) -> None:
        """The checks of :func:`self_checks` not yet known, in that order: the cuts that
        leave a prefill's logits unchanged, which states restore exactly up to ``n_ctx``
        (one round trip: a verdict for a shorter context is extended), the batched-logit
        bound of draft verification and whether drafts pay on this machine. Idle work: when
        *should_stop()* turns true (a user's question waits) it raises
        :class:`~percache_core.errors.Preempted` between two engine calls; the checks done
        by then are kept. A check after the first starts only while *may_start()* (an idle
        round's time left): a check begun is finished, as a half-done one is worth nothing."""
        checks = self_checks(engine, should_stop)
        with _checking(engine):  # one caller at a time (an idle round, the background checks)
            for index, name in enumerate(self.pending_checks(engine)):
                if should_stop is not None and should_stop():
                    raise Preempted("self-checks pre-empted by a user question")
                if index and may_start is not None and not may_start():
                    return
                checks[name][1]()

    def pending_checks(self, engine: Engine) -> list[str]:
        """The names of :func:`self_checks` whose verdict for *engine* is not known yet (a
        state layout proved for a shorter context than ``n_ctx`` counts as not known)."""
        return [name for name, (known, _) in self_checks(engine).items() if not known()]

    def self_check_report(self, engine: Engine, config: PerCacheConfig) -> dict[str, Any]:
        ran, rule = known_cut_rule(engine)
        layout = known_state_layout(engine)
        return {
            "ran": ran,
            "cut_rule": None if rule is None else {"min_tokens": rule.min_tokens, "multiple": rule.multiple},
            "state_layout": None if layout is None else {"slices": layout.slices, "reach_tokens": layout.reach},
            "n_ctx": engine.n_ctx,
            "draft_bound_logits": known_bound(engine),
            "drafts_pay": known_drafts_pay(engine),
            "repack_weights": config.engine.repack_weights,
            "checks": check_costs(engine),
            "pending": self.pending_checks(engine),
        }

    def load(self, model_path: str | Path | None, config: PerCacheConfig, *, verbose: bool = False) -> LlamaEngine:
        return open_engine(model_path, config, verbose=verbose)

    def load_identity(self, model_path: Path, config: PerCacheConfig, extra: str) -> str:
        return load_identity(
            model_path,
            n_ctx=config.engine.n_ctx,
            n_batch=config.engine.n_batch,
            n_threads=config.engine.n_threads,
            repack_weights=config.engine.repack_weights,
            extra=extra,
        )


_check_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_check_locks_guard = threading.Lock()


def _checking(engine: Engine) -> threading.Lock:
    """The lock that one caller of an engine's self-checks holds at a time."""
    with _check_locks_guard:
        lock = _check_locks.get(engine)
        if lock is None:
            lock = _check_locks[engine] = threading.Lock()
        return lock


def self_checks(
    engine: Engine, should_stop: Callable[[], bool] | None = None
) -> dict[str, tuple[Callable[[], bool], Callable[[], object]]]:
    """The self-checks of an in-process engine in the order they run, by name: whether its
    verdict for *engine* is known, and measuring it (*should_stop*: see
    :meth:`InProcessKind.self_check`). The first two decide which states are kept (until
    both are known, answers keep none); the last two, drafts."""

    def layout_proved() -> bool:
        layout = known_state_layout(engine)
        return layout is not None and layout.tried >= engine.n_ctx

    def locked(measure: Callable[[Engine], object]) -> Callable[[], object]:
        def run() -> object:
            with engine.lock:
                return measure(engine)

        return run

    return {
        "cut_rule": (lambda: known_cut_rule(engine)[0], lambda: measure_cut_rule(engine, should_stop)),
        "state_layout": (layout_proved, lambda: state_layout(engine, engine.n_ctx, should_stop)),
        "draft_bound": (lambda: known_bound(engine) is not None, locked(deviation_bound)),
        "drafts_pay": (lambda: known_drafts_pay(engine) is not None, locked(drafts_pay)),
    }


KIND = InProcessKind()
