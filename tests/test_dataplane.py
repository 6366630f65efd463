"""The collective data plane: each rank's share of the decode (exhaustively, against the scheme's own decode), and
the runtime on real gloo groups between threads of this process (real all-reduces, real waiting, a real store)."""

from __future__ import annotations

import itertools
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_pgc.codes import SCHEMES, BoundedScheme, make_scheme
from lightning_pgc.runtime.control import serve_store
from lightning_pgc.runtime.collectives import CollectiveError
from lightning_pgc.decisions.leader import DivergedError
from lightning_pgc.runtime.plane import CollectiveRuntime, PGCDetached
from lightning_pgc.codes.shares import contribute, contributions, reference_decode
from tests.runtime_scenarios import _together

D = 61  # payload elements: 56 decoded (gradient and loss), 5 averaged (buffers)
CODED = 56


def _code(rank: int, version: int, dtype=torch.float32, integer=False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * version + rank)
    if integer:
        return torch.randint(-64, 64, (D,), generator=g).to(dtype)
    return torch.randn(D, generator=g, dtype=torch.float64).to(dtype)


def _sum_of_shares(scheme, plan, codes, dtype):
    """What the all-reduce adds up: every rank's share, summed here in rank order."""
    total = torch.zeros(D, dtype=dtype)
    for rank in range(scheme.n):
        mine = {v: c for (k, v), c in codes.items() if k == rank}
        total += contribute(scheme, plan, rank, mine, CODED, torch.empty(D, dtype=dtype))
    return total


def _admissible_orders(scheme):
    for size in range(scheme.wait_for, scheme.n + 1):
        for ranks in itertools.combinations(range(scheme.n), size):
            if scheme.admits(list(ranks)):
                yield list(ranks)


# ------------------------------------------------------------------------------------------- shares of a decode
@pytest.mark.parametrize("name", SCHEMES)
def test_the_shares_add_up_to_the_decode_for_every_admitted_set(name):
    """For every scheme and every admitted set, the ranks' shares add up to the scheme's decode (plus the plain
    mean of the buffers): within float rounding of the payload dtype (the sum runs in another order), and exactly
    with integer-valued codes and power-of-two weights (every product and partial sum is exact)."""
    n = 4
    scheme = make_scheme(name, n, 0 if name == "dgd" else 1)
    dtype = scheme.payload_dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-6, atol=2e-6)
    exact = []
    for ranks in _admissible_orders(scheme):
        plan = [(k, k, 3) for k in ranks]
        codes = {(k, 3): _code(k, 3, dtype) for k in range(n)}
        torch.testing.assert_close(
            _sum_of_shares(scheme, plan, codes, dtype), reference_decode(scheme, plan, codes, CODED), **tol
        )
        weights = list(scheme.decoding_weights(sorted(ranks)).values()) + [1 / len(ranks)]
        if all(w == 0 or _power_of_two(w) for w in weights):
            exact.append(ranks)
            icodes = {(k, 3): _code(k, 3, dtype, integer=True) for k in range(n)}
            assert torch.equal(
                _sum_of_shares(scheme, plan, icodes, dtype), reference_decode(scheme, plan, icodes, CODED)
            ), (name, ranks)
    if name in ("dgd", "ignore", "gc_fr", "pgc_fr"):
        assert exact  # (the full set at least: weights 1/4)


def _power_of_two(w: float) -> bool:
    m, _ = __import__("math").frexp(w)
    return m == 0.5


def test_a_rank_outside_the_plan_contributes_zeros_and_arrival_order_does_not_matter():
    scheme = make_scheme("pgc_fr", 4, 1)  # FR: the first rank of each group (in rank order) is used
    assert contributions(scheme, [(3, 3, 0), (0, 0, 0), (2, 2, 0)], 1) == {}
    assert contributions(scheme, [(3, 3, 0), (2, 2, 0), (0, 0, 0)], 2) == contributions(
        scheme, [(0, 0, 0), (2, 2, 0), (3, 3, 0)], 2
    )
    out = contribute(scheme, [(0, 0, 0), (2, 2, 0)], 1, {}, CODED, torch.full((D,), 7.0))
    assert torch.equal(out, torch.zeros(D))


