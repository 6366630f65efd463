"""A rank frozen by SIGSTOP inside a wait of the runtime's (a Lightning collective, the stop, a rejoin) costs the
others a bounded wait, then they go on without it (``tests/bounds_job.py``: 3 real processes of the bare runtime;
the bounds on live ranks that never act are tested in threads in tests/test_bounds.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal

import pytest

from lightning_pgc.runtime.control import serve_store
from tests import bounds_job as job

#: The longest wait a survivor may see: the group's timeout (2 s) for the collective the frozen rank holds, a
#: heartbeat window (1 s) and the leader's wait for reports (2 s + 1 s) make 6 s; the rest is a loaded machine.
LONGEST_S = 6.0 + 9.0
JOB_TIMEOUT_S = 90.0  # (a hang fails the test here)


@pytest.mark.parametrize("scenario", ["gather", "stop", "rejoin"])
def test_a_rank_frozen_inside_a_wait_costs_the_others_a_bounded_wait(tmp_path, scenario):
    """Rank 2 freezes inside the barrier, just before its BYE, or once it asked to rejoin (its donor's transfer then
    fails at the group's timeout). Ranks 0 and 1 finish (exit 0), their longest wait within ``LONGEST_S``, having
    applied the same aggregates; the frozen rank is killed afterwards."""
    server = serve_store()
    fork = multiprocessing.get_context("fork")  # (no start-up: the ranks have the test's imports)
    addr = f"127.0.0.1:{server.port}"
    procs = [fork.Process(target=job.run_rank, args=(scenario, r, addr, tmp_path)) for r in range(job.N)]
    for p in procs:
        p.start()
    try:
        for r in (0, 1):
            procs[r].join(JOB_TIMEOUT_S)
        logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(job.N)]
        assert [procs[r].exitcode for r in (0, 1)] == [0, 0], logs
        assert procs[job.FROZEN].is_alive()  # (frozen, not ended: the others did not wait for it to end)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["longest_s"] < LONGEST_S for r in ranks), ranks
    assert ranks[0]["applied"] == ranks[1]["applied"] and ranks[0]["versions"] == ranks[1]["versions"]
    if scenario == "rejoin":
        assert "the state transfer to rank 2 failed" in logs[0], logs[0][-3000:]
