"""Scenario helpers for the PGC runtime on in-process queues (no processes, real threads, real waiting):
building runtimes, sending codes, freezing, killing and burying ranks, stepping every rank, rejoining. Shared by
the runtime, dead-rank, leader-failover, bounded-fault and divergence tests."""

from __future__ import annotations

import faulthandler
import sys

import threading
import time

import pytest
import torch

from lightning_pgc.runtime import (
    Channel,
    PGCDetached,
    PGCRuntime,
    QueueHub,
    ShardLayout,
)
from lightning_pgc.runtime.messages import Kind, read_header

D = 61  # payload elements (odd: shards are padded, message rows stay aligned)


class RecordingTransport:
    """Wraps a transport and records (channel, sender, receiver, kind, version, shard) of every data message sent;
    ``hold`` delays a peer's sends on one channel (a fault injected through the transport)."""

    def __init__(self, inner, log, hold=None):
        self.inner, self.log, self.hold = inner, log, hold or {}
        self.rank, self.world_size = inner.rank, inner.world_size

    def isend(self, channel, peer, message):
        if channel not in (Channel.CTRL, Channel.COLL):  # small int64 messages without a data header
            h = read_header(message)
            self.log.append((channel, self.rank, peer, h.kind, h.version, h.shard))
        delay = self.hold.get((channel, self.rank))
        if delay:
            time.sleep(delay)
        return self.inner.isend(channel, peer, message)

    def recv(self, channel, peer, buf):
        self.inner.recv(channel, peer, buf)

    def close(self):
        self.inner.close()


class FrozenTransport:
    """A transport whose rank froze at a given moment (as under SIGSTOP): from ``freeze()`` on, nothing it sends
    leaves and nothing is received (its receiver threads block)."""

    def __init__(self, inner):
        self.inner, self.frozen = inner, threading.Event()
        self.rank, self.world_size = inner.rank, inner.world_size

    def freeze(self):
        self.frozen.set()

    def isend(self, channel, peer, message):
        if self.frozen.is_set():
            return _NoSend()
        return self.inner.isend(channel, peer, message)

    def recv(self, channel, peer, buf):
        self.inner.recv(channel, peer, buf)
        while self.frozen.is_set():
            time.sleep(0.05)

    def close(self):
        self.inner.close()


class _NoSend:
    def wait(self):
        return None


def make_runtimes(
    scheme,
    timeout=5.0,
    max_lag=1000,
    shards=None,
    plain=0,
    numel=D,
    log=None,
    hold=None,
    ranks=None,
    heartbeat=(0.2, 15),
    wrap=None,
    failover=False,
    frozen_failover=False,
):
    """Runtimes of ``scheme`` on in-process queues; ``ranks``: the ranks started (others never come up, as dead
    processes); ``wrap``: rank -> a transport wrapper."""
    hub = QueueHub(scheme.n)
    layout = ShardLayout(numel, numel - plain, shards or scheme.n)
    runtimes = []
    for r in range(scheme.n) if ranks is None else ranks:
        transport = hub.endpoint(r)
        if log is not None:
            transport = RecordingTransport(transport, log, hold)
        if wrap and r in wrap:
            transport = wrap[r](transport)
        runtimes.append(
            PGCRuntime(
                scheme,
                transport,
                rank=r,
                world_size=scheme.n,
                layout=layout,
                down_dtype=torch.float32,
                start_version=0,
                timeout=timeout,
                max_lag=max_lag,
                heartbeat_interval=heartbeat[0],
                heartbeat_misses=heartbeat[1],
                failover=failover,
                frozen_failover=frozen_failover,
            )
        )
    for rt in runtimes:
        rt.hub = hub
        rt.start()
    return runtimes


def code(rank, version, numel=D):
    return torch.arange(numel, dtype=torch.float32) / 7 + 10 * version + rank


def submit(rt, version, payload=None, ages=(0,)):
    message = rt.new_code(version)
    message.write(0, code(rt.rank, version) if payload is None else payload)
    rt.submit(version, message, ages)
    return message


def _stop_all(rts, timeout=5.0):
    threads = [threading.Thread(target=rt.stop) for rt in rts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 15)


