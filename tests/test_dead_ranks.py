"""Dead ranks on in-process queues: up to s dead workers are survived (data plane and collectives), a dead shard
owner's shards move to live ranks (a version it never published is decoded again, a rank that missed its last
shard rejoins by state transfer), and Lightning's collectives run among the live ranks with identical results."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from lightning_pgc.codes import make_scheme
from lightning_pgc.runtime import Channel, PGCDetached
from lightning_pgc.runtime.collectives import CollectiveError, _op_name
from lightning_pgc.runtime.messages import Kind, read_header
from tests.runtime_scenarios import (
    _ask_after_detach,
    _bury,
    code,
    _cr_mean,
    _die,
    _DiesWhileDonating,
    _eventually,
    _finish_rejoin,
    FrozenTransport,
    _kill,
    make_runtimes,
    _NoSend,
    _release_receivers,
    _resume_and_rejoin,
    _step_all,
    _stop_all,
    submit,
    _together,
)


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
        assert all(
            isinstance(v, CollectiveError) and "rank 3, which is no longer in the job" in str(v) for v in got.values()
        )
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


class _Withheld(FrozenTransport):
    """A shard owner that dies while serving version 2: its aggregate shards of version >= 2 never reach rank 3."""

    def isend(self, channel, peer, message):
        if channel == Channel.AGG and peer == 3:
            header = read_header(message)
            if header.kind == Kind.AGGREGATE and header.version >= 2:
                return _NoSend()
        return super().isend(channel, peer, message)


def test_a_dead_shard_owner_hands_its_shard_to_a_live_rank(caplog):
    """pgc_cr, n = 4, s = 1, 4 shards (every rank owns one, the large-model layout). Rank 2 dies between versions
    1 and 2: its shard moves to rank 1 (the fewest shards, not the leader) from version 2 on, and the three live
    ranks go on with exact, identical aggregates; nobody aborts."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=4, heartbeat=(0.05, 40), wrap={2: FrozenTransport})
    live = [0, 1, 3]
    try:
        for v in range(2):
            _step_all(rts, v)
        _die(rts, 2)
        assert all(_eventually(lambda rt=rts[r]: rt.owners.owner(2, 2) == 1) for r in live)
        assert rts[0].owners.owner(2, 1) == 2  # versions before the move stay its
        for v in range(2, 6):
            aggs = _step_all(rts, v, live)
            torch.testing.assert_close(aggs[0], _cr_mean(live, v))
            assert all(torch.equal(a, aggs[0]) for a in aggs)
        assert "rank 2 died at version 2" in caplog.text and "shard 2 to rank 1" in caplog.text
        assert "decoded again" not in caplog.text and "rejoins by state transfer" not in caplog.text
        assert all(rts[r].error is None and rts[r].mailbox.failure() is None for r in live)
    finally:
        _bury(rts, 2)


def test_two_owners_dying_together_are_survived_with_s_2(caplog):
    """pgc_cr, n = 5, s = 2, 5 shards: ranks 3 and 4 die at once (one node with two ranks). Both shards move, to the
    live non-leader ranks with the fewest shards (ranks 1 and 2, one each), and the three live ranks go on with
    exact, identical aggregates."""
    scheme = make_scheme("pgc_cr", 5, 2)
    rts = make_runtimes(scheme, shards=5, heartbeat=(0.05, 40), wrap={3: FrozenTransport, 4: FrozenTransport})
    live = [0, 1, 2]
    try:
        for v in range(2):
            _step_all(rts, v)
        rts[3].transport.freeze()
        rts[4].transport.freeze()
        _kill(live_rts := [rts[r] for r in live], 3)
        _kill(live_rts, 4)
        assert all(
            _eventually(lambda rt=rts[r]: {rt.owners.owner(3, 2), rt.owners.owner(4, 2)} == {1, 2}) for r in live
        )
        for v in range(2, 5):
            aggs = _step_all(rts, v, live)
            torch.testing.assert_close(aggs[0], sum(code(k, v) for k in live) / 3 / 3)  # mu / n = 1 / (|R| c)
            assert all(torch.equal(a, aggs[0]) for a in aggs)
        assert all(rts[r].error is None for r in live)
    finally:
        for dead in (3, 4):
            _release_receivers(rts[dead].hub, dead, [r for r in range(5) if r != dead])
            rts[dead].transport.frozen.clear()
        _stop_all(rts, timeout=1.0)


