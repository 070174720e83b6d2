"""The one exception hierarchy of PerCache.

Every error PerCache raises on purpose is a :class:`PerCacheError`. Errors that are
also plain misuse of an argument derive from :class:`ValueError` as well, so callers
that already catch ``ValueError`` keep working.

>>> issubclass(InvalidQuestionError, ValueError) and issubclass(InvalidQuestionError, PerCacheError)
True
"""

from __future__ import annotations


class PerCacheError(Exception):
    """Base class of every error raised by PerCache."""


class InvalidQuestionError(PerCacheError, ValueError):
    """The question is empty, whitespace only, or otherwise unusable."""


class InvalidDocumentError(PerCacheError, ValueError):
    """A document given to ``add_documents`` has no usable text or a bad shape."""


class ContextOverflowError(PerCacheError, ValueError):
    """The prompt cannot fit the model's context, even with no retrieved chunk."""


class ModelNotFoundError(PerCacheError, FileNotFoundError):
    """The GGUF model file (or the embedder) cannot be found or loaded."""


class MissingDependencyError(PerCacheError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class CacheFolderError(PerCacheError, OSError):
    """The cache folder cannot be created, read or written."""


class StorageWriteError(PerCacheError, OSError):
    """A write to the cache folder failed (disk full, read-only, locked too long); nothing
    was half-written. After decoding, PerCache logs and counts it and still answers."""


class CacheClosedError(PerCacheError, RuntimeError):
    """The cache was used after ``close()``."""


class EngineError(PerCacheError, RuntimeError):
    """llama.cpp failed while evaluating or sampling tokens."""


def missing_dependency(package: str, install: str) -> MissingDependencyError:
    """Build the error raised when an optional *package* is absent; *install* is what to
    pip-install (a distribution of this project with its extra).

    >>> str(missing_dependency("llama_cpp", "percache-core[llama-cpp]"))
    'llama_cpp is not installed: pip install "percache-core[llama-cpp]"'
    """
    return MissingDependencyError(f'{package} is not installed: pip install "{install}"')


class Preempted(PerCacheError):
    """Idle work (an idle round, an engine self-check) stopped because a user's question is
    waiting."""
