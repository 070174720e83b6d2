"""The in-process kind: llama.cpp through llama-cpp-python (:class:`LlamaEngine`), or any
other :class:`~percache_core.kv.engine.Engine` (the tests' ``FakeEngine``), run token by
token by :class:`~percache_core.engines.llama_cpp.runner.PromptRunner`.

Its states are kept at the state points of the engine's cut rule (measured once, see
:func:`~percache_core.kv.cuts.measure_cut_rule`), as slices where the engine passes a
round trip at opening (:mod:`percache_core.engines.llama_cpp.slicing`) and whole otherwise,
and only as deep as that round trip proved exact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...config import LiveConfig, PerCacheConfig
from ...kv.cuts import known_cut_rule, measure_cut_rule
from ...kv.engine import TOKEN_LEVEL, Engine, EngineFeatures
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
        # calls), or at segment ends without a rule: the two are never mixed
        rule = measure_cut_rule(engine)
        slices = state_layout(engine).slices and live.current.tiers.chunk_state_slices
        calls = "segment-calls" if rule is None else f"stock-calls-{rule.min_tokens}-{rule.multiple}"
        fingerprint = engine.fingerprint(f"{TEMPLATE_VERSION}|{'slices' if slices else 'whole'}|{calls}")
        return PromptRunner(engine, place.open(fingerprint, slices=slices), live, budget=budget)

    def plain_runner(self, engine: Engine) -> PromptRunner:
        return PromptRunner(engine, None, PerCacheConfig(chunk_states=False))

    def self_check(self, engine: Engine, config: PerCacheConfig) -> None:
        """The cuts that leave a prefill's logits unchanged, which states restore exactly up
        to ``n_ctx`` (the round trip at opening proved a shorter reach where ``n_ctx`` is
        longer), the batched-logit bound of draft verification and whether drafts pay on
        this machine."""
        measure_cut_rule(engine)
        state_layout(engine, engine.n_ctx)
        with engine.lock:
            deviation_bound(engine)
            drafts_pay(engine)

    def self_check_report(self, engine: Engine, config: PerCacheConfig) -> dict[str, Any]:
        ran, rule = known_cut_rule(engine)
        layout = known_state_layout(engine)
        return {
            "ran": ran,
            "cut_rule": None if rule is None else {"min_tokens": rule.min_tokens, "multiple": rule.multiple},
            "state_layout": None if layout is None else {"slices": layout.slices, "reach_tokens": layout.reach},
            "draft_bound_logits": known_bound(engine),
            "drafts_pay": known_drafts_pay(engine),
            "repack_weights": config.engine.repack_weights,
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


KIND = InProcessKind()