def test_a_shard_owner_that_leaves_on_sigterm_hands_its_shard_over(caplog):
    """Rank 2 (owner of shard 2) gets SIGTERM between versions 1 and 2 and leaves at once (``stop(leave=True)``):
    its BYE tells every rank its shard is lost, the shard moves to rank 1, and the three others go on with exact,
    identical aggregates."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=4, heartbeat=(0.05, 40))
    live = [0, 1, 3]
    try:
        for v in range(2):
            _step_all(rts, v)
        rts[2].stop(leave=True)
        assert all(_eventually(lambda rt=rts[r]: rt.owners.owner(2, 2) == 1) for r in live)
        for v in range(2, 5):
            aggs = _step_all(rts, v, live)
            torch.testing.assert_close(aggs[0], _cr_mean(live, v))
            assert all(torch.equal(a, aggs[0]) for a in aggs)
        assert "rank 2 left at version 2 (SIGTERM on that rank)" in caplog.text
        assert "its shard(s) [2] move to live ranks" in caplog.text
    finally:
        _release_receivers(rts[2].hub, 2, live)
        _stop_all([rts[r] for r in live], timeout=1.0)


class _LateAssign:
    """Rank 1's transport: the leader's ASSIGN reaches it 0.3 s late, after the codes that ranks which applied it
    first re-sent to rank 1 (which then does not own the shard yet)."""

    def __init__(self, inner):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size

    def isend(self, channel, peer, message):
        return self.inner.isend(channel, peer, message)

    def recv(self, channel, peer, buf):
        self.inner.recv(channel, peer, buf)
        if channel == Channel.CTRL and int(buf[0]) == Kind.ASSIGN:
            time.sleep(0.3)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("late_assign", [False, True], ids=["assign_first", "codes_first"])
def test_a_closed_version_its_dead_owner_never_published_is_decoded_again_from_live_codes(caplog, late_assign):
    """Rank 2 sends its code for version 2, freezes (it never publishes shard 2 of it), version 2 closes with
    ranks 2, 0, 1, and then rank 2's process is gone. The leader moves shard 2 to rank 1 from version 2 and decides
    version 2 again for it, from the live codes: ranks 0, 1 and rank 3, whose code comes late. Every rank's
    aggregate of version 2 is shards 0, 1, 3 decoded from {0, 1, 2} and shard 2 from {0, 1, 3}: exact for each
    set, identical on every rank; version 3 is plain again. ``codes_first``: the re-sent codes reach rank 1 before
    its ASSIGN does, and it keeps them."""
    scheme = make_scheme("pgc_cr", 4, 1)
    wrap = {2: FrozenTransport, **({1: _LateAssign} if late_assign else {})}
    rts = make_runtimes(scheme, shards=4, heartbeat=(0.05, 40), wrap=wrap)
    live = [0, 1, 3]
    try:
        for v in range(2):
            _step_all(rts, v)
        submit(rts[2], 2, ages=(0, 0))
        assert _eventually(lambda: 2 in rts[0].leader._order)  # shard 0 of its code reached the leader
        rts[2].transport.freeze()
        submit(rts[0], 2, ages=(0, 0))
        submit(rts[1], 2, ages=(0, 0))
        assert _eventually(lambda: rts[0].record(2) is not None)
        assert sorted(rts[0].record(2).admitted) == [0, 1, 2]
        _die(rts, 2)
        assert _eventually(lambda: all(rts[r].owners.owner(2, 2) == 1 for r in live))
        time.sleep(0.3)
        assert rts[1]._keep_from == 3  # codes of version 2 are below it: rank 1 keeps them only as owed
        assert not any(rts[r].mailbox.has(2) for r in live)  # shard 2 of version 2 waits for rank 3's late code
        submit(rts[3], 2, ages=(0, 0))
        taken = {r: rts[r].wait(2) for r in live}
        aggs = [taken[r].clone() for r in live]
        first, again = _cr_mean([0, 1, 2], 2), _cr_mean(live, 2)
        lo, hi = rts[0].layout.bounds(2)
        expected = torch.cat([first[:lo], again[lo:hi], first[hi:]])
        torch.testing.assert_close(aggs[0], expected)
        assert not torch.allclose(first[lo:hi], again[lo:hi])  # so the shard really was decoded from the new set
        assert all(torch.equal(a, aggs[0]) for a in aggs)
        again_line = "version 2 (closed with ranks [2, 0, 1]) is decoded again for shards [2] from ranks [0, 1, 3]"
        assert _eventually(lambda: again_line in caplog.text)  # logged just after the decision went out
        for r in live:
            rts[r].release(taken[r])
        aggs = _step_all(rts, 3, live)
        torch.testing.assert_close(aggs[0], _cr_mean(live, 3))
        assert all(torch.equal(a, aggs[0]) for a in aggs)
    finally:
        _bury(rts, 2)


def _rejoin_while_others_wait(rts, rank, others, asked, state):
    """``others`` submit version ``asked + 1`` and wait for it (donating ``state``) while detached ``rank`` rejoins
    (asked at ``asked``: it must get ``asked + 1`` and ``state``), then submits and waits; the aggregates by rank."""
    version = asked + 1
    got: dict[int, torch.Tensor] = {}

    def donor(rt):
        got[rt.rank] = rt.wait(version, donate=lambda: state).clone()

    for r in others:
        submit(rts[r], version, ages=(0, 0))
    threads = [threading.Thread(target=donor, args=(rts[r],)) for r in others]
    for t in threads:
        t.start()
    u, received = rts[rank].rejoin(asked)
    assert u == version and torch.equal(received, state)
    submit(rts[rank], version, ages=(0, 0))
    got[rank] = rts[rank].wait(version).clone()
    for t in threads:
        t.join(10)
    return got


@pytest.mark.parametrize("dead", [2, 0], ids=["owner", "leader_with_failover"])
def test_a_rank_that_missed_the_dead_owners_last_shard_rejoins_by_state_transfer(caplog, dead):
    """Rank ``dead`` dies while serving version 2: the two other live ranks got its shard, rank 3 did not. Rank 3
    cannot complete version 2, which others applied, so it is detached and rejoins at version 3 by state transfer.
    With a rank dead and s = 1, version 3 needs rank 3's code: the leader donates its state while it waits for
    version 3 (not after, which would never come), and version 3 closes with the live ranks, identical on every
    rank. Rank 2 is a plain owner; rank 0 is the leader (with failover): rank 1 takes over, shard 0 and the
    donation with it."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=4, heartbeat=(0.05, 40), wrap={dead: _Withheld}, failover=dead == 0)
    live = [r for r in range(4) if r != dead]
    state = torch.arange(12, dtype=torch.uint8)
    try:
        for v in range(2):
            _step_all(rts, v)
        for rt in rts:
            submit(rt, 2, ages=(0, 0))
        for r in range(3):
            rts[r].release(rts[r].wait(2))
        _die(rts, dead)
        assert _eventually(lambda: rts[3].detached(2))
        with pytest.raises(PGCDetached):
            rts[3].wait(2)
        assert f"rank 3 did not get the shards [{dead}] of version 2 from lost owner(s) [{dead}]" in caplog.text
        assert all(_eventually(lambda rt=rts[r]: rt.owners.owner(dead, 3) == 1) for r in live)
        got = _rejoin_while_others_wait(rts, 3, live[:2], 2, state)
        torch.testing.assert_close(got[live[0]], _cr_mean(live, 3))
        assert all(torch.equal(got[r], got[live[0]]) for r in live)
        leader = rts[live[0]]
        assert leader.is_leader and leader.rank_stats()[3]["rejoined"] == 1
        assert all(rts[r].donation(3) == [] for r in live[:2])  # donated once, from wait
    finally:
        _bury(rts, dead)


