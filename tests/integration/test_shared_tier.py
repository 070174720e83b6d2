"""The shared tier on real redis-server processes: standalone and a 3-node cluster."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from percache_core import PerCache, PerCacheConfig
from percache_core.inspection import internals

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed (make test installs it)"
)

from tests.local_redis import RedisServer, start_cluster  # noqa: E402

SECRET = "test-secret-of-twenty-chars"
QUESTION = "When is the presentation rehearsal for the launch talk?"
PARAPHRASE = "When is the rehearsal for the launch presentation?"


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    servers = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield servers
    for server in servers:
        server.stop()


def shared(url: str, namespace: str = "team", **changes) -> dict:
    return dict(
        shared_url=url,
        shared_secret=SECRET,
        shared_namespace=namespace,
        shared_sync_interval_s=0.1,
        **changes,
    )


def wait_until(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def populate_in_another_process(url: str, folder) -> None:
    script = textwrap.dedent(f"""
        from percache_core import PerCache, PerCacheConfig
        from percache_core.demo import demo_corpus
        config = PerCacheConfig(max_new_tokens=24, shared_url={url!r}, shared_secret={SECRET!r}, shared_namespace="team")
        with PerCache.open({str(folder)!r}, config=config) as pc:
            pc.add_documents(demo_corpus()["documents"])
            pc.answer({QUESTION!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_process_b_reuses_what_process_a_populated(kind, request, make_cache, tmp_path):
    url = (
        request.getfixturevalue("standalone").url
        if kind == "standalone"
        else f"redis+cluster://127.0.0.1:{request.getfixturevalue('cluster')[0].port}"
    )
    reference = make_cache("reference", qa_bank=False, chunk_states=False).answer(QUESTION).text
    populate_in_another_process(url, tmp_path / "a")  # process A: its own cache folder and model

    qa_client = make_cache("b-qa", **shared(url))
    wait_until(lambda: len(internals(qa_client).qa_bank) >= 1)
    repeat = qa_client.answer(QUESTION)  # exact mode: A's answer is a draft the model confirms
    assert repeat.answered_before and repeat.matched_question == QUESTION
    assert repeat.text == reference and not repeat.approximate

    semantic_client = make_cache("b-semantic", qa_mode="semantic", max_error_rate=1.0, **shared(url))
    wait_until(lambda: len(internals(semantic_client).qa_bank) >= 1)
    hit = semantic_client.answer(PARAPHRASE)
    assert hit.source == "qa_bank" and hit.matched_question == QUESTION and hit.approximate

    states_client = make_cache("b-states", qa_bank=False, **shared(url))
    states_client.preload()  # binds the engine fingerprint, so the state catalog syncs
    wait_until(lambda: internals(states_client).shared.bloom.count >= 4)
    answer = states_client.answer(QUESTION)
    assert answer.source == "chunk_states" and answer.reused_chunks == len(answer.chunk_ids)
    assert answer.text == reference
    # states are slices: the deepest prefix is fetched with its ancestors (system + each chunk)
    assert internals(states_client).states.slices
    assert states_client.stats()["shared"]["hits"] == len(answer.chunk_ids) + 1


def test_namespaces_and_fingerprints_never_meet(standalone, make_cache, model_path, embedder):
    writer = make_cache("alice", **shared(standalone.url, "alice"))
    writer.answer(QUESTION)
    reader = make_cache("bob", qa_bank=True, **shared(standalone.url, "bob"))
    reader.preload()
    time.sleep(0.5)
    assert len(internals(reader).qa_bank) == 0
    answer = reader.answer(QUESTION)
    assert answer.source == "full" and answer.reused_tokens == 0

    from percache_core.engines.llama_cpp.engine import LlamaEngine

    other = LlamaEngine(model_path, n_batch=256)  # another configuration: another fingerprint
    try:
        config = PerCacheConfig(max_new_tokens=24, qa_bank=False, **shared(standalone.url, "alice"))
        with PerCache.open(
            writer.folder.parent / "alice-256", config=config, engine=other, embedder=embedder
        ) as foreign:
            foreign.add_documents(
                [{"id": c.doc_id, "text": c.text} for c in internals(writer).knowledge.chunks], split=False
            )
            result = foreign.answer(QUESTION)
            assert result.reused_tokens == 0 and foreign.stats()["shared"]["hits"] == 0
    finally:
        other.close()


def test_tampered_or_unsigned_entries_are_never_served(standalone, make_cache):
    import redis

    writer = make_cache("w", **shared(standalone.url, "tamper"))
    original = writer.answer(QUESTION)
    client = redis.Redis.from_url(standalone.url)
    keys = client.keys("percache:tamper:*")
    for key in keys:
        if b":qa:" in key:
            value = client.get(key)
            client.set(key, value.replace(original.text.encode(), b"Never, it was cancelled."))
        elif b":prompt:" in key:
            client.set(key, client.get(key).replace(original.text.encode(), b"Never, it was cancelled."))
        elif b":state:" in key:
            value = bytearray(client.get(key))
            value[len(value) // 2] ^= 0xFF
            client.set(key, bytes(value))
    reader = make_cache("r", **shared(standalone.url, "tamper"))
    time.sleep(0.5)
    assert all("cancelled" not in (e.answer or "") for e in internals(reader).qa_bank.entries)
    answer = reader.answer(QUESTION)
    assert answer.source == "full" and answer.text == original.text
    assert reader.stats()["shared"]["rejected"] >= 1


def test_a_signed_entry_of_another_embedding_size_is_refused_and_sync_goes_on(standalone, make_cache):
    import numpy as np

    from percache_core.types import QAEntry

    writer = make_cache("w", **shared(standalone.url, "sizes"))
    odd = QAEntry("odd", "An odd question?", np.full(8, 8**-0.5, dtype=np.float32), "odd answer")
    internals(writer).shared.put_qa(odd)  # signed with the namespace's secret, but 8 values, not 384
    reader = make_cache("r", **shared(standalone.url, "sizes"))  # its first sync meets it
    writer.answer(QUESTION)  # a genuine entry after the odd one
    wait_until(lambda: len(internals(reader).qa_bank) >= 1)
    assert reader.stats()["shared"]["rejected"] >= 1
    assert [e.question for e in internals(reader).qa_bank.entries] == [QUESTION]


def test_a_replayed_older_envelope_is_refused(standalone, make_cache):
    import redis

    writer = make_cache("w", **shared(standalone.url, "replay"))
    first = writer.caller.remember(QUESTION, "Monday at 9 am.")
    client = redis.Redis.from_url(standalone.url)
    key = internals(writer).shared.qa_key(first.id)
    old_envelope = client.get(key)
    reader = make_cache("r", **shared(standalone.url, "replay"))
    time.sleep(0.01)
    writer.caller.remember(QUESTION, "Tuesday at 10 am.")  # a newer signed envelope
    wait_until(lambda: any(e.answer == "Tuesday at 10 am." for e in internals(reader).qa_bank.entries))
    client.set(key, old_envelope)  # a peer replays the old, validly signed envelope
    client.xadd(internals(writer).shared.qa_catalog(), {"k": first.id})
    wait_until(lambda: reader.stats()["shared"]["replayed"] >= 1)
    assert [e.answer for e in internals(reader).qa_bank.entries] == ["Tuesday at 10 am."]


def test_a_fresh_client_never_serves_a_replayed_envelope(standalone, make_cache):
    import redis

    writer = make_cache("w", **shared(standalone.url, "replay-fresh"))
    question = "What is the door code?"
    first = writer.caller.remember(question, "The door code is 1111 (v1).")
    key = internals(writer).shared.qa_key(first.id)
    client = redis.Redis.from_url(standalone.url)
    old_envelope = client.get(key)
    writer.caller.remember(question, "The door code is 2222 (v2).")
    assert client.get(key) != old_envelope
    client.set(key, old_envelope)  # put back with plain Redis commands, before anyone reads v2
    client.xadd(internals(writer).shared.qa_catalog(), {"k": first.id})
    for mode in ("exact", "semantic"):
        reader = make_cache(f"fresh-{mode}", qa_mode=mode, **shared(standalone.url, "replay-fresh"))
        wait_until(lambda reader=reader: len(internals(reader).qa_bank) >= 1)
        hit = reader.caller.lookup(question)
        assert hit is None or "1111" not in hit.text
        answer = reader.answer(question)
        assert "1111" not in answer.text and answer.source != "remembered"
        if mode == "exact":
            assert hit is None  # nothing from the shared tier is served as it is
            assert answer.text == reader.answer(question).text  # the model's, then its prompt answer
        # (the exact reader's own answer, from the demo documents, is shared: the semantic
        # reader may serve it, as it was generated from the texts the reader holds)


def _refuse(*args, **kwargs):
    raise AssertionError("the model ran for a prompt another client answered")


def test_prompt_answers_are_shared_and_any_signed_one_is_the_models(standalone, make_cache, engine, monkeypatch):
    import redis

    writer = make_cache("w", **shared(standalone.url, "prompts"))
    reference = writer.answer(QUESTION)
    client = redis.Redis.from_url(standalone.url)
    keys = client.keys("percache:prompts:prompt:*")
    assert len(keys) == 1
    reader = make_cache("r", **shared(standalone.url, "prompts"))
    reader.preload()
    for name in ("eval", "eval_with_logits", "load_state", "generate"):
        monkeypatch.setattr(engine, name, _refuse)
    answer = reader.answer(QUESTION)  # the same prompt on another client: no model
    monkeypatch.undo()
    assert (answer.text, answer.source, answer.prefilled_tokens) == (reference.text, "prompt_answer", 0)
    assert reader.stats()["shared"]["prompt_answer_hits"] == 1
    value = client.get(keys[0])
    client.set(keys[0], value.replace(reference.text.encode(), b"Never, it was cancelled."))
    other = make_cache("r2", **shared(standalone.url, "prompts"))
    tampered = other.answer(QUESTION)
    assert tampered.text == reference.text and tampered.prefilled_tokens > 0  # the model ran
    assert other.stats()["shared"]["rejected"] >= 1


def test_short_secrets_are_refused():
    with pytest.raises(ValueError, match="at least 16 characters"):
        PerCacheConfig(shared_url="redis://localhost:6379/0", shared_secret="x")


def test_redis_dying_never_fails_an_answer_and_sharing_resumes(tmp_path, make_cache):
    server = RedisServer(tmp_path / "dying").start()
    try:
        pc = make_cache("dies", **shared(server.url, "faults", shared_timeout_s=0.05))
        expected = pc.answer(QUESTION).text
        internals(pc).shared.breaker.cooldown_s = 0.3
        server.stop()
        for question in (
            QUESTION,
            "Which room is the launch talk rehearsal in?",
            "When is my dentist appointment?",
        ):
            assert pc.answer(question, similarity_threshold=1.0).text
        assert pc.answer(QUESTION).text == expected
        stats = pc.stats()["shared"]
        assert stats["failures"] >= 1 and stats["breaker_trips"] >= 1
        server.start()
        time.sleep(0.4)
        writes = pc.stats()["shared"]["writes"]
        wait_until(
            lambda: (
                pc.answer("What is my flight booking reference?", similarity_threshold=1.0)
                and pc.stats()["shared"]["writes"] > writes
            )
        )
        other = make_cache("after-restart", **shared(server.url, "faults"))
        wait_until(
            lambda: any(e.question == "What is my flight booking reference?" for e in internals(other).qa_bank.entries)
        )
    finally:
        server.stop()
