"""A simulated clock: the real codes, coordinator rules and delay models on virtual time (no model, no processes).

:func:`simulate` replays one training run of ``steps`` versions on ``n`` simulated ranks as a discrete-event
simulation. It runs the objects the real runtime runs: the scheme (``scheme.evaluations`` decides how many
partition gradients a rank computes per step, :class:`~lightning_pgc.codes.StaleCache` which cached entries a
code carries and their ages), the leader's decisions (:class:`~lightning_pgc.decisions.leader.Leader` or
:class:`~lightning_pgc.decisions.bounded.BoundedLeader`, fed the same code headers with virtual arrival times: its
``try_close`` decides every close and admitted set) and the delay models of :mod:`lightning_pgc.delays`
(:func:`~lightning_pgc.delays.delay_for`: the same realisation a real run with the same seed sleeps). What it
does not run is the model: it answers *when* versions close and *which* codes they use, not what loss a run
reaches (see ``docs/results/simulation.md``).

A simulated rank follows the runtime's step (``PGCStrategy.optimizer_step``): at the start of version ``t`` it
skips computing if the aggregate of ``t`` already reached it (Invariant 3); otherwise it computes
``len(scheme.evaluations(k, t))`` partition gradients (``Costs.compute_s`` each) plus its injected delay, sends
its code (shard 0 reaches the leader ``Costs.code_s`` later; the leader's own code is local), and waits for the
aggregate of ``t`` (``Costs.aggregate_s`` after the close). Every step, computed or skipped, costs
``Costs.overhead_s`` (Lightning's loop, the optimizer, data loading). Not modelled: detaching and rejoining
(``max_lag``), heartbeats and failures, contention for CPU cores between ranks, and variation in message times.
"""

from __future__ import annotations

import functools
import heapq
import math
import statistics
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from lightning_pgc.codes import AutoScheme, Scheme, StaleCache
from lightning_pgc.codes.bounded import BoundedScheme
from lightning_pgc.decisions.bounded import BoundedLeader
from lightning_pgc.decisions.leader import Leader, StepRecord
from lightning_pgc.decisions.header import Header
from lightning_pgc.delays import DelayModel, delay_for, parse_delay
from lightning_pgc.emulator.auto import auto_leader

__all__ = ["Costs", "SimResult", "simulate"]

_TOKEN = torch.zeros(1)  # what the simulated caches hold: only versions matter here

#: ``delay_for`` memoised: every scheme of a grid cell draws the same (model, seed, rank, step) realisation.
_delay = functools.lru_cache(maxsize=1 << 18)(delay_for)


@dataclass(frozen=True)
class Costs:
    """Per-step and per-message costs of the simulated machine, in seconds (see ``docs/results/simulation.md``).

    Args:
        compute_s: one partition gradient (forward + backward of one mini-batch, plus any simulated compute).
        overhead_s: every rank's fixed cost per step, computed or skipped (loop, optimizer, data loading).
        code_s: from the end of a rank's compute to its code's arrival at the leader (0 for the leader's own).
        aggregate_s: from a version's close to its aggregate being usable on every rank (decision to the shard
            owners, their decode, the aggregate shards to every rank).
    """

    compute_s: float = 0.0
    overhead_s: float = 0.0
    code_s: float = 0.0
    aggregate_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("compute_s", "overhead_s", "code_s", "aggregate_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Costs.{name} must be a finite number >= 0 seconds, got {value!r}")

    @staticmethod
    def message_s(nbytes: float, latency_s: float, bandwidth_bytes_per_s: float) -> float:
        """Seconds one message of ``nbytes`` takes: ``latency_s + nbytes / bandwidth`` (to build ``code_s`` and
        ``aggregate_s`` from a payload size)."""
        if bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth_bytes_per_s}")
        return latency_s + nbytes / bandwidth_bytes_per_s


