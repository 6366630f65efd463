"""Bounded staleness with dead and frozen ranks on in-process queues: a dead or frozen shard owner hands its shard to a
live rank and a dead leader is replaced, with every aggregate still the weighted sum of entries younger than the
window, identical on every live rank. Every rank keeps its own codes of its last ``c`` versions and sends them again
to a new owner; the dead rank's entries are forgotten (its own shard of each of its codes died with it); a version a
dead owner closed but never published is planned again from live codes. Real ranks: tests/test_leader_faults.py and
tests/test_owner_faults.py."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from lightning_pgc.codes import BoundedScheme, Entry
from lightning_pgc.runtime.bounded import BoundedLeader
from lightning_pgc.runtime.messages import Header, Kind
from tests.bounded_scenarios import D, make_runtimes, payload, submit
from tests.runtime_scenarios import (
    _bury,
    _collect,
    _die,
    _eventually,
    FrozenTransport,
    _kill,
    _ReachesOnlyRank3,
    _release_receivers,
    _resume_and_rejoin,
    _step_all,
    _stop_all,
    _two_miss_the_last_aggregate_and_rejoin,
    _Unpublished,
)


def _step(rts, version, ranks):
    """``ranks`` submit ``version`` and wait for it; returns their aggregates (cloned), released."""
    return _step_all(rts, version, ranks, send=submit)


# ------------------------------------------------------------------------------------- the leader's fallbacks
def _closed_leader(scheme, versions, missing=()):
    """A BoundedLeader that saw every rank's round-robin code of ``versions`` (but ``missing``'s ``(rank, version)``)
    and closed them; returns it and the records."""
    leader = BoundedLeader(scheme, scheme.n, 0, timeout=5.0, max_lag=100)
    recs = []
    for v in versions:
        for r in range(scheme.n):
            if (r, v) not in missing:
                leader.on_code(Header(Kind.CODE, v, r, 0, 1, 0, (0,), 0, -1), 1.0 + v)
        recs.append(leader.try_close(1.0 + v))
    return leader, recs


def _newest_by_hand(scheme, partition, floor, below, gone, missing=()):
    """The newest round-robin code of ``partition`` of a version in ``(floor, below]`` from a rank not ``gone``."""
    for v in range(below, floor, -1):
        for q in range(scheme.n):
            if q not in gone and (q, v) not in missing and scheme.evaluated(q, v) == partition:
                return q, v
    return None


def test_replan_replaces_exactly_the_lost_entries_by_the_newest_live_code_within_the_window():
    """n = 4, r = 2, every c and kept-codes count in 1..3 and every set of at most two lost ranks (rank 3's code of
    the replanned version missing, so an entry may be stale): the plan keeps each entry of a live rank that is young
    enough, replaces every other one by the newest live code of its partition within ``min(c, kept)`` versions (by
    hand from the round robin), and is None when some partition has none."""
    for c in (1, 2, 3):
        scheme = BoundedScheme(4, 2, c)
        missing = {(3, 3)} if c > 1 else set()  # rank 3 was slow at version 3 (c = 1 would not close without it)
        leader, recs = _closed_leader(scheme, range(4), missing=missing)
        rec = recs[3]
        assert rec is not None and rec.version == 3
        for kept in (1, 2, 3):
            for k in range(3):
                for gone in itertools.combinations(range(4), k):
                    floor = 3 - min(c, kept)
                    want = []
                    for i, e in enumerate(rec.entries):
                        if e.rank in gone or e.version <= floor:
                            sub = _newest_by_hand(scheme, i, floor, 3, set(gone), missing)
                            want.append(None if sub is None else (i, *sub))
                        else:
                            want.append((i, e.rank, e.version))
                    got = leader.replan(3, set(gone), kept)
                    assert got == (None if None in want else want), (c, kept, gone)


def test_forget_falls_back_on_the_newest_other_code_the_owners_still_keep():
    """n = 4, r = 2, c = 2, versions 0-2 closed with every code. Forgetting rank 2 replaces its entry of partition 2
    (version 2) by rank 1's code of version 1, the newest other code of that partition; with a floor above version 1
    there is none, and the partition waits for coverage. A forgotten rank's codes count again from the version it
    rejoins at."""
    scheme = BoundedScheme(4, 2, 2)
    leader, _ = _closed_leader(scheme, range(3))
    assert leader.table.entries == [Entry(i, 2) for i in range(4)]
    leader.forget(2, floor=1)
    assert leader.table.entries == [Entry(0, 2), Entry(1, 2), Entry(1, 1), Entry(3, 2)]
    leader.forget(1, floor=2)
    assert leader.table.entries == [Entry(0, 2), None, None, Entry(3, 2)]
    assert leader.table.missing(3, 2) == [1, 2]
    code = {r: Header(Kind.CODE, 3, r, 0, 1, 0, (0,), 0, -1) for r in range(4)}  # version 3: partitions r + 1
    leader.on_code(code[2], 9.0)  # (sent before it froze, say: it counts only once rank 2 rejoined)
    leader.on_code(code[0], 9.0)
    assert leader.table.entries == [Entry(0, 2), Entry(0, 3), None, Entry(3, 2)]
    assert leader.on_rejoin(2, leader_rank=0) == (3, 0)
    leader.on_code(code[2], 9.5)  # sent again after its rejoin at version 3
    assert leader.table.entries == [Entry(0, 2), Entry(0, 3), None, Entry(2, 3)]


def test_a_partition_no_live_code_can_cover_is_left_out_instead_of_waiting_for_ever():
    """n = 4, r = 2, round robin, every c in 1..3 and every rank dead from version 0: no rank computes version t + 1
    before t closes, so a partition without an entry younger than c whose live holders' codes of t carry other
    partitions can never be covered at t. Every version closes anyway; exactly those partitions (by hand: no live
    rank evaluated them within the window) are left out, counted in ``uncovered``, and the others' weights are
    renormalised."""
    for c in (1, 2, 3):
        for dead in range(4):
            scheme = BoundedScheme(4, 2, c)
            leader = BoundedLeader(scheme, 4, 0, timeout=5.0, max_lag=100, now=0.0)
            leader.on_dead(dead)
            live = [r for r in range(4) if r != dead]
            out = 0
            for t in range(6):
                for r in live:
                    leader.on_code(Header(Kind.CODE, t, r, 0, 1, 0, (0,), 0, -1), 0.1 * t)
                rec = leader.try_close(0.1 * t)
                assert rec is not None and rec.version == t, (c, dead, t)
                want = [
                    i
                    for i in range(4)
                    if not any(scheme.evaluated(q, v) == i for q in live for v in range(max(0, t - c + 1), t + 1))
                ]
                assert [i for i, e in enumerate(rec.entries) if e is None] == want, (c, dead, t, rec.entries)
                for r, w in rec.weights.items():  # 1/4 per partition, or 1/(4 - left out)
                    assert w == pytest.approx(sum(e is not None and e.rank == r for e in rec.entries) / (4 - len(want)))
                out += len(want)
            assert out >= 1 and leader.uncovered == out  # (version 0 at least: the dead rank's own partition)


def test_a_live_holder_whose_code_has_not_arrived_is_waited_for():
    """n = 4, r = 2, c = 1, fresh = 2, rank 3 dead. Version 0 has codes of ranks 0 and 1 (partitions 0, 1): partition
    2's live holder rank 2 has not reported, so the version waits; once rank 2's code covers partition 2, partition
    3 (holders 2 and the dead 3) cannot be covered, and the version closes without it."""
    scheme = BoundedScheme(4, 2, 1, fresh=2)
    leader = BoundedLeader(scheme, 4, 0, timeout=5.0, max_lag=100, now=0.0)
    leader.on_dead(3)
    for r in (0, 1):
        leader.on_code(Header(Kind.CODE, 0, r, 0, 1, 0, (0,), 0, -1), 0.1)
    assert leader.try_close(0.1) is None and leader.uncovered == 0
    leader.on_code(Header(Kind.CODE, 0, 2, 0, 1, 0, (0,), 0, -1), 0.2)
    rec = leader.try_close(0.2)
    assert rec.entries == (Entry(0, 0), Entry(1, 0), Entry(2, 0), None) and leader.uncovered == 1
    assert rec.plan() == [(0, 0, 0), (1, 1, 0), (2, 2, 0), (3, -1, 0)]


# ---------------------------------------------------------------------------------------------- the runtime
def _go_on(scheme, rts, versions, live, leader, lost):
    """The ``live`` ranks step through ``versions``: every entry of the ``leader``'s records is younger than c and
    none is ``lost``'s, and every aggregate is the reference of its entries, identical on each live rank."""
    for v in versions:
        aggs = _step(rts, v, live)
        rec = rts[leader].record(v)
        assert all(e.rank != lost and v - e.version < scheme.window for e in rec.entries), (v, rec.entries)
        _check(scheme, aggs, _entries(rec))


