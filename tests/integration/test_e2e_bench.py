"""The end-to-end evaluation on a tiny data set in the shared schema: every system answers
every question within its meeting, results repeat exactly with the same seed, and the
report is written."""

import json

import pytest

from benchmarks import app_passages, neighbour_pairs
from benchmarks.e2e_harness import SYSTEMS, evaluate, write_report
from percache_core.types import ANSWERED_BEFORE

DOCUMENTS = [
    {
        "user": "pat",
        "doc_id": "m1#c000",
        "meeting_id": "m1",
        "text": "Pat: The kiln firing is on Wednesday at 6 pm. Lee: I will bring the glaze samples.",
    },
    {
        "user": "pat",
        "doc_id": "m1#c001",
        "meeting_id": "m1",
        "text": "Lee: The studio rent rises to 300 euros in October. Pat: We split it three ways.",
    },
    {
        "user": "pat",
        "doc_id": "m2#c000",
        "meeting_id": "m2",
        "text": "Pat: The pottery market is on 12 November in the old tram hall.",
    },
]
QUERIES = [
    {
        "user": "pat",
        "qid": "q1",
        "question": "When is the kiln firing?",
        "answer": "Wednesday at 6 pm.",
        "gold_doc_ids": ["m1#c000"],
        "meeting_id": "m1",
    },
    {
        "user": "pat",
        "qid": "q2",
        "question": "When does the kiln firing happen?",
        "answer": "Wednesday at 6 pm.",
        "gold_doc_ids": ["m1#c000"],
        "meeting_id": "m1",
    },
    {
        "user": "pat",
        "qid": "q3",
        "question": "How much is the studio rent in October?",
        "answer": "300 euros.",
        "gold_doc_ids": ["m1#c001"],
        "meeting_id": "m1",
    },
]


def write_data(tmp_path):
    data = tmp_path / "data" / "qmsum"
    data.mkdir(parents=True)
    (data / "documents.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCUMENTS))
    (data / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES))


def retrieval_only_run(tmp_path, bench) -> dict:
    """*bench*'s ``main`` over the tiny data set (one QMSum user); its JSON."""
    write_data(tmp_path)
    out = tmp_path / "result.json"
    argv = ["--data", str(tmp_path / "data"), "--qmsum-users", "1", "--squad-users", "0", "--out", str(out)]
    assert bench.main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.model  # the real embedder
def test_neighbour_pairs_count_second_chunks_within_the_meeting(tmp_path):
    result = retrieval_only_run(tmp_path, neighbour_pairs)
    # meeting m1 has two chunks: each one's only neighbour there is the other, which every
    # m1 question retrieves second
    assert result["questions"] == 3 and result["share_second_chunk_is_a_neighbour"]["1"] == 1.0
    assert result["users"][0]["chunks"] == 3


def test_tiny_run_is_complete_repeatable_and_reported(tmp_path, engine, embedder):
    write_data(tmp_path)
    systems = [s for s in SYSTEMS if s.name in ("naive", "ragcache+meancache", "percache")]
    settings = dict(
        data=tmp_path / "data",
        qmsum_users=1,
        squad_users=0,
        queries_per_user=3,
        stride=1,
        max_new_tokens=12,
        systems=systems,
        progress=lambda line: None,
        engine=engine,  # the session's, loaded and self-checked once
        embedder=embedder,
    )
    first = evaluate(**settings)
    # the run again, of the system with the most work (its idle rounds before the first
    # question, that question and the round after it): the same sources and answers; with
    # a sensitivity run (tau) over that one question
    second = evaluate(
        **{**settings, "queries_per_user": 1, "systems": [s for s in systems if s.name == "percache"]}, taus=[0.9]
    )
    for name in ("naive", "ragcache+meancache", "percache"):
        records = first["queries"]["qmsum/pat"][name]
        assert [r["qid"] for r in records] == ["q1", "q2", "q3"] and not any("error" in r for r in records)
    again = second["queries"]["qmsum/pat"]["percache"]
    assert [(r["source"], r["answer"]) for r in again] == [
        (r["source"], r["answer"]) for r in first["queries"]["qmsum/pat"]["percache"][:1]
    ]
    totals = first["per_user"]["qmsum/pat"]
    assert totals["naive"]["qa_bank_hit_rate"] == 0 and totals["naive"]["rouge_l_naive"] == 1.0
    assert totals["ragcache+meancache"]["qa_bank_hit_rate"] > 0  # q2 paraphrases q1
    assert totals["percache"]["idle"]["seconds"] > 0 and totals["naive"]["idle"]["seconds"] == 0
    # idle knowledge prefill stored [system, chunk] for every chunk: each prompt restores
    # at least its first chunk, and retrieval stayed inside meeting m1
    assert totals["percache"]["idle"]["chunks_prefilled"] >= 1  # the rest came with predictions
    generated = [r for r in first["queries"]["qmsum/pat"]["percache"] if r["source"] not in ANSWERED_BEFORE]
    assert generated and all(r["prefix_overlap"] > 0 for r in generated)
    assert all(c.startswith("m1#") for r in generated for c in r["chunk_ids"])
    assert [row["sweep"] for row in second["sensitivity"]] == ["tau"] and second["tau_sweep"][0]["tau"] == 0.9
    assert set(totals["percache"]["stage_seconds_mean"]) >= {"embed", "retrieve", "prefill", "decode"}
    written = write_report(first, tmp_path / "out" / "e2e.json")
    assert {p.name for p in written} >= {
        "e2e.json",
        "e2e.md",
        "per_query_latency.png",
        "latency_per_user.png",
    }
    summary = (tmp_path / "out" / "e2e.md").read_text()
    assert "| percache |" in summary and "| prefill |" in summary
    swept = write_report(second, tmp_path / "swept" / "e2e.json")
    assert "| tau = 0.9 |" in (tmp_path / "swept" / "e2e.md").read_text()
    assert "tau_tradeoff.png" in {p.name for p in swept}


@pytest.mark.model  # the real embedder
def test_app_passages_rank_each_questions_second_and_third_passage(tmp_path):
    result = retrieval_only_run(tmp_path, app_passages)
    # three chunks and three passages a question: the second is one of the first's two
    # neighbours, the third the only chunk left
    assert result["summary"]["questions"] == 3 and result["per_user"][0]["chunks"] == 3
    assert result["summary"]["second_within"]["2"] == 3 and result["summary"]["third_within"]["1"] == 3
    assert all(rank in (0, 1) for rank in result["per_user"][0]["second"])
