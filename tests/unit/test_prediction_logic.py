"""Predictor and abstract logic with a scripted fake LLM and a bag-of-words fake embedder."""

import numpy as np

from percache_core import PerCacheConfig
from percache_core.prediction.abstract import KnowledgeAbstract
from percache_core.prediction.predictor import QueryPredictor
from percache_core.storage import Store
from percache_core.types import Chunk


class WordEmbedder:
    """Unit vectors of hashed words: identical word sets give similarity 1."""

    name, dimension = "fake-words", 64

    def embed(self, texts):
        rows = np.zeros((len(texts), self.dimension), dtype=np.float32)
        for row, text in zip(rows, texts):
            for word in text.lower().strip("?").split():
                row[hash(word) % self.dimension] += 1
        return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-9)


class ScriptedLLM:
    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.prompts = []
        self.temperatures = []

    def __call__(self, prompt, decoding):
        self.prompts.append(prompt)
        self.temperatures.append(decoding.sampling.temperature)
        return self.outputs.pop(0) if self.outputs else ""


def predictor(llm, known=lambda e: 0.0, **config):
    return QueryPredictor(
        complete=llm,
        count_tokens=lambda text: len(text.split()),
        embedder=WordEmbedder(),
        known_similarity=known,
        config=PerCacheConfig(**config),
    )


def test_bad_outputs_are_filtered_and_duplicates_raise_the_temperature():
    llm = ScriptedLLM(
        [
            " When is the rehearsal?\n2. When is the rehearsal?\n3. \n4. Budget.\n5. Who books the room?\n6. "
            + "why " * 60
            + "?",
            " Where is the Birch room?",
        ]
    )
    questions, tally = predictor(llm).predict_from_knowledge(["Rehearsal Thursday 4 pm"], 3)
    assert [q.text for q in questions] == [
        "When is the rehearsal?",
        "Who books the room?",
        "Where is the Birch room?",
    ]
    assert tally.duplicates == 1 and tally.malformed == 2 and tally.llm_calls == 2
    assert llm.temperatures == [0.7, 0.8]


def test_questions_known_to_the_bank_are_dropped():
    llm = ScriptedLLM([" When is the rehearsal?\n2. Who books the room?"])

    def known(e):
        return 1.0 if e @ WordEmbedder().embed(["When is the rehearsal?"])[0] > 0.99 else 0.0

    questions, tally = predictor(llm, known=known).predict_from_knowledge(["facts"], 2, max_calls=1)
    assert [q.text for q in questions] == ["Who books the room?"] and tally.duplicates == 1


def test_masking_puts_recent_questions_in_the_prompt_within_the_budget():
    llm = ScriptedLLM([" When is the rehearsal?\n2. Who books the room?", " Where is the dinner?"])
    p = predictor(llm)
    p.predict_from_knowledge(["facts"], 2)
    p.predict_from_knowledge(["facts"], 1)
    second = llm.prompts[-1]
    assert "1. When is the rehearsal?\n2. Who books the room?\n3." in second
    p.recent.extend(f"Question number {i} about something long?" for i in range(400))
    prompt, _ = p.knowledge_prompt(["facts"], 1)
    assert len(prompt.split()) < 1000  # only whole questions that fit the budget
    assert prompt.rstrip().endswith(".") and "Question number 399 about something long?" in prompt


def test_history_prompt_lists_the_users_questions():
    llm = ScriptedLLM([" What about the budget?"])
    questions, _ = predictor(llm).predict_from_history(["When is the rehearsal?", "Who is Tomasz?"], 1)
    assert "1. When is the rehearsal?\n2. Who is Tomasz?" in llm.prompts[0]
    assert questions[0].origin == "history"


def test_abstract_merges_facts_in_batches_and_condenses(tmp_path):
    store = Store(tmp_path / "meta")
    abstract = KnowledgeAbstract(store, max_lines=3, batch_chunks=2)
    chunks = [Chunk(f"d#c{i}", "d", f"text {i}") for i in range(4)]
    llm = ScriptedLLM(
        [
            " Rehearsal on Thursday\n- Budget 18,500 euros\n- x",
            " Dentist on Monday\n- Rehearsal on Thursday\n- Flight KX7Q2M to Lisbon",
            " Rehearsal and budget facts",
        ]
    )
    added = abstract.summarise(chunks, llm)
    assert added == 4  # the repeated fact and the too-short line are dropped
    assert abstract.pending(chunks) == []
    assert len(abstract.lines) == 3 and abstract.lines[0] == "Rehearsal and budget facts"
    assert KnowledgeAbstract(store).lines == abstract.lines  # persisted
