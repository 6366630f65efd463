"""The sharded data plane on in-process queues: no processes, real threads, real waiting."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from lightning_pgc.codes import SCHEMES, make_scheme
from lightning_pgc.runtime import (
    Channel,
    CoordinatorError,
    OwnerMap,
    PGCDetached,
    PGCRuntime,
    PGCTimeoutError,
    QueueHub,
    ShardLayout,
    choose_num_shards,
)
from lightning_pgc.runtime.messages import Header, Kind, pack, pack_ages, unpack, unpack_ages
from tests.runtime_scenarios import (
    code,
    D,
    _donate,
    _eventually,
    FrozenTransport,
    make_runtimes,
    _release_receivers,
    _stop_all,
    submit,
)


# ------------------------------------------------------------------------------------------------- pure parts
def test_header_roundtrip_float32_and_float64():
    for dtype in (torch.float32, torch.float64):
        for h in (
            Header(Kind.CODE, 123456789012, 3, 2, 4, 7, (0, 1, 15, 7), 99, partition=5),
            Header(Kind.AGGREGATE, 8, 0, 0, 0, 1, table=tuple(i % 16 for i in range(16))),
        ):
            msg = pack(h, torch.arange(D, dtype=dtype), D, dtype)
            got, payload = unpack(msg)
            assert got == h
        assert torch.equal(payload, torch.arange(D, dtype=dtype))
    assert unpack_ages(pack_ages((3, 20)), 2) == (3, 15)  # clamped at 15


def test_layout_covers_the_payload_exactly_once():
    for numel, coded, shards in [(10, 7, 1), (10, 7, 3), (10, 10, 4), (64, 1, 4), (5, 0, 5), (1001, 990, 4)]:
        layout = ShardLayout(numel, coded, shards)
        seen_coded = seen_plain = 0
        for j in range(shards):
            start, end = layout.bounds(j)
            assert end - start == layout.shard_numel
            ce, pe = layout.coded_end(j), layout.plain_end(j)
            assert 0 <= ce <= pe <= layout.shard_numel
            seen_coded += ce
            seen_plain += pe - ce
        assert (seen_coded, seen_plain) == (coded, numel - coded)
        assert layout.padded_numel >= numel and layout.shard_numel % 8 == 0
    with pytest.raises(ValueError):
        ShardLayout(4, 5, 1)
    assert choose_num_shards(100, 8, 1 << 20) == 1
    assert choose_num_shards(10 << 20, 8, 1 << 20) == 8
    assert choose_num_shards(3 << 20, 8, 1 << 20) == 3


def test_owner_map_is_versioned():
    owners = OwnerMap(3, 4)
    assert [owners.owner(j, 0) for j in range(3)] == [0, 1, 2]
    owners.reassign(2, 3, from_version=5)
    assert owners.owner(2, 4) == 2 and owners.owner(2, 5) == 3 and owners.owner(2, 99) == 3
    assert owners.shards_of(3, 5) == [2] and owners.shards_of(2, 5) == []
    with pytest.raises(ValueError, match="already reassigned"):
        owners.reassign(2, 1, from_version=4)
    with pytest.raises(ValueError):
        OwnerMap(5, 4)


# ------------------------------------------------------------------------------------------------- protocol
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_every_shard_decodes_with_the_same_admitted_set(name, shards):
    """All owners use the leader's ordered set: the assembled aggregate equals the float64 decode of whole codes,
    whatever order the codes reach the different owners in, and is bit-identical on every rank."""
    s = 0 if name == "dgd" else 1
    scheme = make_scheme(name, 4, s)
    plain = 3
    rts = make_runtimes(scheme, shards=shards, plain=plain)
    try:
        for version, order in enumerate(itertools.islice(itertools.permutations(range(4)), 0, 24, 5)):
            codes = {r: code(r, version) * (1 + r) for r in range(4)}
            for r in order:
                submit(rts[r], version, codes[r], ages=(0, 0))
                time.sleep(0.01)
            aggs = [rt.wait(version) for rt in rts]
            rec = rts[0].record(version)
            ref = scheme.decode({k: codes[k][: D - plain].double() for k in rec.admitted})
            for a in aggs:
                assert torch.equal(a, aggs[0])
            torch.testing.assert_close(aggs[0][: D - plain].double(), ref, rtol=1e-6, atol=1e-5)
            tail = torch.stack([codes[k][D - plain :] for k in rec.admitted]).mean(0)
            torch.testing.assert_close(aggs[0][D - plain :], tail)
            for rt, a in zip(rts, aggs):
                rt.release(a)
    finally:
        _stop_all(rts)


def test_aggregate_without_the_slow_rank_late_code_counted():
    scheme = make_scheme("ignore", 4, 1)
    rts = make_runtimes(scheme)
    try:
        for r in (0, 1, 2):
            submit(rts[r], 0)
        aggs = [rts[r].wait(0) for r in (0, 1, 2)]
        expected = (code(0, 0) + code(1, 0) + code(2, 0)) / 3
        for a in aggs:
            assert torch.equal(a, aggs[0])
        torch.testing.assert_close(aggs[0], expected)
        # the slow rank finds version 0 already published: it may skip computing and just apply it
        assert _eventually(lambda: rts[3].published(0))
        assert torch.equal(rts[3].wait(0), aggs[0])
        submit(rts[3], 0)  # its late code is counted, not used
        assert _eventually(lambda: rts[0].rank_stats()[3]["late"] == 1)
        rec = rts[0].record(0)
        assert sorted(rec.admitted) == [0, 1, 2] and 3 in rec.late
        stats = rts[0].rank_stats()
        assert [row["admitted"] for row in stats] == [1, 1, 1, 0]
        assert stats[3]["mean_lag_s"] > 0
    finally:
        _stop_all(rts)


def test_a_rank_whose_training_thread_stalls_still_serves_its_shard():
    """Rank 3 never submits (its training thread sleeps); its background thread still decodes and sends shard 3,
    so the other ranks close version after version without it."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme)
    try:
        for version in range(5):
            for r in (0, 1, 2):
                submit(rts[r], version, ages=(0, 0))
            aggs = [rts[r].wait(version) for r in (0, 1, 2)]
            expected = (code(0, version) + code(1, version) + code(2, version)) / (3 * 2)
            torch.testing.assert_close(aggs[0], expected)
            assert all(torch.equal(a, aggs[0]) for a in aggs)
        assert len(rts[3].mailbox) == 5  # every aggregate reached the sleeping rank too
        assert rts[3].buffer_stats()["bytes_sent"] > 0  # it served shard 3 to the others
    finally:
        _stop_all(rts)