def test_a_donor_worker_that_dies_during_the_state_transfer_is_replaced_by_another(caplog):
    """pgc_cr, n = 4, s = 1, one shard, ``max_lag`` 2. The leader's own training thread stalls: it is detached, and
    rejoins with the state of the worker furthest ahead, rank 1, which dies after sending the header. The leader asks
    again, naming rank 1 (dead from then on), and attaches itself at the next version with rank 2 as donor, which
    sends its state while it waits for that version (it needs the leader's code). Ranks 0, 2, 3 go on exact and
    identical."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=1, max_lag=2, heartbeat=(0.05, 40), wrap={1: _DiesWhileDonating})
    live = [0, 2, 3]
    first, second = torch.full((9,), 7, dtype=torch.uint8), torch.arange(9, dtype=torch.uint8)
    try:
        for v in range(4):
            _step_all(rts, v, [1, 2, 3])
        asker, got, _ = _ask_after_detach(rts, 0, 0)
        u = rts[0].leader.rejoining[0]
        _step_all(rts, u, [1, 2, 3])
        assert [rts[r].donation(u) for r in (1, 2, 3)] == [[0], [], []]
        rts[1].send_state(0, u, first)  # the header leaves, then rank 1 dies
        _die(rts, 1)
        assert _eventually(lambda: rts[0].leader.rejoining[0] > u)
        _finish_rejoin(rts, 0, live, rts[0].leader.rejoining[0], second, asker, got)
        assert "PGC rank 0: rank 1 died while sending the training state for version" in caplog.text
        assert "rank 1 died at version" in caplog.text
    finally:
        _bury(rts, 1)


def test_a_frozen_shard_owner_is_fenced_off_its_shard_moves_and_it_rejoins_when_it_resumes(caplog):
    """Rank 2 (owner of shard 2) freezes (SIGSTOP: no heartbeats, its streams stay up) before version 2. After a
    heartbeat window every rank stops accepting its shards and reports; shard 2 moves to rank 1 and version 2, which
    closed without rank 2 but whose shard 2 it never published, is decoded again by rank 1. The live ranks go on
    with exact, identical aggregates. When rank 2 resumes, what it publishes late is ignored, and it rejoins by
    state transfer (donated while the others wait: with it frozen, s = 1 is used up)."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=4, heartbeat=(0.05, 10), wrap={2: FrozenTransport})
    live = [0, 1, 3]
    state = torch.arange(5, dtype=torch.uint8)
    try:
        for v in range(2):
            _step_all(rts, v)
        rts[2].transport.freeze()
        for v in range(2, 4):
            aggs = _step_all(rts, v, live)
            torch.testing.assert_close(aggs[0], _cr_mean(live, v))
            assert all(torch.equal(a, aggs[0]) for a in aggs)
        assert "rank 2 owns shards [2] and sent no heartbeat" in caplog.text and "shard 2 to rank 1" in caplog.text
        rts[2].transport.frozen.clear()  # SIGCONT
        u, behind = _resume_and_rejoin(rts, 2, 0, live, state, first=2)
        assert behind <= 3
        assert rts[0].rank_stats()[2]["rejoined"] == 1
        aggs = _step_all(rts, u + 1)  # all four again
        torch.testing.assert_close(aggs[0], _cr_mean(sorted(rts[0].record(u + 1).admitted), u + 1))
        assert all(torch.equal(a, aggs[0]) for a in aggs)
        assert all(rts[r].error is None for r in range(4))
    finally:
        _stop_all(rts, timeout=1.0)


