"""Completion before publication: an aggregate is reported completed, published or applied only once its all-reduce
finished on the device. NCCL's ``wait()`` returns before that (it only orders the current stream); these tests fake
that Work over gloo: the sum lands in the tensor, and ``is_completed()`` turns true, only later, or the collective
fails after it was queued (a partial sum lands and an error is set), or it never finishes."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import lightning_pgc.runtime.comm as comm
from lightning_pgc.codes import make_scheme
from lightning_pgc.runtime.group import CollectiveTimeout, DataGroup
from lightning_pgc.runtime.plane import PGCDetached
from tests.runtime_scenarios import _together
from tests.test_dataplane import D, _assert_decodes, _planes, _submit


class LateWork:
    """A collective with NCCL's host semantics: ``wait()`` returns at once; the result (``run()``, a blocking
    collective on copies) lands in ``tensors`` ``delay`` seconds after it finished, and only then is the work
    completed. ``outcome`` ``"fail"``: half the result lands and the work completes with an error; ``"hang"``: it
    never completes."""

    def __init__(self, tensors: list[torch.Tensor], run: Any, delay: float, outcome: str = "ok") -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self.outcome = outcome

        def land() -> None:
            try:
                results = run()
            except Exception as exc:  # the real collective failed: so does this one
                self._error = exc
                self._done.set()
                return
            time.sleep(delay)
            if outcome == "hang":
                return
            for tensor, result in zip(tensors, results):
                if outcome == "fail":
                    half = tensor.numel() // 2
                    tensor.view(-1)[:half].copy_(result.view(-1)[:half])
                else:
                    tensor.copy_(result)
            if outcome == "fail":
                self._error = RuntimeError("NCCL error: remote process exited or there was a network error")
            self._done.set()

        threading.Thread(target=land, daemon=True).start()

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def exception(self) -> Optional[BaseException]:
        return self._error


class LateGroup:
    """A process group whose all-reduces are :class:`LateWork` over ``inner``'s (a real gloo group's), with the
    outcome ``faults`` names for this call (by call number, from 0), else ``"ok"``."""

    def __init__(self, inner: Any, delay: float, faults: Optional[dict[int, str]] = None) -> None:
        self.inner, self.delay, self.faults = inner, delay, dict(faults or {})
        self.calls = 0

    def allreduce(self, tensors: list[torch.Tensor]) -> LateWork:
        copies = [t.clone() for t in tensors]
        real = self.inner.allreduce(copies)
        outcome = self.faults.get(self.calls, "ok")
        self.calls += 1
        return LateWork(tensors, lambda: (real.wait(), copies)[1], self.delay, outcome)

    def allgather(self, outputs: Any, inputs: Any) -> Any:
        return self.inner.allgather(outputs, inputs)


class Doubling:
    """A fake two-member group whose peer contributes the same tensor: the sum is twice it (no real group)."""

    def __init__(self, delay: float, outcome: str = "ok") -> None:
        self.delay, self.outcome = delay, outcome

    def allreduce(self, tensors: list[torch.Tensor]) -> LateWork:
        results = [2 * t for t in tensors]
        return LateWork(tensors, lambda: results, self.delay, self.outcome)


def _faked_group(pg: Any, timeout: float) -> DataGroup:
    """A data group of ranks [0, 1] as seen by rank 0, whose collectives are ``pg``'s."""
    group = DataGroup(dist.HashStore(), "t", 0, [0], 0, torch.device("cpu"), timedelta(seconds=timeout))
    group.members, group.size, group.pg = [0, 1], 2, pg
    group.waits_on_host = False  # (as NCCL's)
    return group


def test_an_all_reduce_returns_once_its_sum_landed_and_its_time_is_until_then():
    group = _faked_group(Doubling(delay=0.3), timeout=30.0)
    t = torch.arange(6, dtype=torch.float32)
    started = time.monotonic()
    group.all_reduce(t, "the all-reduce of version 3")
    assert time.monotonic() - started >= 0.3
    assert torch.equal(t, 2 * torch.arange(6, dtype=torch.float32))


def test_an_all_reduce_that_never_finishes_raises_naming_it_at_the_groups_timeout():
    group = _faked_group(Doubling(delay=0.0, outcome="hang"), timeout=0.5)
    started = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"the all-reduce of version 7 .* ranks \[0, 1\].* within 0.5 s"):
        group.all_reduce(torch.ones(4), "the all-reduce of version 7")
    assert 0.5 <= time.monotonic() - started < 5.0


def test_an_all_reduce_that_fails_after_it_was_queued_raises_instead_of_returning_a_partial_sum():
    group = _faked_group(Doubling(delay=0.1, outcome="fail"), timeout=30.0)
    with pytest.raises(RuntimeError, match="the all-reduce of version 2 .* failed: NCCL error"):
        group.all_reduce(torch.ones(4), "the all-reduce of version 2")