def test_pgc_cr_weights_and_arrival_order():
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme)
    try:
        for r in (2, 0, 3):
            submit(rts[r], 0, ages=(0, 0))
            time.sleep(0.2)
        agg = rts[0].wait(0)
        mu = 4 / (3 * 2)
        torch.testing.assert_close(agg, (mu / 4) * (code(0, 0) + code(2, 0) + code(3, 0)))
        rec = rts[0].record(0)
        assert sorted(rec.admitted) == [0, 2, 3] and rec.admitted == sorted(rec.admitted, key=rec.arrivals.get)
    finally:
        _stop_all(rts)


def test_the_same_admitted_set_gives_the_same_bits_whatever_the_arrival_order():
    """Owners sum the admitted codes in rank order: a resumed or repeated run with the same admitted sets
    computes the same bits even when the codes arrive in another order (float32 sums depend on the order)."""
    scheme = make_scheme("dgd", 4, 0)
    gen = torch.Generator().manual_seed(0)
    codes = {r: torch.randn(D, generator=gen) * 10.0 ** (3 * r - 4) for r in range(4)}
    rts = make_runtimes(scheme)
    try:
        aggs = []
        for version, order in enumerate([(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)]):
            for r in order:
                submit(rts[r], version, codes[r])
                time.sleep(0.05)
            aggs.append(rts[0].wait(version).clone())
            assert rts[0].record(version).admitted == list(order)
        for agg in aggs[1:]:
            assert torch.equal(agg, aggs[0])
        in_arrival_order = [
            sum((codes[r] / 4 for r in order), torch.zeros(D)) for order in [(0, 1, 2, 3), (3, 2, 1, 0)]
        ]
        assert not torch.equal(*in_arrival_order)  # so the orders above would give other bits if summed as they came
    finally:
        _stop_all(rts)


