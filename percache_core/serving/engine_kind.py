"""What the runtime needs of one kind of engine (:class:`EngineKind`), and where a runtime
keeps its chunk states (:class:`StatesPlace`).

Each engine PerCache runs on is a folder under :mod:`percache_core.engines` whose ``kind``
module names one ``KIND``: whether an engine object is of that kind, what it can do, how
its runner and stored states open, its start-up self-check and what the self-check found.
:class:`~percache_core.answering.runtime.ModelRuntime` asks the registry
(:func:`percache_core.engines.engine_kind`) for the kind of the engine it holds and never
names an engine itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..config import LiveConfig, PerCacheConfig
from ..kv.engine import EngineFeatures
from ..kv.state_store import StateStore
from ..kv.tiers import SharedStates, TieredStateStore
from .state_runner import StateRunner


@dataclass(frozen=True)
class StatesPlace:
    """Where a runtime keeps its chunk states: *folder* (one folder per engine fingerprint
    below it), the *shared* tier behind it (None: local only) and the free disk to leave."""

    folder: Path
    shared: SharedStates | None
    min_free_bytes: Callable[[], int]

    def open(self, fingerprint: str, *, slices: bool) -> TieredStateStore:
        """The tiered store of the states of *fingerprint*, kept as slices or whole."""
        local = StateStore(self.folder, fingerprint, min_free_bytes=self.min_free_bytes)
        return TieredStateStore(local, self.shared, slices=slices)


class EngineKind(Protocol):
    """One kind of engine, as the runtime sees it (an engine folder's ``KIND``)."""

    name: str  # in words, for errors and reports

    def accepts(self, engine: object) -> bool:
        """Whether *engine* is of this kind."""
        ...

    def features(self, engine: Any) -> EngineFeatures:
        """What PerCache can do on *engine* (read once per engine)."""
        ...

    def configured(self, engine: Any, config: PerCacheConfig) -> PerCacheConfig:
        """*config* as it runs on *engine* (a tier the engine cannot hold exactly turned
        off, with a warning); raises ``ValueError`` for a mode it cannot run."""
        ...

    def open_runner(
        self, engine: Any, place: StatesPlace, live: LiveConfig, budget: Callable[[], int]
    ) -> StateRunner:
        """The runner of *engine* over its stored states, opened in *place* (measures what
        the states' layout depends on first: once per engine)."""
        ...

    def plain_runner(self, engine: Any) -> StateRunner:
        """A runner with no chunk states and no stored answers (stock's behaviour)."""
        ...

    def waiting_runner(self, engine: Any, live: LiveConfig) -> StateRunner:
        """The runner that answers until :meth:`checks_ready`: no stored states, prompts run
        as stock runs them (so that no answer waits for a self-check)."""
        ...

    def checks_ready(self, engine: Any) -> bool:
        """Whether what the stored states depend on is measured (the runner over them may
        open without measuring anything)."""
        ...

    def self_check(
        self,
        engine: Any,
        config: PerCacheConfig,
        should_stop: Callable[[], bool] | None = None,
        may_start: Callable[[], bool] | None = None,
    ) -> None:
        """Measure, once per engine, what decides how prompts run on it (idle work: raises
        ``Preempted`` when *should_stop()* turns true; a check after the first starts only
        while *may_start()*)."""
        ...

    def self_check_report(self, engine: Any, config: PerCacheConfig) -> dict[str, Any]:
        """What :meth:`self_check` found, as far as it ran (``ran``: whether it did)."""
        ...


class FileEngineKind(EngineKind, Protocol):
    """The kind that loads a model file given by path (a cache opened without an engine)."""

    def load(self, model_path: str | Path | None, config: PerCacheConfig, *, verbose: bool = False) -> Any:
        """The engine of *model_path* (None: the bundled model) with *config*'s settings."""
        ...

    def load_identity(self, model_path: Path, config: PerCacheConfig, extra: str) -> str:
        """What loading *model_path* with *config* would load from, without loading it."""
        ...
