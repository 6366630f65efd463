"""Every wait has a bound that names what it waited for: a store pop, a Lightning collective a live member never
calls, the leader's wait for the BYEs at the end, a rejoin no rank can donate for (the runtime in threads of this
process, over real gloo groups; a rank frozen by SIGSTOP inside each wait is in tests/test_bounds_ranks.py)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from lightning_pgc.codes import make_scheme
from lightning_pgc.decisions.leader import Leader, NoDonorYet
from lightning_pgc.runtime.aggregates import PGCTimeoutError
from lightning_pgc.runtime.control import Channel, ControlTimeout, serve_store
from tests.runtime_scenarios import _together
from tests.test_dataplane import _planes, _submit

BOUND_S = 1.5  # the peer timeout of these tests (the process group's, 30 min by default)
SLACK_S = 8.0  # what a loaded machine adds to a bound: heartbeats, thread switches, gloo teardown


def test_a_pop_that_gets_no_message_raises_naming_the_box_at_its_bound():
    server = serve_store()
    chan = Channel(server, "p", 1, bound=timedelta(seconds=0.5))
    started = time.monotonic()
    with pytest.raises(ControlTimeout, match=r"no message in the control box 'to/3' for 0.5 s"):
        chan.pop("to/3")
    assert 0.5 <= time.monotonic() - started < SLACK_S


def _bounded_planes(n: int = 3):
    rts = _planes(make_scheme("ignore", n, 1), timeout=1.0, heartbeat=(0.1, 10))
    for rt in rts:
        rt.peer_timeout = BOUND_S
    return rts


def test_a_collective_a_live_member_never_calls_fails_every_caller_naming_that_member():
    """Ranks 0 and 1 call a barrier; rank 2 lives (it beats) but never calls it. After the peer timeout both
    callers raise an error naming rank 2 and the collective, instead of waiting for ever."""
    rts = _bounded_planes()
    try:
        started = time.monotonic()
        got = _together(rts[:2], lambda rt: rt.collectives.barrier())
        assert BOUND_S <= time.monotonic() - started < BOUND_S + SLACK_S
        for err in got.values():
            assert isinstance(err, RuntimeError), err
            assert "collective 1" in str(err) and "ranks [2] did not call it within 1.5 s" in str(err)
    finally:
        _together(rts, lambda rt: rt.stop())


def test_the_leader_ends_the_run_without_a_live_rank_that_never_says_bye(caplog):
    """Ranks 0 and 1 finish; rank 2 lives but never stops. After the peer timeout the leader logs that it ends the
    run without rank 2, both stops return, and rank 2's runtime fails saying the leader ended the run."""
    rts = _bounded_planes()
    try:
        for rt in rts:
            _submit(rt, 0)
        for rt, agg in _together(rts, lambda rt: rt.wait(0)).items():
            rts[rt].release(agg)
        started = time.monotonic()
        _together(rts[:2], lambda rt: rt.stop())
        assert BOUND_S <= time.monotonic() - started < BOUND_S + SLACK_S
        assert "ranks [2] did not finish within 1.5 s of the leader's end" in caplog.text
        deadline = time.monotonic() + SLACK_S
        while rts[2].failure() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "the leader ended the run before this rank did" in str(rts[2].failure())
    finally:
        _together(rts, lambda rt: rt.stop())


def test_a_rejoin_no_rank_can_donate_for_is_given_up_naming_it(monkeypatch):
    """The leader finds no donor for rank 2's rejoin, every time it asks. After the peer timeout rank 2's rejoin
    raises naming the version and why; the other ranks go on."""

    def no_donor(self, rank, leader_rank, leader_finished=False):
        raise NoDonorYet(f"rank {rank}: no donor")

    monkeypatch.setattr(Leader, "on_rejoin", no_donor)
    rts = _bounded_planes()
    try:
        got = {}
        rejoin = threading.Thread(target=lambda: got.update(result=_catch(lambda: rts[2].rejoin(0))))
        started = time.monotonic()
        rejoin.start()
        rejoin.join(BOUND_S + SLACK_S)
        assert not rejoin.is_alive()
        assert BOUND_S <= time.monotonic() - started < BOUND_S + SLACK_S
        err = got["result"]
        assert isinstance(err, PGCTimeoutError) and "no donor for its rejoin at version 0 within 1.5 s" in str(err)
        for v in range(2):
            for rt in rts[:2]:
                _submit(rt, v)
            for rt in rts[:2]:
                rt.release(rt.wait(v))
        assert rts[0].failure() is None and rts[1].failure() is None
    finally:
        _together(rts, lambda rt: rt.stop())


def _catch(fn):
    try:
        return fn()
    except Exception as exc:
        return exc