@dataclass
class SimResult:
    """What one simulated run produced (times in virtual seconds from the start of step 0).

    ``records`` are the leader's own :class:`~lightning_pgc.decisions.leader.StepRecord` objects (one per version,
    closing time, admitted ranks in arrival order, decoding weights, ages of the entries each admitted code used).
    """

    n: int
    records: list[StepRecord]
    applied: list[list[float]]  # applied[k][t]: when rank k finished applying version t (its step end)
    busy_s: list[float]  # per rank: compute + injected delay
    computed: list[int]  # per rank: versions it computed a code for
    evaluations: list[int]  # per rank: partition gradients evaluated
    skipped: list[int]  # per rank: versions applied without computing (caught up)
    late: list[int] = field(default_factory=list)  # per rank: codes that arrived after their version closed

    @property
    def close_times(self) -> list[float]:
        """When each version closed at the leader."""
        return [r.closed_at for r in self.records]

    @property
    def admitted(self) -> list[list[int]]:
        """Admitted ranks of each version, in arrival order (bounded: the ranks whose entries the aggregate uses)."""
        return [list(r.admitted) for r in self.records]

    @property
    def wall_s(self) -> list[float]:
        """Per rank: the end of its last step."""
        return [times[-1] if times else 0.0 for times in self.applied]

    @property
    def utilization(self) -> list[float]:
        """Per rank: busy time over its wall time (as the real-rank experiments' work meter measures it)."""
        return [b / w if w > 0 else float("nan") for b, w in zip(self.busy_s, self.wall_s)]

    def step_times(self, rank: int = 0) -> list[float]:
        """Intervals between consecutive step ends of ``rank`` (rank 0's are what ``curve.csv`` records)."""
        t = self.applied[rank]
        return [b - a for a, b in zip(t, t[1:])]

    def max_ages(self) -> list[int]:
        """Per version: the largest age of an entry the aggregate used (0: every entry fresh)."""
        out = []
        for rec in self.records:
            ages = [a for r in rec.admitted if rec.weights.get(r, 0.0) != 0.0 for a in rec.ages.get(r, ())]
            out.append(max(ages, default=0))
        return out

    def steps_per_s(self) -> float:
        """Versions per second on rank 0, from its first to its last step end (throughput, not a median)."""
        t = self.applied[0]
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else float("nan")

    def summary(self) -> dict[str, float]:
        """The timing metrics of the run in one flat dict (for tables and JSON)."""
        steps = self.step_times(0)
        ages = self.max_ages()
        return {
            "steps_per_s": self.steps_per_s(),
            "step_s_mean": statistics.fmean(steps) if steps else float("nan"),
            "utilization_mean": statistics.fmean(self.utilization),
            "max_age": float(max(ages, default=0)),
            "mean_max_age": statistics.fmean(ages) if ages else 0.0,
            "evaluations_per_step": sum(self.evaluations) / max(len(self.records), 1),
            "skipped_fraction": sum(self.skipped) / max(self.n * len(self.records), 1),
        }


def _default_leader(scheme: Scheme, steps: int, costs: Costs) -> Leader:
    keep = max(steps + 1, 16)
    if isinstance(scheme, AutoScheme):  # pgc_auto: the strategy's leader and switching rule
        return auto_leader(scheme, steps, costs.aggregate_s)
    if isinstance(scheme, BoundedScheme):
        return BoundedLeader(scheme, scheme.n, 0, timeout=math.inf, max_lag=1 << 30, now=0.0)
    return Leader(scheme, scheme.n, 0, timeout=math.inf, max_lag=1 << 30, keep_records=keep, now=0.0)


