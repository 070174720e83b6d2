"""The results a user reads are the report's output from the committed results (no
hand-edited figures), and each row reads what its benchmark writes (pure logic, no model)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report
from benchmarks.report_rows import ROWS, read_result, runs


def test_the_readme_and_the_evaluation_are_the_reports_output_from_the_committed_results():
    assert report.main(["--check"]) == 0  # else: python -m benchmarks.report


def test_the_results_table_fits_on_one_screen_with_one_line_per_thing_a_user_runs():
    lines = report.table(report.RESULTS).splitlines()
    assert len(lines) - len(report.HEADER) == len(ROWS) <= 10
    assert all(line.startswith("| ") and line.endswith("` |") for line in lines[len(report.HEADER):])


def test_every_committed_result_is_stamped_and_read_by_its_rows():
    committed = [row for row in ROWS if read_result(report.RESULTS, row) is not None]
    assert committed, "no committed results under benchmarks/results"
    for row in committed:
        result = read_result(report.RESULTS, row)
        assert {"date", "machine", "cores", "command"} <= set(result["run"]), row.result
        measured = row.read(result)
        assert measured.same.split("/")[0].strip().isdigit() and "**" in measured.figure
        if measured.ratio is not None:
            assert 0 < measured.ratio < 10


def test_the_quick_run_covers_every_result_file_once_and_writes_it(tmp_path: Path):
    assert sorted(row.result for row in runs()) == sorted({row.result for row in ROWS})
    for row in runs():
        command = row.command(row.quick)
        assert command[:2] == ["-m", row.module] and command[-2:] == ["--out", f"benchmarks/results/{row.result}"]


def test_a_missing_result_says_how_to_measure_it_and_markers_are_required(tmp_path: Path):
    body = report.table(tmp_path)
    assert body.count("not measured yet") == len(ROWS)
    text = f"intro\n{report.START}\nold\n{report.END}\nrest"
    assert report.replace_between_markers(text, body, "x") == f"intro\n{report.START}\n{body}\n{report.END}\nrest"
    try:
        report.replace_between_markers("no markers", body, "README.md")
    except SystemExit as error:
        assert "README.md" in str(error)
    else:
        raise AssertionError("a file without markers must be refused")


def test_the_figure_is_written_from_the_results(tmp_path: Path):
    (tmp_path / "apps_starter.json").write_text(json.dumps({
        "summary": {"ratio": 0.5, "identical": 2, "questions": 2},
        "per_user": [{"questions": 2, "before_mean_s": 4.0, "after_mean_s": 2.0}],
        "run": {"date": "2026-11-28", "machine": "x86_64", "cores": 2, "command": "python -m benchmarks.apps"},
    }))
    path = report.plot(tmp_path, tmp_path / "figure.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "**0.50x** the time" in report.table(tmp_path) and "2026-11-28, 2 cores" in report.table(tmp_path)
