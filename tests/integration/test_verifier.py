"""QA-hit verification with the real embedder on the labelled pairs, and scoped entries."""

import json
from pathlib import Path

import pytest

from benchmarks.verify import main as verify_main
from benchmarks.verify_harness import evaluate, read_pairs
from percache_core.inspection import internals
from percache_core.qa.verifier import LexicalVerifier
from percache_core.types import QAEntry

PAIRS = Path(__file__).resolve().parents[1] / "data" / "verify_pairs.jsonl"


@pytest.fixture(scope="module")
def result(embedder):
    return evaluate(read_pairs(PAIRS), embedder)


def test_the_pair_set_covers_every_kind(result):
    pairs = read_pairs(PAIRS)
    kinds = {p["kind"] for p in pairs if p["label"] == "near_miss"}
    assert {"negation", "name", "swap", "date", "place", "number", "antonym", "scope"} <= kinds
    assert result["pairs"] >= 150 and result["paraphrases"] >= 60 and result["near_misses"] >= 60


def test_the_verifier_only_rejects(result):
    for row in result["rows"]:
        plain, verified = row["plain"], row["verified"]
        assert verified["paraphrase_hit_rate"] <= plain["paraphrase_hit_rate"]
        assert verified["near_miss_false_hit_rate"] <= plain["near_miss_false_hit_rate"]
    row = next(r for r in result["rows"] if r["tau"] == 0.85)
    assert row["plain"]["near_miss_false_hit_rate"] > 0.30  # what cosine alone would serve
    assert row["verified"]["near_miss_false_hit_rate"] <= 0.05


@pytest.mark.parametrize(
    ("stored", "asked", "accepted"),
    [
        (
            "When will the presentation rehearsal take place?",
            "When is the presentation rehearsal not taking place?",
            False,
        ),
        (
            "When will the presentation rehearsal take place?",
            "Is time of presentation rehearsal given?",
            True,
        ),
        ("What was the lowest bid for the contract?", "What was the highest bid for the contract?", False),
        ("Did Priya email Maya about the rehearsal?", "Did Maya email Priya about the rehearsal?", False),
        ("What is on my calendar on Monday?", "What is on my calendar on Tuesday?", False),
        ("Who sits in seat 14C?", "Who sits in seat 15C?", False),
        ("When does my flight land in Lisbon?", "When does my flight land in Porto?", False),
        ("When is my dentist appointment?", "What time is my appointment at the dentist?", True),
        ("Is the office open on 1 May?", "Will the office be closed on the first of May?", True),
    ],
)
def test_decisions_on_labelled_pairs(embedder, stored, asked, accepted):
    similarity = float(embedder.embed([stored])[0] @ embedder.embed([asked])[0])
    verdict = LexicalVerifier().verify(asked, QAEntry("x", stored, None, "a"), similarity)
    assert verdict.accepted is accepted, verdict.reason


def test_semantic_mode_serves_nothing_below_tau_and_rejects_near_misses(make_cache):
    pc = make_cache(qa_mode="semantic", max_error_rate=1.0, chunk_states=False, max_new_tokens=16)
    pc.answer("When will the presentation rehearsal take place?")
    paraphrase = pc.answer("Is time of presentation rehearsal given?")
    assert not paraphrase.answered_before and paraphrase.similarity < 0.85  # below tau: never served
    near_miss = pc.answer("When is the presentation rehearsal not taking place?")
    assert not near_miss.answered_before
    assert pc.stats()["verifier_rejections"] >= 1
    plain = make_cache("plain", qa_mode="semantic", max_error_rate=1.0, chunk_states=False, verifier="none", max_new_tokens=16)
    plain.answer("When will the presentation rehearsal take place?")
    assert plain.answer("When is the presentation rehearsal not taking place?").source == "qa_bank"


def test_scoped_entries_never_answer_another_scope(make_cache):
    pc = make_cache(chunk_states=False, max_new_tokens=24)
    kickoff = pc.answer("Summarize the whole meeting.", scope={"meeting": "harbor-kickoff"})
    assert kickoff.chunk_ids == ("notes-kickoff#c000",)  # retrieval is scoped too
    review = pc.answer("Summarize the whole meeting.", scope={"meeting": "harbor-design-review"})
    assert review.source == "full" and review.chunk_ids == ("notes-review#c000",)
    again = pc.answer("Summarize the whole meeting.", scope={"meeting": "harbor-kickoff"})
    assert again.source == "prompt_answer" and again.text == kickoff.text
    assert not pc.answer("Summarize the whole meeting.", max_new_tokens=4).answered_before  # no scope
    assert len(internals(pc).qa_bank) == 3
    with pytest.raises(TypeError, match="scope"):
        pc.answer("Summarize the whole meeting.", scope="harbor-kickoff")


def test_bench_verify_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert verify_main(["--pairs", str(PAIRS), "--out", str(out)]) == 0
    assert "verified" in capsys.readouterr().out
    assert json.loads(out.read_text())["pairs"] >= 150
