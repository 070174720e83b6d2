"""Chunking, stop strings, rank fusion and configuration: pure logic."""

import pytest

from percache_core import PerCacheConfig
from percache_core.knowledge.bm25 import bm25_tokens
from percache_core.knowledge.chunking import split_into_chunks
from percache_core.knowledge.index import reciprocal_rank_fusion
from percache_core.kv.stopping import StopStringFilter


def test_chunks_keep_sentences_and_respect_the_word_limit():
    text = " ".join(f"Sentence number {i} has six words." for i in range(40))
    chunks = split_into_chunks(text, chunk_words=20)
    assert all(len(c.split()) <= 20 for c in chunks)
    assert all(c.endswith(".") for c in chunks)
    assert " ".join(chunks).split() == text.split()


def test_chunks_keep_line_structure_of_notes():
    chunks = split_into_chunks("Ana: hello there.\nTomasz: the API is late.", chunk_words=100)
    assert chunks == ["Ana: hello there.\nTomasz: the API is late."]


def test_a_long_sentence_is_split_by_words():
    chunks = split_into_chunks("word " * 250, chunk_words=100)
    assert [len(c.split()) for c in chunks] == [100, 100, 50]


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        ([" Fri", "day.\n", "Question: x"], "Friday."),
        (["Room", " B", "Que", "stion:"], "Room B"),
        (["Que", "ue"], "Queue"),  # a false start of a stop string is released
        (["  ", " 3 pm"], "3 pm"),
    ],
)
def test_stop_filter_never_shows_a_stop_string(pieces, expected):
    stop = StopStringFilter(["\n", "Question:"])
    shown = "".join(stop.feed(p) for p in pieces) + stop.finish()
    assert shown == expected == stop.text


def test_rrf_prefers_items_ranked_well_by_both():
    scores = reciprocal_rank_fusion([[1, 2, 3], [3, 1, 2]], k=60)
    assert max(scores, key=scores.get) == 1
    assert bm25_tokens("What did Tomasz say about the API?") == ["tomasz", "say", "about", "api"]


def test_config_validates_and_copies():
    with pytest.raises(ValueError, match="top_k"):
        PerCacheConfig(top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        PerCacheConfig(temperature=-1)
    with pytest.raises(TypeError):
        PerCacheConfig(0.9)  # keyword-only
    assert PerCacheConfig(stop=["x"]).stop == ("x",)


def test_text_prompts_are_cut_only_after_documents_into_pieces_of_the_exact_size():
    from percache_core.kv.cuts import CutRule
    from percache_core.serving.prompting import TextPrompt, lay_out_text
    from tests.fake_engine import FakeEngine

    engine = FakeEngine()  # one token per byte
    prompt = "<bos>Context:\nLunch is at noon.\n\nTickets cost 20 euros.\nQ: When?\nA:"
    documents = ("Lunch is at noon.", "Tickets cost 20 euros.", "not in the prompt")
    layout = lay_out_text(TextPrompt(prompt, documents), engine, max_prompt_tokens=1000, rule=CutRule(8))
    assert [t for s in layout.segments for t in s.tokens] == engine.tokenize_chat(prompt)
    # cut after each document and the white space after it; the tail is long enough
    assert [s.text for s in layout.segments] == [
        "<bos>Context:\nLunch is at noon.\n\n", "Tickets cost 20 euros.\n", "Q: When?\nA:"
    ]
    assert [s.keep_state for s in layout.segments] == [True, True, False]
    # no piece shorter than min_piece: the cut before a short tail is left out
    short = lay_out_text(TextPrompt(prompt, documents), engine, max_prompt_tokens=1000, rule=CutRule(12))
    assert [s.text for s in short.segments] == ["<bos>Context:\nLunch is at noon.\n\n", "Tickets cost 20 euros.\nQ: When?\nA:"]
    assert min(len(s.tokens) for s in short.segments) >= 12
    # without documents (a framework LLM outside PerCache's engine) the prompt is one piece
    alone = lay_out_text(TextPrompt(prompt), engine, max_prompt_tokens=1000, rule=CutRule(8))
    assert len(alone.segments) == 1 and not alone.segments[0].keep_state
    # cuts on multiples of 4 tokens (repacked weights): moved back from the documents' ends
    aligned = lay_out_text(TextPrompt(prompt, documents), engine, max_prompt_tokens=1000, rule=CutRule(8, 4))
    assert [len(s.tokens) for s in aligned.segments] == [28, 24, 11]  # 29 -> 28; 52 stays
    assert [t for s in aligned.segments for t in s.tokens] == engine.tokenize_chat(prompt)


def test_text_prompts_find_the_tokens_the_tokenizer_added_from_their_bytes():
    from percache_core.kv.cuts import CutRule
    from percache_core.serving.prompting import TextPrompt, lay_out_text
    from tests.fake_engine import BOS, FakeEngine

    engine = FakeEngine()  # one token per byte: "é" is two
    documents = ("Le déjeuner est à midi.", "Les billets coûtent 20 euros.")
    text = "Contexte :\nLe déjeuner est à midi.\n\nLes billets coûtent 20 euros.\nQ : Quand ?\nR :"
    for prompt, add_bos in ((text, True), ("<bos>" + text, True), (text, False)):
        layout = lay_out_text(TextPrompt(prompt, documents, add_bos=add_bos), engine, max_prompt_tokens=1000, rule=CutRule(8))
        tokens = [t for s in layout.segments for t in s.tokens]
        assert tokens == engine.tokenize(prompt, add_bos, special=True)
        assert tokens.count(BOS) == add_bos + prompt.startswith("<bos>")
        # cut after each document (the text of each piece is the prompt's, in order)
        assert "".join(s.text for s in layout.segments) == prompt
        assert [s.text.endswith(("midi.\n\n", "euros.\n")) for s in layout.segments] == [True, True, False]

    class Misspelled(FakeEngine):  # pieces that do not spell the text: the prompt stays whole
        def token_bytes(self, token: int, *, special: bool = False) -> bytes:
            return b"?" if token == engine.tokenize("L")[0] else super().token_bytes(token, special=special)

    layout = lay_out_text(TextPrompt(text, documents, add_bos=True), Misspelled(), max_prompt_tokens=1000, rule=CutRule(8))
    assert len(layout.segments) == 1


def test_text_prompts_stay_whole_without_a_safe_cut():
    from percache_core.errors import ContextOverflowError
    from percache_core.serving.prompting import TextPrompt, lay_out_text
    from tests.fake_engine import FakeEngine

    engine = FakeEngine()
    prompt = "<bos>Context:\nLunch is at noon.\n\nTickets cost 20 euros.\nQ: When?\nA:"
    documents = ("Lunch is at noon.", "Tickets cost 20 euros.")
    layout = lay_out_text(TextPrompt(prompt, documents), engine, max_prompt_tokens=1000, rule=None)
    assert [s.tokens for s in layout.segments] == [tuple(engine.tokenize_chat(prompt))]
    assert not layout.segments[0].keep_state
    with pytest.raises(ContextOverflowError):
        lay_out_text(TextPrompt(prompt), engine, max_prompt_tokens=10, rule=None)
