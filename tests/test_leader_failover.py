"""Leader failover on in-process queues: when the leader's process dies or freezes, the lowest live rank takes over
the control plane and shard 0, every live rank goes on with exact, identical aggregates, collectives go through the
new leader (one in flight completes with the same result everywhere), and a frozen leader that resumes steps down
and rejoins. A rank that missed the dead leader's last aggregate rejoins by state transfer: tests/test_dead_ranks.py,
``test_a_rank_that_missed_the_dead_owners_last_shard_rejoins_by_state_transfer[leader_with_failover]``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_pgc.codes import make_scheme
from lightning_pgc.runtime import Channel
from tests.runtime_scenarios import (
    _ask_after_detach,
    _bury,
    _cr_mean,
    _die,
    _DiesWhileDonating,
    _eventually,
    _finish_rejoin,
    FrozenTransport,
    _go_on_exact,
    _kill,
    make_runtimes,
    _NoSend,
    _ReachesOnlyRank3,
    _resume_and_rejoin,
    _step_all,
    _stop_all,
    submit,
    _together,
    _two_miss_the_last_aggregate_and_rejoin,
    _Unpublished,
)


def test_a_dead_leader_between_versions_is_replaced_by_the_lowest_live_rank(caplog):
    """pgc_cr, n = 4, s = 1, one shard (the leader's: the small-model layout). Rank 0 dies between versions 1 and 2,
    while ranks 1-3 already sent their codes for version 2 to it, before it closed it: rank 1 takes over, shard 0 moves to it, kept codes are sent again, and versions 2-5 reach every live rank
    exact and identical; barrier, broadcast and reduce then run through rank 1."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=1, heartbeat=(0.05, 40), wrap={0: FrozenTransport}, failover=True)
    live = [1, 2, 3]
    try:
        for v in range(2):
            _step_all(rts, v)
        rts[0].transport.freeze()  # (else it may publish version 2 to some ranks only: they rejoin, another test)
        for r in live:
            submit(rts[r], 2, ages=(0, 0))
        _die(rts, 0)
        for v in range(2, 6):
            if v > 2:
                for r in live:
                    submit(rts[r], v, ages=(0, 0))
            aggs = []
            for r in live:
                agg = rts[r].wait(v)
                aggs.append(agg.clone())
                rts[r].release(agg)
            torch.testing.assert_close(aggs[0], _cr_mean(live, v))
            assert all(torch.equal(a, aggs[0]) for a in aggs)
        assert rts[1].is_leader and [rts[r].leader_rank for r in live] == [1, 1, 1]
        assert [rts[r].successions for r in live] == [[(0, 1)]] * 3
        assert [rts[r].owners.owner(0, 3) for r in live] == [1, 1, 1]
        assert [rts[r].owners.owner(0, 1) for r in live] == [0, 0, 0]
        assert "rank 1 takes over" in caplog.text and "shard 0 to rank 1" in caplog.text
        assert "rejoins by state transfer" not in caplog.text
        assert [(rts[r].error, rts[r].mailbox.failure()) for r in live] == [(None, None)] * 3
        assert _eventually(lambda: all(rts[r].alive == 3 for r in live))

        alive = [rts[r] for r in live]
        assert set(_together(alive, lambda rt: rt.collectives.barrier()).values()) == {None}
        got = _together(alive, lambda rt: rt.collectives.broadcast(f"from {rt.rank}", src=2))
        assert all(v == "from 2" for v in got.values())
        got = _together(alive, lambda rt: rt.collectives.reduce(torch.tensor(float(rt.rank)), "sum"))
        assert all(float(v) == 6.0 for v in got.values())
    finally:
        _bury(rts, 0)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pgc-")]


class _RefusesRank0(FrozenTransport):
    """A rank whose sends to rank 0 fail at once once ``refuse`` is set (gloo: ``Connection reset by peer``)."""

    refuse = threading.Event()

    def isend(self, channel, peer, message):
        if peer == 0 and self.refuse.is_set():
            raise RuntimeError("Read error [127.0.0.1]:43910: Connection reset by peer")
        return super().isend(channel, peer, message)


def test_a_code_send_to_the_dead_leader_that_fails_at_once_does_not_fail_its_sender(caplog):
    """pgc_cr, n = 4, s = 1, one shard, failover. Rank 0 dies; rank 3's next code goes to it before rank 3 learned
    of the death, and gloo refuses the send at once (seen on 4 real ranks: the training thread raised). The code
    stays kept and goes to rank 1 when shard 0 moves; versions 2-3 close exact and identical."""
    scheme = make_scheme("pgc_cr", 4, 1)
    _RefusesRank0.refuse.clear()
    rts = make_runtimes(
        scheme, shards=1, heartbeat=(0.05, 40), wrap={0: FrozenTransport, 3: _RefusesRank0}, failover=True
    )
    live = [1, 2, 3]
    try:
        for v in range(2):
            _step_all(rts, v)
        rts[0].transport.freeze()  # dead, but its streams have not broken yet anywhere
        _RefusesRank0.refuse.set()
        submit(rts[3], 2, ages=(0, 0))
        assert "sending shard 0 of its code for version 2 to rank 0 failed" in caplog.text
        _kill([rt for rt in rts if rt.rank != 0], 0)
        for r in (1, 2):
            submit(rts[r], 2, ages=(0, 0))
        got = [rts[r].wait(2).clone() for r in live]
        torch.testing.assert_close(got[0], _cr_mean(live, 2))
        assert all(torch.equal(a, got[0]) for a in got)
        _go_on_exact(rts, [3], live)
    finally:
        _RefusesRank0.refuse.clear()
        _bury(rts, 0)


def test_without_failover_a_dead_leader_still_ends_the_job_on_every_rank():
    """The default (``failover=False``): every worker fails at once naming the lost leader."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=1, heartbeat=(0.05, 40), wrap={0: FrozenTransport})
    try:
        _step_all(rts, 0)
        _die(rts, 0)
        for r in (1, 2, 3):
            submit(rts[r], 1, ages=(0, 0))
        for r in (1, 2, 3):
            with pytest.raises(RuntimeError, match="leader"):
                rts[r].wait(1)
    finally:
        _bury(rts, 0)


def test_a_version_the_dead_leader_closed_but_never_published_is_decided_again_by_its_successor(caplog):
    """pgc_cr, n = 4, s = 1, 4 shards. Rank 0 closes version 2 (with three of the four codes) and the other owners
    publish shards 1-3 of it, but rank 0 dies before its shard 0 leaves. Nobody completed version 2, so the new
    leader decides it afresh from the live ranks' codes, sent again to it; only shard 0 is published again. Every
    rank applies the same aggregate: shard 0 from the new set {1, 2, 3}, shards 1-3 from the dead leader's set."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=4, heartbeat=(0.05, 40), wrap={0: _Unpublished}, failover=True)
    live = [1, 2, 3]
    try:
        for v in range(2):
            _step_all(rts, v)
        for rt in rts:
            submit(rt, 2, ages=(0, 0))
        assert _eventually(lambda: rts[0].leader.record(2) is not None)
        first = rts[0].leader.record(2).admitted
        assert _eventually(
            lambda: all(rts[r].mailbox.failure() is None and rts[r]._shard_seen[r] == 2 for r in live)
        )  # shards 1-3 of version 2 are out
        _die(rts, 0)
        aggs = []
        for r in live:
            agg = rts[r].wait(2)
            aggs.append(agg.clone())
            rts[r].release(agg)
        assert all(torch.equal(a, aggs[0]) for a in aggs)
        size = rts[1].layout.shard_numel
        torch.testing.assert_close(aggs[0][:size], _cr_mean(live, 2)[:size])
        torch.testing.assert_close(aggs[0][size:], _cr_mean(first, 2)[size:])
        assert "move from version 2 on: shard 0 to rank 1" in caplog.text
        for v in range(3, 5):
            got = _step_all(rts, v, live)
            torch.testing.assert_close(got[0], _cr_mean(live, v))
            assert all(torch.equal(a, got[0]) for a in got)
    finally:
        _bury(rts, 0)


def test_two_ranks_that_missed_the_dead_leaders_last_aggregate_rejoin_at_one_version_from_one_donor(caplog):
    """pgc_cr, n = 4, s = 1, one shard. Rank 0 dies while sending version 2: rank 3 got it, ranks 1 (the successor)
    and 2 did not. Both are detached and rejoin at version 3, which needs both their codes (three of four), so both
    must be attached at version 3 and both get rank 3's state while it waits (found on 4 real ranks: the leader used
    to attach one rank per version, and the second waited for a version that waited for it)."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=1, heartbeat=(0.05, 40), wrap={0: _ReachesOnlyRank3}, failover=True)
    live = [1, 2, 3]
    state = torch.arange(9, dtype=torch.uint8)
    try:
        got = _two_miss_the_last_aggregate_and_rejoin(rts, state, lambda rt, v: submit(rt, v, ages=(0, 0)))
        assert sorted(got) == live
        torch.testing.assert_close(got[3], _cr_mean(live, 3))
        assert all(torch.equal(got[r], got[3]) for r in live)
        assert rts[3].donation(3) == []  # both donated from wait, once
        stats = rts[1].rank_stats()
        assert stats[1]["rejoined"] == 1 and stats[2]["rejoined"] == 1
        assert "rejoined at version 3 with the state of rank 3" in caplog.text
        _go_on_exact(rts, range(4, 6), live)
    finally:
        _bury(rts, 0)


def test_a_donor_that_dies_during_the_state_transfer_is_replaced_by_another(caplog):
    """pgc_cr, n = 4, s = 1, one shard, ``max_lag`` 2. Rank 3 stalls and is detached. When it asks to rejoin, its
    donor (the leader, rank 0) dies after sending the header of its state. Rank 3 asks again, naming the donor; rank
    1 takes over, attaches it at its own open version and donates while it waits for that version, which needs rank
    3's code. Rank 3 gets rank 1's state, and ranks 1-3 go on with exact, identical aggregates."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=1, max_lag=2, heartbeat=(0.05, 40), wrap={0: _DiesWhileDonating}, failover=True)
    live = [1, 2, 3]
    first, second = torch.full((9,), 7, dtype=torch.uint8), torch.arange(9, dtype=torch.uint8)
    try:
        for v in range(4):  # rank 3 stalls: versions close with ranks 0-2, and it is detached past max_lag
            _step_all(rts, v, [0, 1, 2])
        asker, got, _ = _ask_after_detach(rts, 3, 0)
        u = rts[0].leader.rejoining[3]
        _step_all(rts, u, [0, 1, 2])  # version u closes without rank 3; the leader donates with its aggregate
        assert all(rts[r].donation(u) == [] for r in (1, 2))
        assert rts[0].donation(u) == [3]
        rts[0].send_state(3, u, first)  # the header leaves, then rank 0 dies
        _die(rts, 0)
        assert _eventually(lambda: rts[1].is_leader and 3 in rts[1].leader.rejoining)
        assert rts[1].leader.rejoining[3] > u
        _finish_rejoin(rts, 3, live, rts[1].leader.rejoining[3], second, asker, got)
        assert "PGC rank 3: rank 0 died while sending the training state for version" in caplog.text
    finally:
        _bury(rts, 0)


def test_a_frozen_leader_is_replaced_and_rejoins_as_a_worker_when_it_resumes(caplog):
    """pgc_cr, n = 4, s = 1, one shard. Rank 0 freezes (SIGSTOP: its streams stay up, it sends nothing) after
    version 1. After a heartbeat window the others fence it off and rank 1 takes over; versions 2-3 close with ranks
    1-3, exact and identical. When rank 0 resumes it reads rank 1's DEPOSE, steps down, finds itself detached and
    rejoins by state transfer; then all four go on with exact, identical aggregates, and nothing it sent on resuming
    is used."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(
        scheme, shards=1, heartbeat=(0.05, 10), wrap={0: FrozenTransport}, failover=True, frozen_failover=True
    )
    live = [1, 2, 3]
    state = torch.arange(7, dtype=torch.uint8)
    try:
        for v in range(2):
            _step_all(rts, v)
        rts[0].transport.freeze()
        for v in range(2, 4):
            got = _step_all(rts, v, live)
            torch.testing.assert_close(got[0], _cr_mean(live, v))
            assert all(torch.equal(a, got[0]) for a in got)
        assert [rts[r].leader_rank for r in live] == [1, 1, 1] and rts[1].is_leader
        assert "the leader (rank 0) is frozen" in caplog.text
        rts[0]._doubt_since = time.monotonic()  # what its service loop finds on resuming (here it never stopped)
        assert rts[0].seat_in_doubt()
        rts[0].transport.frozen.clear()  # SIGCONT
        assert rts[0].settle_seat() is False  # it learns it was replaced before any rank-zero write
        assert not rts[0].is_leader and rts[0].leader_rank == 1 and not rts[0].seat_in_doubt()
        # (on resuming it may close and apply version 2 itself from codes in its sockets: void, as it is detached
        # from version 2 and rejoins)
        u, _ = _resume_and_rejoin(rts, 0, 1, live, state, first=2)
        for v in range(u + 1, u + 3):
            agg = _step_all(rts, v)
            torch.testing.assert_close(agg[0], _cr_mean(rts[1].record(v).admitted, v))
            assert all(torch.equal(a, agg[0]) for a in agg)
        assert "took over as leader while this rank was frozen" in caplog.text
        assert [rt.successions for rt in rts] == [[(0, 1)]] * 4
        assert all(rt.error is None and rt.mailbox.failure() is None for rt in rts)
    finally:
        _stop_all(rts, timeout=1.0)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pgc-")]


def test_a_leader_that_stopped_but_was_not_replaced_keeps_leading(caplog):
    """The whole machine paused (every process stopped, nobody took over): the leader, in doubt on resuming, waits a
    heartbeat window for a DEPOSE that does not come, says so, and goes on leading."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, shards=1, heartbeat=(0.05, 40), failover=True, frozen_failover=True)
    try:
        _step_all(rts, 0)
        rts[0]._doubt_since = time.monotonic()  # as its service loop finds after a stop of more than a window
        assert rts[0].seat_in_doubt() and not rts[1].seat_in_doubt()
        assert rts[0].settle_seat() is True
        assert not rts[0].seat_in_doubt() and rts[0].is_leader
        assert "no rank took over; it goes on leading" in caplog.text
        got = _step_all(rts, 1)
        assert all(torch.equal(a, got[0]) for a in got)
    finally:
        _stop_all(rts, timeout=1.0)


class _ResultToRank2Only(FrozenTransport):
    """The leader sends the result of collective 2 to rank 2 only (header and payload), then freezes (and dies)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.cut = False

    def isend(self, channel, peer, message):
        if channel == Channel.COLL and message.dtype == torch.int64 and int(message[0]) == 2:
            self.cut = True
        if self.cut and channel == Channel.COLL and peer in (1, 3):
            return _NoSend()
        handle = super().isend(channel, peer, message)
        if self.cut and channel == Channel.COLL and peer == 2 and message.dtype == torch.uint8:
            self.freeze()
        return handle


@pytest.mark.parametrize("got_by", [None, 2], ids=["nobody_got_it", "rank_2_got_it"])
def test_a_collective_in_flight_when_the_leader_dies_completes_through_its_successor(got_by):
    """A reduce is in flight when the leader dies: either before anyone got its result (the survivors' contributions
    go again to rank 1, which decides it among the live ranks), or after rank 2 got it (that result stands: rank 2
    tells rank 1, which gives it to ranks 1 and 3). Either way every survivor gets the same result, and the next
    collective runs through rank 1."""
    scheme = make_scheme("pgc_cr", 4, 1)
    wrap = _ResultToRank2Only if got_by == 2 else FrozenTransport
    rts = make_runtimes(scheme, shards=1, heartbeat=(0.05, 40), wrap={0: wrap}, failover=True)
    live = [rts[r] for r in (1, 2, 3)]
    try:
        assert set(_together(rts, lambda rt: rt.collectives.barrier()).values()) == {None}  # collective 1
        if got_by is None:
            rts[0].transport.freeze()  # it gets the contributions but sends nothing
        results: dict[int, object] = {}

        def reduce(rt):
            results[rt.rank] = rt.collectives.reduce(torch.tensor(float(rt.rank + 1)), "sum")  # collective 2

        threads = [threading.Thread(target=reduce, args=(rt,)) for rt in rts]
        for t in threads:
            t.start()
        assert _eventually(lambda: rts[0].transport.frozen.is_set() and (got_by is None or 2 in results))
        _die(rts, 0)
        for t in threads[1:]:
            t.join(20)
        assert not any(t.is_alive() for t in threads[1:]), "a survivor's collective hung"
        expected = 10.0 if got_by == 2 else 9.0  # 1+2+3+4 (rank 0 took part), or 2+3+4 among the survivors
        assert [float(results[r]) for r in (1, 2, 3)] == [expected] * 3
        got = _together(live, lambda rt: rt.collectives.reduce(torch.tensor(1.0), "sum"))  # collective 3
        assert all(float(v) == 3.0 for v in got.values())
    finally:
        _bury(rts, 0)
