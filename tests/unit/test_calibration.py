"""Approximate tiers within ``max_error_rate``: the calibration's arithmetic, and the control
flow that collects labels and serves only what they support (fake engine and embedder)."""

from __future__ import annotations

import pytest

from percache_core import PerCacheConfig
from percache_core.inspection import internals
from percache_core.qa.calibration import COMPOSED, Calibration, Label, equivalent, error_upper_bound
from percache_core.storage import Store

QUESTION = "When is the presentation rehearsal for the launch talk?"
PARAPHRASE = "Quick question: When is the presentation rehearsal for the launch talk?"


def test_the_threshold_is_the_lowest_similarity_whose_labels_meet_the_bound(tmp_path):
    calibration = Calibration(Store(tmp_path / "meta"))
    assert calibration.threshold(0.05) is None  # no labels: nothing may be served
    calibration.add_many(Label(f"e{i}", 0.96, True, "asked") for i in range(60))
    assert calibration.threshold(0.05) == 0.96  # 0 of 60 wrong: upper bound 0.049
    calibration.add_many(Label(f"f{i}", 0.90, i % 2 == 0, "variant") for i in range(20))
    assert calibration.threshold(0.05) == 0.96  # 10 of 80 wrong at 0.90: the bound fails there
    assert calibration.threshold(0.05, kinds=("asked",)) == 0.96
    calibration.add_many(Label(f"g{i}", 0.99, False, "asked", False) for i in range(9))  # rejected by the verifier
    assert calibration.threshold(0.05) == 0.96 and calibration.floor("g1") == -1.0  # never served: no evidence
    assert calibration.threshold(0.05, context="same") is None  # each context on its own labels
    assert calibration.floor("f1") == 0.90 and calibration.floor("e1") == -1.0
    assert 0.9 < calibration.accuracy(0.95) < 1.0 and calibration.accuracy(0.5) < calibration.accuracy(0.95)
    reopened = Calibration(Store(tmp_path / "meta"))  # labels persist with the cache
    assert len(reopened) == 89 and reopened.threshold(0.05) == 0.96 and reopened.floor("f1") == 0.90


def test_the_upper_bound_and_the_equivalences():
    assert error_upper_bound(0, 150) < 0.02 < error_upper_bound(1, 150)
    assert error_upper_bound(5, 100) > 0.05 and error_upper_bound(100, 100) == 1.0
    assert abs(error_upper_bound(40, 1000) - 0.0524) < 0.002  # the normal-approximation branch
    assert equivalent("Friday.", " Friday.") and not equivalent("Friday", "Friday at noon")
    assert equivalent("Friday at noon", "on Friday at noon", equivalence="token_f1", min_f1=0.8)
    with pytest.raises(ValueError, match="equivalence"):
        equivalent("a", "a", equivalence="cosine")


def test_composed_states_use_the_fewest_recompute_tokens_that_meet_the_bound():
    calibration = Calibration()
    calibration.add_many(Label(f"{COMPOSED}16", 1.0, i % 3 != 0, "composed") for i in range(90))
    calibration.add_many(Label(f"{COMPOSED}64", 1.0, True, "composed") for _ in range(90))
    assert calibration.recompute_choice((16, 32, 64), 0.05) == 64
    assert calibration.recompute_choice((16, 32, 64), 0.01) is None  # 0 of 90 is not enough for 1%
    assert calibration.composed_accuracy(16) < calibration.composed_accuracy(64)


def test_settings_of_the_bound_are_checked():
    for bad in (0.0, 1.5, True, "0.02"):
        with pytest.raises(ValueError, match="max_error_rate"):
            PerCacheConfig(max_error_rate=bad)
    with pytest.raises(ValueError, match="answer_equivalence"):
        PerCacheConfig(answer_equivalence="cosine")
    with pytest.raises(ValueError, match="calibration_answers_per_round"):
        PerCacheConfig(calibration_answers_per_round=-1)
    assert PerCacheConfig().bound.bounded and not PerCacheConfig(max_error_rate=1.0).bound.bounded


