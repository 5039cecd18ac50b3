"""The README's "What works today" table is what the benchmarks' result files say."""

from __future__ import annotations

import json

import pytest

from tests.scale.helpers import load_benchmark

readme_table = load_benchmark("readme_table")


def test_the_readme_table_is_rendered_from_the_result_files():
    readme = readme_table.README.read_text(encoding="utf-8")
    assert readme_table.table_in(readme) == readme_table.render(), (
        "README.md's table differs from benchmarks/results/: run "
        "python3 benchmarks/readme_table.py --write")


@pytest.mark.parametrize("row", [r for r in readme_table.ROWS if r.result],
                         ids=lambda r: r.result)
def test_each_figure_names_the_benchmark_run_that_made_it(row):
    data = json.loads((readme_table.RESULTS / row.result).read_text(encoding="utf-8"))
    made = data["recorded"]
    assert made["command"].startswith("python3 benchmarks/"), made
    assert made["date"] and made["machine"] and made["commit"], made
    assert row.figure(data["summary"])      # the keys the row reads are there


def test_a_changed_result_changes_the_table(tmp_path):
    """The table is read from the files, not kept beside them."""
    for path in readme_table.RESULTS.glob("*.json"):
        (tmp_path / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    hang = tmp_path / "hang.json"
    data = json.loads(hang.read_text(encoding="utf-8"))
    data["summary"]["max_healthy_stall_s"] = 1234.0
    hang.write_text(json.dumps(data), encoding="utf-8")
    assert "1234.0 s" in readme_table.render(tmp_path)
    assert "1234.0 s" not in readme_table.render()