def test_the_launchers_kill_nobody_while_the_job_runs_and_reap_every_rank_after_rank_0(caplog):
    """PGCStrategy launches through Lightning's launchers minus their kill-all: ``popen`` and ``fork`` both map to
    a surviving launcher, and after rank 0 returned the other ranks get ``grace_s`` to exit, then are killed; the
    ones that failed are named with their status."""
    import subprocess

    from lightning.pytorch import Trainer

    from lightning_pgc import PGCStrategy
    from lightning_pgc._lightning import SurvivingMultiprocessingLauncher, SurvivingSubprocessLauncher, _reap

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
    from lightning_pgc.state_transfer import STALLED_IDLE, StateTransfer

    transfer = StateTransfer(strategy=None)  # ``ahead`` reads no strategy state
    assert [transfer.ahead(v, 30) for v in (10, 15, 20, 25, 28)] == [True] * 5
    assert transfer.ahead(29, 30) is False  # within a version: rejoin now
    assert transfer.ahead(5, 20) is True and transfer.ahead(6, 24) is True  # a jump of the frontier
    assert transfer.ahead(7, 18) is True  # gaining again
    steady = [transfer.ahead(8 + i, 19 + i) for i in range(STALLED_IDLE)]  # no longer gaining
    assert steady == [True] * (STALLED_IDLE - 1) + [False]
    assert transfer.ahead(30, 30) is False