def _weighted(scheme, entries):
    """The float64 reference: ``sum_i w_i g_i`` over ``(partition, rank, version)`` entries."""
    return sum(scheme.partition_weights[i] * payload(k, v).double() for i, k, v in entries)


def _entries(rec):
    return [(i, e.rank, e.version) for i, e in enumerate(rec.entries)]


def _check(scheme, aggs, entries):
    """Every live rank got the same aggregate, the weighted sum of ``entries``."""
    assert all(torch.equal(a, aggs[0]) for a in aggs)
    torch.testing.assert_close(aggs[0].double(), _weighted(scheme, entries), rtol=1e-6, atol=1e-5)


def test_a_rank_dead_from_the_start_leaves_its_partition_out_of_the_first_version_only(caplog):
    """r = 2, c = 2, 2 shards (owners 0 and 1); rank 3's process never comes up. Version 0 cannot cover partition
    3 (rank 2, its other holder, evaluates partition 2 at even versions), so it closes without it: both owners
    decode the mean of partitions 0-2, identical on every live rank. From version 1 on rank 2's code of version 1
    covers partition 3 for two versions at a time and nothing is left out (found on 4 real ranks, where a rank
    killed in the sanity check left version 0 waiting for ever)."""
    scheme = BoundedScheme(4, 2, 2)
    live = [0, 1, 2]
    rts = make_runtimes(scheme, shards=2, ranks=live, heartbeat=(0.05, 40))
    try:
        _kill(rts, 3)
        aggs = _step(rts, 0, live)
        assert all(torch.equal(a, aggs[0]) for a in aggs)
        torch.testing.assert_close(
            aggs[0].double(), sum(payload(k, 0).double() for k in live) / 3, rtol=1e-6, atol=1e-5
        )
        assert rts[0].record(0).entries[3] is None and rts[0].leader.uncovered == 1
        assert "version 0 closes without partitions [3]" in caplog.text
        for v in range(1, 6):
            aggs = _step(rts, v, live)
            rec = rts[0].record(v)
            assert None not in rec.entries
            _check(scheme, aggs, _entries(rec))
        assert rts[0].leader.uncovered == 1
    finally:
        _stop_all(rts, timeout=0.5)


