"""Facts of this machine kept between processes, under PerCache's home folder
(``$PERCACHE_HOME``, default ``~/.cache/percache``): small JSON files of key -> value.

What is kept there is what a new process would otherwise measure again: a model file's
sha256 (by path, size and modification time), the fingerprint an engine setting-up gives
(so a stored answer can be found before the model loads) and the engine self-checks'
verdicts (by engine fingerprint). Every value can be measured again, so a memo that cannot
be read or written is only slower, never wrong: failures are ignored.

>>> import tempfile, os
>>> before = os.environ.get("PERCACHE_HOME")
>>> os.environ["PERCACHE_HOME"] = tempfile.mkdtemp()
>>> Memo("example").get("k") is None
True
>>> Memo("example").put("k", {"rule": [8, 4]})
>>> Memo("example").get("k")
{'rule': [8, 4]}
>>> _ = os.environ.pop("PERCACHE_HOME") if before is None else os.environ.update(PERCACHE_HOME=before)
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

_write_lock = threading.Lock()
MAX_ENTRIES = 256  # per memo file; the oldest go first


def percache_home() -> Path:
    """PerCache's own folder for assembled models and memos (``$PERCACHE_HOME``)."""
    return Path(os.environ.get("PERCACHE_HOME") or Path.home() / ".cache" / "percache")


class Memo:
    """One memo file, ``<home>/<name>.json``, read on each call (another process may have
    written it) and written whole by atomic replace."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def path(self) -> Path:
        return percache_home() / f"{self.name}.json"

    def _read(self) -> dict[str, Any]:
        try:
            value = json.loads(self.path.read_text("utf-8"))
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def get(self, key: str) -> Any:
        """The value kept under *key*, or None."""
        return self._read().get(key)

    def put(self, key: str, value: Any) -> None:
        """Keep *value* (JSON) under *key*; a failure to write is ignored."""
        with _write_lock:
            entries = self._read()
            entries.pop(key, None)
            entries[key] = value
            while len(entries) > MAX_ENTRIES:
                entries.pop(next(iter(entries)))
            path = self.path
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                temporary = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                temporary.write_text(json.dumps(entries), "utf-8")
                os.replace(temporary, path)
            except OSError:
                pass
