"""States past the model's sliding window (Gemma 3: 512 tokens), in the process, with the real
model: the prompts a framework's defaults make (1,024-token chunks, top 2: 2,000-token
prompts). A state saved there lacks the sliding-window cells its window has passed; restored
as llama.cpp lays it out it gave other logits and, in LlamaIndex's starter app, another answer.
Laid out as a fresh prefill's (zero cells put back), whole states, slices and the prefill
after them give the live logits bit for bit, and a caller's prompt gets stock's fresh text."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from benchmarks.stock import stock_llama
from percache_core.inspection import internals
from percache_core.kv.engine import Decoding
from percache_core.kv.probe_text import probe_sentences, probe_tokens
from percache_core.kv.state_cells import read_caches

HEADER = 8  # an in-process sequence state's magic and sequence id


def test_whole_states_and_slices_past_the_window_restore_the_live_logits(engine):
    window = engine.n_swa
    assert window == 512
    tokens = probe_tokens(engine, 1800)  # pieces of 300, 764 and 736 tokens: the last two cross the window
    with engine.lock:
        engine.reset()
        engine.eval(tokens[:300])
        first = engine.save_state()
        engine.eval(tokens[300:1064])
        piece = engine.save_slice(300)
        whole = engine.save_state()
        engine.eval(tokens[1064:1800])
        live = np.array(engine.last_logits(), copy=True)

        # the cause: the sliding-window cache wrote only its window's cells
        full, sliding = read_caches(whole, HEADER)
        assert [p for p, _ in full.cells] == list(range(1064))
        assert [p for p, _ in sliding.cells] == list(range(1064 - window, 1064))

        assert engine.load_state(whole, 1064)
        engine.eval(tokens[1064:1800])
        assert np.array_equal(engine.last_logits(), live)
        assert engine.truncate(1200)  # its last 512 positions are real cells
        assert engine.load_state(whole, 1064)
        assert not engine.truncate(700)  # positions 188-551 are zero cells now: a rebuild, never a wrong answer

        assert engine.load_state(first, 300) and engine.append_slice(piece, 1064)
        engine.eval(tokens[1064:1800])
        assert np.array_equal(engine.last_logits(), live)
        engine.reset()


@pytest.fixture
def stock(model_path) -> Iterator[object]:
    llm = stock_llama(model_path, n_ctx=2048, threads=2)
    yield llm
    llm.close()


def test_a_prompt_of_long_passages_restored_past_the_window_gets_stocks_fresh_text(make_cache, stock):
    pc = make_cache("long", documents=False)
    notes = probe_sentences(76)
    first, second, third = "\n".join(notes[:30]), "\n".join(notes[30:53]), "\n".join(notes[53:])
    decoding = Decoding(max_new_tokens=24, stop=())  # no stop string: any divergence shows

    def prompt(passages: list[str], question: str) -> str:
        return "Answer from the notes below.\n\n" + "\n\n".join(passages) + f"\n\nQuestion: {question}\nAnswer:"

    def fresh(text: str) -> str:
        stock.reset()
        return stock(text, max_tokens=24, temperature=0.0)["choices"][0]["text"]

    asks = [([first, second], "Who said the van needs a review?"), ([first, third], "When is the rehearsal?")]
    answers = []
    for passages, question in asks:
        text = prompt(passages, question)
        assert 1200 < len(pc.caller.text_model.tokenize(text, True)) < 2000
        answer = pc.caller.complete(text, documents=passages, decoding=decoding)
        assert answer.text == fresh(text), question
        answers.append(answer)
    # the second restored [instructions + first passage], a state past the window
    assert answers[1].reused_tokens > internals(pc).engine.n_swa + 100


def test_a_slice_of_the_exactness_sweep_restores_every_state_of_a_long_prompt_exactly(make_cache, stock):
    from benchmarks.exactness_sweep import (
        Prompt,
        detokenize,
        fill,
        framework_templates,
        run_pairs,
        stock_text,
    )

    pc = make_cache("sweep", documents=False, qa_bank=False)
    engine = internals(pc).engine
    tokens = probe_tokens(engine, 1500)
    passages = [detokenize(engine, tokens[1:700]), detokenize(engine, tokens[700:1400])]  # ~700 tokens each
    prompt = Prompt("llamaindex_qa", passages, "Who said the van needs a review?")
    prompt.text = fill(prompt, framework_templates()["llamaindex_qa"])
    reference = stock_text(stock, prompt, internals(pc).runner, 32)
    pairs = run_pairs(pc, prompt, reference, 32)  # restoring each state point of the prompt in turn
    assert len(pairs) >= 2 and all(pair["identical"] for pair in pairs), pairs
    assert max(pair["reused"] for pair in pairs) > 2 * engine.n_swa  # [template + both passages]
