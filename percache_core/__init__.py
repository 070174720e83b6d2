"""PerCache: a predictive two-tier cache for local RAG on llama.cpp.

>>> from percache_core import PerCache, PerCacheConfig
>>> PerCacheConfig().similarity_threshold
0.85

Importing this package loads no model and touches no file.
"""

from .answering.completion import UncachedCompletion
from .callers import CallerCache
from .config import (
    BoundSettings,
    BudgetSettings,
    EngineSettings,
    IdleSettings,
    PerCacheConfig,
    RetrievalSettings,
    SharedSettings,
    TierSettings,
)
from .engines.llama_cpp.kind import open_engine
from .engines.llama_server.server import LlamaServer, ServerError, ServerLaunch
from .errors import (
    CacheClosedError,
    CacheFolderError,
    ContextOverflowError,
    EngineError,
    InvalidDocumentError,
    InvalidQuestionError,
    MissingDependencyError,
    ModelNotFoundError,
    PerCacheError,
    StorageWriteError,
    missing_dependency,
)
from .knowledge.bert import BertEmbedder
from .knowledge.embedding import Embedder, SentenceTransformerEmbedder
from .kv.engine import ChatPrompt, Decoding, Engine, EngineFeatures, Sampling
from .pipeline import AnswerStream, PerCache
from .prediction.scheduler import WarmReport
from .serving.binding import chunk_sources
from .serving.prompting import TextPrompt, chat_prompt
from .types import Answer, Chunk, QAEntry, QAHit, RetrievedChunk, combined_source

__version__ = "0.2.0"  # the distributions' version (pyproject.toml)

__all__ = [
    "Answer",
    "BertEmbedder",
    "AnswerStream",
    "CallerCache",
    "ChatPrompt",
    "CacheClosedError",
    "CacheFolderError",
    "Chunk",
    "ContextOverflowError",
    "Embedder",
    "Engine",
    "EngineError",
    "EngineFeatures",
    "InvalidDocumentError",
    "InvalidQuestionError",
    "LlamaServer",
    "MissingDependencyError",
    "ModelNotFoundError",
    "PerCache",
    "PerCacheConfig",
    "BoundSettings",
    "BudgetSettings",
    "Decoding",
    "EngineSettings",
    "IdleSettings",
    "RetrievalSettings",
    "SharedSettings",
    "TierSettings",
    "PerCacheError",
    "QAEntry",
    "QAHit",
    "RetrievedChunk",
    "Sampling",
    "SentenceTransformerEmbedder",
    "ServerError",
    "ServerLaunch",
    "StorageWriteError",
    "TextPrompt",
    "UncachedCompletion",
    "WarmReport",
    "__version__",
    "chat_prompt",
    "chunk_sources",
    "combined_source",
    "missing_dependency",
    "open_engine",
]
