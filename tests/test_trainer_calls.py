"""A script that calls the Trainer several times works under PGC as under ``ddp`` (``tests/trainer_calls_job.py``):
``validate`` before ``fit``, ``fit`` then ``validate``/``test``/``predict``, a second ``Trainer`` that fits on from
``ckpt_path="last"``, under the ``popen``, ``fork`` and ``spawn`` launchers and under ``torchrun``, each against
``ddp`` in the same test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import trainer_calls_job as job

ROOT = Path(__file__).resolve().parents[1]
CALLS = ["validate", "fit", "validate", "test", "predict", "fit", "test"]


def _run(
    strategy: str, start_method: str, out: Path, launch: tuple[str, ...] = (), short: bool = False
) -> dict[str, Any]:
    out.mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, *launch, "-m", "tests.trainer_calls_job", strategy, start_method, str(out)]
    proc = subprocess.run(
        command + (["short"] if short else []), cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    assert "killed" not in log, log[-4000:]  # no rank outlived the script
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left after the script ended: {left}"
    calls = [[json.loads(line) for line in (out / f"rank{k}.jsonl").read_text().splitlines()] for k in range(2)]
    scripts = {int(p.stem[len("script") :]): json.loads(p.read_text()) for p in out.glob("script*.json")}
    return {"calls": calls, "scripts": scripts, "log": log}


def _check_calls(run: dict[str, Any], calls: list[str] = CALLS) -> None:
    """Every rank ran every call, with identical replicas after each, and no runtime thread outlived a call."""
    ranks = run["calls"]
    for rows in ranks:
        assert [r["call"] for r in rows] == calls
        assert all(r["threads"] == [] for r in rows), rows
    for i in range(len(calls)):
        assert len({rows[i]["checksum"] for rows in ranks}) == 1, f"replicas differ after call {i} ({calls[i]})"
    steps = [r["step"] for r in ranks[0] if r["call"] == "fit"]
    assert steps == [job.STEPS, job.RESUMED_STEPS]  # the second fit went on from the first one's last checkpoint
    fits = [r["checksum"] for r in ranks[0] if r["call"] == "fit"]
    assert fits[0] != fits[1]  # the second fit trained on


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp")
    return {method: _run("ddp", method, out / method) for method in ("popen", "fork")}


@pytest.mark.parametrize("strategy", ["pgc", "bounded_staleness"])
def test_a_script_of_trainer_calls_finishes_as_under_ddp_with_the_default_launcher(tmp_path, ddp, strategy):
    """popen: ranks 1..n-1 run the whole script, so every later call runs in the same processes; the job ends
    when the script ends on every rank. The training step's conditional ``sync_dist=True`` (condition false)
    trains normally (the source scan only warns about it: ``test_compat.py``)."""
    run, base = _run(strategy, "popen", tmp_path / strategy), ddp["popen"]
    _check_calls(run)
    _check_calls(base)
    assert run["calls"][0][0]["checksum"] == base["calls"][0][0]["checksum"]  # the same model, seeded alike
    assert sorted(run["scripts"]) == sorted(base["scripts"]) == [0, 1]
    for rank, script in run["scripts"].items():
        reference = base["scripts"][rank]
        assert script["returned"] == reference["returned"]  # as many validate/test/predict results as ddp
        assert script["step"] == job.RESUMED_STEPS
        assert script["threads"] == []
        # no process group but the default one left, and once that is destroyed no socket opened during the script
        assert script["process_groups"] == reference["process_groups"] == 1
        assert script["sockets_left"] == [], script


def test_the_fork_launcher_runs_every_call_as_under_ddp(tmp_path, ddp):
    run, base = _run("pgc", "fork", tmp_path / "pgc"), ddp["fork"]
    _check_calls(run)
    _check_calls(base)
    assert run["scripts"][0]["returned"] == base["scripts"][0]["returned"]  # predict returns None, as under ddp
    assert run["scripts"][0]["threads"] == []


def test_the_spawn_launcher_runs_fit_validate_and_a_second_fit(tmp_path, ddp):
    """spawn starts fresh ranks for every call, each importing Lightning (the slowest launcher here): fit, then
    validate, then a second Trainer's fit from the last checkpoint."""
    run = _run("pgc", "spawn", tmp_path / "pgc", short=True)
    _check_calls(run, ["fit", "validate", "fit"])
    assert run["scripts"][0]["returned"] == {"validate": ddp["fork"]["scripts"][0]["returned"]["validate"]}


def test_torchrun_runs_every_call_as_under_ddp(tmp_path, ddp):
    """torchrun starts every rank itself (no Lightning launcher): each runs the whole script."""
    run = _run(
        "pgc",
        "popen",
        tmp_path / "pgc",
        launch=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
    )
    _check_calls(run)
    for rank, script in run["scripts"].items():
        assert script["returned"] == ddp["popen"]["scripts"][rank]["returned"]
        assert script["threads"] == []
