"""PerCache on llama.cpp's llama-server (built by ``make llama-server``): the answers are the
server's own text for the same prompt with nothing reused, on every entry point, with chunk
states restored from slot files, across a restart of server and cache, and when the server
reuses other than planned."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from percache_core import Decoding, LlamaServer, PerCache, PerCacheConfig, ServerLaunch, TextPrompt
from percache_core.engines.llama_server.runner import ServerRunner
from percache_core.engines.llama_server.slot import ServerCuts, ServerSlot, SlotContent
from percache_core.errors import Preempted
from percache_core.inspection import internals
from percache_core.kv.cuts import CutRule
from percache_core.serving.prompting import PromptLayout, Segment
from percache_core.serving.state_runner import IDLE_PIECE_TOKENS, RunOptions
from percache_core.serving.streaming import drain
from tests.suite_settings import SHORT_IDLE

pytestmark = pytest.mark.model

QUESTIONS = [
    "When is the presentation rehearsal for the launch talk?",
    "Which room is the launch talk rehearsal in, and what should I bring?",
    "How much budget did finance approve for the Harbor design work?",
    "How much of the Harbor design budget is reserved for user testing?",
    "Who is bringing the projector to the rehearsal?",
]


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[LlamaServer]:
    with LlamaServer.start(model_path, ServerLaunch(n_ctx=2048)) as started:
        yield started


def fresh_text(server: LlamaServer, tokens: Sequence[int], *, max_new_tokens: int, stop: Sequence[str]) -> str:
    """The server's text for *tokens* with nothing reused."""
    return "".join(server.complete(tokens, Decoding(max_new_tokens, stop=list(stop)), cache_prompt=False))


def open_on(folder: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any], **settings: Any) -> PerCache:
    settings.setdefault("max_new_tokens", 24)
    settings.setdefault("prediction", False)
    pc = PerCache.open(folder, config=PerCacheConfig(**settings), engine=server, embedder=embedder)
    if not len(internals(pc).knowledge):
        pc.add_documents(corpus["documents"])
    return pc


def own_prompt_reference(pc: PerCache, server: LlamaServer, question: str, chunk_ids: Sequence[str]) -> str:
    runner = internals(pc).runtime.runner
    chunks = [pc.caller.chunk(chunk_id) for chunk_id in chunk_ids]
    layout = runner.lay_out(question, chunks, max_new_tokens=pc.config.engine.max_new_tokens)
    return fresh_text(server, layout.tokens, max_new_tokens=pc.config.engine.max_new_tokens, stop=pc.config.engine.stop).strip()


