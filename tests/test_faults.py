"""Faults on real processes (4 CPU ranks, gloo): a long stall, a non-finite gradient, non-finite BatchNorm statistics,
a 300-step soak; and the fault callbacks."""

from __future__ import annotations

import math
import os
import re
import threading
import time
from typing import Optional

import pytest
import torch

from lightning_pgc.callbacks.faults import Freeze, Kill, NaNGradient, Stall
from tests.jobs import FAST_LIVENESS, LIVENESS, MAX_LAG, kill_job, run_job, soak, whole_log


#: How far apart the survivors of a lost job may be gone: detection takes at most twice the heartbeat window (1 s
#: here, so 2 s), the rest is interpreter and gloo teardown, which on CI's 2 loaded cores has taken 4.7 s. The bound
#: guards against a hang or a wait for a long timeout (the job's own limit is 240 s); the log lines the tests check
#: prove each rank failed by detecting the loss itself, not by being killed by the launcher.
EXIT_SPREAD_S = 2 * 1.0 + 6.0


def test_a_long_stall_costs_nobody_and_the_stalled_rank_rejoins_by_state_transfer(tmp_path):
    """Rank 3 is frozen by SIGSTOP for 6 s at step 2; rank 1's gradient is NaN at step 50; rank 2 stalls 2 s at
    step 70. The faults do not overlap: with two ranks out at once, 2 of 4 could not close a version (s = 1), and
    nobody would fall behind.

    Frozen rank 3 misses its heartbeats and is reported missing. Its comm thread froze too, so the others wait in
    the all-reduce it froze in for one liveness window (heartbeat window 2 s + timeout 3 s: the one cost of a frozen
    rank, which the freeze outlasts), then go on without it; after SIGCONT it rejoins by state transfer. Nobody
    waits for stalled rank 2 (its training thread sleeps, its comm thread is on time): it falls past ``max_lag``
    versions, is detached (its buffers stay bounded), comes back and gets a donor's state (during the run or, if the
    others finished, at the end).
    Rank 1's NaN is rejected (counted, not decoded). Every replica ends identical, losses stay finite.
    """
    job = run_job(
        tmp_path,
        "stall",
        strategy="pgc",
        devices=4,
        max_steps=90,
        check_val_every_n_epoch=100,
        compute_s_per_eval=0.05,
        strategy_kwargs={"liveness": {"max_lag": MAX_LAG, "heartbeat_interval": 0.1, "heartbeat_misses": 20}},
        faults=[
            {"kind": "Freeze", "rank": 3, "step": 2, "seconds": 6.0},
            {"kind": "NaNGradient", "rank": 1, "step": 50},
            {"kind": "Stall", "rank": 2, "step": 70, "seconds": 2.0},
        ],
    )
    ranks = job["ranks"]
    assert len({r["checksum"] for r in ranks}) == 1 and len({r["global_step"] for r in ranks}) == 1
    assert all(r["pgc_threads_after_fit"] == [] for r in ranks)
    table = ranks[0]["rank_stats"]
    assert all(r["rank_stats"] == table for r in ranks)
    assert table[2]["rejoined"] >= 1 and table[3]["rejoined"] >= 1  # (others may too, on a busy machine)
    assert table[1]["rejected"] == 1 and sum(row["rejected"] for row in table) == 1
    # the others went on: each faulty rank ran steps without computing or applying anything
    assert ranks[2]["skipped_steps"] >= MAX_LAG and ranks[3]["skipped_steps"] >= MAX_LAG
    # bounded memory: they never held more than max_lag aggregates
    assert max(ranks[k]["buffers"]["mailbox_high_water"] for k in (2, 3)) <= MAX_LAG + 1
    assert all(math.isfinite(loss) for _, _, loss in job["curve"])
    assert "rejoined at version" in job["stderr"] and "non-finite gradient at step 50" in job["stderr"]
    assert "rank 3 is missing (no heartbeat" in job["stderr"] and "rank 3 is alive again" in job["stderr"]


