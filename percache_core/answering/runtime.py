"""The model runtime: the engine, its stored chunk states and the prompt runner, loaded on
first use (opening a cache loads no model).

The engine is one passed in (a loaded in-process engine shared between caches, the
``FakeEngine`` of the tests, or a llama-server), or a model file loaded at the first
question that needs it. Which kind it is, what it can do (:attr:`ModelRuntime.features`),
how its runner and states open and how it checks itself are its engine folder's
(:mod:`percache_core.engines`): this module names no engine. Its states live in a
:class:`~percache_core.kv.tiers.TieredStateStore` under ``folder/states``, one folder per
engine fingerprint, with the shared tier (when configured) behind the local one.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import LiveConfig, PerCacheConfig
from ..engines import engine_kind, file_engine_kind
from ..kv.budget import (
    BUDGET_FLOOR_BYTES,
    PREFILL_BUDGET_SHARE,
    demand_budget,
    knowledge_tokens,
    prefill_state_bytes,
    sized_state_budget,
)
from ..kv.engine import EngineFeatures, ModelEngine
from ..kv.state_store import delete_document_states
from ..kv.tiers import SharedStates, TieredStateStore
from ..kv.tree import ChunkStateTree
from ..memo import Memo
from ..serving.engine_kind import EngineKind, StatesPlace
from ..serving.prompting import TEMPLATE_VERSION, chunk_text
from ..serving.state_runner import StateRunner
from ..types import Chunk

ENGINE_MEMO = "engines"  # load identity -> engine fingerprint (see ModelRuntime.model_id)


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under *folder* (0 when it does not exist)."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total


class ModelRuntime:
    """The engine, the chunk-state tiers and the runner of one cache."""

    def __init__(
        self,
        folder: Path,
        config: PerCacheConfig | LiveConfig,
        *,
        engine: ModelEngine | None,
        model_path: Path | None,
        shared: SharedStates | None = None,
        verbose: bool = False,
    ) -> None:
        if engine is None and model_path is None:
            raise ValueError("give an engine or a model path")
        self._folder = folder
        self._live = config if isinstance(config, LiveConfig) else LiveConfig(config)
        self._engine = engine
        self._model_path = model_path
        self._shared = shared
        self._verbose = verbose
        self.owns_engine = engine is None
        self._lock = threading.Lock()
        self._states: TieredStateStore | None = None
        self._runner: StateRunner | None = None
        self._waiting: StateRunner | None = None  # answers until the self-checks are known
        self._sized_budget = BUDGET_FLOOR_BYTES  # chunk_state_budget_bytes=None: see size_state_budget
        self._knowledge_bytes = 0  # what the knowledge prefill's states take (size_state_budget)
        self._bytes_per_token: float | None = None  # of the loaded engine's state slices, once measured
        self._knowledge_token_count: tuple[tuple[int, str], int] | None = None  # knowledge key -> tokens
        self._model_id: tuple[ModelEngine, str] | None = None  # (engine, its fingerprint)
        self._recorded_id: str | None = None  # the fingerprint recorded for the engine it would load
        self._kind: tuple[ModelEngine, EngineKind] | None = None  # (engine, its kind)
        # told whenever an answer runs before the self-checks (the idle layer starts them in
        # the background: prediction.background_checks)
        self.when_checks_pending: Callable[[], None] | None = None

    @property
    def config(self) -> PerCacheConfig:
        """The configuration in force now."""
        return self._live.current

    @property
    def engine(self) -> Any:
        """The engine (see :mod:`percache_core.engines`), loaded on first use."""
        with self._lock:
            if self._engine is None:
                assert self._model_path is not None
                self._engine = file_engine_kind().load(self._model_path, self.config, verbose=self._verbose)
            return self._engine

    @property
    def kind(self) -> EngineKind:
        """The engine's kind (the model file's before it loads): loads nothing; looked up
        once per engine."""
        engine = self._engine
        if engine is None:
            return file_engine_kind()
        if self._kind is None or self._kind[0] is not engine:
            self._kind = (engine, engine_kind(engine))
        return self._kind[1]

    @property
    def features(self) -> EngineFeatures:
        """What the engine can do (an in-process engine everything; a server what its
        settings allow), read once per engine."""
        return self.kind.features(self._engine)

    def runs_on(self, engine: Any) -> bool:
        """Whether *engine* is this runtime's (loads nothing)."""
        return self._engine is engine

    @property
    def engine_loaded(self) -> bool:
        return self._engine is not None

    def model_id(self) -> str:
        """The identity of the model that answers (the engine's fingerprint), hashed once
        per engine: an engine's settings do not change once it is loaded. Before the model
        file is loaded, the fingerprint an earlier load of the same file, llama.cpp build,
        processor and settings recorded (the ``engines`` memo): a stored answer is found
        without loading the model. With no such record, the engine loads."""
        if self._engine is None:
            if self._recorded_id is None:
                recorded = Memo(ENGINE_MEMO).get(self._load_identity())
                self._recorded_id = recorded if isinstance(recorded, str) else None
            if self._recorded_id is not None:
                return self._recorded_id
        engine = self.engine
        known = self._model_id
        if known is None or known[0] is not engine:
            known = self._model_id = (engine, engine.fingerprint(TEMPLATE_VERSION))
            if self.owns_engine:
                Memo(ENGINE_MEMO).put(self._load_identity(), known[1])
        return known[1]

    def _load_identity(self) -> str:
        """What the engine this runtime loads is loaded from (read without loading it)."""
        assert self._model_path is not None
        return file_engine_kind().load_identity(self._model_path, self.config, TEMPLATE_VERSION)

    @property
    def states(self) -> TieredStateStore:
        """The stored chunk states of this engine's fingerprint (opened on first use), with
        the states the runner's writer still stores stored first."""
        self._open_states()
        assert self._states is not None
        self.flush()
        return self._states

    def flush(self) -> None:
        """Wait until the states the runner's writer still stores are stored (nothing to
        wait for before the states are opened)."""
        if self._runner is not None:
            self._runner.flush()

    @property
    def state_budget_bytes(self) -> int:
        """The chunk-state budget in force: ``chunk_state_budget_bytes``, or (None) the one
        sized from the knowledge (:meth:`size_state_budget`; 1 GiB until then) and grown
        with what requests stored (:func:`~percache_core.kv.budget.demand_budget`)."""
        configured = self.config.budgets.chunk_state_budget_bytes
        if configured:
            return configured
        request_bytes = self._states.tree.request_bytes if self._states is not None else 0
        if not request_bytes:
            return self._sized_budget
        demand = demand_budget(
            knowledge_bytes=self._knowledge_bytes, request_bytes=request_bytes, free_disk_bytes=self._free_disk()
        )
        return max(self._sized_budget, demand)

    def _free_disk(self) -> int:
        """The free disk under the states folder plus what the states take (0 unreadable)."""
        try:
            return shutil.disk_usage(self._folder / "states").free + (self._states.bytes if self._states else 0)
        except OSError:
            return 0

    def size_state_budget(self, chunks: Sequence[Chunk]) -> int:
        """Size the budget from the knowledge's *chunks* when none is configured (see
        :mod:`percache_core.kv.budget`); needs the engine loaded (it is not loaded
        for this). Called by ``preload()`` and at the start of each idle round (where the
        knowledge prefill fills the budget), never on a user's path. Returns the budget
        in force."""
        configured = self.config.budgets.chunk_state_budget_bytes is not None or not self.config.tiers.chunk_states
        if not configured and self.engine_loaded and self.checks_ready():
            self._knowledge_bytes = self.knowledge_prefill_bytes(chunks)
            self._sized_budget = sized_state_budget(needed_bytes=self._knowledge_bytes, free_disk_bytes=self._free_disk())
        return self.state_budget_bytes

    def knowledge_prefill_bytes(self, chunks: Sequence[Chunk]) -> int:
        """The bytes the bulk knowledge prefill's states of *chunks* take on the loaded
        engine (every [system, chunk] and ``knowledge_prefill_neighbours`` pairs of each)."""
        config = self.config
        return self._prefill_bytes(chunks, config.idle.knowledge_prefill_neighbours if config.idle.knowledge_prefill else 0)

    def _prefill_bytes(self, chunks: Sequence[Chunk], neighbours: int) -> int:
        """The bytes of every [system, chunk] state of *chunks* and *neighbours* pairs of
        each, at the loaded engine's bytes per token (measured once)."""
        if self._bytes_per_token is None:
            self._bytes_per_token = self.runner.bytes_per_token()
        return prefill_state_bytes(
            self._knowledge_tokens(chunks),
            bytes_per_token=self._bytes_per_token,
            neighbours=neighbours,
            slices=self.states.slices,
        )

    def _knowledge_tokens(self, chunks: Sequence[Chunk]) -> int:
        """The prompt tokens of *chunks*' segments (estimated from a sample), remembered
        per knowledge size."""
        key = (len(chunks), chunks[-1].id if chunks else "")
        if self._knowledge_token_count is None or self._knowledge_token_count[0] != key:
            self._knowledge_token_count = (key, knowledge_tokens([chunk_text(c) for c in chunks], self.engine.tokenize))
        return self._knowledge_token_count[1]

    def idle_state_bytes(self) -> int:
        """Bytes of the stored states idle work stored (0 while the states are not open:
        this never loads the engine)."""
        if self._states is None:
            return 0
        return sum(node.size for node in self._states.tree.nodes if node.idle)

    def knowledge_prefill_fits(self, chunks: Sequence[Chunk]) -> bool:
        """Whether the bulk knowledge prefill's first pass, the [system, chunk] state of
        every one of *chunks*, fits the prefill's share of the chunk-state budget: then the
        bulk prefill gives every prompt its first chunk and its pairs fill the rest; else
        idle time prefills only the paths the demand estimate names
        (:mod:`percache_core.prediction.demand`)."""
        return self._prefill_bytes(chunks, 0) <= PREFILL_BUDGET_SHARE * self.state_budget_bytes

    @property
    def tree(self) -> ChunkStateTree:
        return self.states.tree

    @property
    def runner(self) -> StateRunner:
        """Runs prompts on the engine through the stored chunk states; until the engine's
        self-checks that the states depend on are known (:meth:`self_check`, idle work),
        a runner without stored states whose prompts run as stock runs them (and
        ``when_checks_pending`` is told: the checks start in the background)."""
        if self._runner is not None:
            return self._runner
        engine = self.engine
        if not self.kind.checks_ready(engine):
            if self.when_checks_pending is not None:
                self.when_checks_pending()
            with self._lock:
                if self._waiting is None or self._waiting.engine is not engine:
                    self._waiting = self.kind.waiting_runner(engine, self._live)
                return self._waiting
        self._open_states()
        assert self._runner is not None
        return self._runner

    def reinstate_asked(self) -> int:
        """After an idle round: the last user prompt's stored prefix back in the engine (see
        :meth:`~percache_core.serving.state_runner.StateRunner.reinstate_asked`); 0 before
        the runner over the stored states is open."""
        return self._runner.reinstate_asked() if self._runner is not None else 0

    def _open_states(self) -> None:
        if self._states is not None:
            return
        engine = self.engine
        with self._lock:
            if self._states is None:
                place = StatesPlace(self._folder / "states", self._shared, self._min_free_bytes)
                runner = self.kind.open_runner(engine, place, self._live, lambda: self.state_budget_bytes)
                assert runner.states is not None
                self._runner, self._states = runner, runner.states

    def _min_free_bytes(self) -> int:
        return self.config.budgets.min_free_disk_bytes

    def forget_recorded_model(self) -> None:
        """Look the model's recorded fingerprint up again (the settings it is loaded with
        may have changed before it loaded)."""
        self._recorded_id = None

    def delete_chunk_states(self, chunk_ids: set[str]) -> int:
        """Delete the stored states that may hold these chunks' text, of every fingerprint
        (see :func:`~percache_core.kv.state_store.delete_document_states`); the count."""
        self.flush()  # a state the writer still stores is deleted too
        dropped = delete_document_states(self._folder / "states", chunk_ids)
        if self._states is not None:
            self._states.sync()
        return dropped

    def preload(self) -> None:
        """Load the engine, run the engine's self-checks and open the states now."""
        self.engine.warm_up()
        self.self_check()
        self._open_states()

    def self_check(
        self, should_stop: Callable[[], bool] | None = None, may_start: Callable[[], bool] | None = None
    ) -> None:
        """Measure, once per engine, what decides how prompts run (seconds to a minute on a
        new machine, in ``preload()`` or an idle round, never inside an answer; each check's
        cost is in :meth:`self_check_report`): the cuts that leave a prefill's logits
        unchanged (:func:`~percache_core.kv.cuts.measure_cut_rule`), which states restore
        exactly up to ``n_ctx``, the batched-logit bound of draft verification and whether
        drafts pay on this machine (:mod:`percache_core.engines.llama_cpp.drafting`); on a
        server its cut rule. Idle work: ``Preempted`` when *should_stop()* turns true (the
        checks done by then are kept); a check after the first starts only while
        *may_start()*."""
        self.kind.self_check(self.engine, self.config, should_stop, may_start)

    def checks_ready(self) -> bool:
        """Whether the engine's verdicts that the stored states depend on are known (false
        before the engine loads): until then answers keep and restore no state."""
        return self.engine_loaded and self.kind.checks_ready(self.engine)

    def self_check_report(self) -> dict[str, Any]:
        """What the engine's self-check found (see :meth:`self_check`), as far as it ran:
        the cuts a framework prompt may take without changing its output, the batched-logit
        bound of draft verification and whether drafts are used by default."""
        if not self.engine_loaded:
            return {"ran": False}
        return self.kind.self_check_report(self.engine, self.config)

    def _budget_origin(self) -> str:
        """Where the chunk-state budget in force comes from, in words."""
        if self.config.budgets.chunk_state_budget_bytes:
            return "configured"
        if self.state_budget_bytes > self._sized_budget:
            return "sized from the knowledge and grown with the states requests stored (2x their bytes)"
        if self._bytes_per_token is None:
            return "not sized yet (1 GiB until the knowledge is measured: preload() or an idle round)"
        return "sized from the knowledge"

    def stats(self) -> dict[str, Any]:
        """Nodes, bytes, budget and failures of the chunk-state tier; the stored bytes per
        prompt token they cover against the model's KV bytes per token (the duplication
        factor: 1.0 where each token's cells are stored once), restores and evictions per
        state."""
        budget = {
            "budget_bytes": self.state_budget_bytes,
            "budget": self._budget_origin(),
            "bytes_per_token": self._bytes_per_token,
        }
        if self._states is None or self._runner is None:  # what the folder holds, every model's, no model loaded
            return {"nodes": 0, "bytes": 0, "bytes_on_disk": folder_bytes(self._folder / "states"), **budget}
        self.flush()  # the states a writer still stores
        tree = self._states.tree
        nodes = tree.nodes
        covered = tree.tokens_covered()
        per_token = self._states.bytes / covered if covered else None
        return {
            "nodes": len(tree),
            "bytes": self._states.bytes,
            **budget,
            "request_bytes": tree.request_bytes,
            "prompt_tokens_stored": covered,
            "bytes_per_stored_token": per_token,
            "duplication": per_token / self._bytes_per_token if per_token and self._bytes_per_token else None,
            "restores_per_state": sum(node.hits for node in nodes) / len(nodes) if nodes else None,
            "evictions": self._states.evictions,
            "evictions_per_state": self._states.evictions / max(1, len(nodes) + self._states.evictions),
            "restore_failures": self._runner.restore_failures,
            "batched_runs": self._runner.batched_runs,
            "prefix_waits": self._runner.prefix_waits,
            "company_waits": self._runner.company_waits,
            "storage_failures": self._runner.storage_failures,
            "corrupt_dropped": self._states.local.corrupt_dropped,
        }

    def close(self) -> None:
        """Persist state counters; free the engine if this runtime loaded it."""
        if self._runner is not None:
            self._runner.close()  # the states still being stored
        if self._states is not None:
            self._states.close()
        if self.owns_engine and self._engine is not None:
            self._engine.close()