def test_bounded_shares_sum_a_ranks_entries_across_versions():
    """Bounded staleness: the plan names, per partition, a rank and the version of its code; a rank named twice
    adds both entries (from its kept codes), and partitions left out are averaged over the others."""
    scheme = BoundedScheme(4, 2, 2)
    codes = {(k, v): _code(k, v) for k in range(4) for v in (4, 5)}
    plans = [
        [(0, 0, 5), (1, 1, 5), (2, 2, 4), (3, 3, 5)],
        [(0, 3, 4), (1, 0, 5), (2, 1, 5), (3, 3, 5)],  # rank 3 twice, two versions
        [(0, 0, 5), (1, -1, 5), (2, 2, 5), (3, 2, 4)],  # partition 1 left out, rank 2 twice
    ]
    for plan in plans:
        torch.testing.assert_close(
            _sum_of_shares(scheme, plan, codes, torch.float32),
            reference_decode(scheme, plan, codes, CODED),
            rtol=2e-6,
            atol=2e-6,
        )
    assert contributions(scheme, plans[1], 3) == {4: (0.25, 0.25), 5: (0.25, 0.25)}


# ------------------------------------------------------------------------------------------- the runtime, in threads
def _planes(scheme, max_lag=100, timeout=3.0, heartbeat=(0.1, 50), failover=False):
    store = serve_store()
    rts = [
        CollectiveRuntime(
            scheme,
            store,
            r,
            scheme.n,
            D,
            CODED,
            D,
            torch.float32,
            0,
            timeout,
            max_lag,
            heartbeat_interval=heartbeat[0],
            heartbeat_misses=heartbeat[1],
            prefix="test",
            failover=failover,
        )
        for r in range(scheme.n)
    ]
    _together(rts, lambda rt: rt.start())  # building the first group needs every rank
    for rt in rts:
        rt.store_server = store
    return rts


def _submit(rt, version, payload=None):
    code = rt.new_code(version)
    code.write(0, (_code(rt.rank, version) if payload is None else payload).to(code.flat.dtype))
    rt.submit(version, code, (0,))


def _eventually(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def _assert_decodes(aggregate, scheme, record):
    """``aggregate`` is the decode of the codes ``record`` admitted (each rank's ``_code``), within float rounding."""
    v = record.version
    codes = {(k, v): _code(k, v, scheme.payload_dtype) for k in range(scheme.n)}
    plan = [(k, k, v) for k in record.admitted]
    tol = 1e-6 if scheme.payload_dtype == torch.float32 else 1e-7
    torch.testing.assert_close(
        aggregate, reference_decode(scheme, plan, codes, CODED, torch.float32), rtol=tol, atol=tol
    )


def _kill(rt):
    """Rank ``rt`` dies: its threads stop, its connections close, it says nothing."""
    rt._stopped = True
    rt._beats_done.set()
    rt._ctl.push(f"to/{rt.rank}", (-1, ("halt",)))
    if rt.is_leader:
        rt._ctl.push(rt._leader_box(), ("halt",))
    for t in rt._threads:
        t.join(5)
    rt.group.close()


def _stop_all(rts):
    _together([rt for rt in rts if not rt._stopped], lambda rt: rt.stop())


def _store_connections(server) -> set[str]:
    """The peers (address:port) of the connections the store ``server`` has accepted and still holds (it listens on
    IPv4: see ``serve_store``)."""
    port = f":{server.port:04X}"
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return {row[2] for row in rows if row[1].endswith(port) and row[3] == "01"}  # local port; 01: established


def _pgc_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("pgc-")]


@pytest.mark.parametrize("name", ["pgc_cr", "gc_cr", "pgc_fr", "ignore"])
def test_every_rank_gets_the_same_bits_equal_to_the_decode_and_a_straggler_is_not_waited_for(name):
    """Versions close with the fastest ranks; every rank, the straggler included (its comm thread takes part on time
    with zeros), gets the same bits, equal to the decode of the admitted codes; the straggler applies them later
    without computing."""
    scheme = make_scheme(name, 4, 1)
    rts = _planes(scheme)
    try:
        for v in range(4):
            slow = v % 4
            for rt in rts:
                if rt.rank != slow:
                    _submit(rt, v)
            aggs = {rt.rank: rt.wait(v) for rt in rts if rt.rank != slow}
            assert _eventually(lambda: rts[slow].published(v))
            aggs[slow] = rts[slow].wait(v)
            assert all(torch.equal(a, aggs[0]) for a in aggs.values())
            record = rts[0].record(v)
            assert slow not in record.admitted
            _assert_decodes(aggs[0], scheme, record)
            for rt in rts:
                rt.release(aggs[rt.rank])
    finally:
        _stop_all(rts)
    assert _pgc_threads() == []


