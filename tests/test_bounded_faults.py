"""The bounded-staleness leader when ranks die or freeze (no I/O): a lost rank's entries are forgotten and fall back on
the newest other code of the same partition, a partition no live code can cover is left out instead of waiting for
ever, and a live holder whose code has not arrived is waited for. The runtime's side: tests/test_dataplane.py; real
ranks: tests/test_leader_faults.py and test_faults.py."""

from __future__ import annotations


import pytest

from lightning_pgc.codes import BoundedScheme, Entry
from lightning_pgc.decisions.bounded import BoundedLeader
from lightning_pgc.decisions.header import Header


def _closed_leader(scheme, versions, missing=()):
    """A BoundedLeader that saw every rank's round-robin code of ``versions`` (but ``missing``'s ``(rank, version)``)
    and closed them; returns it and the records."""
    leader = BoundedLeader(scheme, scheme.n, 0, timeout=5.0, max_lag=100)
    recs = []
    for v in versions:
        for r in range(scheme.n):
            if (r, v) not in missing:
                leader.on_code(Header(v, r, 1, (0,)), 1.0 + v)
        recs.append(leader.try_close(1.0 + v))
    return leader, recs


def _newest_by_hand(scheme, partition, floor, below, gone, missing=()):
    """The newest round-robin code of ``partition`` of a version in ``(floor, below]`` from a rank not ``gone``."""
    for v in range(below, floor, -1):
        for q in range(scheme.n):
            if q not in gone and (q, v) not in missing and scheme.evaluated(q, v) == partition:
                return q, v
    return None


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
    code = {r: Header(3, r, 1, (0,)) for r in range(4)}  # version 3: partitions r + 1
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
                    leader.on_code(Header(t, r, 1, (0,)), 0.1 * t)
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
        leader.on_code(Header(0, r, 1, (0,)), 0.1)
    assert leader.try_close(0.1) is None and leader.uncovered == 0
    leader.on_code(Header(0, 2, 1, (0,)), 0.2)
    rec = leader.try_close(0.2)
    assert rec.entries == (Entry(0, 0), Entry(1, 0), Entry(2, 0), None) and leader.uncovered == 1
    assert rec.plan() == [(0, 0, 0), (1, 1, 0), (2, 2, 0), (3, -1, 0)]


# ---------------------------------------------------------------------------------------------- the runtime
