"""The evaluation report's arithmetic on hand-made records (pure logic, no model)."""

from benchmarks.e2e_harness import STAGES, _totals, markdown_table, reductions


def run(latencies, sources, answers):
    records = [
        {
            "qid": f"q{i}",
            "answer": answer,
            "source": source,
            "latency_s": latency,
            "ttft_s": latency / 2,
            "prefix_overlap": None if source == "qa_bank" else 1 / 3,
            "rouge_reference": 0.5,
            "f1_reference": 0.25,
            "stages": {stage: 0.01 for stage in STAGES},
        }
        for i, (latency, source, answer) in enumerate(zip(latencies, sources, answers))
    ]
    return {"records": records, "idle": {"seconds": 0.0}, "cache_bytes": {}}


def test_a_run_with_only_naive_and_percache_reports_without_a_best_baseline():
    naive = run([2.0, 2.0], ["full", "full"], ["Friday at noon", "room B"])
    ours = run([1.0, 0.0], ["chunk_states", "qa_bank"], ["Friday at noon", "room C"])
    per_user = {"qmsum/u": {"naive": _totals(naive, naive), "percache": _totals(ours, naive)}}
    totals = per_user["qmsum/u"]["percache"]
    assert totals["qa_bank_hit_rate"] == 0.5 and totals["latency_s"]["mean"] == 0.5
    assert totals["chunk_state_prefix_overlap"] == 1 / 3  # QA hits have no prompt
    assert 0.5 < totals["rouge_l_naive"] < 1.0  # one answer differs from naive's
    assert totals["identical_to_naive"] == 0.5 and totals["f1_reference"] == 0.25
    reduction = reductions(per_user)
    assert reduction["mean_vs_naive"] == 0.75 and reduction["mean_vs_best_baseline"] is None
    sensitivity = [{"sweep": "tau", "value": 0.6, "user": "qmsum/u", **totals}]
    table = markdown_table({"per_user": per_user, "reduction": reduction, "sensitivity": sensitivity})
    assert "| percache | 0.500 |" in table and "| tau = 0.6 |" in table
    assert "below the best baseline" not in table
