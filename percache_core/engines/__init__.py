"""The engines PerCache runs on, one folder each.

A folder holds its engine, its runner and everything only that engine uses, and a ``kind``
module whose ``KIND`` (an :class:`~percache_core.serving.engine_kind.EngineKind`) tells the
runtime whether an engine object is of that kind, what it can do and how its runner opens.
:data:`ENGINE_FOLDERS` is the registry: a new engine is one folder and one line there.

- ``llama_cpp``: llama.cpp in the process (llama-cpp-python), or any
  :class:`~percache_core.kv.engine.Engine`; it also loads a model file given by path;
- ``llama_server``: a llama-server, started or attached to.

Only this folder (and the package's public names) imports an engine's modules.
"""

from __future__ import annotations

from importlib import import_module
from typing import cast

from ..serving.engine_kind import EngineKind, FileEngineKind

ENGINE_FOLDERS = (  # the first whose kind accepts an engine runs it
    "llama_server",
    "llama_cpp",
)
FILE_ENGINE = "llama_cpp"  # the folder whose kind loads a model file given by path


def _kind(folder: str) -> EngineKind:
    return cast(EngineKind, import_module(f"{__name__}.{folder}.kind").KIND)


def engine_kind(engine: object) -> EngineKind:
    """The kind of *engine*: the first in :data:`ENGINE_FOLDERS` that accepts it.

    Raises:
        TypeError: no registered kind accepts it.

    >>> engine_kind(FakeEngine()).name   # doctest: +SKIP
    'an in-process engine (e.g. LlamaEngine)'
    """
    kinds = [_kind(folder) for folder in ENGINE_FOLDERS]
    for kind in kinds:
        if kind.accepts(engine):
            return kind
    names = " or ".join(kind.name for kind in kinds)
    raise TypeError(f"engine must be {names}, got {type(engine).__name__}")


def file_engine_kind() -> FileEngineKind:
    """The kind that loads a model file (a cache opened with no engine)."""
    return cast(FileEngineKind, _kind(FILE_ENGINE))
