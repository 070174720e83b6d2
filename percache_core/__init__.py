"""PerCache: a predictive two-tier cache for local RAG on llama.cpp.

>>> from percache_core import PerCache, PerCacheConfig
>>> PerCacheConfig().similarity_threshold
0.85

Importing this package loads no model and touches no file.
"""

from .callers import CallerPipeline
from .config import PerCacheConfig
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
)
from .knowledge.embedding import Embedder, SentenceTransformerEmbedder
from .kv.engine import ChatPrompt, Sampling
from .pipeline import AnswerStream, PerCache
from .types import Answer, Chunk, QAEntry, QAHit, RetrievedChunk

__version__ = "0.1.0"

__all__ = [
    "Answer",
    "AnswerStream",
    "CallerPipeline",
    "ChatPrompt",
    "CacheClosedError",
    "CacheFolderError",
    "Chunk",
    "ContextOverflowError",
    "Embedder",
    "EngineError",
    "InvalidDocumentError",
    "InvalidQuestionError",
    "MissingDependencyError",
    "ModelNotFoundError",
    "PerCache",
    "PerCacheConfig",
    "PerCacheError",
    "QAEntry",
    "QAHit",
    "RetrievedChunk",
    "Sampling",
    "SentenceTransformerEmbedder",
    "__version__",
]