def test_threads_per_rank_do_not_grow_with_n():
    counts = {}
    for n in (2, 6):
        rts = _planes(make_scheme("pgc_cr", n, 1))
        try:
            counts[n] = sorted(len([t for t in rt._threads if t.is_alive()]) for rt in rts)
        finally:
            _stop_all(rts)
    assert counts[2] == [2, 3] and counts[6] == [2, 2, 2, 2, 2, 3]  # comm + heartbeat (+ the leader's)
    assert _pgc_threads() == []


def test_a_dead_rank_is_survived_and_more_than_s_fail_fast_naming_them(caplog):
    """pgc_cr, n = 4, s = 1. Rank 3 dies: the all-reduce fails, the survivors build a new group and versions go on
    closing with identical aggregates; Lightning's collectives run among them. Then rank 2 dies too: two dead
    ranks are more than s, and every survivor fails with an error naming them."""
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = _planes(scheme, timeout=1.0)
    connections = _store_connections(rts[0].store_server)
    try:
        for v in range(2):
            for rt in rts:
                _submit(rt, v)
            for rt in rts:
                rt.release(rt.wait(v))
        _kill(rts[3])
        live = rts[:3]
        for v in range(2, 5):
            for rt in live:
                _submit(rt, v)
            aggs = _together(live, lambda rt: rt.wait(v))
            assert all(torch.equal(a, aggs[0]) for a in aggs.values()), aggs
            for rt in live:
                rt.release(aggs[rt.rank])
        assert rts[0]._coordinator.members == [0, 1, 2] and 3 in rts[0].leader.detached
        assert "ranks [3] left the data group" in caplog.text and "rank 3 died at version" in caplog.text
        got = _together(live, lambda rt: rt.collectives.reduce(torch.tensor([1.0]) * (rt.rank + 1), "mean"))
        assert all(torch.equal(x, torch.tensor([2.0])) for x in got.values())
        got = _together(live, lambda rt: rt.collectives.broadcast(f"from {rt.rank}", src=0))
        assert set(got.values()) == {"from 0"}
        _kill(rts[2])
        for rt in rts[:2]:
            _submit(rt, 5)
        got = _together(rts[:2], lambda rt: rt.wait(5))
        for err in got.values():
            assert isinstance(err, Exception) and "Missing ranks" in str(err), err
        assert re.search(r"Missing ranks: \[2, 3\]", str(rts[0].failure()))
        assert _store_connections(rts[0].store_server) <= connections, (
            "a store connection was opened"
        )  # none opened while liveness is judged
    finally:
        _stop_all(rts[:2])
    assert _pgc_threads() == []


@pytest.mark.parametrize("name", ["pgc_cr", "gc_cr"])
def test_a_dead_leader_is_replaced_by_the_lowest_live_member_and_versions_go_on(name, caplog):
    """Failover, n = 4, s = 1. Rank 0 (the leader) dies between versions; the codes of version 2 go to its box
    before anyone noticed. Rank 1 takes over (every rank follows it), the members send it their codes again and
    versions 2-4 close with identical bits on every live rank, equal to the decode of the admitted codes;
    Lightning's collectives run through the new leader."""
    scheme = make_scheme(name, 4, 1)
    rts = _planes(scheme, timeout=1.0, heartbeat=(0.05, 10), failover=True)
    connections = _store_connections(rts[0].store_server)
    try:
        for v in range(2):
            for rt in rts:
                _submit(rt, v)
            for rt in rts:
                rt.release(rt.wait(v))
        _kill(rts[0])
        live = rts[1:]
        for v in range(2, 5):
            for rt in live:
                _submit(rt, v)
            aggs = _together(live, lambda rt: rt.wait(v))
            assert all(torch.equal(a, aggs[1]) for a in aggs.values()), aggs
            record = rts[1].record(v)
            assert 0 not in record.admitted
            _assert_decodes(aggs[1], scheme, record)
            for rt in live:
                rt.release(aggs[rt.rank])
        assert rts[1].is_leader and {rt.leader_rank for rt in live} == {1} and {rt.term for rt in live} == {1}
        assert "rank 1 takes over" in caplog.text
        got = _together(live, lambda rt: rt.collectives.broadcast(f"from {rt.rank}", src=1))
        assert set(got.values()) == {"from 1"}
        assert _store_connections(rts[0].store_server) <= connections  # the successor leads over its own
    finally:
        _stop_all(rts[1:])
    assert _pgc_threads() == []


