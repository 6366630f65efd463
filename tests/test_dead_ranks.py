"""Dead ranks on in-process queues: up to s dead workers are survived (data plane and collectives), a dead shard
owner fails fast naming it, and Lightning's collectives run among the live ranks with identical results."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from lightning_pgc.codes import make_scheme
from lightning_pgc.runtime import CoordinatorError
from lightning_pgc.runtime.collectives import CollectiveError, _op_name
from tests.test_runtime import _eventually, _release_receivers, _stop_all, code, make_runtimes, submit


def _together(rts, fn):
    """``fn(rt)`` on every runtime at once (collectives block until all live ranks joined); results by rank."""
    out: dict[int, object] = {}

    def run(rt):
        try:
            out[rt.rank] = fn(rt)
        except Exception as exc:  # returned, to be asserted on
            out[rt.rank] = exc

    threads = [threading.Thread(target=run, args=(rt,)) for rt in rts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a collective hung"
    return out


def _kill(rts, dead):
    """Rank ``dead``'s process is gone: every stream from it breaks (its runtime was never started here)."""
    for rt in rts:
        _release_receivers(rt.hub, rt.rank, [dead])


def test_a_dead_worker_that_owns_no_shard_is_survived_with_identical_aggregates_and_collectives(caplog):
    """pgc_cr, n = 4, s = 1, one shard (rank 0's, the small-model layout). Rank 3 dies after version 1: the leader
    names it and the version, nobody aborts, versions go on closing with the 3 live ranks, every live rank gets the
    same aggregate, heartbeats carry the live count, and barrier, broadcast and reduce complete among the live
    ranks with identical results."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=1, ranks=[0, 1, 2], heartbeat=(0.05, 40))  # a 2 s window: busy CPUs
    try:
        for v in range(2):
            for rt in rts:
                submit(rt, v, ages=(0, 0))
            for rt in rts:
                rt.release(rt.wait(v))
        _kill(rts, 3)
        assert _eventually(lambda: 3 in rts[0].leader.dead)
        assert "rank 3 died at version 2" in caplog.text and "3 of 4 ranks alive" in caplog.text
        for v in range(2, 6):
            for rt in rts:
                submit(rt, v, ages=(0, 0))
            aggs = [rt.wait(v) for rt in rts]
            assert all(torch.equal(a, aggs[0]) for a in aggs)
            expected = sum(code(k, v) for k in (0, 1, 2)) / 3 / 2  # mu / n = 1 / ((n - s) c)
            torch.testing.assert_close(aggs[0], expected)
            for rt, a in zip(rts, aggs):
                rt.release(a)
        assert all(rt.error is None and rt.mailbox.failure() is None for rt in rts)
        assert _eventually(lambda: all(rt.alive == 3 for rt in rts))

        assert set(_together(rts, lambda rt: rt.collectives.barrier()).values()) == {None}
        got = _together(rts, lambda rt: rt.collectives.broadcast({"path": f"from {rt.rank}"}, src=0))
        assert all(v == {"path": "from 0"} for v in got.values())
        got = _together(rts, lambda rt: rt.collectives.reduce(torch.tensor([1.0, 2.0]) * (rt.rank + 1), "mean"))
        assert all(torch.equal(v, torch.tensor([2.0, 4.0])) for v in got.values())  # mean of ranks 0, 1, 2
        got = _together(rts, lambda rt: rt.collectives.reduce(torch.tensor(rt.rank), "sum"))
        assert all(int(v) == 3 for v in got.values())
        got = _together(rts, lambda rt: rt.collectives.broadcast(rt.rank, src=3))
        assert all(isinstance(v, CollectiveError) and "rank 3, which is no longer in the job" in str(v)
                   for v in got.values())
        got = _together(rts, lambda rt: rt.collectives.all_gather(torch.tensor([rt.rank])))
        assert all(isinstance(v, CollectiveError) and "ranks [3] are gone" in str(v) for v in got.values())
    finally:
        _stop_all(rts, timeout=1.0)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pgc-")]


def test_collectives_with_every_rank_alive_gather_in_rank_order_and_refuse_mismatched_calls():
    scheme = make_scheme("pgc_cr", 3, 1)
    rts = make_runtimes(scheme, shards=1)
    try:
        got = _together(rts, lambda rt: rt.collectives.all_gather(torch.tensor([rt.rank, 10 * rt.rank])))
        assert all(torch.equal(v, torch.tensor([[0, 0], [1, 10], [2, 20]])) for v in got.values())
        got = _together(rts, lambda rt: rt.collectives.reduce(torch.tensor(float(rt.rank)), "max"))
        assert all(float(v) == 2.0 for v in got.values())
        got = _together(rts, lambda rt: rt.collectives.barrier() if rt.rank else rt.collectives.broadcast(1))
        assert all(isinstance(v, CollectiveError) and "different collectives" in str(v) for v in got.values())
    finally:
        _stop_all(rts)


def test_reduce_op_names():
    assert _op_name(None) == "mean" and _op_name("SUM") == "sum"
    assert _op_name(torch.distributed.ReduceOp.MAX) == "max"


def test_a_dead_shard_owner_fails_the_job_fast_naming_it():
    """With n shards every rank owns one: rank 3's death is not survived yet, and the error says what to do."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=4, ranks=[0, 1, 2], heartbeat=(0.05, 40))
    try:
        for rt in rts:
            submit(rt, 0, ages=(0, 0))
        _kill(rts, 3)
        dead_owner = r"rank 3 died at version \d+ and it owns shard\(s\) \[3\].*shard_bytes"
        for rt in rts:  # the leader's error, or the same words from a rank that lost the owner's stream first
            with pytest.raises(RuntimeError, match=dead_owner):
                rt.wait(1)
        assert _eventually(lambda: isinstance(rts[0].error, CoordinatorError))
        got = _together(rts, lambda rt: rt.collectives.barrier())
        assert all(isinstance(v, RuntimeError) for v in got.values())  # collectives fail too, instead of hanging
    finally:
        _stop_all(rts, timeout=0.5)


