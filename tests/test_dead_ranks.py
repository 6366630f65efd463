"""Pieces of surviving dead ranks that need no runtime: reduce-op names of the live-rank collectives, the launchers
that kill nobody while the job runs, and when a detached rank asks to rejoin (the runtime's own fault tests are in
tests/test_dataplane.py; the real-rank ones in test_faults.py and test_leader_faults.py)."""

from __future__ import annotations

import re

import torch

from lightning_pgc.runtime.collectives import _op_name


def test_reduce_op_names():
    assert _op_name(None) == "mean" and _op_name("SUM") == "sum"
    assert _op_name(torch.distributed.ReduceOp.MAX) == "max"


def test_the_launchers_kill_nobody_while_the_job_runs_and_reap_every_rank_after_rank_0(caplog):
    """PGCStrategy launches through Lightning's launchers minus their kill-all: ``popen`` and ``fork`` both map to
    a surviving launcher, and after rank 0 returned the other ranks get ``grace_s`` to exit, then are killed; the
    ones that failed are named with their status."""
    import subprocess

    from lightning.pytorch import Trainer

    from lightning_pgc import PGCStrategy
    from lightning_pgc._lightning.launchers import SurvivingMultiprocessingLauncher, SurvivingSubprocessLauncher, _reap

    for start_method, kind in (("popen", SurvivingSubprocessLauncher), ("fork", SurvivingMultiprocessingLauncher)):
        trainer = Trainer(strategy=PGCStrategy(start_method=start_method), devices=2, accelerator="cpu", logger=False)
        assert isinstance(trainer.strategy.launcher, kind)
    procs = [subprocess.Popen(["sleep", "30"]), subprocess.Popen(["sh", "-c", "exit 3"]), subprocess.Popen(["true"])]
    procs[1].wait()
    procs[2].wait()
    _reap(
        procs,
        lambda p: p.poll() is None,
        lambda p: (p.kill(), p.wait()),
        lambda p: p.returncode,
        grace_s=0.5,
        first_rank=1,
    )
    assert procs[0].returncode == -9  # killed after the grace period, not waited for (it sleeps 30 s)
    assert re.search(rf"rank 1 \(pid {procs[0].pid}\) still runs \d+ s after rank 0 returned: killed", caplog.text)
    assert f"rank 2 (pid {procs[1].pid}) exited with status 3" in caplog.text and "rank 3" not in caplog.text


def test_a_detached_rank_idles_up_to_the_open_version_before_it_asks_to_rejoin():
    """``StateTransfer.ahead``: a detached rank idles while it gains on the open version and asks to rejoin within
    one version of it; if it stops gaining (its idle steps are no faster than the others' steps) it asks after
    ``STALLED_IDLE`` idle steps; a single wider gap (the frontier moves in heartbeat-sized jumps) is not enough."""
    from lightning_pgc.strategy.rejoin import STALLED_IDLE, StateTransfer

    transfer = StateTransfer(strategy=None)  # ``ahead`` reads no strategy state
    assert [transfer.ahead(v, 30) for v in (10, 15, 20, 25, 28)] == [True] * 5
    assert transfer.ahead(29, 30) is False  # within a version: rejoin now
    assert transfer.ahead(5, 20) is True and transfer.ahead(6, 24) is True  # a jump of the frontier
    assert transfer.ahead(7, 18) is True  # gaining again
    steady = [transfer.ahead(8 + i, 19 + i) for i in range(STALLED_IDLE)]  # no longer gaining
    assert steady == [True] * (STALLED_IDLE - 1) + [False]
    assert transfer.ahead(30, 30) is False
