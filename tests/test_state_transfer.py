"""State transfer at real size (``tests/transfer_job.py``): a 25 M-parameter model, 204 MB of weights and momentum,
on 4 CPU ranks through a long stall, a frozen leader, a donor killed mid-transfer and a resume. In each, every
rank that finishes ends with bitwise identical parameters, buffers, optimizer and scheduler state; no value the
store carries exceeds 64 KiB; no key of a transfer's rendezvous is left; and a transfer grows neither side's
resident memory by a quarter of the state (it is sent from, and received into, the ranks' own tensors), beyond the
aggregate buffers the comm thread's pool adds meanwhile (at most ``max_lag``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import transfer_job as job

ROOT = Path(__file__).resolve().parents[1]
LARGEST_PAYLOAD = 64 << 10


def _run(scenario: str, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "tests.transfer_job", scenario, str(out)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    ranks = {int(p.stem[len("rank") :]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    return {"ranks": ranks, "log": log}


class _Runs(dict):
    """Each scenario's run, started by the first test that reads it: a test's time limit covers its own scenario,
    not every scenario of the module."""

    def __init__(self, base: Path) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, scenario: str) -> dict[str, Any]:
        assert scenario in job.SCENARIOS, scenario
        self[scenario] = _run(scenario, self.base / scenario)
        return self[scenario]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _Runs(tmp_path_factory.mktemp("transfer"))


def _check_replicas(run: dict[str, Any], survivors: list[int]) -> None:
    ranks = run["ranks"]
    assert sorted(ranks) == survivors, run["log"][-4000:]
    for field in ("parameters", "buffers", "optimizer", "scheduler"):
        assert len({r[field] for r in ranks.values()}) == 1, f"{field} differ: {[r[field] for r in ranks.values()]}"
    assert {r["step"] for r in ranks.values()} == {job.STEPS}
    state = ranks[survivors[0]]["state_bytes"]
    assert state > 200e6  # weights and momentum of 25.4 M parameters
    for r in ranks.values():
        assert r["largest_payload"][0] <= LARGEST_PAYLOAD, r["largest_payload"]
        assert r["keys_left"] == []
        for transfer in r["transfers"]:
            assert transfer["rss_growth"] < state / 4, transfer
            assert transfer["aggregate_buffers_added"] <= job.MAX_LAG, transfer


def _sides(run: dict[str, Any]) -> dict[str, list[int]]:
    sides: dict[str, list[int]] = {"donor": [], "recipient": []}
    for rank, row in sorted(run["ranks"].items()):
        for transfer in row["transfers"]:
            sides[transfer["side"]].append(rank)
    return sides


def test_a_rank_stalled_past_max_lag_rejoins_with_the_whole_state_over_its_own_group(runs):
    run = runs["stall"]
    _check_replicas(run, [0, 1, 2, 3])
    assert _sides(run) == {"donor": [0], "recipient": [2]}
    moved = re.search(r"PGC rank 2: rejoined at version \d+ with the state of rank 0 \(([\d.]+) MB", run["log"])
    assert moved is not None and float(moved.group(1)) * 1e6 >= run["ranks"][2]["state_bytes"] - 1e5
    assert run["ranks"][0]["rank_stats"][2]["rejoined"] == 1


def test_a_frozen_leader_is_replaced_and_rejoins_with_its_successors_state(runs):
    run = runs["freeze_leader"]
    _check_replicas(run, [0, 1, 2, 3])
    assert "rank 1 takes over" in run["log"]
    assert "PGC rank 0: rejoined at version" in run["log"] and "with the state of rank 1" in run["log"]
    assert _sides(run) == {"donor": [1], "recipient": [0]}


def test_a_donor_killed_mid_transfer_is_survived_and_the_recipient_asks_again(runs):
    run = runs["donor_death"]
    _check_replicas(run, [1, 2, 3])  # rank 0 was killed after the header, the metadata and one chunk
    log = run["log"]
    assert "PGC rank 2: the state transfer from rank 0 failed" in log and "asking again" in log
    assert "PGC rank 2: rejoined at version" in log and "with the state of rank 1" in log
    assert "exited with status -9" in log


def test_a_resume_from_a_checkpoint_keeps_every_replica_identical(runs):
    _check_replicas(runs["resume"], [0, 1, 2, 3])
