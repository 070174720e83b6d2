"""Signed envelopes for shared entries: a JSON header, a payload and an HMAC-SHA256.

The MAC covers the Redis key and namespace as well, so a value copied to another key or
namespace, or changed in any byte, fails verification and is never used.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Any

MAGIC = b"PCS1"
_MAC_SIZE = 32


def seal(secret: bytes, key: str, header: dict[str, Any], payload: bytes) -> bytes:
    """Pack and sign one entry stored under Redis *key*.

    >>> blob = seal(b"s", "k", {"a": 1}, b"data")
    >>> open_envelope(b"s", "k", blob)
    ({'a': 1}, b'data')
    >>> open_envelope(b"s", "other-key", blob) is None, open_envelope(b"x", "k", blob) is None
    (True, True)
    """
    head = json.dumps(header, sort_keys=True).encode("utf-8")
    body = MAGIC + struct.pack("<I", len(head)) + head + payload
    return body + hmac.new(secret, key.encode("utf-8") + b"\0" + body, hashlib.sha256).digest()


def open_envelope(secret: bytes, key: str, data: bytes | None) -> tuple[dict[str, Any], bytes] | None:
    """The (header, payload) of a valid envelope for *key*, or None (tampered, unsigned,
    truncated, or signed with another secret)."""
    if not isinstance(data, bytes) or len(data) < len(MAGIC) + 4 + _MAC_SIZE or not data.startswith(MAGIC):
        return None
    body, mac = data[:-_MAC_SIZE], data[-_MAC_SIZE:]
    expected = hmac.new(secret, key.encode("utf-8") + b"\0" + body, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        return None
    (length,) = struct.unpack("<I", body[4:8])
    try:
        header = json.loads(body[8 : 8 + length])
    except ValueError:
        return None
    return header, body[8 + length :]
