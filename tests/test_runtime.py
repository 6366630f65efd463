"""The coordinator protocol on in-process queues: no processes, real threads, real waiting."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_pgc.codes import make_scheme
from lightning_pgc.runtime import CoordinatorError, PGCRuntime, PGCTimeoutError, QueueHub
from lightning_pgc.runtime.messages import Header, Kind, pack, pack_ages, unpack, unpack_ages

D = 64  # payload elements (256 bytes: room for an error text in an ABORT)


def make_runtimes(scheme, timeout=5.0, max_lag=1000):
    hub = QueueHub(scheme.n)
    runtimes = [
        PGCRuntime(scheme, hub.endpoint(r), rank=r, world_size=scheme.n, payload_numel=D, down_dtype=torch.float32,
                   start_version=0, timeout=timeout, max_lag=max_lag)
        for r in range(scheme.n)
    ]
    for rt in runtimes:
        rt.start()
    return runtimes


def code(rank, version):
    return torch.full((D,), float(10 * version + rank))


def test_header_roundtrip_float32_and_float64():
    for dtype in (torch.float32, torch.float64):
        h = Header(Kind.CODE, 123456789012, 3, 4, 7, (0, 1, 15, 7))
        msg = pack(h, torch.arange(D, dtype=dtype), D, dtype)
        got, payload = unpack(msg)
        assert got == h
        assert torch.equal(payload, torch.arange(D, dtype=dtype))
    assert unpack_ages(pack_ages((3, 20)), 2) == (3, 15)  # clamped at 15


def test_aggregate_without_the_slow_rank_and_identical_everywhere():
    scheme = make_scheme("ignore", 4, 1)
    rts = make_runtimes(scheme)
    try:
        for r in (0, 1, 2):
            rts[r].submit(0, code(r, 0), (0,))
        # rank 3 never sends for version 0: the others still get the aggregate of the fastest three
        aggs = [rts[r].wait(0) for r in (0, 1, 2)]
        expected = (code(0, 0) + code(1, 0) + code(2, 0)) / 3
        for a in aggs:
            assert torch.equal(a, aggs[0])
            torch.testing.assert_close(a, expected)
        # the slow rank finds version 0 already published: it may skip computing and just apply it
        assert rts[3].published(0) or _eventually(lambda: rts[3].published(0))
        assert torch.equal(rts[3].wait(0), aggs[0])
        # its late code is counted, not used
        rts[3].submit(0, code(3, 0), (0,))
        assert _eventually(lambda: rts[0].coordinator.late_codes == 1)
        rec = rts[0].coordinator.record(0)
        assert sorted(rec.admitted) == [0, 1, 2]
        assert _eventually(lambda: 3 in rec.late)
    finally:
        _stop_all(rts)


def test_pgc_cr_weights_and_arrival_order():
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = make_runtimes(scheme)
    try:
        for r in (2, 0, 3):
            rts[r].submit(0, code(r, 0), (0, 0))
            time.sleep(0.2)
        agg = rts[0].wait(0)
        mu = 4 / (3 * 2)
        expected = (mu / 4) * (code(0, 0) + code(2, 0) + code(3, 0))
        torch.testing.assert_close(agg, expected)
        rec = rts[0].coordinator.record(0)
        # admitted in arrival order (2, 0, 3 unless a receiver thread was starved for 0.2 s)
        assert sorted(rec.admitted) == [0, 2, 3] and rec.admitted == sorted(rec.admitted, key=rec.arrivals.get)
    finally:
        _stop_all(rts)


def test_dgd_waits_for_everyone_then_times_out_naming_the_missing_rank():
    scheme = make_scheme("dgd", 3, 0)
    rts = make_runtimes(scheme, timeout=0.5)
    try:
        rts[0].submit(0, code(0, 0), (0,))
        rts[1].submit(0, code(1, 0), (0,))
        with pytest.raises(CoordinatorError, match=r"Missing ranks: \[2\]"):
            rts[0].wait(0)
        # the other workers are told, instead of hanging
        with pytest.raises(RuntimeError, match=r"coordinator failed: CoordinatorError: .*Missing ranks: \[2\]"):
            rts[1].wait(0)
    finally:
        _stop_all(rts, timeout=0.5)


def test_coordinator_names_missing_ranks_beyond_s():
    scheme = make_scheme("pgc_cr", 3, 1)
    rts = make_runtimes(scheme, timeout=0.3)
    try:
        rts[1].submit(0, code(1, 0), (0,))
        with pytest.raises(RuntimeError, match=r"Missing ranks: \[0, 2\]"):
            rts[1].wait(0)
    finally:
        _stop_all(rts, timeout=0.3)


def test_worker_times_out_when_the_coordinator_is_gone():
    scheme = make_scheme("pgc_cr", 3, 1)
    hub = QueueHub(3)
    worker = PGCRuntime(scheme, hub.endpoint(1), rank=1, world_size=3, payload_numel=D, down_dtype=torch.float32,
                        start_version=0, timeout=0.2, max_lag=10)
    worker.start()
    worker.submit(0, code(1, 0), (0,))
    with pytest.raises(PGCTimeoutError, match="no aggregate for version 0"):
        worker.wait(0)
    hub.down[1].put(pack(Header(Kind.BYE, 0, 0), None, D, torch.float32))  # let its receiver thread end
    worker.stop()


def test_max_lag_bounds_how_far_a_slow_rank_falls_behind():
    scheme = make_scheme("ignore", 3, 1)
    rts = make_runtimes(scheme, max_lag=2)
    try:
        # ranks 0 and 1 run ahead; rank 2 sent nothing yet (last seen: version -1)
        for v in range(2):
            for r in (0, 1):
                rts[r].submit(v, code(r, v), (0,))
            for r in (0, 1):
                rts[r].wait(v)
        for r in (0, 1):
            rts[r].submit(2, code(r, 2), (0,))
        time.sleep(0.3)
        assert not rts[0].published(2)  # version 2 would leave rank 2 more than 2 behind
        rts[2].submit(0, code(2, 0), (0,))  # a late code shows rank 2 is alive and at version 0
        assert _eventually(lambda: rts[0].published(2))
        for v in range(3):
            rts[2].wait(v)
        assert len(rts[2].mailbox) == 0
    finally:
        _stop_all(rts)


def test_stop_drains_and_joins_every_thread():
    scheme = make_scheme("pgc_fr", 4, 1)
    rts = make_runtimes(scheme)
    for v in range(5):
        for r in range(4):
            rts[r].submit(v, code(r, v), (0, 1))
        for r in range(4):
            rts[r].wait(v)
    before = threading.active_count()
    _stop_all(rts)
    assert all(not t.name.startswith("pgc-") for t in threading.enumerate()), threading.enumerate()
    assert threading.active_count() < before


def _stop_all(rts, timeout=5.0):
    threads = [threading.Thread(target=rt.stop) for rt in rts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)


def _eventually(pred, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_plain_tail_is_averaged_not_decoded():
    """Buffers (e.g. BatchNorm statistics) ride as a plain tail: averaged over the received ranks."""
    scheme = make_scheme("pgc_cr", 3, 1)
    hub = QueueHub(3)
    rts = [PGCRuntime(scheme, hub.endpoint(r), rank=r, world_size=3, payload_numel=D, down_dtype=torch.float32,
                      start_version=0, timeout=5.0, max_lag=10, plain_numel=2) for r in range(3)]
    for rt in rts:
        rt.start()
    try:
        for r in (0, 1):
            rts[r].submit(0, code(r, 0), (0, 0))
        agg = rts[0].wait(0)
        mu_over_n = 1 / (2 * 2)  # mu/n = 1/(|R| c)
        torch.testing.assert_close(agg[:-2], mu_over_n * (code(0, 0) + code(1, 0))[:-2])
        torch.testing.assert_close(agg[-2:], ((code(0, 0) + code(1, 0)) / 2)[-2:])
    finally:
        _stop_all(rts)