def test_a_dead_shard_owner_hands_its_shard_to_a_live_rank_and_its_entries_are_forgotten(caplog):
    """r = 2, c = 2, 4 shards (every rank owns one). Rank 3 dies between versions 1 and 2: its shard moves to a live
    rank, the other ranks send it their kept codes again, and versions 2-7 close with ranks 0-2. No entry names rank
    3 from version 2 on (its entry of version 1 is replaced by the newest other code of that partition), every entry
    is younger than c, and every aggregate is the float64 reference of its entries, identical on every live rank."""
    scheme = BoundedScheme(4, 2, 2)
    rts = make_runtimes(scheme, shards=4, heartbeat=(0.05, 40), wrap={3: FrozenTransport})
    live = [0, 1, 2]
    try:
        for v in range(2):
            _step(rts, v, range(4))
        _die(rts, 3)
        assert all(_eventually(lambda rt=rts[r]: rt.owners.owner(3, 2) in live) for r in live)
        _go_on(scheme, rts, range(2, 8), live, leader=0, lost=3)
        assert "rank 3 died at version 2" in caplog.text and "shard 3 to rank" in caplog.text
        assert "decoded again" not in caplog.text
        assert all(rts[r].error is None and rts[r].mailbox.failure() is None for r in live)
    finally:
        _bury(rts, 3)


def test_a_shard_owner_that_leaves_on_sigterm_hands_its_shard_over():
    """r = 2, c = 2, 4 shards. Rank 2 gets SIGTERM between versions 1 and 2 and leaves at once (``stop(leave=True)``,
    as under any scheme): its shard moves, its entries are forgotten, and the three others go on with aggregates that
    are the reference of their entries, identical on each."""
    scheme = BoundedScheme(4, 2, 2)
    rts = make_runtimes(scheme, shards=4, heartbeat=(0.05, 40))
    live = [0, 1, 3]
    try:
        for v in range(2):
            _step(rts, v, range(4))
        rts[2].stop(leave=True)
        assert all(_eventually(lambda rt=rts[r]: rt.owners.owner(2, 2) in live) for r in live)
        _go_on(scheme, rts, range(2, 6), live, leader=0, lost=2)
    finally:
        _release_receivers(rts[2].hub, 2, live)
        _stop_all([rts[r] for r in live], timeout=1.0)