def _eventually(pred, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def _release_receivers(hub, rank, peers):
    """Let a runtime's receiver threads from ``peers`` end (those peers never existed)."""
    for ch in Channel:
        for src in peers:
            hub.queues[(ch, src, rank)].put(RuntimeError("peer gone"))


def _donate(rt, version, state):
    """What a donor's training thread does after waiting for ``version``: send the state to each rank that asked
    (returns the one, or None; the tests here rejoin one rank at a time)."""
    recipients = rt.donation(version)
    for recipient in recipients:
        rt.send_state(recipient, version, state)
    assert len(recipients) <= 1
    return recipients[0] if recipients else None


def _together(rts, fn, timeout=30):
    """``fn(rt)`` on every runtime at once (collectives block until all live ranks joined); results by rank. A call
    still running after ``timeout`` seconds fails the test, with every thread's stack printed."""
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
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
    assert not any(t.is_alive() for t in threads), f"a call hung: {sorted({rt.rank for rt in rts} - set(out))}"
    return out


def _kill(rts, dead):
    """Rank ``dead``'s process is gone: every stream from it breaks (its runtime was never started here)."""
    for rt in rts:
        _release_receivers(rt.hub, rt.rank, [dead])


class _DiesWhileDonating(FrozenTransport):
    """A rank that dies while it sends a rejoining rank its training state: the header leaves, the rest never."""

    def isend(self, channel, peer, message):
        if channel == Channel.STATE and message.dtype == torch.uint8:
            self.freeze()
        return super().isend(channel, peer, message)


def _die(rts, dead):
    """Rank ``dead`` (started on a :class:`FrozenTransport`) dies now: nothing more leaves it, and every stream
    from it breaks at the other ranks, as when its process is gone."""
    rts[dead].transport.freeze()
    _kill([rt for rt in rts if rt.rank != dead], dead)


def _bury(rts, dead):
    """End the dead rank's own threads (its receivers), then stop every runtime."""
    _release_receivers(rts[dead].hub, dead, [rt.rank for rt in rts if rt.rank != dead])
    rts[dead].transport.frozen.clear()  # its receivers leave their frozen wait and find their streams broken
    _stop_all(rts, timeout=1.0)


def _step_all(rts, version, ranks=None, send=lambda rt, v: submit(rt, v, ages=(0, 0))):
    """Every rank of ``ranks`` submits ``version`` (``send(rt, v)``) and waits for it; returns the aggregates (cloned),
    released."""
    ranks = [rt.rank for rt in rts] if ranks is None else ranks
    for r in ranks:
        send(rts[r], version)
    return _collect(rts, version, ranks)


def _collect(rts, version, ranks):
    """Every rank of ``ranks`` waits for ``version``; returns the aggregates (cloned), released."""
    out = []
    for r in ranks:
        agg = rts[r].wait(version)
        out.append(agg.clone())
        rts[r].release(agg)
    return out


def _go_on_exact(rts, versions, live):
    """The ``live`` ranks step through ``versions``: every aggregate is pgc_cr's over ``live``, identical on each."""
    for v in versions:
        out = _step_all(rts, v, live)
        torch.testing.assert_close(out[0], _cr_mean(live, v))
        assert all(torch.equal(a, out[0]) for a in out)


def _cr_mean(ranks, version):
    """pgc_cr's aggregate of these test codes (ages (0, 0)): ``mu / n = 1 / (|R| c)`` times their sum."""
    return sum(code(k, version) for k in ranks) / len(ranks) / 2


def _ask_after_detach(rts, rank, leader, first=0):
    """Rank ``rank`` applies what it still gets from version ``first`` on until it finds itself detached, then asks
    to rejoin from a thread, which stores ``rejoin``'s result in ``got["result"]``. Returns (that thread, ``got``,
    the version it asked at) once leader ``leader`` attached it (``rts[leader].leader.rejoining[rank]``)."""
    behind = first
    with pytest.raises(PGCDetached):
        while True:
            rts[rank].release(rts[rank].wait(behind))
            behind += 1
    got: dict = {}
    asker = threading.Thread(target=lambda: got.update(result=rts[rank].rejoin(behind)))
    asker.start()
    assert _eventually(lambda: rank in rts[leader].leader.rejoining)
    return asker, got, behind


def _resume_and_rejoin(rts, rank, leader, live, state, first, send=lambda rt, v: submit(rt, v, ages=(0, 0))):
    """Rank ``rank`` resumed: it applies what it still gets from version ``first`` on (the state transfer replaces
    it) until it finds itself detached, then asks to rejoin; the ``live`` ranks submit and wait for the version it
    is attached at, donating ``state`` while waiting or with the aggregate, as the strategy does. Asserts it got
    that state and every rank the same aggregate; returns (that version, the version it asked at). ``send(rt, v)``
    submits a rank's code."""
    asker, got, behind = _ask_after_detach(rts, rank, leader, first)
    u = rts[leader].leader.rejoining[rank]  # the open version, and nobody sent a code for it yet

    def donor(rt):
        agg = rt.wait(u, donate=lambda: state)
        _donate(rt, u, state)
        got[rt.rank] = agg.clone()
        rt.release(agg)

    for r in live:
        send(rts[r], u)
    threads = [threading.Thread(target=donor, args=(rts[r],)) for r in live]
    for t in threads:
        t.start()
    asker.join(10)
    assert got["result"][0] == u and torch.equal(got["result"][1], state)
    send(rts[rank], u)
    got[rank] = rts[rank].wait(u).clone()
    for t in threads:
        t.join(10)
    assert all(torch.equal(got[r], got[rank]) for r in live)
    return u, behind


def _finish_rejoin(rts, rank, live, version, state, asker, got):
    """The others of ``live`` submit ``version`` and wait for it, donating ``state``, while rank ``rank`` (whose
    ``rejoin`` runs in thread ``asker``, its result into ``got``) is attached there; asserts it got ``state``, that
    ``version`` and two more are exact and identical on every live rank."""
    aggs: dict = {}

    def donor(r):
        submit(rts[r], version, ages=(0, 0))
        aggs[r] = rts[r].wait(version, donate=lambda: state).clone()

    donors = [threading.Thread(target=donor, args=(r,)) for r in live if r != rank]
    for t in donors:
        t.start()
    asker.join(10)
    assert got["result"][0] == version and torch.equal(got["result"][1], state)
    submit(rts[rank], version, ages=(0, 0))
    aggs[rank] = rts[rank].wait(version).clone()
    for t in donors:
        t.join(10)
    torch.testing.assert_close(aggs[rank], _cr_mean(live, version))
    assert all(torch.equal(aggs[r], aggs[rank]) for r in live)
    _go_on_exact(rts, range(version + 1, version + 3), live)


class _Unpublished(FrozenTransport):
    """The leader closes version 2 and tells the other owners, but dies before any of its shard 0 of it leaves."""

    def isend(self, channel, peer, message):
        if channel == Channel.AGG:
            header = read_header(message)
            if header.kind == Kind.AGGREGATE and header.version >= 2:
                return _NoSend()
        return super().isend(channel, peer, message)


class _ReachesOnlyRank3(FrozenTransport):
    """A leader that dies while serving version 2: its aggregate of version >= 2 reaches rank 3, not ranks 1-2."""

    def isend(self, channel, peer, message):
        if channel == Channel.AGG and peer in (1, 2) and read_header(message).version >= 2:
            return _NoSend()
        return super().isend(channel, peer, message)


def _two_miss_the_last_aggregate_and_rejoin(rts, state, send):
    """Versions 0-2 on all four ranks (``send(rt, v)`` submits), rank 0 (a :class:`_ReachesOnlyRank3`) dies while
    sending version 2; ranks 1 and 2, detached, rejoin at version 3 with rank 3's ``state`` while rank 3 waits for
    it. Returns the aggregates of version 3 by rank."""
    for v in range(2):
        _step_all(rts, v, send=send)
    for rt in rts:
        send(rt, 2)
    rts[3].release(rts[3].wait(2))
    _die(rts, 0)
    assert _eventually(lambda: rts[1].detached(2) and rts[2].detached(2))
    got: dict = {}

    def rejoin(rank):
        u, received = rts[rank].rejoin(2)
        assert u == 3 and torch.equal(received, state)
        send(rts[rank], 3)
        got[rank] = rts[rank].wait(3).clone()

    send(rts[3], 3)
    threads = [threading.Thread(target=rejoin, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    got[3] = rts[3].wait(3, donate=lambda: state).clone()
    for t in threads:
        t.join(10)
    return got
