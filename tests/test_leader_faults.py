"""A dead or frozen leader on 4 real CPU ranks (gloo, fork): rank 1 takes over the control plane, shard 0, checkpoints, the
loggers' runs and the fit's results, and the job finishes (tests/test_leader_failover.py has the protocol on
in-process queues). A file of its own so that pytest-xdist runs it beside the other fault tests."""

from __future__ import annotations

import csv
import math
import re

import pytest
import torch

from tests.jobs import FAST_LIVENESS, kill_job, run_job


@pytest.mark.parametrize(
    "strategy,during",
    [("pgc", "train"), ("bounded_staleness", "train"), ("bounded_staleness", "sanity_check")],
    ids=["pgc", "bounded", "bounded_sanity"],
)
def test_a_killed_leader_is_replaced_by_rank_1_and_the_job_finishes(tmp_path, strategy, during):
    """SIGKILL of rank 0 (the leader, and Lightning's rank zero) at step 3: rank 1 takes over. Ranks 1-3 finish fit
    with identical replicas; validation and checkpoints go on (written by rank 1, in the same folder); the CSV
    logger's run continues (rows from before and after the failover in one ``metrics.csv``, ``pgc/alive`` 3); the
    summary comes from rank 1 and the launching process exits 0, warning that rank 0 died. Under bounded staleness
    rank 1 rebuilds the table from the codes the live ranks keep and send it again. Killed in the sanity check
    instead (``bounded_sanity``), before any version closed, version 0 closes without rank 0's partition."""
    fault = {"kind": "Kill", "rank": 0, "step": 3 if during == "train" else 0, "during": during}
    job = kill_job(tmp_path, "kill0", strategy, fault, during)
    log = job["stderr"]
    ranks = job["ranks"]
    assert ranks[0] is None
    live = [ranks[r] for r in (1, 2, 3)]
    assert len({r["checksum"] for r in live}) == 1 and {r["global_step"] for r in live} == {16}
    assert re.search(r"the leader \(rank 0\) is (gone|silent) at version \d+ .*; rank 1 takes over", log), log[-3000:]
    assert re.search(r"PGC rank 1: rank 0 \(the leader\) died or froze; this rank leads from step \d+ on", log), log[
        -3000:
    ]
    assert "rank 0 (the first PGC leader) exited with status -9" in log
    alive = [row["pgc/alive"] for row in job["summary"]["diagnostics"] if "pgc/alive" in row]
    assert alive and alive[-1] == 3.0
    windows = [row["pgc/bounded/window"] for row in job["summary"]["diagnostics"] if "pgc/bounded/window" in row]
    assert bool(windows) == (strategy == "bounded_staleness")  # (the diagnostics rank 1 logged after the failover)
    assert math.isfinite(job["summary"]["metrics"]["val_loss"])
    folder = tmp_path / "kill0" / "checkpoints"
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 16
    assert sorted(int(re.search(r"step=(\d+)", p.name).group(1)) for p in folder.glob("epoch*.ckpt")) == [8, 16]
    runs = list((tmp_path / "kill0" / "logs").glob("version_*"))
    assert [p.name for p in runs] == ["version_0"]  # the same run, not a new version
    with open(runs[0] / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    steps = {int(row["step"]) for row in rows if row.get("step")}
    assert max(steps) >= 15, sorted(steps)  # (rows rank 0 had not flushed yet died with it)
    assert any(row.get("pgc/alive") == "3.0" for row in rows)


@pytest.mark.parametrize("strategy", ["pgc", "bounded_staleness"])
def test_a_frozen_leader_is_replaced_and_rejoins_as_a_worker_when_it_resumes(tmp_path, strategy):
    """SIGSTOP of rank 0 (the leader) for 3 s at step 3: after a heartbeat window (1 s) rank 1 takes over and the
    others go on. After SIGCONT rank 0 waits to learn whether it was replaced before any rank-zero write, steps
    down, gives up Lightning's rank-zero seat and rejoins by state transfer. All four finish with identical
    replicas; checkpoints, validation, the CSV run and the results come from rank 1 (one ``metrics.csv``, readable,
    rows up to the last step). Steps take 0.1 s, so the others are still training when rank 0 resumes (a rank that
    resumes after the others finished, plus the liveness timeout, is left behind: the leader does not wait)."""
    job = run_job(
        tmp_path,
        "freeze0",
        strategy=strategy,
        devices=4,
        max_steps=40,
        val_check_interval=20,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        checkpoint_every_n_steps=20,
        compute_s_per_eval=0.1,
        strategy_kwargs=FAST_LIVENESS,
        faults=[{"kind": "Freeze", "rank": 0, "step": 3, "seconds": 3.0}],
    )
    log = job["stderr"]
    ranks = job["ranks"]
    assert len({r["checksum"] for r in ranks}) == 1 and {r["global_step"] for r in ranks} == {40}
    assert re.search(r"the leader \(rank 0\) is (frozen|silent) at version \d+ .*; rank 1 takes over", log), log[-3000:]
    assert "PGC rank 0: rank 1 took over as leader while this rank was frozen" in log
    assert "rank 0: rejoined at version" in log
    assert ranks[1]["rank_stats"][0]["rejoined"] >= 1
    assert math.isfinite(job["summary"]["metrics"]["val_loss"])
    folder = tmp_path / "freeze0" / "checkpoints"
    assert sorted(int(re.search(r"step=(\d+)", p.name).group(1)) for p in folder.glob("epoch*.ckpt")) == [20, 40]
    runs = list((tmp_path / "freeze0" / "logs").glob("version_*"))
    assert [p.name for p in runs] == ["version_0"]
    with open(runs[0] / "metrics.csv", newline="") as fh:
        steps = {int(row["step"]) for row in csv.DictReader(fh) if row.get("step")}
    assert max(steps) >= 39, sorted(steps)


def test_a_successor_appends_to_rank_0s_csv_run_keeping_its_rows_and_columns(tmp_path):
    """The logger side of a failover, in one process: rank 0's CSV run has rows; the successor, pinned to the same
    version, continues the run: one ``metrics.csv`` with rank 0's rows, then its own, under the union of columns."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_pgc._lightning import continue_loggers, logger_ids, pin_loggers

    first = CSVLogger(tmp_path, name="logs")
    first.log_metrics({"train_loss": 1.0}, step=1)
    first.save()
    ids = logger_ids([first])
    successor = CSVLogger(tmp_path, name="logs")
    pin_loggers([successor], ids)
    continue_loggers([successor])
    successor.log_metrics({"train_loss": 0.5, "pgc/alive": 3.0}, step=5)
    successor.save()
    assert successor.log_dir == first.log_dir and ids == ["0"]
    with open(tmp_path / "logs" / "version_0" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["step"], r["train_loss"], r["pgc/alive"]) for r in rows] == [("1", "1.0", ""), ("5", "0.5", "3.0")]


def test_every_logger_write_follows_the_seat_first_while_guarded(tmp_path):
    """The fence of a resumed leader on the logger side: while guarded, each write of a logger first calls the seat
    check (a leader in doubt waits there to learn whether it was replaced); after the fit the logger is plain."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_pgc._lightning import guard_loggers, unguard_loggers

    logger = CSVLogger(tmp_path, name="logs")
    checks = []
    guard_loggers([logger], lambda: checks.append(1))
    guard_loggers([logger], lambda: checks.append(2))  # idempotent: one guard
    logger.log_metrics({"train_loss": 1.0}, step=0)
    logger.save()
    assert checks == [1, 1]
    unguard_loggers([logger])
    logger.log_metrics({"train_loss": 0.5}, step=1)
    logger.save()
    assert checks == [1, 1] and "log_metrics" not in vars(logger)
    with open(tmp_path / "logs" / "version_0" / "metrics.csv", newline="") as fh:
        assert [row["train_loss"] for row in csv.DictReader(fh)] == ["1.0", "0.5"]


def test_other_ranks_pin_rank_0s_wandb_run_id(tmp_path):
    """The W&B run a successor continues: rank 0's, by id, resumed (``wandb.init(id=..., resume="allow")``)."""
    from lightning.pytorch.loggers import WandbLogger

    from lightning_pgc._lightning import pin_loggers

    wandb = WandbLogger(save_dir=str(tmp_path), offline=True, project="p")
    pin_loggers([wandb], ["abc123"])
    assert wandb.version == "abc123"
    assert wandb._wandb_init["id"] == "abc123" and wandb._wandb_init["resume"] == "allow"