def test_answers_are_the_servers_fresh_text_with_states_restored(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    pc = open_on(tmp_path / "cache", server, embedder, corpus)
    try:
        answers = [pc.answer(question) for question in [*QUESTIONS, *reversed(QUESTIONS)]]
        for question, answer in zip([*QUESTIONS, *reversed(QUESTIONS)], answers):
            assert answer.text == own_prompt_reference(pc, server, question, answer.chunk_ids), question
        assert any(a.source == "chunk_states" and a.reused_tokens >= 64 for a in answers)  # restored slot files
        assert all(a.source == "prompt_answer" for a in answers[len(QUESTIONS) :])  # repeats: no model
        runner = internals(pc).runtime.runner
        assert isinstance(runner, ServerRunner) and runner.rule is not None
        assert runner.restore_failures == 0 and runner.unexpected_reuse == 0
        # states are slices: a restore joined a path of several, each token's cells stored once
        states = internals(pc).states
        stats = pc.stats()["chunk_states"]
        assert states.slices and stats["nodes"] > 0
        assert stats["bytes_per_stored_token"] <= 1.2 * runner.bytes_per_token()  # a whole slot file's per token
        chained = {node.n_tokens for node in states.tree.nodes if len(states.chain(node) or []) >= 2}
        assert any(a.source == "chunk_states" and a.reused_tokens in chained for a in answers)
    finally:
        pc.close()


def test_a_restart_of_server_and_cache_restores_states_from_disk(
    tmp_path: Path, model_path: Path, embedder: Any, corpus: dict[str, Any]
) -> None:
    folder = tmp_path / "cache"
    with LlamaServer.start(model_path, ServerLaunch(n_ctx=2048)) as first:
        pc = open_on(folder, first, embedder, corpus)
        before = pc.answer(QUESTIONS[0])
        pc.close()
    with LlamaServer.start(model_path, ServerLaunch(n_ctx=2048)) as second:  # a new process, a new slot folder
        pc = open_on(folder, second, embedder, corpus)
        try:
            followup = pc.answer("At what time is the rehearsal of the launch talk?")
            assert followup.source == "chunk_states" and followup.reused_tokens >= 64
            assert followup.text == own_prompt_reference(pc, second, followup.question, followup.chunk_ids)
            assert pc.answer(QUESTIONS[0]).text == before.text
        finally:
            pc.close()


def test_a_reuse_other_than_planned_is_a_miss(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    pc = open_on(tmp_path / "cache", server, embedder, corpus)
    try:
        runner = internals(pc).runtime.runner
        assert isinstance(runner, ServerRunner)
        chunks = [pc.caller.chunk(document["id"]) for document in corpus["documents"][:3]]
        layout = runner.lay_out(QUESTIONS[2], chunks, max_new_tokens=24)
        # another client used the slot behind the runner's back, which believes the slot
        # holds this prompt's first 128 tokens and plans to keep them
        other = LlamaServer(url=server.url)
        fresh_text(other, server.tokenize("Unrelated words, " * 40, True), max_new_tokens=2, stop=[])
        runner.pool.slots[0].content = SlotContent(tuple(layout.tokens[:128]), 128)
        result = drain(runner.run(layout, RunOptions(max_new_tokens=24)))
        assert runner.unexpected_reuse == 1 and result.reused_tokens == 0
        reference = fresh_text(server, layout.tokens, max_new_tokens=24, stop=pc.config.engine.stop).strip()
        assert result.text == reference
    finally:
        pc.close()


def test_caller_prompts_and_the_adapters_give_the_servers_text(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage

    from percache_langchain import PerCacheChatModel, PerCacheLLM
    from percache_llamaindex import PerCacheLlamaCPP

    pc = open_on(tmp_path / "cache", server, embedder, corpus)
    try:
        runner = internals(pc).runtime.runner
        notes = [document["text"] for document in corpus["documents"][:3]]
        prompt = "Notes:\n" + "\n".join(notes) + "\nQuestion: When is the rehearsal?\nAnswer:"
        tokens = runner.lay_out("", [], spec=TextPrompt(prompt), max_new_tokens=24).tokens
        reference = fresh_text(server, tokens, max_new_tokens=24, stop=pc.config.engine.stop)
        answer = pc.caller.complete(prompt, documents=notes, decoding=Decoding(max_new_tokens=24, trim=False))
        assert answer.text == reference
        assert pc.caller.complete(prompt, documents=notes, decoding=Decoding(max_new_tokens=24)).source == "prompt_answer"
        other = prompt.replace("When is the rehearsal?", "How much did finance approve?")
        answer = pc.caller.complete(other, documents=notes, decoding=Decoding(max_new_tokens=24))  # restores the notes' state
        assert answer.reused_tokens >= 64
        other_tokens = runner.lay_out("", [], spec=TextPrompt(other), max_new_tokens=24).tokens
        assert answer.text == fresh_text(server, other_tokens, max_new_tokens=24, stop=pc.config.engine.stop)

        llm = PerCacheLLM(percache=pc, max_new_tokens=24)
        assert llm.invoke(prompt) == reference
        assert "".join(llm.stream(prompt)) == reference
        assert asyncio.run(llm.ainvoke(prompt)) == reference

        chat = PerCacheChatModel(percache=pc, max_new_tokens=24)
        messages = [SystemMessage(content="Notes:\n" + "\n".join(notes)), HumanMessage(content="When is the rehearsal?")]
        chat_prompt = server.stock_chat([("system", messages[0].content), ("user", messages[1].content)])
        chat_tokens = server.tokenize(chat_prompt.text, True, special=True)
        expected = fresh_text(server, chat_tokens, max_new_tokens=24, stop=[])
        assert chat.invoke(messages).content == expected
        assert chat.invoke(messages).content == expected  # a stored prompt answer, or a restore

        index_llm = PerCacheLlamaCPP(engine=server, max_new_tokens=24, stop=list(pc.config.engine.stop))
        assert index_llm.complete(prompt, formatted=True).text == reference  # outside a cache: fresh
    finally:
        pc.close()


def test_an_attached_server_without_a_slot_folder_keeps_stored_answers_only(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    attached = LlamaServer(url=server.url)
    assert attached.chunk_state_problem is not None and not attached.features.chunk_states
    with pytest.warns(UserWarning, match="no chunk states"):
        pc = open_on(tmp_path / "cache", attached, embedder, corpus)
    try:
        first = pc.answer(QUESTIONS[0])
        assert first.reused_tokens == 0
        assert first.text == own_prompt_reference(pc, server, QUESTIONS[0], first.chunk_ids)
        assert pc.answer(QUESTIONS[0]).source == "prompt_answer"
    finally:
        pc.close()
    with pytest.raises(ValueError, match="in-process engine"):
        PerCache.open(tmp_path / "other", config=PerCacheConfig(reuse="approximate"), engine=attached, embedder=embedder)


def test_where_a_server_prefill_may_start() -> None:  # (the arithmetic of ServerCuts)
    cuts = ServerCuts(CutRule(64, 4), 512)
    assert cuts.cut_allowed(0, 800)
    assert cuts.cut_allowed(128, 800) and not cuts.cut_allowed(130, 800)  # a multiple of 4
    assert not cuts.cut_allowed(40, 800) and not cuts.cut_allowed(760, 800)  # 64 tokens or more after
    assert not cuts.cut_allowed(128, 700)  # the prefill after it would end with a 60-token batch
    # a fresh prefill of 520 ends with an 8-token batch: a cut at 512 keeps it as it is, and a
    # cut from which the prefill may go to 512 in a request of its own (then the 8 alone)
    assert cuts.cut_allowed(256, 520) and cuts.cut_allowed(512, 520) and not cuts.cut_allowed(480, 520)
    assert cuts.last_batch_start(256, 520) == 512 and cuts.last_batch_start(512, 520) is None
    # a prefill from 0 to 520: its last 8 cells were computed in a short batch
    assert cuts.valid_end(0, 520) == 512 and cuts.valid_end(0, 600) == 600
    assert cuts.state_allowed(0, 548, 600) and not cuts.state_allowed(0, 516, 520)
    assert not cuts.state_allowed(0, 550, 600)  # not a multiple of 4
    cuts.window = 512  # a sliding-window model: states within the window only
    assert cuts.state_allowed(0, 512, 600) and not cuts.state_allowed(0, 548, 600)
    assert cuts.cut_allowed(400, 800) and not cuts.cut_allowed(600, 800)


def test_a_callers_prompt_keeps_its_last_batch_boundary() -> None:  # (ServerCuts.with_tail_cut)
    cuts = ServerCuts(CutRule(64, 4), 512)

    def layout(*lengths: int) -> PromptLayout:
        pieces, start = [], 0
        for index, length in enumerate(lengths):
            last = index == len(lengths) - 1
            pieces.append(Segment("text", f"piece {index}", tuple(range(start, start + length)), keep_state=not last))
            start += length
        return PromptLayout(tuple(pieces))

    # a 1,100-token prompt prefilled from 0: its end is valid, its last batch boundary (1,024) kept too
    kept = cuts.with_tail_cut(layout(600, 500), 0)
    assert kept.ends == [600, 1024, 1100] and [s.keep_state for s in kept.segments] == [True, True, False]
    assert kept.tokens == layout(600, 500).tokens and kept.segments[-1].text == "piece 1"
    # the boundary inside an earlier piece splits that piece (a next turn of 1,030 tokens may go on only from 1,024)
    assert cuts.with_tail_cut(layout(1050, 50), 0).ends == [1024, 1050, 1100]
    assert cuts.cut_allowed(1024, 1030) and not cuts.cut_allowed(1000, 1030)
    # nothing before where the prefill started, and a short last batch's cells are not kept
    assert cuts.with_tail_cut(layout(1050, 50), 1040).ends == [1050, 1100]
    assert cuts.with_tail_cut(layout(300, 230), 0).ends == [300, 512, 530]


def test_long_prompts_and_a_chats_next_turn_restore_exact_states_past_the_window(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from percache_langchain import PerCacheChatModel

    pc = open_on(tmp_path / "cache", server, embedder, corpus)
    try:
        runner = internals(pc).runtime.runner
        assert isinstance(runner, ServerRunner) and runner.window == server.sliding_window == 512
        def rag(notes: list[str], question: str) -> tuple[str, list[int]]:
            prompt = "Notes:\n" + "\n".join(notes) + f"\nQuestion: {question}\nAnswer:"
            return prompt, runner.lay_out("", [], spec=TextPrompt(prompt), max_new_tokens=24).tokens

        # notes past the window, and a prompt whose fresh prefill ends with a full batch
        # (one ending with a batch under 64 tokens can only be restored at 512)
        texts = [document["text"] for document in corpus["documents"]]
        notes = next(
            texts[:k] for k in range(len(texts), 0, -1)
            if len(tokens := rag(texts[:k], "When?")[1]) > 600 and len(tokens) % 512 >= 80
        )
        for question in ("When is the rehearsal?", "How much did finance approve?"):
            prompt, tokens = rag(notes, question)
            answer = pc.caller.complete(prompt, documents=notes, decoding=Decoding(max_new_tokens=24))
            assert answer.text == fresh_text(server, tokens, max_new_tokens=24, stop=pc.config.engine.stop)
        assert answer.reused_tokens > 512  # the second restored a state of the first's notes, past the window

        chat = PerCacheChatModel(percache=pc, max_new_tokens=16)
        messages: list[Any] = [SystemMessage(content="Notes:\n" + "\n".join(notes)), HumanMessage(content="When?")]
        restored = []
        for turn in range(3):
            reply = chat.invoke(messages)
            pairs = [(m.type.replace("human", "user").replace("ai", "assistant"), m.content) for m in messages]
            tokens = server.tokenize(server.stock_chat(pairs).text, True, special=True)
            assert reply.content == fresh_text(server, tokens, max_new_tokens=16, stop=[])
            restored.append(reply.usage_metadata["input_token_details"]["cache_read"])
            messages += [AIMessage(content=reply.content), HumanMessage(content=f"And the {turn} other?")]
        # a next turn restored a state saved near the end of the turn before, past the window
        # (where a prompt's fresh prefill ends with a batch under 64 tokens, only a batch
        # boundary may be restored: the turn before kept one)
        assert max(restored[1:]) > 512
    finally:
        pc.close()


def test_the_slot_is_cut_back_to_an_allowed_start(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    pc = open_on(tmp_path / "cache", server, embedder, corpus, chunk_state_slices=False)  # whole slot files
    try:
        runner = internals(pc).runtime.runner
        assert not internals(pc).states.slices
        notes = "Notes:\n" + "\n".join(document["text"] for document in corpus["documents"][:3])
        first = pc.caller.complete(notes + "\nQuestion: When is the rehearsal?\nAnswer:", decoding=Decoding(max_new_tokens=16))
        assert first.reused_tokens == 0
        # the same notes and another question: what the slot holds diverges inside the
        # question, where no state was kept; the slot is cut back to a start the rule allows
        prompt = notes + "\nQuestion: How much did finance approve?\nAnswer:"
        tokens = runner.lay_out("", [], spec=TextPrompt(prompt), max_new_tokens=16).tokens
        assert len(tokens) < 500  # within the window: the saved slot holds every cell
        second = pc.caller.complete(prompt, decoding=Decoding(max_new_tokens=16))
        assert second.reused_tokens >= 128 and second.reused_tokens % 4 == 0
        assert second.text == fresh_text(server, tokens, max_new_tokens=16, stop=pc.config.engine.stop)
    finally:
        pc.close()


def test_a_prompt_the_window_never_passes_runs_as_one_request_and_keeps_its_states(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a sliding-window model (Gemma: 512) a prompt that, with the most tokens it may
    generate, stays within the window is sent as one request (no state saved on the way):
    the slot saved after the answer holds every cell, so its states are kept from there."""
    pc = open_on(tmp_path / "cache", server, embedder, corpus)
    try:
        runner = internals(pc).runtime.runner
        notes = [document["text"] for document in corpus["documents"][:3]]
        requests: list[int] = []
        complete = server.complete

        def counted(tokens: Sequence[int], *args: Any, **kwargs: Any) -> Iterator[str]:
            requests.append(len(tokens))
            return complete(tokens, *args, **kwargs)

        monkeypatch.setattr(server, "complete", counted)
        asked = []
        for question in ("When is the rehearsal?", "How much did finance approve?"):
            prompt = "Notes:\n" + "\n".join(notes) + f"\nQuestion: {question}\nAnswer:"
            tokens = runner.lay_out("", [], spec=TextPrompt(prompt), max_new_tokens=16).tokens
            assert len(tokens) + 16 <= runner.window
            with pc.caller.lend_engine():
                pass  # what the slot holds is unknown now: only a stored state can be reused
            requests.clear()
            answer = pc.caller.complete(prompt, documents=notes, decoding=Decoding(max_new_tokens=16))
            assert requests == [len(tokens)]  # one request (a restored state goes by slot file)
            asked.append((answer, tokens))
            assert pc.stats()["chunk_states"]["nodes"] > 0  # taken from the slot saved after the answer (stats flushes)
        assert asked[1][0].reused_tokens >= 128  # the notes' states the first ask kept, restored
        for answer, tokens in asked:
            assert answer.text == fresh_text(server, tokens, max_new_tokens=16, stop=pc.config.engine.stop)
    finally:
        pc.close()


def test_an_idle_round_on_the_server_fills_states_and_predicts(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    pc = open_on(tmp_path / "cache", server, embedder, corpus, prediction=True, max_new_tokens=16, **SHORT_IDLE)
    try:
        report = pc.warm(max_seconds=120, max_predictions=2, progress=False)
        assert not report.preempted
        assert pc.stats()["chunk_states"]["nodes"] > 0  # the knowledge prefill's [system, chunk] states
        assert report.predicted  # the predictor's LLM calls ran on the server
        answer = pc.answer(QUESTIONS[1])
        assert answer.text == own_prompt_reference(pc, server, QUESTIONS[1], answer.chunk_ids)
        # a user's question pre-empts a round at once
        stopped = pc.warm(max_seconds=120, progress=False, should_stop=lambda: True)
        assert stopped.preempted
    finally:
        pc.close()


def test_a_started_server_keeps_answering_and_stops_with_its_owner(model_path: Path) -> None:
    import gc

    server = LlamaServer.start(model_path, ServerLaunch(n_ctx=512))
    assert server._process is not None
    process = server._process.popen
    client = LlamaServer(url=server.url, timeout_s=30)  # a server blocked on its log would time out
    tokens = client.tokenize("Hello there", True)
    for _ in range(200):  # its log grows past what an unread pipe holds
        assert "".join(client.complete(tokens, Decoding(1), cache_prompt=False)) is not None
    del server
    gc.collect()
    assert process.wait(timeout=15) is not None  # stopped when the object went


def test_a_prefix_without_a_state_point_prefills_nothing(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    from percache_core import Chunk

    pc = open_on(tmp_path / "cache", server, embedder, corpus)
    try:
        runner = internals(pc).runtime.runner
        tiny = Chunk("t#c000", "t", "Lunch at noon.")  # [system, chunk] is shorter than a state may be
        assert runner.prefill_prefix([tiny]) == 0
        assert not runner.path_is_stored("When is lunch?", [tiny], 16)
    finally:
        pc.close()


def test_the_llamaindex_query_engine_on_the_server_answers_as_the_apps_own(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any]
) -> None:
    from llama_index.core import Document, VectorStoreIndex

    from percache_llamaindex import PerCacheEmbedding, PerCacheLlamaCPP, PerCacheQueryEngine

    documents = [Document(text=d["text"], doc_id=d["id"]) for d in corpus["documents"]]
    index = VectorStoreIndex.from_documents(documents, embed_model=PerCacheEmbedding(embedder))
    llm = PerCacheLlamaCPP(engine=server, max_new_tokens=24)
    plain = index.as_query_engine(llm=llm, similarity_top_k=2)  # the app's own engine: fresh each time
    cached = PerCacheQueryEngine.from_index(index, cache_dir=tmp_path / "cache", llm=llm, similarity_top_k=2)
    try:
        asked = [QUESTIONS[1], QUESTIONS[0], QUESTIONS[1]]
        responses = [cached.query(question) for question in asked]
        assert [r.response for r in responses] == [plain.query(question).response for question in asked]
        assert [r.metadata["percache"]["source"] for r in responses][2] == "qa_bank"
    finally:
        cached.close()


def test_idle_works_plain_prompt_yields_the_server_after_one_piece(server: LlamaServer, monkeypatch: Any) -> None:
    """The predictor's and the abstract's prompts go to the server ``IDLE_PIECE_TOKENS`` at a
    time (a request each, nothing generated until the last), so a client's request that
    arrives during one waits for that piece, not the whole prompt."""
    slot = ServerSlot(server, ServerCuts(None, 512))
    sent: list[tuple[int, int, bool]] = []
    complete = server.complete

    def counted(tokens: Sequence[int], decoding: Decoding, **options: Any) -> Iterator[str]:
        sent.append((len(tokens), decoding.max_new_tokens, options["cache_prompt"]))
        return complete(tokens, decoding, **options)

    monkeypatch.setattr(server, "complete", counted)
    prompt = "Notes of the week. " + " ".join(f"Item {i}: the rehearsal moved to room {i}." for i in range(40))
    with pytest.raises(Preempted):
        slot.complete_plain(prompt, Decoding(4), should_stop=lambda: bool(sent))
    assert sent == [(IDLE_PIECE_TOKENS, 0, False)]  # one piece, then the request's turn
    sent.clear()
    text, prompt_tokens, generated = slot.complete_plain(prompt, Decoding(4))
    assert prompt_tokens > 2 * IDLE_PIECE_TOKENS
    assert [n for n, _, _ in sent] == [*range(IDLE_PIECE_TOKENS, prompt_tokens, IDLE_PIECE_TOKENS), prompt_tokens]
    assert [m for _, m, _ in sent] == [0] * (len(sent) - 1) + [4]  # the pieces generate nothing
    assert [c for _, _, c in sent] == [False] + [True] * (len(sent) - 1)  # each goes on from the slot's cache
    assert server.last.prompt_tokens <= IDLE_PIECE_TOKENS and generated <= 4  # the rest came from the cache


def test_a_prompt_whose_last_batch_is_short_restores_a_state_and_prefills_that_batch_alone(
    tmp_path: Path, server: LlamaServer, embedder: Any, corpus: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh prefill of 512 + k tokens (k under the rule's least piece) ends with a batch of
    k: a stored state before 512 is restored, the prefill goes to 512 in a request of its own,
    and the last request prefills the k tokens alone, as the fresh prefill does."""
    pc = open_on(tmp_path / "cache", server, embedder, corpus)
    try:
        runner = internals(pc).runtime.runner
        assert isinstance(runner, ServerRunner) and runner.rule is not None
        notes = [document["text"] for document in corpus["documents"][:4]]
        head = "Notes:\n" + "\n".join(notes) + "\nQuestion: "

        def text_of(question: str) -> tuple[str, list[int]]:  # padded to 512 + a short last batch
            for extra in range(400):
                text = head + question + " (" + "please " * extra + ")\nAnswer:"
                tokens = runner.lay_out("", [], spec=TextPrompt(text, tuple(notes), add_bos=True), max_new_tokens=16).tokens
                if 0 < len(tokens) - 512 < runner.rule.min_tokens:
                    return text, tokens
            raise AssertionError("no length with a short last batch")

        first, _ = text_of("When is the rehearsal?")
        pc.caller.complete(first, documents=notes, decoding=Decoding(max_new_tokens=16))
        text, tokens = text_of("How much did finance approve?")
        for slot in runner.pool.slots:
            slot.content = None  # only a stored state can be reused
        requests: list[tuple[int, int]] = []
        complete = server.complete

        def counted(prompt: Sequence[int], decoding: Decoding, **kwargs: Any) -> Iterator[str]:
            requests.append((len(prompt), decoding.required_tokens()))
            return complete(prompt, decoding, **kwargs)

        monkeypatch.setattr(server, "complete", counted)
        answer = pc.caller.complete(text, documents=notes, decoding=Decoding(max_new_tokens=16))
        monkeypatch.undo()
        assert 0 < answer.reused_tokens < 512 and requests[0] == (512, 0) and requests[-1][0] == len(tokens)
        assert answer.text == fresh_text(server, tokens, max_new_tokens=16, stop=pc.config.engine.stop)
        assert runner.unexpected_reuse == 0
    finally:
        pc.close()
