"""The control plane's scale benchmark runs end to end at a tiny n and writes its results, page and plot."""

from __future__ import annotations

import json

import control_scale


def test_the_control_scale_benchmark_runs_at_a_tiny_n_and_writes_its_files(tmp_path):
    written = control_scale.main(
        ["--ns", "4", "--steps", "3", "--skip", "1", "--step-ms", "20", "--docs", str(tmp_path)]
    )
    assert {p.name for p in written} == {"control_scale.json", "control_scale.md", "control_scale.png"}
    result = json.loads((tmp_path / "control_scale.json").read_text())
    assert {(r["n"], r["variant"]) for r in result["rows"]} == {(4, "before"), (4, "after")}
    for row in result["rows"]:
        assert row["leader_store_calls_per_step"] > 0 and row["leader_cpu_ms_per_step"] > 0
    assert "| 4 |" in (tmp_path / "control_scale.md").read_text()
    assert result["machine"] and len(result["load_average_1min"]) == 2
