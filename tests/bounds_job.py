"""Three ranks of the bare runtime (no Lightning) in real processes, forked from the test (:func:`run_rank`); rank
2 freezes itself by SIGSTOP inside one wait and is never resumed. The scenarios:

- ``gather``: after two versions every rank calls a barrier; rank 2 freezes once it asked for it;
- ``stop``: after three versions every rank stops; rank 2 freezes just before it says BYE;
- ``rejoin``: rank 2 falls ``MAX_LAG`` versions behind (the other scenarios detach no rank) and is detached; it freezes once it asked to rejoin, and its
  donor's transfer to it fails.

Ranks 0 and 1 write ``OUT/rank{k}.json``: the seconds their longest wait took (``longest_s``: the barrier, the
stop, a version's aggregate), the sum of the aggregates they applied and the versions they ran; every rank logs to
``OUT/rank{k}.log``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_pgc.codes import make_scheme
from lightning_pgc.runtime.plane import CollectiveRuntime

N, FROZEN, D = 3, 2, 16
MAX_LAG = 2
LIVENESS = dict(timeout=1.0, heartbeat_interval=0.1, heartbeat_misses=10)  # a group timeout of 2 s


def _freeze() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def _freeze_on(rt: CollectiveRuntime, kind: str) -> None:
    """Rank 2 freezes when its training thread sends a message of ``kind``: just before a BYE, else just after it."""
    push = rt._ctl.push

    def pushing(box, message):
        if message[0] == kind == "bye":
            _freeze()
        push(box, message)
        if message[0] == kind:
            _freeze()

    rt._ctl.push = pushing  # type: ignore[method-assign]


def _version(rt: CollectiveRuntime, v: int, applied: list[float], state: dict) -> float:
    """Run version ``v`` on this rank; returns the seconds it took (its aggregate, the donations it made)."""
    started = time.monotonic()
    code = rt.new_code(v)
    code.write(0, torch.full((D,), float(rt.rank + 1 + v)))
    rt.submit(v, code, (0,))
    agg = rt.wait(v, donate=lambda: dict(state))
    applied.append(float(agg.sum()))
    state["sum"] = sum(applied)
    rt.release(agg)
    rt.serve_rejoins(v, lambda: dict(state))
    return time.monotonic() - started


def main(scenario: str, rank: int, addr: str, out: Path) -> None:
    host, port = addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60), use_libuv=True)
    # (only the rejoin scenario detaches rank 2; elsewhere a rank that load holds back must reach its wait, not be
    # detached on the way)
    max_lag = MAX_LAG if scenario == "rejoin" else 1000
    rt = CollectiveRuntime(
        make_scheme("ignore", N, 1), store, rank, N, D, D, D, torch.float32, 0, max_lag=max_lag, prefix="b", **LIVENESS
    )
    rt.start()
    applied: list[float] = []
    state: dict = {"sum": 0.0}
    waits = [0.0]
    versions = {"gather": 2, "stop": 3, "rejoin": 16}[scenario]
    if rank == FROZEN:
        _freeze_on(rt, {"gather": "coll", "stop": "bye", "rejoin": "rejoin"}[scenario])
        if scenario == "rejoin":  # it computes nothing: detached once the others are MAX_LAG versions ahead
            while FROZEN not in rt.detached_ranks():
                time.sleep(0.05)
            rt.rejoin(rt.detached_ranks()[FROZEN])  # (frozen inside, never resumed)
    for v in range(versions):
        waits.append(_version(rt, v, applied, state))
        if scenario == "rejoin":
            time.sleep(0.2)  # (paced, so that rank 2's rejoin comes while the others run)
    if scenario == "gather":
        started = time.monotonic()
        rt.collectives.barrier()
        waits.append(time.monotonic() - started)
        for v in range(versions, versions + 2):  # the survivors go on
            waits.append(_version(rt, v, applied, state))
    started = time.monotonic()
    rt.stop(donate=lambda: dict(state))
    waits.append(time.monotonic() - started)
    result = {"longest_s": max(waits), "applied": sum(applied), "versions": len(applied)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def run_rank(scenario: str, rank: int, addr: str, out: Path) -> None:
    """A forked rank's whole life: :func:`main`, logging to ``OUT/rank{k}.log``; it ends with ``os._exit`` (0, or 1
    after writing the traceback to the log), so nothing the test process held is torn down here."""
    handler = logging.FileHandler(out / f"rank{rank}.log")
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    code = 0
    try:
        main(scenario, rank, addr, out)
    except BaseException:
        logging.getLogger(__name__).error("rank %d failed:\n%s", rank, traceback.format_exc())
        code = 1
    handler.flush()
    os._exit(code)
