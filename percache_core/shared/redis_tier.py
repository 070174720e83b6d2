"""The shared tier on Redis (standalone, or Redis Cluster with a ``redis+cluster://`` URL).

Layout (every key starts with ``percache:<namespace>:``, so tenants never meet):

    <fp>:state:<node key>   a signed envelope: node header + state bytes
    <fp>:catalog            a stream of the node keys added (the master catalog)
    <emb>:qa:<entry id>     a signed envelope: question, answer, chunk ids + embedding
    <emb>:qa-catalog        a stream of the QA entry ids added
    prompt:<prompt key>     a signed envelope: the answer of one whole prompt

``<fp>`` is the engine fingerprint (model file, llama.cpp build, context settings,
template), ``<emb>`` a digest of the embedder's name. Each client keeps a local Bloom
filter of the catalog, synchronised by a background thread, so it asks Redis for a state
only when the catalog says it is there; a false positive costs one wasted fetch. The same
thread pulls new QA entries, with their embeddings, into the local QA bank.

Replays. Anyone with write access to Redis but without the secret can put back an older,
validly signed envelope, and a client that opens afterwards has no memory of the newer one.
So nothing whose value can change is served as it is from this tier:

- A prompt answer's key (:func:`~percache_core.qa.prompt_answers.prompt_key`) digests the
  engine, the whole prompt and the decoding settings, and the model gives one answer to
  one prompt: every envelope ever signed under that key holds the same answer, so an older
  one is the same answer. These are served on every client without the model.
- A QA entry is keyed by its question, and its answer changes when documents or a caller's
  ``remember()`` change it. In exact mode entries taken in from here are never served as
  they are (``lookup()`` skips them): they are drafts that the client's own model verifies
  on the client's own prompt, so a replayed entry costs at most a rejected draft. In
  semantic mode (approximate, by the caller's choice) an entry is served only when the
  chunks its question retrieves on this client now are the ones, id and text digest, its
  answer came from: an older answer put back is served only where it was generated from
  the texts the client holds. Entries without sources (a caller's remembered answers) are
  never served from here. (A client that saw the newer envelope also refuses the older.)

Every call has a short timeout and goes through a circuit breaker: when Redis is down,
slow or restarting, the client works locally and says so in ``stats()``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..config import PerCacheConfig, SharedSettings
from ..errors import missing_dependency
from ..kv.tree import StateNode
from ..qa.bank import QABank
from ..types import QAEntry
from .bloom import BloomFilter
from .breaker import CircuitBreaker
from .envelope import open_envelope, seal

logger = logging.getLogger(__name__)

_STREAM_BATCH = 1000
# what a shared QA entry carries beside its question and answer: the binding (model,
# template, settings) it was produced under, its scope, its token ids (exact-mode drafts)
# and the chunks it was answered from (semantic-mode staleness checks)
_SHARED_METADATA = ("binding", "scope", "tokens", "sources")


def _shared_metadata_valid(header: dict[str, Any]) -> bool:
    """Whether a shared entry's metadata has the shapes this version writes."""
    binding, scope = header.get("binding"), header.get("scope")
    tokens, sources = header.get("tokens"), header.get("sources")
    return (
        (binding is None or isinstance(binding, str))
        and (scope is None or isinstance(scope, dict))
        and (tokens is None or (isinstance(tokens, list) and all(type(t) is int for t in tokens)))
        and (
            sources is None
            or (isinstance(sources, list) and all(isinstance(s, list) and len(s) == 2 for s in sources))
        )
    )


@dataclass
class SharedCounters:
    catalog_misses: int = 0  # the catalog said "absent": no network round trip
    fetches: int = 0
    hits: int = 0
    wasted_fetches: int = 0  # the catalog said "present" but Redis had nothing
    rejected: int = 0  # tampered, unsigned or foreign entries dropped
    writes: int = 0
    failures: int = 0
    skipped_while_open: int = 0
    qa_synced: int = 0
    replayed: int = 0  # signed entries older than one already taken in: refused
    prompt_answer_hits: int = 0  # whole prompts answered by another client
    prompt_answer_misses: int = 0


def _connect(url: str, timeout_s: float) -> Any:
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as error:
        raise missing_dependency("redis", "percache-core[redis]") from error
    options = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if "+cluster://" in url:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url.replace("+cluster://", "://"), **options)
    return redis.Redis.from_url(url, **options)