def test_one_ranks_nan_batchnorm_statistics_are_rejected_and_every_replica_stays_finite_and_identical(tmp_path):
    """4 ranks, the digits CNN with BatchNorm; rank 1's running statistics turn NaN at step 3, its gradient intact.
    Its code is rejected as a NaN gradient's is (counted, not decoded), it takes the others' statistics with that
    step's aggregate, and every replica ends identical with every parameter and buffer finite. Rank 3 is slow at
    every step, so without the check rank 1's code would be among the three admitted and the aggregate's mean would
    carry the NaN to every rank."""
    job = run_job(
        tmp_path,
        "nan_buffers",
        strategy="pgc",
        devices=4,
        max_steps=8,
        batch_norm=True,
        check_val_every_n_epoch=100,
        delay="slowranks(ranks=[3], seconds=0.3)",
        faults=[{"kind": "NaNBuffers", "rank": 1, "step": 3}],
    )
    ranks = job["ranks"]
    assert len({r["checksum"] for r in ranks}) == 1 and {r["global_step"] for r in ranks} == {8}
    assert all(r["state_finite"] for r in ranks)
    table = ranks[0]["rank_stats"]
    assert table[1]["rejected"] == 1 and sum(row["rejected"] for row in table) == 1
    assert all(math.isfinite(loss) for _, _, loss in job["curve"])
    assert "PGC rank 1: non-finite buffers at step 3" in job["stderr"]


def test_a_300_step_soak_with_jitter_and_stalls_neither_hangs_nor_grows(tmp_path):
    """4 ranks, pgc_cr s = 1, 300 steps with log-normal jitter (median 3 ms) and a 1 s stall on each of ranks 1, 2
    and 3 (steps 60, 140, 220: tens of versions, far past ``max_lag``). The job finishes (the harness timeout
    guards against a hang), every stalled rank rejoins by state transfer, replicas end identical, the loss falls,
    and per rank nothing grows from step 50 (warm-up done) to the end: no thread more, resident memory within
    ``SOAK_RSS_GROWTH``. Measured growth is at most 4 MiB on a ~540 MiB rank (3 runs); a leak of 100 kB per step (one
    tensor kept per step) adds 25-28 MiB over the 250 steps and trips the bound."""
    soak(tmp_path)


