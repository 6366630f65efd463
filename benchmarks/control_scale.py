"""The control plane's cost per step against n: a real store, the real leader, fake ranks (no training, no data group).

    python benchmarks/control_scale.py                     # n = 8 .. 256, 40 steps of 100 ms each (about 2 min)
    python benchmarks/control_scale.py --ns 4 --steps 5    # a smoke run

For each n, one process hosts a TCPStore (:func:`lightning_pgc.runtime.control.serve_store`) and runs the real
:class:`~lightning_pgc.runtime.coordinator.Coordinator` with its :class:`~lightning_pgc.decisions.leader.Leader`
(``pgc_cr``, s = 1) on a thread of its own, over a channel whose store calls are counted. Fake ranks do what a
rank's threads send the leader, through their own store connections: every heartbeat interval each rank's tick to
its own inbox and its heartbeat to the leader's box (rank 0: a tick to the leader's box), and once per step each
rank's announcement of its code. A reader drains every inbox (what each rank's comm thread pops). A step is paced at
``--step-ms``: the next version's codes go out once the leader closed the last one and the step's time is up.
Each n runs twice, interleaved: the runtime as it is, and as it was before heartbeats skipped what carries them
already (``before``: the leader beat to every inbox and every worker to the leader every interval; now the leader
skips the ranks it sent a plan since its last heartbeat, and a worker that announced a code within the interval
sends none).

Measured over the steps after ``--skip``: the leader's store calls per step (every call of its connection), its CPU
time per step (the leader thread's own CPU clock, ``pthread_getcpuclockid``), and the heartbeat store calls per
second of the whole job (the ranks' tick and beat pushes, the leader's beat pushes to every inbox, and one pop of
each by its reader). Writes docs/results/control_scale.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

from lightning_pgc.codes import make_scheme
from lightning_pgc.decisions.leader import Leader
from lightning_pgc.runtime.control import Channel, inbox, leader_box, serve_store
from lightning_pgc.runtime.coordinator import Coordinator
from lightning_pgc.runtime.transfer import ForwardingStore
from pgc_lab.experiments.report import write_report

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"
NS = (8, 16, 32, 64, 128, 256)
INTERVAL = 0.2  # the runtime's default heartbeat interval (s)
BUDGET = 0.05  # the goal: control cost under 5 % of a step


class CountingStore(ForwardingStore):
    """Counts every call made through it (the leader's connection)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls = 0
        self.beats = 0  # pushes of heartbeats

    def touched(self, key: str, value: Optional[bytes] = None) -> None:
        self.calls += 1

    def queue_push(self, key: str, value: Any) -> None:
        self.beats += b'"beat"' in value
        super().queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        self.calls += 1
        return self.inner.queue_pop(key, block)

    def queue_len(self, key: str) -> int:
        self.calls += 1
        return self.inner.queue_len(key)

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self.calls += 1
        return self.inner.delete_key(key)


class FakeHost:
    """What the coordinator reads of its rank's runtime (:class:`~lightning_pgc.runtime.coordinator.CoordinatorHost`):
    rank 0 of ``n``, no failover, nothing detached, every all-reduce instantaneous."""

    def __init__(self, store: Any, prefix: str, n: int) -> None:
        self.scheme = make_scheme("pgc_cr", n, 1)
        self.rank, self.world_size = 0, n
        self.timeout, self.failover = 30.0, False
        self.heartbeat_interval, self.heartbeat_window = INTERVAL, 15 * INTERVAL
        self.group_timeout = timedelta(seconds=self.heartbeat_window + self.timeout)
        self.peer_timeout, self.kept_versions = 60.0, 1
        self.term, self.members, self.config = 0, list(range(n)), 0
        self.progress, self.alive, self.allreduce_s, self.allreduces = 0, n, 0.0, 0
        self.leader: Optional[Leader] = None
        self.succession: Any = None
        self.error: Optional[BaseException] = None
        self._stopping = threading.Event()
        self.chan = Channel(store, prefix, n)
        self.counter = CountingStore(self.chan.store)
        self.chan._connection = self.counter

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def leader_channel(self) -> Channel:
        return self.chan

    def detached_ranks(self) -> dict[int, int]:
        return {}

    def donate_final(self, rank: int, version: int, transfer: str) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        self.error = exc


class EveryInboxBeats(Coordinator):
    """The leader as it was before its heartbeat skipped the ranks it had just sent a plan: a heartbeat to every
    inbox every interval (for the side-by-side comparison; its workers beat every interval too)."""

    def _beat(self, now: float) -> None:
        self._told = set()
        super()._beat(now)


VARIANTS = {"before": EveryInboxBeats, "after": Coordinator}


def _beats(chan: Channel, n: int, done: threading.Event, count: list[int], announced: list[float]) -> None:
    """Every rank's heartbeat thread: a tick to its own inbox, a heartbeat (rank 0: a tick) to the leader's box;
    with ``announced`` (after) a worker that announced within the interval sends no heartbeat."""
    box = leader_box(0)
    while not done.wait(INTERVAL):
        quiet = time.monotonic() - announced[0] < INTERVAL
        for r in range(n):
            chan.push(inbox(r), (-1, ("tick", time.monotonic())))
            count[0] += 1
            if r == 0 or not quiet:
                chan.push(box, ("tick",) if r == 0 else ("beat", r, 0))
                count[0] += 1


def _readers(chan: Channel, n: int, done: threading.Event) -> None:
    """Every rank's comm thread: what comes into its inbox is popped."""
    while not done.wait(INTERVAL / 2):
        for r in range(n):
            chan.drain(inbox(r))


def _cpu(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def measure(n: int, steps: int, skip: int, step_s: float, variant: str = "after") -> dict[str, Any]:
    """One n: the leader's store calls and CPU seconds per step, and the job's heartbeat calls per second."""
    server = serve_store()
    prefix = f"bench/{n}"
    host = FakeHost(server, prefix, n)
    leader = Leader(host.scheme, n, 0, host.timeout, 1000, host.heartbeat_window)
    host.leader = leader
    coordinator = VARIANTS[variant](host, leader)  # type: ignore[arg-type]
    codes, beats, reads = (Channel(server, prefix, n) for _ in range(3))
    done, beat_count = threading.Event(), [0]
    announced = [0.0]  # when the workers last announced (before: every worker beats every interval all the same)
    threads = [
        threading.Thread(target=coordinator.run, name="leader", daemon=True),
        threading.Thread(target=_beats, args=(beats, n, done, beat_count, announced), daemon=True),
        threading.Thread(target=_readers, args=(reads, n, done), daemon=True),
    ]
    for t in threads:
        t.start()
    marks: dict[str, float] = {}
    for v in range(steps):
        if v == skip:
            marks = _marks(host, threads[0], beat_count)
        started = time.monotonic()
        for r in range(n):
            codes.push(leader_box(0), ("code", r, v, (0,), 0, -1, 0.0))
        host.progress = v
        announced[0] = time.monotonic() if variant == "after" else 0.0
        while leader.version <= v:
            time.sleep(0.0005)
        time.sleep(max(0.0, step_s - (time.monotonic() - started)))
    end = _marks(host, threads[0], beat_count)
    host._stopping.set()
    codes.push(leader_box(0), ("halt",))
    done.set()
    for t in threads:
        t.join(10)
    measured = steps - skip
    wall = end["wall"] - marks["wall"]
    return {
        "n": n,
        "variant": variant,
        "steps": measured,
        "leader_store_calls_per_step": (end["calls"] - marks["calls"]) / measured,
        "leader_cpu_ms_per_step": 1e3 * (end["cpu"] - marks["cpu"]) / measured,
        "heartbeat_calls_per_s": 2 * (end["beats"] - marks["beats"]) / wall,
        "step_s": wall / measured,
    }


def _marks(host: FakeHost, leader_thread: threading.Thread, beat_count: list[int]) -> dict[str, float]:
    return {
        "wall": time.monotonic(),
        "calls": host.counter.calls,
        "cpu": _cpu(leader_thread),
        "beats": beat_count[0] + host.counter.beats,
    }


def summarize(result: dict[str, Any]) -> dict[str, float]:
    """The arithmetic at the largest n (after): calls per rank and step, the leader's CPU per call, and the calls
    per step the goal leaves at that CPU per call."""
    top = max((r for r in result["rows"] if r["variant"] == "after"), key=lambda r: r["n"])
    per_call_us = 1e3 * top["leader_cpu_ms_per_step"] / top["leader_store_calls_per_step"]
    return {
        "n": top["n"],
        "calls_per_rank_per_step": top["leader_store_calls_per_step"] / top["n"],
        "leader_cpu_us_per_call": per_call_us,
        "calls_within_goal": 1e6 * BUDGET * result["step_s"] / per_call_us,
    }


def render(result: dict[str, Any]) -> str:
    by = {(r["n"], r["variant"]): r for r in result["rows"]}
    sm = result["summary"]
    ns = sorted({r["n"] for r in result["rows"]})
    rows = []
    for n in ns:
        b, a = by[(n, "before")], by[(n, "after")]
        rows.append(
            f"| {n} | {b['leader_store_calls_per_step']:.0f} / {a['leader_store_calls_per_step']:.0f} | "
            f"{b['leader_cpu_ms_per_step']:.2f} / {a['leader_cpu_ms_per_step']:.2f} | "
            f"{100 * a['leader_cpu_ms_per_step'] / (1e3 * result['step_s']):.1f} % | "
            f"{b['heartbeat_calls_per_s']:.0f} / {a['heartbeat_calls_per_s']:.0f} |"
        )
    return "\n".join(
        [
            "# The control plane's cost per step against n",
            "",
            f"Produced by `{result['command']}` ({result['machine']}; load average {result['load_average_1min'][0]:.2f}"
            f" before, {result['load_average_1min'][1]:.2f} after). A real store, the real leader (`pgc_cr`, s = 1), "
            f"fake ranks that send what the runtime's threads send; steps of {1e3 * result['step_s']:.0f} ms, "
            f"heartbeats every {1e3 * result['heartbeat_interval_s']:.0f} ms, {result['rows'][0]['steps']} steps "
            "measured per n and variant, the two variants interleaved. Store calls: every call of the leader's "
            "connection per step. Leader CPU: the leader thread's own CPU time per step. Heartbeat calls: store "
            "calls per second of the whole job for liveness (pushes and their pops). Each cell is before / after: "
            "before, the leader's heartbeat went to every inbox and every worker's to the leader every interval; "
            "after, the leader skips the ranks it sent a plan since its last heartbeat and a worker that announced a "
            "code within the interval sends none (each is heard as a heartbeat).",
            "",
            "| n | leader store calls / step | leader CPU ms / step | CPU of the step (after) | heartbeat calls / s |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"The goal is a control cost under {100 * BUDGET:.0f} % of the step at n = 256 "
            f"({1e3 * BUDGET * result['step_s']:.0f} ms of a {1e3 * result['step_s']:.0f} ms step). At n = "
            f"{sm['n']} the leader makes {sm['calls_per_rank_per_step']:.1f} store calls per rank and step and "
            f"spends {sm['leader_cpu_us_per_call']:.0f} us of CPU per call, so the goal leaves about "
            f"{sm['calls_within_goal']:.0f} calls per step.",
            "",
            "![leader CPU and store calls per step against n](control_scale.png)",
            "",
        ]
    )


def figure(result: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for variant in VARIANTS:
        rows = [r for r in result["rows"] if r["variant"] == variant]
        ns = [r["n"] for r in rows]
        a.plot(ns, [r["leader_cpu_ms_per_step"] for r in rows], "o-", label=variant)
        b.plot(ns, [r["leader_store_calls_per_step"] for r in rows], "o-", label=variant)
    a.axhline(1e3 * BUDGET * result["step_s"], color="grey", ls="--", label=f"{100 * BUDGET:.0f} % of the step")
    a.set(xscale="log", xlabel="n (ranks)", ylabel="ms per step", title="leader CPU per step")
    b.set(xscale="log", yscale="log", xlabel="n (ranks)", ylabel="calls per step", title="leader store calls")
    a.legend()
    b.legend()
    fig.tight_layout()
    return fig


def main(argv: Optional[list[str]] = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", type=int, nargs="+", default=list(NS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--docs", default=str(DOCS))
    p.add_argument("--from-json", action="store_true", help="only rewrite the page and plot from the results file")
    args = p.parse_args(argv)
    if args.from_json:
        result = json.loads((Path(args.docs) / "control_scale.json").read_text())
        result["summary"] = summarize(result)
        return _write(Path(args.docs), result)
    load_before = os.getloadavg()[0]
    skip = min(args.skip, args.steps - 1)
    rows = [measure(n, args.steps, skip, args.step_ms / 1e3, variant) for n in args.ns for variant in VARIANTS]
    result = {
        "command": "python benchmarks/control_scale.py" + (f" {' '.join(argv)}" if argv else ""),
        "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}",
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "step_s": args.step_ms / 1e3,
        "heartbeat_interval_s": INTERVAL,
        "rows": rows,
    }
    result["summary"] = summarize(result)
    return _write(Path(args.docs), result)


def _write(docs: Path, result: dict[str, Any]) -> list[Path]:
    return write_report(
        docs, "control_scale", result, page=render(result), figures={"control_scale.png": figure(result)}
    )


if __name__ == "__main__":
    main()
