"""``lightning-pgc advise trace.json``: which strategy and ``s`` to use on the cluster a step trace came from.

The trace (:class:`~lightning_pgc.step_trace.StepTimeTrace`) holds every rank's own time per step and the measured
time of one all-reduce of the model's gradient. Advise

1. derives the job's compute-to-communication ratio: the typical own step (median over ranks and steps) divided by
   the all-reduce time (``--bound`` or ``--ratio`` override it; a trace without an all-reduce time needs one);
2. picks the proxy task of that kind (:func:`proxy_task`, :data:`PROXY_TASKS`: the digits MLP for both kinds
   unless ``--task`` names a harder one);
3. replays the trace's delays by block resampling (:mod:`lightning_pgc.emulator.traces`: blocks of consecutive
   steps, so persistent slowness and stall durations survive), through the map's own straggler pattern
   ``"trace:PATH"``;
4. runs every arm of the map for the trace's ``n`` (:func:`candidate_arms`: the map's arm list,
   :func:`~lightning_pgc.emulator.cells.arms_for`, at every ``s`` from 1 to :func:`s_values`, with each staleness
   correction and bounded staleness), each through the map's tuning protocol
   (:func:`~lightning_pgc.emulator.cells.run_arm`: the map's ``lr x momentum`` grid on its tuning seeds, then
   ``seeds`` evaluation seeds);
5. decides with the map's statistics, in one call (:func:`~lightning_pgc.emulator.summary.summarize`: each arm
   against ddp on the same seeds, Holm's correction over the cell's comparisons, the winner rule).

When no arm is faster than ddp with a Holm-corrected p below the map's ``alpha``, advise says that nothing is surely
faster and keeps ddp; it also reports the smallest Holm p the seeds and the number of comparisons can reach at all
(:func:`p_floor`), so a p that could never have been significant is not read as evidence. Everything it reports is
emulated, and labelled so.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from lightning_pgc.emulator.cells import MapArm, MapCell, Protocol, _model, arms_for, run_arm
from lightning_pgc.emulator.cluster import COMPUTE_S, RATIOS, TRACE_PREFIX
from lightning_pgc.emulator.scoring import holm, sign_flip_p
from lightning_pgc.emulator.summary import ALPHA, summarize
from lightning_pgc.emulator.traces import Trace, block_length, load_trace

__all__ = [
    "Advice",
    "PROXY_TASKS",
    "advise",
    "candidate_arms",
    "load_trace",
    "main",
    "p_floor",
    "proxy_task",
    "render",
    "s_values",
]

#: the proxy tasks by kind, the preferred first: ``compute`` (a ratio of at least :data:`KIND_SPLIT`) and ``comm``
#: (below it); the first one the emulator knows is used. Both are the digits MLP, whose advice on a trace is timed in
#: docs/guide.md. The harder proxy tasks (``bncnn``, a conv net with many FLOPs per gradient element, and ``lm``, a
#: transformer; docs/results/tasks.md) are chosen with ``--task`` and run under their own protocol: an arm costs minutes of
#: CPU there (docs/results/hard_tasks.md), so advice over every arm of a trace takes hours, and they are not the default.
PROXY_TASKS: dict[str, tuple[str, ...]] = {"compute": ("mlp",), "comm": ("mlp",)}
#: the ratio between the map's two bounds on a log scale, ``sqrt(4 * 0.5)``: at or above it a job is compute-bound
KIND_SPLIT = math.sqrt(RATIOS["compute"] * RATIOS["comm"])
#: above this ``n``, ``s`` takes powers of two (and ``n / 8``, the node size of the map) instead of every value
EVERY_S_UP_TO_N = 8


def proxy_task(ratio: float, known: Optional[Callable[[str], bool]] = None) -> str:
    """The proxy task for a job with compute-to-communication ``ratio``: the first known task of its kind."""
    if known is None:
        known = _task_known
    kind = "compute" if ratio >= KIND_SPLIT else "comm"
    for task in PROXY_TASKS[kind]:
        if known(task):
            return task
    raise ValueError(f"none of the proxy tasks {PROXY_TASKS[kind]} is available")


def _task_known(task: str) -> bool:
    try:
        _model(task, 0)
    except ValueError:
        return False
    return True


def s_values(n: int) -> list[int]:
    """The ``s`` advise tries for ``n`` ranks: every ``s`` from 1 to ``n - 1`` up to :data:`EVERY_S_UP_TO_N` ranks;
    above, the powers of two below ``n / 2`` and ``n / 2`` and ``n / 8`` (a node of the map)."""
    if n < 2:
        raise ValueError(f"n must be >= 2 ranks, got {n}")
    if n <= EVERY_S_UP_TO_N:
        return list(range(1, n))
    out = {n // 2, max(1, n // 8)}
    s = 1
    while s < n // 2:
        out.add(s)
        s *= 2
    return sorted(out)


def candidate_arms(n: int, ss: Optional[Sequence[int]] = None) -> list[MapArm]:
    """ddp and every arm of the map for ``n`` ranks at each ``s`` of ``ss`` (default :func:`s_values`): the map's
    arms (:func:`~lightning_pgc.emulator.cells.arms_for` with ``c = s + 1``), then, where the map's list does not
    already hold them, the pipelined arms with each staleness correction (look-ahead at the strategy's default
    ``k``, delay compensation, momentum accounting) and bounded staleness with replication ``s + 1`` (window 2;
    uncorrected, look-ahead, momentum accounting)."""
    ss = s_values(n) if ss is None else list(ss)
    arms, _ = arms_for(n, [s + 1 for s in ss])
    extra: list[MapArm] = []
    for arm in arms:
        if arm.strategy in ("pgc_fr", "pgc_cr") and arm.correction == "none":
            extra += [MapArm(arm.strategy, arm.c, corr) for corr in ("lookahead", "delay_compensation", "momentum")]
    for s in ss:
        if s + 1 <= n:
            extra += [
                MapArm("bounded_staleness", 2, corr, replication=s + 1) for corr in ("none", "lookahead", "momentum")
            ]
    labels = {a.label for a in arms}
    for arm in extra:
        if arm.label in labels:
            continue
        try:
            arm.scheme(n)
        except ValueError:
            continue
        arms.append(arm)
        labels.add(arm.label)
    return arms


def p_floor(seeds: int, comparisons: int) -> float:
    """The smallest Holm-adjusted p any comparison can reach with ``seeds`` paired seeds in a family of
    ``comparisons``: the exact sign-flip test's smallest p (every seed agreeing) times the family's size."""
    if comparisons < 1:
        return 1.0
    best = sign_flip_p([1.0] * seeds)
    return holm([best] + [1.0] * (comparisons - 1))[0]


def seeds_needed(comparisons: int, alpha: float = ALPHA) -> int:
    """The fewest paired seeds whose :func:`p_floor` is below ``alpha`` for ``comparisons`` comparisons."""
    k = 2
    while p_floor(k, comparisons) >= alpha:
        k += 1
    return k


@dataclass
class Advice:
    """The outcome. ``strategy`` and ``s`` to use (``ddp`` and ``None`` when nothing is surely faster), the ratio of
    time to the late target against ddp's (``< 1``: faster) with its 95 % interval, the Holm-corrected p, the
    evaluation seeds, the proxy task, and every arm's row. ``candidate`` is the fastest arm by ratio (``None``:
    no arm besides ddp); ``p_floor`` the smallest Holm p the test could reach."""

    strategy: str
    s: Optional[int]
    ratio: float
    low: float
    high: float
    p_holm: Optional[float]
    seeds: int
    task: str
    rows: list[dict[str, Any]]
    surely_faster: bool
    arm: str
    lr: float
    momentum: float
    strategy_kwargs: dict[str, Any]
    candidate: Optional[dict[str, Any]]
    p_floor: float
    seeds_needed: int
    alpha: float
    comparisons: int
    n: int
    steps: int
    block: int
    compute_s: float
    allreduce_s: Optional[float]
    comm_ratio: float
    ratio_source: str
    cpu_s: float
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {"label": "emulated", **asdict(self)}


def strategy_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    """The strategy's keyword arguments for an arm's row (what to pass to ``PGCStrategy`` by name, its option
    groups as dicts)."""
    if row["strategy"] == "ddp":
        return {}
    out: dict[str, Any]
    if row["strategy"] == "bounded_staleness":
        out = {"coordinator": {"replication": row["s"] + 1, "staleness": row["c"]}}
    else:
        out = {"stragglers": row["s"]}
    if row.get("correction", "none") != "none":
        out["coding"] = {"staleness_correction": row["correction"]}
    return out


def _per_version(record: dict[str, Any]) -> tuple[Optional[float], Optional[float]]:
    """Mean versions to the late target and mean seconds per version, over the evaluation seeds that reached it."""
    pairs = [
        (t, v)
        for t, v in zip(record["eval"]["time_late"], record["eval"]["versions_late"])
        if t is not None and v is not None and v > 0
    ]
    if not pairs:
        return None, None
    return float(np.mean([v for _, v in pairs])), float(np.mean([t / v for t, v in pairs]))


def _row(arm_summary: dict[str, Any], record: dict[str, Any], task: str) -> dict[str, Any]:
    comp = arm_summary.get("vs_ddp_late")
    versions, per_version = _per_version(record)
    row = {
        "arm": arm_summary["arm"],
        "strategy": arm_summary["strategy"],
        "s": None if arm_summary["strategy"] == "ddp" else arm_summary["s"],
        "c": arm_summary["c"],
        "correction": record["arm"].get("correction", "none"),
        "task": task,
        "lr": arm_summary["lr"],
        "momentum": arm_summary["momentum"],
        "seeds": arm_summary["seeds"],
        "reached": arm_summary["reached_late"],
        "rmean_s": arm_summary["rmean_late_s"],
        "versions_to_target": versions,
        "s_per_version": per_version,
        "cpu_s": record.get("cpu_s"),
    }
    if comp is not None:
        row.update(
            ratio=comp["ratio"],
            low=comp["low"],
            high=comp["high"],
            p=comp["p"],
            p_holm=comp["p_holm"],
            # a run that missed counts as the budget: its ratio is then a bound, not a measurement
            ratio_is_bound=arm_summary["reached_late"] < arm_summary["seeds"],
        )
    return row


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b <= 0 else a / b


def _run_one(item: tuple[MapCell, MapArm, Protocol]) -> dict[str, Any]:
    torch.set_num_threads(1)  # the proxy task's small batched kernels run fastest on one thread
    cell, arm, protocol = item
    return run_arm(cell, arm, protocol)


def _progress(done: int, total: int, label: str, started: float, stream: Any) -> None:
    elapsed = time.time() - started
    left = elapsed / done * (total - done) if done else float("nan")
    bar = "#" * (20 * done // total) + "-" * (20 - 20 * done // total)
    stream.write(
        f"\radvise [{bar}] {done}/{total} arms, {elapsed / 60:.1f} min, about {left / 60:.1f} min left "
        f"(last: {label[:40]:<40})"
    )
    if done == total:
        stream.write("\n")
    stream.flush()


def advise(
    trace: Trace,
    seeds: int = 16,
    ratio: Optional[float] = None,
    task: Optional[str] = None,
    protocol: Optional[Protocol] = None,
    arms: Optional[Sequence[MapArm]] = None,
    workers: int = 1,
    progress: Any = None,
) -> Advice:
    """Emulate ddp and every candidate arm on the trace's delays (block-resampled) and decide with the map's statistics.

    Args:
        trace: a trace read by :func:`load_trace` (it must have a ``path``: the map's pattern reads the file).
        seeds: evaluation seeds (paired across arms; 2 to 20).
        ratio: compute-to-communication ratio; default: measured, the trace's typical step over its all-reduce.
        task: the proxy task; default :func:`proxy_task` of the ratio.
        protocol: the tuning protocol; default the map's (:class:`~lightning_pgc.emulator.cells.Protocol`, its grid
            and tuning seeds) with evaluation seeds ``0 .. seeds - 1``.
        arms: the arms (ddp first); default :func:`candidate_arms`.
        workers: processes running arms at once.
        progress: a stream for the progress bar (``None``: none).

    Raises:
        ValueError: no ratio (neither measured nor given), a trace without a path, or ``seeds`` out of range.
    """
    if trace.path is None:
        raise ValueError("advise replays a trace file: read it with load_trace(path)")
    if not 2 <= seeds <= 20:
        raise ValueError(f"seeds must be between 2 and 20 (the exact sign-flip test), got {seeds}")
    source = "given" if ratio is not None else "measured"
    if ratio is None:
        ratio = trace.ratio
    if ratio is None:
        raise ValueError(
            "the trace has no all-reduce time (written by an older StepTimeTrace, or a 1-rank run): record it again, "
            "or pass --bound compute|comm or --ratio R"
        )
    if not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"compute-to-communication ratio must be a finite number > 0, got {ratio!r}")
    task = task or proxy_task(ratio)
    protocol = protocol or Protocol(eval_seeds=tuple(range(seeds)))
    if len(protocol.eval_seeds) != seeds:
        protocol = replace(protocol, eval_seeds=tuple(range(seeds)))
    comm = COMPUTE_S / ratio
    cell = MapCell(
        trace.n,
        TRACE_PREFIX + str(Path(trace.path).resolve()),
        "measured" if source == "measured" else "given",
        task=task,
        costs=(COMPUTE_S, 0.0, comm / 2, comm / 2),
    )
    candidates = list(arms) if arms is not None else candidate_arms(trace.n)
    if not candidates or candidates[0].strategy != "ddp":
        raise ValueError("the first arm must be ddp (every arm is compared with it)")
    items = [(cell, arm, protocol) for arm in candidates]
    started, cpu0 = time.time(), time.process_time()
    records: list[dict[str, Any]] = []
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for i, rec in enumerate(pool.imap(_run_one, items), 1):
                records.append(rec)
                if progress is not None:
                    _progress(i, len(items), rec["arm"]["label"], started, progress)
    else:
        for i, item in enumerate(items, 1):
            records.append(_run_one(item))
            if progress is not None:
                _progress(i, len(items), item[1].label, started, progress)
    summary = summarize(records, str(trace.path))["cells"][0]
    rows = [_row(a, r, task) for a, r in zip(summary["arms"], records)]
    for row in rows[1:]:  # time = versions x time per version: which of the two an arm changes
        base = rows[0]
        row["versions_vs_ddp"] = _div(row["versions_to_target"], base["versions_to_target"])
        row["per_version_vs_ddp"] = _div(row["s_per_version"], base["s_per_version"])
    others = [r for r in rows if r["strategy"] != "ddp"]
    comparisons = sum(1 for a in summary["arms"] for k in ("vs_ddp_early", "vs_ddp_late") if k in a)
    floor = p_floor(seeds, comparisons)
    candidate = min(others, key=lambda r: r["ratio"]) if others else None
    winner = summary["winner"]
    common = dict(
        seeds=seeds,
        task=task,
        rows=rows,
        candidate=candidate,
        p_floor=floor,
        seeds_needed=seeds_needed(comparisons) if comparisons else 2,
        alpha=ALPHA,
        comparisons=comparisons,
        n=trace.n,
        steps=trace.steps,
        block=block_length(trace.own),
        compute_s=trace.compute_s,
        allreduce_s=trace.allreduce_s,
        comm_ratio=ratio,
        ratio_source=source,
        cpu_s=sum(r.get("cpu_s") or 0.0 for r in records) + (time.process_time() - cpu0 if workers > 1 else 0.0),
        wall_s=time.time() - started,
    )
    if winner is not None:
        row = next(r for r in rows if r["arm"] == winner["arm"])
        return Advice(
            strategy=row["strategy"],
            s=row["s"],
            ratio=row["ratio"],
            low=row["low"],
            high=row["high"],
            p_holm=row["p_holm"],
            surely_faster=True,
            arm=row["arm"],
            lr=row["lr"],
            momentum=row["momentum"],
            strategy_kwargs=strategy_kwargs(row),
            **common,  # type: ignore[arg-type]
        )
    ddp = rows[0]
    return Advice(
        strategy="ddp",
        s=None,
        ratio=1.0,
        low=1.0,
        high=1.0,
        p_holm=None,
        surely_faster=False,
        arm="ddp",
        lr=ddp["lr"],
        momentum=ddp["momentum"],
        strategy_kwargs={},
        **common,  # type: ignore[arg-type]
    )


def _fmt_p(p: float) -> str:
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}"


def render(advice: Advice) -> str:
    """What ``lightning-pgc advise`` prints."""
    ar = "not recorded" if advice.allreduce_s is None else f"{advice.allreduce_s * 1e3:.2f} ms"
    lines = [
        f"Trace: {advice.n} ranks x {advice.steps} steps, typical own step {advice.compute_s * 1e3:.1f} ms, one "
        f"all-reduce of the gradient {ar}: compute/communication {advice.comm_ratio:.2g} ({advice.ratio_source}).",
        f"Emulated (not measured) on the {advice.task!r} proxy task: delays replayed in blocks of {advice.block} "
        f"steps, every arm tuned on the map's grid, {advice.seeds} evaluation seeds; time to the late target "
        "against ddp on the same seeds.",
    ]
    for r in advice.rows:
        if r["strategy"] == "ddp":
            extra = ""
        else:
            bound = " (a bound: some seeds missed)" if r["ratio_is_bound"] else ""
            parts = ""
            if r["versions_vs_ddp"] is not None and r["per_version_vs_ddp"] is not None:
                parts = f" (versions {r['versions_vs_ddp']:.2f}x, time per version {r['per_version_vs_ddp']:.2f}x)"
            extra = (
                f"  {r['ratio']:.2f}x ddp [{r['low']:.2f}, {r['high']:.2f}]{bound}{parts}, Holm p {_fmt_p(r['p_holm'])}"
            )
        lines.append(
            f"  {r['arm']:<42} lr {r['lr']:<4g} momentum {r['momentum']:<4g} reached {r['reached']}/{r['seeds']}{extra}"
        )
    floor = (
        f"the smallest Holm p {advice.seeds} seeds can reach over {advice.comparisons} comparisons is "
        f"{_fmt_p(advice.p_floor)}"
    )
    if advice.surely_faster:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in advice.strategy_kwargs.items())
        lines.append(
            f"Recommendation: strategy={advice.strategy!r} ({kwargs}), start at lr {advice.lr:g}, momentum "
            f"{advice.momentum:g}: time to target {advice.ratio:.2f}x ddp's, 95% interval [{advice.low:.2f}, "
            f"{advice.high:.2f}], Holm-corrected p {_fmt_p(advice.p_holm or 1.0)} ({floor})."
        )
    else:
        lines.append(f"Nothing is surely faster than ddp: keep ddp (no arm is faster with Holm p < {advice.alpha:g}).")
        if advice.candidate is not None:
            c = advice.candidate
            lines.append(
                f"  The best other arm, {c['arm']}, is at {c['ratio']:.2f}x ddp [{c['low']:.2f}, {c['high']:.2f}], "
                f"Holm p {_fmt_p(c['p_holm'])}."
            )
        if advice.p_floor >= advice.alpha:
            lines.append(
                f"  This test cannot reach significance: {floor}. Rerun with --seeds {advice.seeds_needed} or more."
            )
        else:
            lines.append(f"  ({floor}: the seeds could have shown a difference.)")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """``lightning-pgc advise TRACE [--json] [--seeds K] [--bound compute|comm | --ratio R] [--task T] [--workers W]``."""
    parser = argparse.ArgumentParser(
        prog="lightning-pgc advise", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", help="a trace.json written by lightning_pgc.step_trace.StepTimeTrace")
    over = parser.add_mutually_exclusive_group()
    over.add_argument(
        "--bound",
        choices=sorted(RATIOS),
        default=None,
        help="override the measured ratio: compute-bound (compute/communication = 4) or communication-bound (0.5)",
    )
    over.add_argument("--ratio", type=float, default=None, help="override the measured compute/communication ratio")
    parser.add_argument("--seeds", type=int, default=16, help="evaluation seeds per arm (2 to 20, default 16)")
    parser.add_argument("--task", default=None, help="proxy task (default: by the ratio, see PROXY_TASKS)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes (default 2)")
    parser.add_argument("--json", action="store_true", help="print the advice as one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(list(argv))
    ratio = args.ratio if args.ratio is not None else (RATIOS[args.bound] if args.bound else None)
    try:
        trace = load_trace(args.trace)
        advice = advise(
            trace,
            seeds=args.seeds,
            ratio=ratio,
            task=args.task,
            workers=args.workers,
            progress=None if args.quiet else sys.stderr,
        )
    except (OSError, ValueError) as err:
        print(f"lightning-pgc advise: {err}")
        return 2
    print(json.dumps(advice.to_json()) if args.json else render(advice))
    return 0
