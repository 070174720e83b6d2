"""Opening a cache folder: the parts of one cache wired once (:func:`open_parts`), and the
settings that cannot change while it is open.
"""

from __future__ import annotations

from pathlib import Path

from ..answering.parts import CacheParts
from ..answering.runtime import ModelRuntime
from ..config import LiveConfig, PerCacheConfig
from ..errors import CacheFolderError
from ..knowledge.bank import KnowledgeBank
from ..knowledge.embedding import Embedder, check_embedder, embedding_dimension
from ..kv.engine import ModelEngine
from ..qa.bank import QABank
from ..qa.calibration import Calibration
from ..qa.prompt_answers import PromptAnswers
from ..serving.activity import UserActivity
from ..serving.shapes import RequestShapes
from ..shared.redis_tier import SharedTier, open_shared_tier
from ..storage import Store, private_folder
from ..usage import UsageCounters

SETTINGS_FIXED_AT_OPEN = frozenset(
    {
        "shared_url",
        "shared_namespace",
        "shared_secret",
        "shared_write",
        "shared_timeout_s",
        "shared_sync_interval_s",
    }
)
SETTINGS_OF_THE_LOADED_MODEL = frozenset(
    {"model_path", "n_ctx", "n_batch", "n_threads", "repack_weights", "chunk_state_slices"}
)


def open_parts(
    folder: Path, config: PerCacheConfig, embedder: Embedder, engine: ModelEngine | None, model_path: Path | None,
    verbose: bool = False,
) -> tuple[CacheParts, SharedTier | None]:
    """Create (or open) the stores under *folder* and wire the cache's parts over them:
    every part reads its settings from one :class:`~percache_core.config.LiveConfig`.
    Returns the parts and the shared tier (None: local only).

    Raises:
        CacheFolderError: the folder cannot be created, or another embedder wrote it.
    """
    try:
        private_folder(folder)
    except OSError as error:
        raise CacheFolderError(f"cannot create cache folder {folder}: {error}") from error
    meta = Store(folder / "meta")
    check_embedder(meta, embedder, folder)
    qa_store = Store(folder / "qa_bank")
    live = LiveConfig(config)
    qa_budget = lambda: live.current.budgets.qa_bank_budget_bytes  # noqa: E731
    qa_bank = QABank(qa_store, dimension=embedding_dimension(embedder), budget_bytes=qa_budget)
    shared = open_shared_tier(config, qa_bank, embedder.name)
    parts = CacheParts(
        live=live,
        embedder=embedder,
        knowledge=KnowledgeBank(
            Store(folder / "knowledge"),
            embedder,
            chunk_words=lambda: live.current.retrieval.chunk_words,
            rrf_k=lambda: live.current.retrieval.rrf_k,
        ),
        qa_bank=qa_bank,
        prompt_answers=PromptAnswers(qa_store, budget_bytes=qa_budget, shared=shared),
        runtime=ModelRuntime(folder, live, engine=engine, model_path=model_path, shared=shared, verbose=verbose),
        activity=UserActivity(history_size=config.idle.history_size),
        usage=UsageCounters(),
        meta=meta,
        calibration=Calibration(meta),
        shapes=RequestShapes(meta),
    )
    return parts, shared
