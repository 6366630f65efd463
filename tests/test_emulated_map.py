"""A tiny emulated map end to end: one JSON Lines file per round, resumable, summarised with Holm's correction,
and the guide rows generated from it in the documented schema."""

from __future__ import annotations

import json

import pytest

from benchmarks import which_strategy
from lightning_pgc.emulator.cells import Cell
from lightning_pgc.emulator.crossmap import plan_items, read_records, run_round
from lightning_pgc.emulator.rounds import tiny_protocol
from lightning_pgc.emulator.summary import summarize

STRATEGIES = {"ddp", "ignore_stragglers", "gc_fr", "gc_cr", "pgc_fr", "pgc_cr"}


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def test_tiny_map_round_resumes_and_yields_guide_rows(tmp_path):
    cells = [Cell(4, "slow node", "compute")]
    protocol = tiny_protocol()
    path = tmp_path / "round.jsonl"
    items, _ = plan_items(cells, protocol)
    assert run_round(path, cells, protocol, progress=False, limit=2) == 2
    with open(path, "a") as f:
        f.write('{"torn')  # a run killed mid-write
    assert run_round(path, cells, protocol, progress=False) == len(items) - 2  # only what is missing
    assert run_round(path, cells, protocol, progress=False) == 0
    records = read_records(path)
    assert len(records) == len(items) == len(path.read_text().splitlines()) - 1  # all but the torn line
    for r in records:
        assert set(r["protocol"]["tuning_seeds"]).isdisjoint(r["protocol"]["eval_seeds"])
        assert len(r["tuning"]["scores"]) == len(protocol.lrs) * len(protocol.momenta)
        assert len(r["eval"]["time_late"]) == len(protocol.eval_seeds)
        times = [t for t in r["eval"]["time_late"] if t is not None]
        assert all(0 < t <= r["budget_s"] for t in times)

    summary = summarize(records, source="round.jsonl")
    (cell,) = summary["cells"]
    compared = [a for a in cell["arms"] if a["strategy"] != "ddp"]
    assert compared and all("vs_ddp_late" in a and "vs_ddp_early" in a for a in compared)
    assert all(a["vs_ddp_late"]["p_holm"] >= a["vs_ddp_late"]["p"] for a in compared)

    guide = which_strategy.build(summary, "round.jsonl")
    assert guide["source"] == "round.jsonl"
    for row in guide["rows"] + [guide["default"]]:
        assert set(row) == {"pattern", "bound", "data", "strategy", "s", "lr", "momentum", "evidence"}
        assert row["strategy"] in STRATEGIES and row["bound"] in ("compute", "comm", "any")
        assert row["data"] in ("iid", "skewed", "any") and row["evidence"].startswith("docs/")
    assert guide["default"]["pattern"] == "don't know"
    json.dumps(guide)