def test_the_launchers_kill_nobody_while_the_job_runs_and_reap_every_rank_after_rank_0(caplog):
    """PGCStrategy launches through Lightning's launchers minus their kill-all: ``popen`` and ``fork`` both map to
    a surviving launcher, and after rank 0 returned the other ranks get ``grace_s`` to exit, then are killed; the
    ones that failed are named with their status."""
    import subprocess
    import time

    from lightning.pytorch import Trainer

    from lightning_pgc import PGCStrategy
    from lightning_pgc._lightning import SurvivingMultiprocessingLauncher, SurvivingSubprocessLauncher, _reap

    for start_method, kind in (("popen", SurvivingSubprocessLauncher), ("fork", SurvivingMultiprocessingLauncher)):
        trainer = Trainer(strategy=PGCStrategy(start_method=start_method), devices=2, accelerator="cpu", logger=False)
        assert isinstance(trainer.strategy.launcher.launcher, kind)  # inside the preflight wrapper
    procs = [subprocess.Popen(["sleep", "30"]), subprocess.Popen(["sh", "-c", "exit 3"]), subprocess.Popen(["true"])]
    procs[1].wait()
    procs[2].wait()
    started = time.monotonic()
    _reap(procs, lambda p: p.poll() is None, lambda p: (p.kill(), p.wait()), lambda p: p.returncode, grace_s=0.5,
          first_rank=1)
    assert time.monotonic() - started < 10 and procs[0].returncode == -9
    assert re.search(rf"rank 1 \(pid {procs[0].pid}\) still runs \d+ s after rank 0 returned: killed", caplog.text)
    assert f"rank 2 (pid {procs[1].pid}) exited with status 3" in caplog.text and "rank 3" not in caplog.text
