"""Nothing a run leaves behind grows with its length: the inbox of a rank that died holds no heartbeats or plans,
the store holds the rendezvous of the current configuration only, nothing at all once every rank stopped, and every
store connection of a rank closes at its stop, even while one of its threads is stuck (threads of this process, a
real store, real gloo groups)."""

from __future__ import annotations

import json
import threading
import time

import torch

import lightning_pgc.runtime.comm as comm
from lightning_pgc.codes import make_scheme
from lightning_pgc.codes.shares import contribute
from lightning_pgc.runtime.control import inbox, serve_store
from tests.runtime_scenarios import _together
from tests.test_dataplane import _eventually, _kill, _planes, _stop_all, _store_connections, _submit

#: The messages a rank's inbox gets per version or per heartbeat (none should pile up for a rank that is gone).
PERIODIC = {"tick", "beat", "decide", "query", "conf", "coll"}


def _inbox(store, prefix: str, rank: int) -> list[str]:
    """The kinds of the messages waiting in ``rank``'s inbox, left in place (popped and pushed back in order: only
    while no runtime runs)."""
    key = f"{prefix}/{inbox(rank)}"
    raw = [store.queue_pop(key, False) for _ in range(store.queue_len(key))]
    for data in raw:
        store.queue_push(key, data)
    return [json.loads(data)[1] for data in raw]


def _keys(store, prefix: str) -> list[str]:
    return sorted(k for k in store.list_keys() if k.startswith(prefix + "/"))


def _versions(live, versions) -> None:
    for v in versions:
        for rt in live:
            _submit(rt, v)
        aggs = _together(live, lambda rt: rt.wait(v))
        assert all(isinstance(a, torch.Tensor) and torch.equal(a, aggs[live[0].rank]) for a in aggs.values()), aggs
        for rt in live:
            rt.release(aggs[rt.rank])


def test_dead_ranks_inboxes_and_the_stores_keys_stay_bounded_over_reconfigurations_and_nothing_is_left():
    """pgc_cr, n = 6, s = 3. Rank 5 dies, then rank 4, then rank 3 leaves alone (SIGTERM): three reconfigurations.
    Once the leader gave up on them their inboxes hold no heartbeats or plans and do not grow while more versions
    run; the store holds only the current configuration's rendezvous keys, and no key of the run after stop."""
    rts = _planes(make_scheme("pgc_cr", 6, 3), timeout=1.0, heartbeat=(0.1, 20))
    raw, prefix = rts[0].store.clone(), rts[0].prefix
    v = 0
    try:
        _versions(rts, range(v, v + 2))
        v += 2
        for leaving in (5, 4, 3):
            if leaving == 3:
                _together([rts[3]], lambda rt: rt.stop(leave=True))
            else:
                _kill(rts[leaving])
            live = rts[:leaving]
            _versions(live, range(v, v + 3))
            v += 3
        gone = (3, 4, 5)
        queued = {r: f"{prefix}/{inbox(r)}" for r in gone}
        # (until the leader gives up on a rank, a liveness window and ``timeout`` after it went silent, its inbox
        # gets a heartbeat per interval: by then dozens)
        time.sleep(rts[0].heartbeat_window + rts[0].timeout + 0.5)
        assert _eventually(lambda: all(raw.queue_len(queued[r]) <= len(rts) for r in gone), timeout=30)
        held = {r: raw.queue_len(queued[r]) for r in gone}
        _versions(live, range(v, v + 10))
        time.sleep(1.0)  # (ten heartbeat intervals)
        # ten versions and ten heartbeat intervals would add at least twenty messages to each; a reconfiguration that
        # load on the 2 cores could cause meanwhile adds a few lasting ones (detach, attach) at most
        grown = {r: raw.queue_len(queued[r]) - held[r] for r in gone}
        assert all(g <= 4 for g in grown.values()), grown
        config = rts[0].config
        assert config >= 3
        keys = _keys(raw, prefix)
        assert keys and all(k.startswith(f"{prefix}/data/{config}/") for k in keys), keys
    finally:
        _stop_all(rts[:3])
    assert _keys(raw, prefix) == []
    for r in gone:  # (read once nothing runs: what a rank that comes back would find)
        assert not PERIODIC & set(_inbox(raw, prefix, r)), _inbox(raw, prefix, r)


def test_every_store_connection_closes_at_stop_even_while_a_thread_is_stuck(monkeypatch, caplog):
    """pgc_cr, n = 2, s = 1. Rank 1's comm thread is stuck in its contribution to version 0 (it never returns in
    time); rank 1 leaves and rank 0 stops. Rank 1's thread outlives its join, and still the store holds no
    connection of either rank afterwards."""
    gate = threading.Event()

    def stuck(scheme, plan, rank, *args, **kwargs):
        if rank == 1:
            gate.wait(60)
        return contribute(scheme, plan, rank, *args, **kwargs)

    monkeypatch.setattr(comm, "contribute", stuck)
    server = serve_store()
    before = _store_connections(server)
    monkeypatch.setattr("tests.test_dataplane.serve_store", lambda: server)
    rts = _planes(make_scheme("pgc_cr", 2, 1), timeout=1.0, heartbeat=(0.05, 10))
    try:
        assert _store_connections(server) - before  # (the ranks hold connections now)
        _submit(rts[0], 0)
        assert _eventually(lambda: rts[1]._busy)
        _together([rts[1]], lambda rt: rt.stop(leave=True))
        assert "threads still running after stop" in caplog.text
        _together([rts[0]], lambda rt: rt.stop())
        assert _eventually(lambda: _store_connections(server) <= before), _store_connections(server) - before
    finally:
        gate.set()
        _stop_all(rts)