def test_a_version_its_dead_owner_closed_but_never_published_is_planned_again_from_live_codes(caplog):
    """r = 2, c = 2, 4 shards. The leader closes version 2 and owners 0, 1 and 3 publish their shards of it, but
    rank 2 dies before its shard 2 leaves. Nobody completed version 2, so the leader plans it again for shard 2: the
    same entries, except that each of rank 2's is replaced by the newest live code of that partition within the
    window (all four ranks sent codes for versions 1 and 2). The new owner decodes shard 2 from the codes the live
    ranks sent it again; every live rank applies the same aggregate (shard 2 from the new plan, the others from the
    first), and the ranks go on."""
    scheme = BoundedScheme(4, 2, 2)
    rts = make_runtimes(scheme, shards=4, heartbeat=(0.05, 40), wrap={2: _Unpublished})
    live = [0, 1, 3]
    try:
        for v in range(2):
            _step(rts, v, range(4))
        submit(rts[2], 2)  # first, so that its code is an entry of version 2 (partition 2's, the newest)
        assert _eventually(lambda: 2 in rts[0].leader._carried.get(2, {}))
        for r in live:
            submit(rts[r], 2)
        assert _eventually(lambda: rts[0].record(2) is not None)
        first = _entries(rts[0].record(2))
        assert _eventually(lambda: all(rts[r]._shard_seen[r] == 2 for r in live))  # shards 0, 1, 3 of version 2
        assert _eventually(lambda: set(rts[0].leader._carried.get(2, {})) == {0, 1, 2, 3})  # every code arrived
        _die(rts, 2)
        aggs = _collect(rts, 2, live)
        again = []
        for i, k, v in first:
            if k == 2:  # the newest live code of partition i of version 2 or 1 (round robin: one rank per version)
                v, k = next((u, q) for u in (2, 1) for q in live if scheme.evaluated(q, u) == i)
            again.append((i, k, v))
        assert any(k == 2 for _, k, _ in first) and not any(k == 2 for _, k, _ in again)
        assert all(torch.equal(a, aggs[0]) for a in aggs)
        size = rts[0].layout.shard_numel
        lost = slice(2 * size, min(3 * size, D))
        torch.testing.assert_close(aggs[0][lost].double(), _weighted(scheme, again)[lost], rtol=1e-6, atol=1e-5)
        rest = torch.ones(D, dtype=torch.bool)
        rest[lost] = False
        torch.testing.assert_close(aggs[0][rest].double(), _weighted(scheme, first)[rest], rtol=1e-6, atol=1e-5)
        assert "version 2 is decoded again for shards [2] of lost owner(s) [2]" in caplog.text
        _go_on(scheme, rts, range(3, 6), live, leader=0, lost=2)
    finally:
        _bury(rts, 2)


def test_a_frozen_shard_owner_is_fenced_off_and_its_shard_moves(caplog):
    """r = 2, c = 2, 4 shards. Rank 2 freezes (SIGSTOP: no heartbeats, its streams stay up) after version 1. After a
    heartbeat window every rank stops accepting its shards, its shard moves to a live rank and its entries are
    forgotten; the live ranks go on with aggregates that are the reference of entries younger than c, identical on
    every one of them."""
    scheme = BoundedScheme(4, 2, 2)
    rts = make_runtimes(scheme, shards=4, heartbeat=(0.05, 10), wrap={2: FrozenTransport})
    live = [0, 1, 3]
    try:
        for v in range(2):
            _step(rts, v, range(4))
        rts[2].transport.freeze()
        _go_on(scheme, rts, range(2, 6), live, leader=0, lost=2)
        assert "rank 2 owns shards [2] and sent no heartbeat" in caplog.text and "shard 2 to rank" in caplog.text
        assert all(rts[r].error is None for r in live)
    finally:
        rts[2].transport.frozen.clear()
        _stop_all(rts, timeout=1.0)


def test_a_dead_leader_is_replaced_and_its_successor_rebuilds_the_table_from_kept_codes(caplog):
    """r = 2, c = 2, one shard (the leader's: the small-model layout), failover. Rank 0 dies while ranks 1-3 sent it
    their codes for version 2, before it closed it. Rank 1 takes over with an empty
    table; the live ranks send it their codes of their last c versions again, from which it rebuilds the table, and
    versions 2-7 close with ranks 1-3: every entry younger than c and none of rank 0, every aggregate the reference
    of its entries, identical on every live rank."""
    scheme = BoundedScheme(4, 2, 2)
    rts = make_runtimes(scheme, shards=1, heartbeat=(0.05, 40), wrap={0: FrozenTransport}, failover=True)
    live = [1, 2, 3]
    try:
        for v in range(2):
            _step(rts, v, range(4))
        rts[0].transport.freeze()  # (else it may publish version 2 to some ranks only: they rejoin, tested below)
        for r in live:
            submit(rts[r], 2)
        _die(rts, 0)
        for v in range(2, 8):
            aggs = _collect(rts, v, live) if v == 2 else _step(rts, v, live)
            rec = rts[1].record(v)
            assert all(v - e.version < 2 and e.rank != 0 for e in rec.entries), (v, rec.entries)
            _check(scheme, aggs, _entries(rec))
        assert rts[1].is_leader and [rts[r].leader_rank for r in live] == [1, 1, 1]
        assert "rank 1 takes over" in caplog.text and "shard 0 to rank 1" in caplog.text
        assert [(rts[r].error, rts[r].mailbox.failure()) for r in live] == [(None, None)] * 3
    finally:
        _bury(rts, 0)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("pgc-")]