def test_semantic_mode_serves_nothing_its_labels_do_not_support(fake_cache):
    pc = fake_cache(qa_mode="semantic", similarity_threshold=0.5, calibration_answers_per_round=12)
    first = pc.answer(QUESTION)
    paraphrase = pc.answer(PARAPHRASE)  # no labels yet: the model answers, and that is a label
    assert not paraphrase.answered_before and not paraphrase.approximate
    labels = internals(pc).parts.calibration.labels
    stored = pc.caller.find(QUESTION)
    assert stored is not None and [(label.entry_id, label.kind) for label in labels] == [(stored.id, "asked")]
    assert labels[0].right == (paraphrase.text == first.text) and labels[0].similarity == paraphrase.similarity

    report = pc.warm(progress=False, max_predictions=0)  # idle work buys labels with variants
    assert 0 < report.calibration_answers <= 12 and report.calibration_labels >= report.calibration_answers
    stats = pc.stats()["approximate"]
    assert stats["labels"] == len(internals(pc).parts.calibration) > 1
    assert stats["labels_by_kind"]["variant"]["labels"] == report.calibration_labels
    assert stats["calibration_answers"] == report.calibration_answers and stats["calibration_seconds"] > 0
    # the fake engine's answer changes with every word of the question: every label is wrong,
    # so no similarity meets the bound and nothing is ever served without the model
    assert set(stats["semantic_thresholds"].values()) == {None} and stats["answers"] == 0
    again = pc.warm(progress=False, max_predictions=0)
    assert again.calibration_answers <= 12  # each variant is labelled once


def test_a_calibrated_hit_carries_its_accuracy_and_is_checked_in_idle_time(fake_cache):
    pc = fake_cache(qa_mode="semantic", similarity_threshold=0.5, calibration_answers_per_round=0)
    stored = pc.answer(QUESTION)
    calibration = internals(pc).parts.calibration
    for context in ("same", "other"):  # as if measured, whatever the paraphrase retrieves
        calibration.add_many(Label(f"{context}-{i}", 0.5, True, "asked", True, context) for i in range(300))
    assert calibration.threshold(0.02, context="unknown") is None  # a caller's lookups: not calibrated
    hit = pc.answer(PARAPHRASE)
    assert hit.source == "qa_bank" and hit.approximate and hit.text == stored.text
    assert hit.estimated_accuracy is not None and hit.estimated_accuracy > 0.99
    assert pc.stats()["approximate"]["answers"] == 1

    report = pc.warm(progress=False, max_predictions=0)  # the follow-up checks what was served
    assert report.followups_answered == 1 and report.served_checked == 1
    stats = pc.stats()["approximate"]
    assert stats["checked"] == 1 and stats["wrong"] == report.served_wrong
    if report.served_wrong:  # the entry's own floor now keeps it from this similarity
        assert calibration.floor(hit.entry_id) == pytest.approx(hit.similarity)
        again = pc.answer(PARAPHRASE)
        assert again.source != "qa_bank" or again.matched_question == PARAPHRASE


def test_composed_states_stay_exact_until_calibrated(fake_cache):
    pc = fake_cache(reuse="approximate", recompute_tokens=4, calibration_answers_per_round=8)
    pc.warm(progress=False, max_predictions=0)  # the knowledge prefill: [system, chunk] states
    answer = pc.answer(QUESTION)
    assert not answer.approximate  # no composed labels yet: the run is exact
    report = pc.warm(progress=False, max_predictions=0)
    composed = pc.stats()["approximate"]["labels_by_kind"]["composed"]
    assert report.calibration_answers >= 1 and composed["labels"] >= 1
    if composed["wrong"]:  # the fake engine's composed answers differ: the bound keeps them off
        assert pc.stats()["approximate"]["recompute_tokens"] is None
        assert not pc.answer("Who will repair the boiler?").approximate


def test_a_callers_own_answers_label_the_stored_answers_its_lookups_saw(fake_cache):
    pc = fake_cache(qa_mode="semantic", similarity_threshold=0.5)
    pc.caller.remember("When is the review?", "Monday at 10.", binding="app")
    assert pc.caller.lookup("When is the design review?", binding="app") is None  # no labels: no hit
    pc.caller.remember("When is the design review?", "Monday at 10.", binding="app")
    pc.caller.lookup("Where is the review?", binding="app")
    pc.caller.remember("Where is the review?", "Room B.", binding="app")
    labels = internals(pc).parts.calibration.labels
    assert [(label.kind, label.right) for label in labels[:2]] == [("asked", True), ("asked", False)]
    assert all(label.entry_id == pc.caller.find("When is the review?", binding="app").id for label in labels[:2])