def test_dgd_waits_for_a_live_slow_rank_and_fails_fast_naming_a_dead_one():
    """Liveness is the heartbeats, not progress: a live rank that sends nothing for many timeouts is waited for
    (dgd needs it); a rank whose process never came up is reported within a heartbeat window plus ``timeout``."""
    scheme = make_scheme("dgd", 3, 0)
    rts = make_runtimes(scheme, timeout=0.3, heartbeat=(0.05, 4))
    try:
        submit(rts[0], 0)
        submit(rts[1], 0)
        time.sleep(1.5)  # 5x (window + timeout): rank 2 is slow, not dead
        assert not rts[0].published(0) and rts[0].error is None
        submit(rts[2], 0)
        aggs = [rt.wait(0) for rt in rts]
        assert sorted(rts[0].record(0).admitted) == [0, 1, 2] and all(torch.equal(a, aggs[0]) for a in aggs)
    finally:
        _stop_all(rts)
    rts = make_runtimes(scheme, timeout=0.3, heartbeat=(0.05, 4), ranks=[0, 1])
    try:
        submit(rts[0], 0)
        submit(rts[1], 0)
        with pytest.raises(
            CoordinatorError, match=r"Missing ranks: \[2\]; the last version closed is -1.*needs 3 of 3"
        ):
            rts[0].wait(0)
        # (no time bound: without the detection this wait would block as long as the live slow rank's above)
        # the other workers are told, instead of hanging
        with pytest.raises(RuntimeError, match=r"leader failed: CoordinatorError: .*Missing ranks: \[2\]"):
            rts[1].wait(0)
    finally:
        for rt in rts:
            _release_receivers(rt.hub, rt.rank, [2])
        _stop_all(rts, timeout=0.5)


def test_leader_names_missing_ranks_beyond_s():
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme, timeout=0.2, heartbeat=(0.05, 4), ranks=[0, 1])
    try:
        submit(rts[1], 0, ages=(0, 0))
        with pytest.raises(RuntimeError, match=r"Missing ranks: \[2, 3\]"):
            rts[1].wait(0)
    finally:
        for rt in rts:
            _release_receivers(rt.hub, rt.rank, [2, 3])
        _stop_all(rts, timeout=0.3)


def test_worker_fails_when_the_leader_stops_beating():
    scheme = make_scheme("pgc_cr", 3, 1)
    hub = QueueHub(3)
    worker = PGCRuntime(
        scheme,
        hub.endpoint(1),
        rank=1,
        world_size=3,
        layout=ShardLayout(D, D, 3),
        down_dtype=torch.float32,
        start_version=0,
        timeout=0.2,
        max_lag=10,
        heartbeat_interval=0.05,
        heartbeat_misses=4,
    )
    worker.start()
    submit(worker, 0)
    with pytest.raises(PGCTimeoutError, match=r"lost the leader \(rank 0\): no heartbeat"):
        worker.wait(0)
    _release_receivers(hub, 1, (0, 2))
    worker.stop()