class SharedTier:
    """One client's view of the shared tier.

    Args:
        settings: the URL (``redis://host:port/db`` or ``redis+cluster://host:port``), the
            namespace (entries of other namespaces are invisible), the HMAC secret (entries
            not signed with it are dropped), whether local additions are written, the
            per-call timeout and the sync interval.
        bloom_capacity: keys the catalog's Bloom filter is sized for.
        bloom_false_positive_rate: its false-positive rate at that size.
        breaker_cooldown_s: how long failures switch the tier off.

    Raises:
        ValueError: no URL or no secret.
    """

    def __init__(
        self,
        settings: SharedSettings,
        *,
        bloom_capacity: int = 200_000,
        bloom_false_positive_rate: float = 0.01,
        breaker_cooldown_s: float = 5.0,
    ) -> None:
        if not settings.shared_url or not settings.shared_secret:
            raise ValueError("a shared tier needs a URL and a secret to sign its entries")
        self.url = settings.shared_url
        self.namespace = settings.shared_namespace
        self._secret = settings.shared_secret.encode("utf-8")
        self.write = settings.shared_write
        self._timeout_s = settings.shared_timeout_s
        self._sync_interval_s = settings.shared_sync_interval_s
        self._bloom_capacity = bloom_capacity
        self.bloom = BloomFilter(bloom_capacity, bloom_false_positive_rate)
        self.breaker = CircuitBreaker(threshold=3, cooldown_s=breaker_cooldown_s)
        self.counters = SharedCounters()
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._fingerprint: str | None = None
        self._embedder_id: str | None = None
        self._on_qa_entry: Callable[[QAEntry], bool | None] | None = None
        self._latest_written: dict[str, int] = {}  # entry id -> newest envelope time taken in
        self._stream_ids: dict[str, str] = {}
        self._own_entries: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- keys -----------------------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return ":".join(("percache", self.namespace, *parts))

    def _state_key(self, node_key: str) -> str:
        assert self._fingerprint is not None
        return self._key(self._fingerprint[:32], "state", node_key)

    def _state_catalog(self) -> str:
        assert self._fingerprint is not None
        return self._key(self._fingerprint[:32], "catalog")

    def qa_key(self, entry_id: str) -> str:
        """The Redis key of a shared QA entry (for tools that inspect the namespace)."""
        assert self._embedder_id is not None
        return self._key(self._embedder_id, "qa", entry_id)

    def qa_catalog(self) -> str:
        """The Redis stream that lists the shared QA entries' ids, newest last."""
        assert self._embedder_id is not None
        return self._key(self._embedder_id, "qa-catalog")

    # -- binding and the sync thread ------------------------------------------------------

    def bind_states(self, fingerprint: str) -> None:
        """Share chunk states of this engine fingerprint."""
        self._fingerprint = fingerprint

    def bind_qa(self, embedder_name: str, on_entry: Callable[[QAEntry], bool | None]) -> None:
        """Share QA entries of this embedder; *on_entry* receives entries of other clients."""
        self._embedder_id = hashlib.sha256(embedder_name.encode("utf-8")).hexdigest()[:16]
        self._on_qa_entry = on_entry

    def serve_qa_bank(self, qa_bank: QABank, embedder_name: str) -> None:
        """Share *qa_bank*'s answered entries, and keep the entries other clients share in
        it."""

        def receive(entry: QAEntry) -> bool:
            local = qa_bank.get(entry.id)
            written = entry.metadata["shared_written_ns"]
            if local is not None and local.metadata.get("shared_written_ns", -1) >= written:
                return False  # a replay of an entry older than the one kept here
            qa_bank.put(
                entry.question, entry.embedding, entry.answer, chunk_ids=entry.chunk_ids, metadata=entry.metadata
            )
            return True

        def share(entry: QAEntry) -> None:
            if entry.origin != "shared":
                self.put_qa(entry)

        self.bind_qa(embedder_name, receive)
        qa_bank.listener = share

    def start(self) -> SharedTier:
        """Start the catalog synchronisation thread (one sync runs at once, first)."""
        self.sync()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="percache-shared-sync", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass

    def _loop(self) -> None:
        while not self._stop.wait(self._sync_interval_s):
            try:
                self.sync()
            except Exception:  # never fatal to the thread; the next sync tries again
                self.counters.failures += 1
                logger.exception("shared-tier sync failed")

    def sync(self) -> None:
        """Read new catalog entries: node keys into the Bloom filter, QA entries into the
        local QA bank."""
        if self._fingerprint is not None:
            for fields in self._read_stream(self._state_catalog()):
                self.bloom.add(fields.get(b"k", b"").decode("utf-8", "replace"))
        if self._embedder_id is not None and self._on_qa_entry is not None:
            for fields in self._read_stream(self.qa_catalog()):
                entry_id = fields.get(b"k", b"").decode("utf-8", "replace")
                if entry_id and entry_id not in self._own_entries:
                    entry = self._fetch_qa(entry_id)
                    if entry is None:
                        continue
                    written = entry.metadata["shared_written_ns"]
                    if self._latest_written.get(entry_id, -1) >= written:
                        self.counters.replayed += 1
                        continue
                    try:
                        taken = self._on_qa_entry(entry)
                    except Exception as error:  # e.g. another embedding size, a full disk
                        self.counters.rejected += 1
                        logger.warning("shared QA entry %s refused by the local bank: %s", entry_id, error)
                        continue
                    if taken is False:
                        self.counters.replayed += 1
                        continue
                    self._latest_written[entry_id] = written
                    self.counters.qa_synced += 1

    def _read_stream(self, stream: str) -> list[dict[bytes, bytes]]:
        last = self._stream_ids.get(stream, "0-0")
        found: list[dict[bytes, bytes]] = []
        while True:
            reply = self._call(lambda client, last=last: client.xread({stream: last}, count=_STREAM_BATCH))
            if not reply:
                break
            _, messages = reply[0]
            for message_id, fields in messages:
                last = message_id.decode() if isinstance(message_id, bytes) else message_id
                found.append(fields)
            if len(messages) < _STREAM_BATCH:
                break
        self._stream_ids[stream] = last
        return found

    # -- calls through the breaker --------------------------------------------------------

    def _call(self, operation: Callable[[Any], Any]) -> Any:
        if not self.breaker.allow():
            self.counters.skipped_while_open += 1
            return None
        try:
            with self._client_lock:
                if self._client is None:
                    self._client = _connect(self.url, self._timeout_s)
                client = self._client
            result = operation(client)
        except Exception as error:  # any Redis or network failure: local-only for now
            self.counters.failures += 1
            self.breaker.failure()
            logger.debug("shared tier call failed: %s", error)
            if self.breaker.state == "open":
                with self._client_lock:
                    self._client = None  # reconnect (maybe to a restarted server) later
            return None
        self.breaker.success()
        return result

    @property
    def available(self) -> bool:
        return self.breaker.allow()

    # -- chunk states ---------------------------------------------------------------------

    def might_have_state(self, node_key: str) -> bool:
        """The catalog's answer: False means certainly absent (no network call made)."""
        present = node_key in self.bloom
        if not present:
            self.counters.catalog_misses += 1
        return present

    def fetch_state(self, node_key: str, fingerprint: str) -> tuple[StateNode, bytes] | None:
        """The verified node and state bytes for *node_key*, or None."""
        self.counters.fetches += 1
        key = self._state_key(node_key)
        data = self._call(lambda client: client.get(key))
        if data is None:
            self.counters.wasted_fetches += 1
            return None
        opened = open_envelope(self._secret, key, data)
        if opened is None:
            self.counters.rejected += 1
            logger.warning("shared chunk state %s failed verification: dropped", node_key)
            return None
        header, payload = opened
        if (
            header.get("fingerprint") != fingerprint
            or header.get("key") != node_key
            or len(payload) != header.get("size")
        ):
            self.counters.rejected += 1
            return None
        self.counters.hits += 1
        node = StateNode(
            node_key, header["parent_key"], header["depth"], header["n_tokens"], header["label"], len(payload)
        )
        return node, payload

    def put_state(self, node: StateNode, data: bytes) -> None:
        """Write a node's state and announce it in the catalog."""
        if not self.write or self._fingerprint is None:
            return
        key = self._state_key(node.key)
        header = {
            "key": node.key,
            "parent_key": node.parent_key,
            "depth": node.depth,
            "n_tokens": node.n_tokens,
            "label": node.label,
            "size": len(data),
            "fingerprint": self._fingerprint,
        }
        envelope = seal(self._secret, key, header, data)
        if self._publish(key, envelope, self._state_catalog(), node.key):
            self.bloom.add(node.key)

    def _publish(self, key: str, envelope: bytes, catalog: str, item: str) -> bool:
        """Write *envelope* under *key* and announce *item* in the *catalog* stream."""
        if self._call(lambda client: client.set(key, envelope)) is None:
            return False
        self._call(
            lambda client: client.xadd(catalog, {"k": item}, maxlen=self._bloom_capacity, approximate=True)
        )
        self.counters.writes += 1
        return True

    # -- prompt answers -------------------------------------------------------------------

    def fetch_prompt_answer(self, prompt_key: str) -> dict[str, Any] | None:
        """The answer another client stored for the prompt with *prompt_key* (verified), or
        None. One round trip; nothing when Redis is away."""
        key = self._key("prompt", prompt_key)
        data = self._call(lambda client: client.get(key))
        if data is None:
            self.counters.prompt_answer_misses += 1
            return None
        opened = open_envelope(self._secret, key, data)
        if opened is None or opened[0].get("key") != prompt_key:
            self.counters.rejected += 1
            logger.warning("shared prompt answer %s failed verification: dropped", prompt_key[:16])
            return None
        self.counters.prompt_answer_hits += 1
        return opened[0]

    def put_prompt_answer(self, prompt_key: str, value: dict[str, Any]) -> None:
        """Share the answer of the prompt with *prompt_key*."""
        if not self.write:
            return
        key = self._key("prompt", prompt_key)
        envelope = seal(self._secret, key, {**value, "key": prompt_key}, b"")
        if self._call(lambda client: client.set(key, envelope)) is not None:
            self.counters.writes += 1

    # -- QA entries -----------------------------------------------------------------------

    def put_qa(self, entry: QAEntry) -> None:
        """Share an answered entry (pending and stale ones are not shared)."""
        if not self.write or self._embedder_id is None or not entry.servable:
            return
        key = self.qa_key(entry.id)
        header = {
            "id": entry.id,
            "question": entry.question,
            "answer": entry.answer,
            "chunk_ids": list(entry.chunk_ids),
            "written_ns": time.time_ns(),
            **{name: entry.metadata.get(name) for name in _SHARED_METADATA},
        }
        envelope = seal(self._secret, key, header, np.asarray(entry.embedding, dtype=np.float32).tobytes())
        self._own_entries.add(entry.id)
        self._publish(key, envelope, self.qa_catalog(), entry.id)

    def _fetch_qa(self, entry_id: str) -> QAEntry | None:
        key = self.qa_key(entry_id)
        opened = open_envelope(self._secret, key, self._call(lambda client: client.get(key)))
        if opened is None:
            self.counters.rejected += 1
            return None
        header, payload = opened
        if header.get("id") != entry_id or not isinstance(header.get("answer"), str):
            self.counters.rejected += 1
            return None
        written = header.get("written_ns")
        if not _shared_metadata_valid(header) or len(payload) % 4 or type(written) is not int:
            self.counters.rejected += 1
            return None
        metadata: dict[str, Any] = {"origin": "shared", "shared_id": entry_id, "shared_written_ns": written}
        metadata.update({name: header[name] for name in _SHARED_METADATA if header.get(name)})
        return QAEntry(
            id=entry_id,
            question=header["question"],
            embedding=np.frombuffer(payload, dtype=np.float32).copy(),
            answer=header["answer"],
            chunk_ids=tuple(header.get("chunk_ids") or ()),
            metadata=metadata,
            created_at=time.time(),
        )

    def stats(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "namespace": self.namespace,
            "breaker": self.breaker.state,
            "breaker_trips": self.breaker.trips,
            "catalog_keys": self.bloom.count,
            "catalog_false_positive_rate_configured": self.bloom.false_positive_rate,
            "catalog_false_positive_rate_expected": self.bloom.expected_false_positive_rate(),
            **asdict(self.counters),
        }


def open_shared_tier(config: PerCacheConfig, qa_bank: QABank, embedder_name: str) -> SharedTier | None:
    """The Redis tier behind the local ones, when ``shared_url`` is set."""
    if config.shared.shared_url is None:
        return None
    shared = SharedTier(config.shared)
    shared.serve_qa_bank(qa_bank, embedder_name)
    return shared.start()