def simulate(
    scheme: Scheme,
    steps: int,
    delay: Union[DelayModel, str] = "none",
    costs: Costs = Costs(),
    delay_seed: int = 0,
    scale: float = 1.0,
    leader: Optional[Leader] = None,
) -> SimResult:
    """Simulate ``steps`` versions of ``scheme`` on ``scheme.n`` ranks with the delays of ``delay`` (times ``scale``,
    realisation ``delay_seed``, as :class:`~lightning_pgc.StragglerInjector` sleeps them) and the given ``costs``.

    Args:
        scheme: any scheme of :func:`~lightning_pgc.codes.make_scheme` or a
            :class:`~lightning_pgc.codes.BoundedScheme` (``warmup`` as configured; caches start empty at step 0).
        leader: the control plane to drive (default: the runtime's, for ``scheme``, at virtual time 0).

    Raises:
        ValueError: ``steps < 1`` or a bad delay spec.
        RuntimeError: the run cannot finish (a version no set of codes can close: a bug in the scheme's rules).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    model = parse_delay(delay) if isinstance(delay, str) else delay
    n = scheme.n
    lead = leader if leader is not None else _default_leader(scheme, steps, costs)
    caches = [StaleCache(scheme.partitions(k), scheme.cache_max_age) for k in range(n)]
    records: list[StepRecord] = []
    aggregate_at: list[float] = []  # when each closed version's aggregate is usable on every rank
    codes: dict[tuple[int, int], Header] = {}  # codes in flight to the leader
    waiting: dict[int, list[tuple[int, float]]] = {}  # version -> (rank, compute end) waiting for its aggregate
    res = SimResult(n, records, [[] for _ in range(n)], [0.0] * n, [0] * n, [0] * n, [0] * n, [0] * n)
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, kind, rank, version)
    seq = 0

    def push(time: float, kind: str, rank: int, v: int) -> None:
        nonlocal seq
        heapq.heappush(events, (time, seq, kind, rank, v))
        seq += 1

    def applied(rank: int, v: int, ready: float) -> None:
        """``rank`` has the aggregate of ``v`` at ``ready``: its step ends, the next starts."""
        end = ready + costs.overhead_s
        res.applied[rank].append(end)
        if v + 1 < steps:
            push(end, "start", rank, v + 1)

    for k in range(n):
        push(0.0, "start", k, 0)
    while events:
        now, _, kind, k, v = heapq.heappop(events)
        if kind == "start":
            lead.on_beat(k, v, now)
            if v < len(aggregate_at) and aggregate_at[v] <= now:  # published: catch up without computing
                res.skipped[k] += 1
                applied(k, v, now)
                continue
            evals = scheme.evaluations(k, v, start=0)
            busy = len(evals) * costs.compute_s + _delay(model, delay_seed, k, v) * scale
            res.busy_s[k] += busy
            res.evaluations[k] += len(evals)
            res.computed[k] += 1
            for p in evals:
                caches[k].put(p, _TOKEN, v, copy=False)
            caches[k].evict(v)
            end = now + busy
            valid = caches[k].ages(v)
            # pgc_cr_naive sends no code until its cache is full again (as the strategy does)
            if scheme.cache_max_age is not None or len(valid) == len(caches[k].partitions):
                ages = tuple(valid.values())
                header = Header(v, k, len(ages), ages, res.skipped[k], busy_s=busy)
                arrive = end if k == 0 else end + costs.code_s
                push(arrive, "code", k, v)
                codes[(k, v)] = header
            if v < len(aggregate_at):
                applied(k, v, max(end, aggregate_at[v]))
            else:
                waiting.setdefault(v, []).append((k, end))
        else:  # a code's shard 0 reaches the leader
            closed_before = lead.version
            lead.on_code(codes.pop((k, v)), now)
            if v < closed_before:
                res.late[k] += 1
            while (rec := lead.try_close(now)) is not None:
                records.append(rec)
                ready = now + costs.aggregate_s
                aggregate_at.append(ready)
                for rank, end in waiting.pop(rec.version, []):
                    applied(rank, rec.version, max(end, ready))
                if len(records) >= steps:
                    break
    if len(records) < steps or any(len(t) < steps for t in res.applied):
        raise RuntimeError(
            f"simulation stalled at version {len(records)} of {steps}: no admissible set of codes "
            f"(scheme {scheme!r}, leader waiting since {records[-1].closed_at if records else 0.0})"
        )
    return res