def test_collectives_gather_in_rank_order_and_refuse_mismatched_calls():
    rts = _planes(make_scheme("pgc_cr", 3, 1))
    try:
        got = _together(rts, lambda rt: rt.collectives.all_gather(torch.tensor([rt.rank, 10 * rt.rank])))
        assert all(torch.equal(v, torch.tensor([[0, 0], [1, 10], [2, 20]])) for v in got.values())
        got = _together(rts, lambda rt: rt.collectives.reduce(torch.tensor(float(rt.rank)), "max"))
        assert all(float(v) == 2.0 for v in got.values())
        got = _together(rts, lambda rt: rt.collectives.barrier() if rt.rank else rt.collectives.broadcast(1))
        assert all(isinstance(v, CollectiveError) and "different collectives" in str(v) for v in got.values())
    finally:
        _stop_all(rts)


def test_nonfinite_codes_make_their_rank_a_straggler_and_too_many_end_in_divergence():
    scheme = make_scheme("pgc_cr", 3, 1)
    rts = _planes(scheme)
    try:
        rts[1].reject(0)
        for r in (0, 2):
            _submit(rts[r], 0)
        aggs = _together(rts, lambda rt: rt.wait(0))
        assert rts[0].record(0).admitted == [0, 2] or rts[0].record(0).admitted == [2, 0]
        assert all(torch.equal(a, aggs[0]) for a in aggs.values())
        for rt in rts:
            rt.release(aggs[rt.rank])
        rts[1].reject(1)
        rts[2].reject(1)
        _submit(rts[0], 1)
        got = _together(rts, lambda rt: rt.wait(1))
        assert all(isinstance(e, Exception) and "diverged" in str(e) for e in got.values()), got
        assert isinstance(rts[0].failure(), DivergedError)
    finally:
        _stop_all(rts)


def test_a_rank_too_far_behind_is_detached_and_rejoins_by_state_transfer():
    """Rank 2 stalls at version 0 while its comm thread keeps serving: past ``max_lag`` it is detached (it holds at
    most ``max_lag`` aggregates), and when it is back it gets the leader's state at the open version and the same
    aggregates as everyone from there on."""
    scheme = make_scheme("ignore", 3, 1)
    rts = _planes(scheme, max_lag=2)
    try:
        for v in range(6):
            for r in (0, 1):
                _submit(rts[r], v)
            for r in (0, 1):
                rts[r].release(rts[r].wait(v))
        assert rts[0].leader.detached == {2: 2}
        assert _eventually(lambda: len(rts[2].aggregates) == 2) and rts[2].detached(2) and not rts[2].detached(1)
        for v in range(2):
            assert rts[2].published(v)
            rts[2].release(rts[2].wait(v))
        with pytest.raises(PGCDetached):
            rts[2].wait(2)
        got = {}
        rejoin = threading.Thread(target=lambda: got.update(result=rts[2].rejoin(2)))
        rejoin.start()
        assert _eventually(lambda: 2 not in rts[0].leader.detached)
        u = rts[0].leader.version
        state = {"weights": torch.arange(10, dtype=torch.float32), "steps": [3, torch.tensor(7)]}
        for r in (0, 1):
            _submit(rts[r], u)
        aggs = {r: rts[r].wait(u, donate=lambda: state) for r in (0, 1)}
        for r in (0, 1):
            rts[r].serve_rejoins(u, lambda: state)
        rejoin.join(10)
        got_u, got_state = got["result"]
        assert got_u == u and torch.equal(got_state["weights"], state["weights"])
        assert got_state["steps"][0] == 3 and int(got_state["steps"][1]) == 7
        agg2 = rts[2].wait(u)
        assert torch.equal(agg2, aggs[0]) and torch.equal(agg2, aggs[1])
        assert rts[2].buffer_stats()["mailbox_high_water"] <= 2
        assert rts[0].rank_stats()[2]["rejoined"] == 1
    finally:
        _stop_all(rts)


