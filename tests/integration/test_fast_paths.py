"""Exact and fast on every path, with the real model: identical prompts without the model,
framework prompts as stock llama.cpp answers them in one call, chats that keep their turns."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from benchmarks.stock import stock_llama
from percache_core import Decoding
from percache_core.inspection import internals
from percache_core.kv.cuts import measure_cut_rule
from percache_langchain import PerCacheChatModel

QUESTIONS = (
    "Which room is the launch talk rehearsal in?",
    "How much budget did finance approve for the Harbor design work?",
    "When is my dentist appointment?",
    "Why is the booking API late?",
)
SYSTEM = (
    "You are Maya's assistant. Maya leads the Harbor app team; Priya Raman runs the launch, "
    "Tomasz times the talks and Ana draws the mooring map. Answer in one short sentence, "
    "names and times first. Never invent meetings or numbers; say when you do not know."
)


def framework_prompt(documents: list[str], question: str) -> str:
    """LlamaIndex's default text-QA layout."""
    context = "\n\n".join(documents)
    return (
        "Context information is below.\n---------------------\n"
        f"{context}\n---------------------\n"
        "Given the context information and not prior knowledge, answer the query.\n"
        f"Query: {question}\nAnswer: "
    )


@pytest.fixture(scope="module")
def stock(model_path):
    """Stock llama_cpp.Llama on the same GGUF (its defaults: weights repacked)."""
    llm = stock_llama(model_path, n_ctx=2048, threads=2)
    yield llm
    llm.close()


def stock_text(stock, prompt: str) -> str:
    stock.reset()  # one call for the whole prompt (no prefix kept from an earlier call)
    return stock.create_completion(prompt, max_tokens=24, temperature=0.0, stop=["\n"])["choices"][0]["text"]


def _refuse(*args, **kwargs):
    raise AssertionError("the model ran for an identical prompt")


def test_framework_prompts_answer_as_stock_llama_cpp_with_and_without_states(make_cache, corpus, stock):
    pc = make_cache("framework", documents=False)
    pc.preload()
    assert measure_cut_rule(internals(pc).engine) is not None
    texts = [d["text"] for d in corpus["documents"]]
    prompts = [framework_prompt(texts[i : i + 2], q) for i, q in zip((0, 1, 0, 2), QUESTIONS)]
    expected = [stock_text(stock, p) for p in prompts]
    first = [pc.caller.complete(p, documents=texts, decoding=Decoding(max_new_tokens=24, stop=["\n"])) for p in prompts]
    assert [a.text for a in first] == [e.strip() for e in expected]
    # the third prompt shares its context with the first: the states kept after it are restored
    assert first[2].reused_tokens > 0 and first[2].source == "chunk_states"
    assert pc.stats()["chunk_states"]["nodes"] >= 2


def test_an_identical_prompt_is_answered_without_the_model(make_cache, engine, monkeypatch):
    off = make_cache("off", qa_bank=False, chunk_states=False)
    pc = make_cache("on")
    question = QUESTIONS[0]
    expected = off.answer(question).text
    first = pc.answer(question)
    prompt = framework_prompt(["Lunch is at noon in the Birch room on Fridays."], "Where is lunch?")
    completed = pc.caller.complete(prompt, decoding=Decoding(max_new_tokens=24, stop=["\n"]))
    for name in ("eval", "eval_with_logits", "load_state", "generate"):
        monkeypatch.setattr(engine, name, _refuse)
    repeat = pc.answer(question)
    streamed = pc.answer_stream(question)
    assert first.text == expected == repeat.text == "".join(streamed)
    assert repeat.source == "prompt_answer" and not repeat.approximate and repeat.generated_tokens == first.generated_tokens
    again = pc.caller.complete(prompt, decoding=Decoding(max_new_tokens=24, stop=["\n"]))
    assert again.text == completed.text and again.source == "prompt_answer"
    monkeypatch.undo()
    # another token limit is another prompt run: the model answers it
    assert not pc.answer(question, max_new_tokens=8).answered_before


def test_a_chat_restores_its_earlier_turns_and_a_new_session_its_system_message(make_cache):
    off = make_cache("chat-off", documents=False, qa_bank=False, chunk_states=False)
    on = make_cache("chat-on", documents=False)
    chats = {name: PerCacheChatModel(percache=pc, max_new_tokens=16, stop=["\n"]) for name, pc in (("off", off), ("on", on))}

    def session(name, turns):
        messages, replies, reused = [SystemMessage(SYSTEM)], [], []
        pc = on if name == "on" else off
        for turn in turns:
            messages.append(HumanMessage(turn))
            before = pc.stats()["reused_tokens"]
            reply = chats[name].invoke(messages)
            reused.append(pc.stats()["reused_tokens"] - before)
            messages.append(AIMessage(reply.content))
            replies.append(reply.content)
        return replies, reused

    turns = ("When is the rehearsal?", "Who times the talk?", "And who draws the mooring map?")
    replies, reused = session("on", turns)
    assert replies == session("off", turns)[0]
    system_tokens = len(internals(on).engine.tokenize(SYSTEM))
    assert reused[0] == 0 and all(r >= system_tokens for r in reused[1:])
    assert reused[2] > reused[1]  # the second turn's state too
    replies, reused = session("on", ("Who runs the launch?",))  # a new session
    assert replies == session("off", ("Who runs the launch?",))[0]
    assert reused[0] >= system_tokens