def test_a_rank_too_far_behind_is_detached_and_rejoins_by_state_transfer():
    """Nobody waits for rank 2, stalled at version 0: past ``max_lag`` it is detached (its mailbox stays bounded
    whatever the stall length), and when it is back it gets the leader's state at the open version and the
    aggregates from there on, identical to everyone's."""
    scheme = make_scheme("ignore", 3, 1)
    rts = make_runtimes(scheme, max_lag=2)
    try:
        for v in range(6):  # rank 2 stalls: 6 versions close without it
            for r in (0, 1):
                submit(rts[r], v)
            for r in (0, 1):
                rts[r].release(rts[r].wait(v))
        assert rts[0].leader.detached == {2: 2}
        assert len(rts[2].mailbox) == 2 and rts[2].detached(2) and not rts[2].detached(1)
        for v in range(2):  # rank 2 is back: it applies what it holds
            assert rts[2].published(v)
            rts[2].release(rts[2].wait(v))
        assert not rts[2].published(2) and rts[2].detached(2)
        with pytest.raises(PGCDetached):
            rts[2].wait(2)
        got = {}
        rejoin = threading.Thread(target=lambda: got.update(result=rts[2].rejoin(2)))
        rejoin.start()
        assert _eventually(lambda: 2 not in rts[0].leader.detached)
        u = rts[0].leader.version
        assert u == 6
        state = torch.arange(10, dtype=torch.uint8)
        for r in (0, 1):
            submit(rts[r], u)
        aggs = {r: rts[r].wait(u) for r in (0, 1)}
        assert _donate(rts[0], u, state) == 2 and _donate(rts[1], u, state) is None
        rejoin.join(5)
        got_u, got_state = got["result"]
        assert got_u == u and torch.equal(got_state, state)
        agg2 = rts[2].wait(u)  # attached again from u on
        assert torch.equal(agg2, aggs[0]) and torch.equal(agg2, aggs[1])
        assert rts[2].buffer_stats()["mailbox_high_water"] <= 2
        assert rts[0].rank_stats()[2]["rejoined"] == 1
    finally:
        _stop_all(rts)


def test_a_rank_back_after_the_others_finished_gets_the_leaders_final_state():
    scheme = make_scheme("ignore", 3, 1)
    rts = make_runtimes(scheme, max_lag=1)
    final = torch.tensor([7, 7, 7], dtype=torch.uint8)
    for v in range(3):
        for r in (0, 1):
            submit(rts[r], v)
        for r in (0, 1):
            rts[r].release(rts[r].wait(v))
    stoppers = [
        threading.Thread(target=rts[0].stop, kwargs={"donate": lambda: final}),
        threading.Thread(target=rts[1].stop),
    ]
    for t in stoppers:
        t.start()
    rts[2].release(rts[2].wait(0))
    assert rts[2].detached(1)
    u, state = rts[2].rejoin(1)
    assert u == 3 and torch.equal(state, final)
    rts[2].stop()
    for t in stoppers:
        t.join(10)
    assert not any(t.is_alive() for t in stoppers)
    assert rts[2].rank_stats()[2]["rejoined"] == 1


def test_a_frozen_rank_is_missing_detached_and_not_waited_for():
    """Rank 2 freezes (SIGSTOP-like: no heartbeats, no messages). With s = 1 the others go on; the leader
    reports it missing after the heartbeat window and detaches it, so nothing accumulates for it."""
    scheme = make_scheme("pgc_cr", 3, 1)
    frozen = {}
    rts = make_runtimes(
        scheme, max_lag=3, shards=1, heartbeat=(0.05, 4), wrap={2: lambda t: frozen.setdefault(2, FrozenTransport(t))}
    )
    try:
        frozen[2].freeze()
        for v in range(8):
            for r in (0, 1):
                submit(rts[r], v, ages=(0, 0))
            for r in (0, 1):
                rts[r].release(rts[r].wait(v))
        assert _eventually(lambda: rts[0].leader.missing(time.monotonic()) == [2])
        assert rts[0].leader.detached == {2: 3}
        assert rts[0].error is None
    finally:
        frozen[2].frozen.clear()
        _stop_all(rts)


def test_a_rejected_code_makes_its_rank_a_straggler_for_that_version():
    scheme = make_scheme("pgc_cr", 3, 1)
    rts = make_runtimes(scheme)
    try:
        rts[1].reject(0)
        submit(rts[0], 0, ages=(0, 0))
        submit(rts[2], 0, ages=(0, 0))
        aggs = [rt.wait(0) for rt in rts]
        assert sorted(rts[0].record(0).admitted) == [0, 2]
        assert all(torch.equal(a, aggs[0]) for a in aggs)
        assert _eventually(lambda: rts[0].rank_stats()[1]["rejected"] == 1)
        assert rts[1].buffer_stats()["rejected"] == 1
    finally:
        _stop_all(rts)