def _device_planes(devices: list[torch.device], data_backend: str) -> list[CollectiveRuntime]:
    store = serve_store()
    scheme = make_scheme("pgc_cr", len(devices), 1)
    rts = [
        CollectiveRuntime(
            scheme,
            store,
            r,
            len(devices),
            D,
            CODED,
            D,
            torch.float32,
            0,
            3.0,
            100,
            prefix=f"cuda-{data_backend}",
            device=device,
            data_backend=data_backend,
        )
        for r, device in enumerate(devices)
    ]
    _together(rts, lambda rt: rt.start())
    return rts


def _identical_bits_on_the_devices(rts: list[CollectiveRuntime]) -> None:
    try:
        for rt in rts:
            _submit(rt, 0)
        aggs = _together(rts, lambda rt: rt.wait(0))
        assert all(aggs[rt.rank].device == rt.device for rt in rts)
        assert all(torch.equal(a.cpu(), aggs[0].cpu()) for a in aggs.values())
    finally:
        _stop_all(rts)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"NCCL needs one GPU per rank: 2 ranks need 2 GPUs, this machine has {torch.cuda.device_count()}",
)
def test_nccl_data_group_with_one_rank_per_gpu_gives_identical_bits():
    """The NCCL data group as it runs in production: rank r on GPU r, the aggregate on each rank's own device, the
    same bits everywhere."""
    _identical_bits_on_the_devices(_device_planes([torch.device("cuda", r) for r in range(2)], "nccl"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs one CUDA device")
def test_ranks_sharing_one_gpu_over_gloo_give_identical_bits():
    """Two ranks on one GPU: NCCL refuses a communicator with the same GPU twice, so the data group is gloo, which
    stages the all-reduce through host memory; codes and aggregates stay on the GPU."""
    cuda = torch.device("cuda", 0)
    _identical_bits_on_the_devices(_device_planes([cuda, cuda], "gloo"))


def test_gradients_keep_the_parameters_channels_last_layout():
    """A channels_last parameter's gradient is stored in its memory order and given back as a view with its
    strides: no copy, and the optimizer sees the layout autograd would have produced."""
    from lightning_pgc.strategy.gradients import flat_like, grad_view

    p = torch.nn.Parameter(torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last))
    g = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
    flat = flat_like(g, p)
    assert flat.data_ptr() == g.data_ptr()  # a view: memory order is flat order
    view = grad_view(flat.clone(), p)
    assert view.stride() == p.stride() and torch.equal(view, g)
    q = torch.nn.Parameter(torch.randn(6, 7))
    assert grad_view(flat_like(torch.ones(6, 7), q), q).is_contiguous()


def test_a_comm_thread_slow_on_a_versions_contribution_is_not_the_leaders_silence(monkeypatch):
    """gc_cr, n = 4, s = 1, a leader-silence limit of 0.4 s. On ranks 1-3 the weighted contribution of version 0 takes
    1 s (a model-sized pass on a loaded machine); the leader's beats wait in the queue meanwhile. That is the comm
    thread's work, not the leader's silence: every rank gets the aggregate, none gives up on the leader."""
    import lightning_pgc.runtime.comm as comm

    def slow(scheme, plan, rank, *args, **kwargs):
        if rank != 0:
            time.sleep(1.0)
        return contribute(scheme, plan, rank, *args, **kwargs)

    monkeypatch.setattr(comm, "contribute", slow)
    rts = _planes(make_scheme("gc_cr", 4, 1), timeout=30.0, heartbeat=(0.05, 4))
    try:
        for rt in rts:
            _submit(rt, 0)
        aggs = _together(rts, lambda rt: rt.wait(0))
        assert all(isinstance(a, torch.Tensor) for a in aggs.values()), aggs
        assert all(torch.equal(a, aggs[0]) for a in aggs.values())
        assert all(rt.failure() is None for rt in rts)
    finally:
        _stop_all(rts)


def test_a_rank_that_gave_up_on_its_leader_stops_without_waiting_for_it():
    """A rank whose training thread finds the leader silent past the limit raises, and its runtime is failed with
    that error: its stop() returns at once instead of serving all-reduces until a STOP that the leader it gave up on
    may never send."""
    from lightning_pgc.runtime.aggregates import PGCTimeoutError

    rts = _planes(make_scheme("gc_cr", 4, 1), timeout=30.0, heartbeat=(0.5, 4))
    try:
        rt = rts[1]
        now = time.monotonic()
        rt._last_check = now
        rt._leader_heard = rt._comm_free_at = rt._resumed_at = now - 10.0  # as if nothing came for 10 s
        with pytest.raises(PGCTimeoutError, match="lost the leader"):
            rt._check_leader("waiting for the aggregate of version 0")
        assert isinstance(rt.failure(), PGCTimeoutError)
        started = time.monotonic()
        _together([rt], lambda rt: rt.stop(), timeout=10)
        assert time.monotonic() - started < 5.0
    finally:
        _stop_all(rts)


def test_the_leader_fails_at_once_when_finished_ranks_leave_a_version_it_cannot_close():
    """gc_cr, n = 4, s = 1 (3 codes close a version). Ranks 1 and 2 stop (say BYE) after version 0, as ranks that
    stopped on an error do; ranks 0 and 3 send codes for version 1, which can never close: the leader fails at once
    with an error naming the finished ranks, not after its timeout (30 s here)."""
    rts = _planes(make_scheme("gc_cr", 4, 1), timeout=30.0)
    stoppers = []
    try:
        for rt in rts:
            _submit(rt, 0)
        for rt, agg in _together(rts, lambda rt: rt.wait(0)).items():
            rts[rt].release(agg)
        for rt in rts[1:3]:
            stopper = threading.Thread(target=rt.stop, daemon=True)
            stopper.start()
            stoppers.append(stopper)
        started = time.monotonic()
        for rt in (rts[0], rts[3]):
            _submit(rt, 1)
        got = _together([rts[0], rts[3]], lambda rt: rt.wait(1), timeout=20)
        assert time.monotonic() - started < 10.0
        assert re.search(r"Version 1 cannot close.*|finished early", str(got[0])), got[0]
        assert "ranks [1, 2] finished early" in str(rts[0].failure())
    finally:
        _stop_all([rts[0], rts[3]])
        for stopper in stoppers:
            stopper.join(10)


def test_an_interrupted_rank_stops_waiting_for_its_aggregate_and_for_the_leaders_stop():
    """SIGTERM's handler calls ``interrupt()``: a training thread waiting for an aggregate that will not come raises
    PGCInterrupted within a heartbeat interval, and a rank serving the last all-reduces until the leader's STOP
    returns instead."""
    from lightning_pgc.runtime.plane import PGCInterrupted

    rts = _planes(make_scheme("gc_cr", 4, 1), timeout=30.0, heartbeat=(0.05, 50))
    try:
        _submit(rts[1], 0)  # alone: version 0 cannot close
        waiter = threading.Thread(target=lambda: rts[1].interrupt() if time.sleep(0.5) is None else None)
        waiter.start()
        started = time.monotonic()
        with pytest.raises(PGCInterrupted, match="interrupted"):
            rts[1].wait(0)
        assert time.monotonic() - started < 5.0
        waiter.join()
        stopper = threading.Thread(target=rts[2].stop, daemon=True)  # the leader sends no STOP while it trains
        stopper.start()
        time.sleep(0.3)
        assert stopper.is_alive()
        rts[2].interrupt()
        stopper.join(5)
        assert not stopper.is_alive()
    finally:
        _stop_all([rts[0], rts[1], rts[3]])


def test_a_detached_leader_whose_every_other_rank_finished_fails_instead_of_waiting_for_a_donor():
    """The leader's own rank fell max_lag versions behind and was detached. While another rank still trains, its
    rejoin waits for a donor (NoDonorYet: ask again); once every other rank finished or died nobody ever can donate,
    and the rejoin fails with an error that says so and what to raise."""
    from lightning_pgc.decisions.leader import CoordinatorError, Leader, NoDonorYet

    leader = Leader(make_scheme("ignore", 3, 1), 3, 0, timeout=5.0, max_lag=2, now=0.0)
    leader.detached[0] = 4
    leader.on_bye(1)
    leader.detached[2] = 5  # detached too: it may come back and donate later
    with pytest.raises(NoDonorYet):
        leader.on_rejoin(0, leader_rank=0)
    del leader.detached[2]
    leader.on_bye(2)
    with pytest.raises(CoordinatorError, match="no rank is left to send it the state") as info:
        leader.on_rejoin(0, leader_rank=0)
    assert not isinstance(info.value, NoDonorYet) and "max_lag" in str(info.value)