def test_a_frozen_leader_is_replaced_and_rejoins_as_a_worker_when_it_resumes(caplog):
    """r = 2, c = 2, one shard, failover of a frozen leader. Rank 0 freezes (SIGSTOP) after version 1; after a
    heartbeat window rank 1 takes over, rebuilds the table from the re-sent codes and closes versions 2-3 with ranks
    1-3. When rank 0 resumes it steps down, rejoins by state transfer, and all four go on: its codes count again
    from then on, and every aggregate is the reference of its entries, identical on every rank."""
    scheme = BoundedScheme(4, 2, 2)
    rts = make_runtimes(
        scheme, shards=1, heartbeat=(0.05, 10), wrap={0: FrozenTransport}, failover=True, frozen_failover=True
    )
    live = [1, 2, 3]
    state = torch.arange(7, dtype=torch.uint8)
    try:
        for v in range(2):
            _step(rts, v, range(4))
        rts[0].transport.freeze()
        _go_on(scheme, rts, range(2, 4), live, leader=1, lost=0)
        assert "the leader (rank 0) is frozen" in caplog.text
        rts[0]._doubt_since = time.monotonic()  # what its service loop finds on resuming (here it never stopped)
        rts[0].transport.frozen.clear()  # SIGCONT
        assert rts[0].settle_seat() is False and rts[0].leader_rank == 1
        u, _ = _resume_and_rejoin(rts, 0, 1, live, state, first=2, send=submit)
        _go_on(scheme, rts, range(u + 1, u + 4), range(4), leader=1, lost=None)
        assert any(e.rank == 0 for v in range(u + 1, u + 4) for e in rts[1].record(v).entries)
        assert all(rt.error is None and rt.mailbox.failure() is None for rt in rts)
    finally:
        _stop_all(rts, timeout=1.0)


def test_ranks_that_missed_the_dead_leaders_last_aggregate_rejoin_and_their_kept_codes_still_count(caplog):
    """r = 2, c = 2, one shard, failover. Rank 0 dies while sending version 2: rank 3 got it, ranks 1 (the
    successor) and 2 did not, so both are detached and rejoin at version 3 with rank 3's state. Their codes of
    version 2, sent again to rank 1 while they are detached, still enter the rebuilt table: version 3 needs rank 1's
    (round robin: partition 1 is evaluated at version 3 only by the dead rank 0). Found on 4 real ranks, where the
    table used to skip a detached rank's codes and version 3 waited for coverage for ever."""
    scheme = BoundedScheme(4, 2, 2)
    rts = make_runtimes(scheme, shards=1, heartbeat=(0.05, 40), wrap={0: _ReachesOnlyRank3}, failover=True)
    live = [1, 2, 3]
    state = torch.arange(9, dtype=torch.uint8)
    try:
        got = _two_miss_the_last_aggregate_and_rejoin(rts, state, submit)
        assert sorted(got) == live
        rec = rts[1].record(3)
        assert rec.entries[1] == Entry(1, 2)
        _check(scheme, [got[r] for r in live], _entries(rec))
        _go_on(scheme, rts, range(4, 6), live, leader=1, lost=0)
    finally:
        _bury(rts, 0)


def test_every_rank_keeps_its_own_codes_of_its_last_c_versions_and_no_more():
    """c = 3, one shard: a rank that owns no shard reuses a code message only once it is c versions old (it may be
    sent again to a new owner until then), so it holds c + 1 messages at most over 10 versions."""
    scheme = BoundedScheme(4, 2, 3)
    rts = make_runtimes(scheme, shards=1)
    try:
        for v in range(10):
            _step(rts, v, range(4))
            versions = sorted(m.version for m in rts[2]._codes)
            assert versions[-1] == v and set(range(max(0, v - 2), v + 1)) <= set(versions)
        assert rts[2].buffer_stats()["code_messages"] <= 4
    finally:
        _stop_all(rts)