def _late_groups(monkeypatch, delay: float, faults: dict[int, dict[int, str]]) -> None:
    """Every data group the runtimes build completes late (``delay``); rank ``r``'s all-reduce number ``i`` of its
    first group has the outcome ``faults[r][i]``."""
    real_open = comm.open_group

    def open_late(store, prefix, number, members, rank, *args, **kwargs):
        group = real_open(store, prefix, number, members, rank, *args, **kwargs)
        if group is not None:
            group.pg = LateGroup(group.pg, delay, faults.get(rank) if number == 0 else None)
            group.waits_on_host = False
        return group

    monkeypatch.setattr(comm, "open_group", open_late)


def _record_publications(rts) -> dict[int, dict[int, torch.Tensor]]:
    """``{rank: {version: a copy of the aggregate as it was published}}``, filled as the runtimes publish."""
    published: dict[int, dict[int, torch.Tensor]] = {rt.rank: {} for rt in rts}
    for rt in rts:
        put = rt.aggregates.put

        def recording(version, buf, event=None, table=(), put=put, mine=published[rt.rank]):
            mine[version] = buf.clone()
            put(version, buf, event, table)

        rt.aggregates.put = recording
    return published


def test_no_rank_publishes_an_aggregate_before_its_all_reduce_finished(monkeypatch):
    """pgc_cr, n = 4: every all-reduce's sum lands 0.2 s after NCCL-like ``wait()`` returned. Each rank publishes
    each version's aggregate only once the sum is there: what it published is the decode of the admitted codes,
    the same bits on every rank; and the all-reduce time ``scheme="auto"`` reads is the time until then."""
    _late_groups(monkeypatch, delay=0.2, faults={})
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = _planes(scheme)
    published = _record_publications(rts)
    try:
        for v in range(3):
            for rt in rts:
                _submit(rt, v)
            for rt in rts:
                rt.release(rt.wait(v))
            for rt in rts:
                assert torch.equal(published[rt.rank][v], published[0][v])
            _assert_decodes(published[0][v], scheme, rts[0].record(v))
        assert all(rt.allreduce_s >= 0.2 for rt in rts)
    finally:
        _together(rts, lambda rt: rt.stop())


def _train(rt, versions: int) -> tuple[torch.Tensor, list[int]]:
    """A replica's loop as the strategy runs it: ``p -= aggregate`` per version; a detached rank rejoins with a
    donor's state; a rank whose aggregate is already here applies it without computing. Returns ``p`` and the
    versions this rank applied."""
    p, applied, v = torch.zeros(D), [], 0
    while v < versions:
        if rt.detached(v) and not rt.published(v):
            v, state = rt.rejoin(v)
            p = state["p"].clone()
            continue
        start = p.clone()
        if not rt.published(v):
            _submit(rt, v)
        try:
            agg = rt.wait(v, donate=lambda start=start: {"p": start})
        except PGCDetached:
            continue
        p -= agg
        applied.append(v)
        rt.release(agg)
        rt.serve_rejoins(v, lambda start=start: {"p": start})
        v += 1
    final = p.clone()
    rt.stop(donate=lambda: {"p": final})
    return p, applied


@pytest.mark.parametrize("outcome", ["fail", "hang"])
def test_an_all_reduce_that_fails_after_enqueue_is_never_applied_and_the_group_is_reconfigured(
    monkeypatch, caplog, outcome
):
    """pgc_cr, n = 4, s = 1. Rank 3's all-reduce of version 1 fails after it was queued (``fail``: half the sum
    lands, then an error; ``hang``: it never finishes, so it is given up at the group's timeout), while ranks 0-2
    complete it. Rank 3 never publishes or applies version 1; it leaves the group, the group is reconfigured, and
    as a rank that did not complete a version the others completed it is detached and rejoins by state transfer.
    Every replica ends identical."""
    _late_groups(monkeypatch, delay=0.02, faults={3: {1: outcome}})
    scheme = make_scheme("pgc_cr", 4, 1)
    rts = _planes(scheme, timeout=1.0, heartbeat=(0.1, 10))
    published = _record_publications(rts)
    got = _together(rts, lambda rt: _train(rt, 12), timeout=60)
    assert all(not isinstance(g, Exception) for g in got.values()), got
    assert all(torch.equal(got[r][0], got[0][0]) for r in range(4))
    assert 1 not in published[3] and 1 not in got[3][1]
    assert all(1 in published[r] for r in range(3))
    assert "the all-reduce of version 1 failed" in caplog.text and "rejoined at version" in caplog.text
    assert rts[0].config >= 1 and rts[0].rank_stats()[3]["rejoined"] == 1