def test_fault_callbacks_validate_their_arguments_and_fire_once():
    with pytest.raises(ValueError, match="rank must be a non-negative integer"):
        Kill(rank=-1, step=0)
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        Stall(rank=0, step="3", seconds=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seconds must be a finite number"):
        Freeze(rank=0, step=0, seconds=float("inf"))
    fired = []

    class Probe(Stall):
        def fire(self, trainer, pl_module):
            fired.append(trainer.global_step)

    class T:
        global_rank, global_step = 1, 0

    probe = Probe(rank=1, step=2, seconds=0)
    for step in range(5):
        T.global_step = step
        probe.on_train_batch_start(T, None, None, step)
    other = Probe(rank=0, step=0, seconds=0)
    other.on_train_batch_start(T, None, None, 0)
    assert fired == [2] and other.fired_at is None
    assert repr(NaNGradient(rank=1, step=3)) == "NaNGradient(rank=1, step=3)"
    with pytest.raises(ValueError, match="during must be one of"):
        Kill(rank=0, step=0, during="test")
    with pytest.raises(ValueError, match="the sanity check runs before step 0"):
        Kill(rank=0, step=3, during="sanity_check")

    class V(T):
        sanity_checking = False

    fired.clear()
    in_validation = Probe(rank=1, step=2, seconds=0, during="validation")
    in_sanity_check = Probe(rank=1, step=0, seconds=0, during="sanity_check")
    assert repr(in_validation) == "Probe(rank=1, step=2, seconds=0.0, during='validation')"
    V.global_step, V.sanity_checking = 0, True
    for fault in (in_validation, in_sanity_check):
        fault.on_train_batch_start(V, None, None, 0)  # never at a training batch
        fault.on_validation_batch_start(V, None, None, 0)
    V.sanity_checking = False
    for step in range(4):
        V.global_step = step
        in_validation.on_validation_batch_start(V, None, None, 0)
        in_sanity_check.on_validation_batch_start(V, None, None, 0)
    assert fired == [0, 2]  # the sanity check's first batch, then the first validation batch from step 2


def test_more_than_s_frozen_ranks_fail_every_survivor_fast_naming_them(tmp_path):
    """s = 1 and ranks 2 and 3 freeze (SIGSTOP, 8 s) at step 3: no version can close. The leader reports the
    missing ranks within the heartbeat window (1 s) plus ``timeout`` (1 s) of the last version it closed, the
    other ranks get the error (ABORT; tested in-process in test_runtime.py), and the job exits non-zero instead of
    hanging."""
    from pgc_lab.experiments import JobFailed

    with pytest.raises(JobFailed) as failed:
        run_job(
            tmp_path,
            "frozen",
            strategy="pgc",
            devices=4,
            max_steps=40,
            check_val_every_n_epoch=100,
            strategy_kwargs={"liveness": {"timeout": 1.0, "heartbeat_interval": 0.1, "heartbeat_misses": 10}},
            faults=[{"kind": "Freeze", "rank": r, "step": 3, "seconds": 8.0} for r in (2, 3)],
        )
    log = whole_log(failed.value.result.out)
    found = re.search(r"Missing ranks: \[2, 3\]; the last version closed is (\d+), ([\d.]+) s ago", log)
    assert found is not None, log[-3000:]
    assert 2 <= int(found.group(1)) <= 3 and float(found.group(2)) < 5.0


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc: the launcher and its ranks)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":  # a zombie is gone, only not reaped yet
                parents[int(entry)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


@pytest.mark.parametrize(
    "during,step,strategy",
    [
        ("train", 3, "pgc"),
        ("validation", 8, "pgc"),
        ("sanity_check", 0, "pgc"),
        ("sanity_check", 0, "bounded_staleness"),
    ],
)
def test_a_killed_worker_is_survived_validation_and_checkpoints_included(tmp_path, during, step, strategy):
    """SIGKILL of rank 3 (4 CPU ranks, s = 1, one shard on rank 0) at step 3, in the validation after step 8, or in
    fit's sanity check (2 batches; the runtime starts there): the launcher kills nobody, the other three finish fit
    with validation (``sync_dist`` reduce, torchmetrics accuracy) and checkpoints (barriers, broadcasts) among the
    live ranks; their replicas are identical; the leader names the dead rank and the version; ``pgc/alive`` drops
    to 3; the launching process exits 0. Under bounded staleness version 0 closes without the dead rank's partition
    (nobody else evaluates it at version 0)."""
    job = kill_job(tmp_path, "kill", strategy, {"kind": "Kill", "rank": 3, "step": step, "during": during}, during)
    ranks = job["ranks"]
    assert ranks[3] is None
    assert len({r["checksum"] for r in ranks[:3]}) == 1 and {r["global_step"] for r in ranks[:3]} == {16}
    died = re.search(r"rank 3 died at version (\d+) .*3 of 4 ranks alive", job["stderr"])
    assert died is not None and int(died.group(1)) >= step, job["stderr"][-3000:]
    alive = [row["pgc/alive"] for row in job["summary"]["diagnostics"] if "pgc/alive" in row]
    assert alive and alive[-1] == 3.0
    assert math.isfinite(job["summary"]["metrics"]["val_loss"]) and "val_acc" in job["summary"]["metrics"]
    ckpt = torch.load(tmp_path / "kill" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 16
    saved = sorted(
        int(re.search(r"step=(\d+)", p.name).group(1)) for p in (tmp_path / "kill" / "checkpoints").glob("epoch*.ckpt")
    )
    assert saved == [8, 16]


def test_more_than_s_killed_ranks_fail_every_survivor_fast_naming_them_and_leave_no_process(tmp_path):
    """s = 1 and ranks 2 and 3 are SIGKILLed at step 3: no version can close. Every surviving rank exits non-zero
    after detecting it within twice the heartbeat window (1 s; ``timeout`` 1 s; plus teardown: ``EXIT_SPREAD_S``)
    of the second kill, the errors name the dead ranks and the last version closed, the last checkpoint on disk
    loads, and no process of the job is left."""
    failed, exits = _failing_job_watched(
        tmp_path,
        "kill2",
        max_steps=40,
        check_val_every_n_epoch=100,
        checkpoint_every_n_steps=2,
        faults=[{"kind": "Kill", "rank": r, "step": 3} for r in (2, 3)],
    )
    ranks = sorted(t for t in exits.values() if t is not None)[:4]  # the launcher exits last (it reaps the ranks)
    # the two killed ranks go first; the job is lost only at the second kill (one dead rank is survived), so the
    # survivors' clock starts there: under load rank 3 reached its step 3 seconds after rank 2 was killed
    fatal_kill = ranks[1]
    assert ranks[3] - fatal_kill < EXIT_SPREAD_S, ranks
    log = whole_log(failed.result.out)
    assert re.search(r"Missing ranks: \[2, 3\]; the last version closed is \d+", log), log[-3000:]
    assert re.search(r"rank 1 \(pid \d+\) exited with status 1: .*Missing ranks: \[2, 3\]", log), log[-3000:]
    ckpt = torch.load(tmp_path / "kill2" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] >= 2 and "state_dict" in ckpt


def _failing_job_watched(tmp_path, name: str, failover=None, **spec):
    """Run a job that must fail (4 ranks, pgc, heartbeat window 1 s, timeout 1 s) while watching its processes;
    returns the JobFailed and, per process of the job, when it was gone. Asserts none is left."""
    from pgc_lab.experiments import JobFailed

    failed: list[JobFailed] = []

    def run() -> None:
        try:
            run_job(
                tmp_path,
                name,
                strategy="pgc",
                devices=4,
                strategy_kwargs={"liveness": {**LIVENESS, "failover": failover}},
                **spec,
            )
        except JobFailed as exc:
            failed.append(exc)

    job = threading.Thread(target=run)
    job.start()
    exits: dict[int, Optional[float]] = {}  # every process of the job -> when it was gone
    while job.is_alive():
        now, procs = time.monotonic(), _descendants(os.getpid())
        exits.update({p: None for p in procs if p not in exits})
        exits.update({p: now for p, t in exits.items() if t is None and p not in procs})
        time.sleep(0.05)
    assert failed and len(exits) >= 5  # the launching process and its 4 ranks
    assert not _descendants(os.getpid()) and not any(_running(p) for p in exits)
    return failed[0], exits


def test_without_failover_a_killed_leader_ends_the_job_fast_and_clean(tmp_path):
    """Rank 0 (the leader) is SIGKILLed at step 3 with ``failover=False`` (as under bounded staleness, or when rank 0
    is the launching process): the job must end, fast and without leftovers. Every worker fails within twice the
    heartbeat window (plus teardown: ``EXIT_SPREAD_S``), naming the lost leader, and the launching process exits
    non-zero saying rank 0 died.
    (With failover the job finishes: tests/test_leader_faults.py.)"""
    failed, exits = _failing_job_watched(
        tmp_path,
        "kill0",
        failover=False,
        max_steps=40,
        check_val_every_n_epoch=100,
        faults=[{"kind": "Kill", "rank": 0, "step": 3}],
    )
    ranks = sorted(t for t in exits.values() if t is not None)[:4]
    assert ranks[3] - ranks[0] < EXIT_SPREAD_S, ranks
    log = whole_log(failed.result.out)
    assert re.search(r"rank 0 \(the PGC leader\) exited with status -9", log), log[-3000:]
    for r in (1, 2, 3):
        lost = re.search(rf"rank {r} \(pid \d+\) exited with status 1: .*(PGC leader|lost the leader)", log)
        assert lost is not None, log[-3000:]


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_on_one_worker_leaves_the_others_training(tmp_path):
    """A SIGTERM on rank 2 only (one node evicted) at step 3: rank 2 says BYE and leaves at once; the others go on
    as with a dead rank (the data group is rebuilt without it) and finish with identical replicas; the job
    succeeds."""
    kwargs = dict(FAST_LIVENESS)
    job = run_job(
        tmp_path,
        "term1",
        strategy="pgc",
        devices=4,
        max_steps=16,
        check_val_every_n_epoch=100,
        strategy_kwargs=kwargs,
        faults=[{"kind": "Terminate", "rank": 2, "step": 3}],
    )
    ranks = job["ranks"]
    assert ranks[2] is None
    assert len({ranks[r]["checksum"] for r in (0, 1, 3)}) == 1 and {ranks[r]["global_step"] for r in (0, 1, 3)} == {16}
    assert re.search(r"PGC rank 2: SIGTERM: leaving at step [3-5] ", job["stderr"]), job["stderr"][-3000:]
    assert re.search(
        r"PGC: rank 2 left at version \d+ \(SIGTERM on that rank\); training goes on with 3 of 4", job["stderr"]
    ), job["stderr"][-3000:]


def test_sigterm_on_every_rank_stops_the_job_cleanly_with_a_checkpoint(tmp_path):
    """A SIGTERM on every rank at step 5 stops the job as under ``ddp``: each rank raises Lightning's
    ``SIGTERMException`` at its next batch, rank 0's ``ModelCheckpoint(save_on_exception=True)`` writes a checkpoint
    of its state, nothing hangs and the launcher exits 0 (as Lightning's ``SIGTERMException``, a ``SystemExit``)."""
    from pgc_lab.experiments import launch

    result = launch(
        {
            "out": str(tmp_path / "term_all"),
            "start_method": "fork",
            "strategy": "pgc",
            "devices": 4,
            "max_steps": 40,
            "check_val_every_n_epoch": 100,
            "checkpoint_every_n_steps": 100,
            "checkpoint_on_exception": True,
            "strategy_kwargs": FAST_LIVENESS,
            "faults": [{"kind": "Terminate", "rank": r, "step": 5} for r in range(4)],
        },
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.log_tail[-3000:]
    log = whole_log(result.out)
    assert all(f"PGC rank {r}: SIGTERM: leaving at step" in log for r in range(4)), log[-3000:]
    saved = list((tmp_path / "term_all" / "checkpoints").glob("*.ckpt"))
    assert saved, result.log_tail[-3000:]
    steps = {torch.load(p, weights_only=False)["global_step"] for p in saved}
    assert min(steps) >= 5 and max(steps) < 40