def test_owner_reassignment_moves_a_shard_and_resends_kept_codes():
    """Shard 2 moves from rank 2 to rank 1 at version 2. Rank 3 already sent its code for version 2 to rank 2
    before the move: it re-sends its kept code. Aggregates stay exact and identical; rank 2 gets no code shards
    for versions >= 2 after the move."""
    scheme = make_scheme("pgc_cr", 4, 1)
    log: list = []
    rts = make_runtimes(scheme, log=log)
    try:
        for v in range(2):
            for r in range(4):
                submit(rts[r], v, ages=(0, 0))
            for rt in rts:
                rt.release(rt.wait(v))
        submit(rts[3], 2, ages=(0, 0))
        assert _eventually(lambda: any(e[:3] == (Channel.CODE, 3, 2) and e[4] == 2 for e in log))
        rts[0].reassign(2, 1, from_version=2)
        assert _eventually(lambda: rts[3].owners.owner(2, 2) == 1)
        assert _eventually(lambda: any(e[:3] == (Channel.CODE, 3, 1) and e[4:] == (2, 2) for e in log))
        for r in (0, 1, 2):
            submit(rts[r], 2, ages=(0, 0))
        aggs = [rt.wait(2) for rt in rts]
        rec = rts[0].record(2)
        expected = sum(code(k, 2) for k in rec.admitted) / (len(rec.admitted) * 2)  # mu / n = 1 / (|R| c)
        torch.testing.assert_close(aggs[0], expected)
        assert all(torch.equal(a, aggs[0]) for a in aggs)
        served = [e for e in log if e[0] == Channel.AGG and e[3] == Kind.AGGREGATE and e[4:] == (2, 2)]
        assert {e[1] for e in served} == {1}  # the new owner published shard 2
        late_to_old = [e for e in log if e[0] == Channel.CODE and e[2] == 2 and e[4] == 2 and e[5] == 2 and e[1] != 3]
        assert late_to_old == []
        with pytest.raises(RuntimeError, match="only the leader"):
            rts[1].reassign(1, 0, 3)
    finally:
        _stop_all(rts)


def test_stop_drains_and_joins_every_thread():
    scheme = make_scheme("pgc_fr", 4, 1)
    rts = make_runtimes(scheme)
    for v in range(5):
        for r in range(4):
            submit(rts[r], v, ages=(0, 1))
        for r in range(4):
            rts[r].release(rts[r].wait(v))
    _stop_all(rts)
    assert all(not t.name.startswith("pgc-") for t in threading.enumerate()), threading.enumerate()
    # after stop every rank holds the leader's final per-rank table
    assert all(rt.rank_stats() == rts[0].rank_stats() for rt in rts[1:])
    assert sum(row["admitted"] for row in rts[1].rank_stats()) >= 5 * 2  # FR closes with one rank per group


def test_traffic_per_rank_is_a_ring_allreduce_worth_with_n_shards():
    """With n shards each rank sends and receives about 4 (n-1)/n payloads per step (a ring all-reduce's bytes);
    with one shard rank 0 carries 2 (n-1) payloads (the star, for small payloads)."""
    numel, steps, n = 4096, 4, 4
    for shards, bound in ((4, 1.1), (1, 2 * (n - 1) / (4 * (n - 1) / n) + 0.1)):
        scheme = make_scheme("pgc_cr", n, 1)
        rts = make_runtimes(scheme, shards=shards, numel=numel)
        for v in range(steps):
            for rt in rts:
                submit(rt, v, code(rt.rank, v, numel), ages=(0, 0))
            for rt in rts:
                rt.release(rt.wait(v))
        time.sleep(0.2)  # late codes still arriving count too
        ring = 4 * (n - 1) / n * numel * 4
        worst = max((rt.bytes_sent + rt.bytes_received) / steps for rt in rts) / ring
        _stop_all(rts)
        assert worst <= bound, (shards, worst)
        if shards == 1:
            assert worst > 1.5
