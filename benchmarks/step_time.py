"""Throughput of pgc vs ddp on CPU ranks (gloo), measured side by side: step time, traffic, admission, memory.

    python benchmarks/step_time.py                 # the full comparison (about 25 min on 2 cores)
    python benchmarks/step_time.py --rounds 1 --quick
    python benchmarks/step_time.py --planes        # the collective data plane against ddp (docs/step_time_planes.*;
                                                   # 15 configurations x 3 rounds, about 30 min on 2 busy cores)

Each configuration is one ``Trainer.fit`` on ``n`` real processes launched by Lightning, MLP models on
synthetic data (nothing downloads). Configurations run interleaved (round 1: all of them, round 2: all again),
so machine noise hits all alike. A run's step time is throughput: the wall time from the moment every rank
finished step ``skip`` to the moment every rank finished the last step, divided by the steps in between
(a rank that lags and catches up in bursts cannot make it look fast). Each rank also reports its bytes sent and
received (the PGC runtime counts them), its peak RSS and, under pgc, the leader's per-rank admission table.

Writes docs/results/step_time.json, docs/results/step_time.md and docs/results/step_time.png (every number in the .md is in the .json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pgc_lab.experiments.timing_model import TimingMLP
from pgc_lab.experiments.launch import launch_script
from pgc_lab.experiments.report import write_report
from pgc_lab.experiments.stats import seconds_per_step

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"

MODELS = {  # name -> (input, hidden, classes, batch per rank)
    "tiny": (16, 32, 4, 32),
    "10m": (1024, 10000, 4, 32),
    "1m": (1024, 1000, 4, 32),
    "25m": (1024, 25000, 4, 32),
    "comm": None,  # the map's comm-bound model: DigitsCNN(hidden=8192), 4.3M parameters, batch 4 per rank
}

PLANE_MODELS = ("1m", "10m", "25m")  # no delay: pgc_cr against ddp at n = 4 and 8
PLANE_TARGET = 1.05  # every ratio of the collective data plane against ddp, side by side
SLOW_RATIO = "10m n=4, rank 2 sleeps: pgc / ddp (no delay)"
FREED_RATIO = "10m n=4, rank 2 sleeps: pgc / pgc (no delay)"  # what the sleeping rank's freed core gives


TARGETS = {  # the collective data plane against ddp, side by side
    "10m n=4: pgc / ddp": 1.05,
    "1m n=8: pgc_cr / ddp": 1.10,
    "comm n=4: pgc_cr / ddp": 1.05,
    "10m n=4, rank 2 sleeps: pgc / ddp (no delay)": 1.05,
}

TARGETS = {  # the step-cost targets the runtime is held to
    "tiny: pgc / ddp": 1.10,
    "10m: pgc / ddp": 1.15,
    "10m: pgc_slow / ddp_slow": 0.40,
    "10m: pgc_slow / ddp (no delay)": 1.30,
}


# ------------------------------------------------------------------------------------------------ one job
def run_worker(args: argparse.Namespace) -> None:
    """One fit (this process is rank 0 and Lightning re-launches the same command for the other ranks)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_pgc  # noqa: F401  (registers the strategy names)
    from lightning_pgc import PGCStrategy
    from lightning_pgc.callbacks.stragglers import StragglerInjector

    torch.set_num_threads(1)
    d_in, hidden, classes, batch = MODELS[args.model] or (64, 0, 10, 4)

    g = torch.Generator().manual_seed(0)
    samples = batch * args.devices * 8
    data = TensorDataset(torch.randn(samples, d_in, generator=g), torch.randint(0, classes, (samples,), generator=g))
    if args.model == "comm":
        from lightning_pgc.examples.digits import DigitsCNN

        data = TensorDataset(
            torch.randn(samples, 1, 8, 8, generator=g), torch.randint(0, classes, (samples,), generator=g)
        )

    class Clock(pl.Callback):
        """Wall time (shared clock) at the end of every step on this rank."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.threads = 0

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            self.times.append(time.time())
            if len(self.times) == 5:  # every thread of this rank (training, runtime, libraries), once warm
                import threading

                self.threads = threading.active_count()

    clock = Clock()
    callbacks: list[Any] = [clock]
    if args.slow_seconds > 0:
        callbacks.append(StragglerInjector(f"slowranks(ranks=[{args.slow_rank}], seconds={args.slow_seconds})"))
    if args.stall_seconds > 0:
        from lightning_pgc.callbacks.faults import Stall

        callbacks.append(Stall(rank=args.slow_rank, step=args.stall_step, seconds=args.stall_seconds))
    strategy: Any = "ddp"
    if args.strategy != "ddp":
        strategy = PGCStrategy(
            scheme=args.strategy,
            stragglers=0 if args.strategy == "dgd" else 1,
            diagnostics={"enabled": False},
            liveness={"timeout": 600.0},
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = DigitsCNN(hidden=8192, sync_train_loss=False) if args.model == "comm" else TimingMLP(d_in, hidden, classes)
    trainer.fit(module, DataLoader(data, batch_size=batch, shuffle=True))
    rank = trainer.global_rank
    st = trainer.strategy
    from pgc_lab.experiments.callbacks import parameter_checksum

    params = sum(p.numel() for p in trainer.lightning_module.parameters())
    result = {
        "rank": rank,
        "times": clock.times,
        "threads": clock.threads,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "buffers": getattr(st, "buffer_stats", {}),
        "rank_stats": st.rank_stats() if hasattr(st, "rank_stats") else [],
        "params": params,
        "skipped": getattr(st, "skipped_steps", 0),
        "checksum": parameter_checksum(trainer.lightning_module),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))


def launch(
    out: Path,
    strategy: str,
    model: str,
    devices: int,
    steps: int,
    slow: float,
    slow_rank: int,
    stall: tuple[int, float] = (0, 0.0),
) -> dict:
    """Run one configuration; ``stall``: (step, seconds) of a :class:`~lightning_pgc.callbacks.faults.Stall` on
    ``slow_rank``."""
    args = {
        "--strategy": strategy,
        "--model": model,
        "--devices": devices,
        "--steps": steps,
        "--slow-seconds": slow,
        "--slow-rank": slow_rank,
        "--stall-step": stall[0],
        "--stall-seconds": stall[1],
    }
    argv = [str(x) for item in args.items() for x in item]
    return {"ranks": launch_script(Path(__file__), argv, out, devices)}


def job_seconds_per_step(job: dict, skip: int) -> float:
    """Wall time from every rank past step ``skip`` to every rank done, per step."""
    return seconds_per_step([r["times"] for r in job["ranks"]], skip)


def traffic_ratio(job: dict, steps: int, devices: int) -> float:
    """Busiest rank's bytes sent + received per step over a ring all-reduce's ``4 (n-1)/n`` payloads."""
    payload = 4 * (job["ranks"][0]["params"] + 1)
    ring = 4 * (devices - 1) / devices * payload
    busiest = max(r["buffers"].get("bytes_sent", 0) + r["buffers"].get("bytes_received", 0) for r in job["ranks"])
    return busiest / steps / ring


def admission(job: dict, steps: int) -> list[float]:
    """Share of the ``steps`` versions whose admitted set contained each rank (the leader's table)."""
    return [s["admitted"] / steps for s in job["ranks"][0]["rank_stats"]]


# ------------------------------------------------------------------------------------------------ the table
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "outputs" / "step_time"))
    p.add_argument("--strategy", default="pgc_cr")
    p.add_argument("--model", default="tiny", choices=list(MODELS))
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--slow-seconds", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=2)
    p.add_argument("--stall-step", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stall-seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--planes", action="store_true", help="the collective data plane against ddp")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer steps (a smoke run; not for docs)")
    p.add_argument(
        "--from-json", action="store_true", help="only rewrite the .md and .png from docs/results/step_time.json"
    )
    args = p.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.planes:
        planes(args)
        return
    if args.from_json:
        result = json.loads((DOCS / "step_time.json").read_text())
        write_report(DOCS, "step_time", result, page=render_markdown(result), figures={"step_time.png": plot(result)})
        return

    from rich.console import Console
    from rich.progress import Progress

    q = args.quick
    tiny_steps, big_steps, slow_steps, scale_steps = (40, 20, 10, 10) if q else (200, 60, 20, 20)
    slow = 0.5
    configs = {  # name -> (strategy, model, devices, steps, slow seconds)
        "tiny/ddp": ("ddp", "tiny", 4, tiny_steps, 0.0),
        "tiny/pgc": ("pgc_cr", "tiny", 4, tiny_steps, 0.0),
        "10m/ddp": ("ddp", "10m", 4, big_steps, 0.0),
        "10m/pgc": ("pgc_cr", "10m", 4, big_steps, 0.0),
        "10m/dgd": ("dgd", "10m", 4, big_steps, 0.0),
        "10m/ddp_slow": ("ddp", "10m", 4, slow_steps, slow),
        "10m/pgc_slow": ("pgc_cr", "10m", 4, big_steps, slow),
    }
    scaling = {f"1m/{s}/n{n}": (s, "1m", n, scale_steps, 0.0) for n in (2, 4, 8) for s in ("ddp", "pgc_cr")}
    out = Path(args.out)
    runs: dict[str, list[dict]] = {k: [] for k in [*configs, *scaling]}
    console = Console()
    started = time.time()
    with Progress(console=console) as progress:
        task = progress.add_task("runs", total=args.rounds * len(configs) + len(scaling))
        for r in range(args.rounds):
            for name, (strategy, model, n, steps, delay) in configs.items():
                progress.update(task, description=f"round {r + 1}: {name}")
                job = launch(
                    out / f"round{r}" / name.replace("/", "_"), strategy, model, n, steps, delay, args.slow_rank
                )
                runs[name].append(job)
                progress.advance(task)
        for name, (strategy, model, n, steps, delay) in scaling.items():
            progress.update(task, description=name)
            runs[name].append(launch(out / name.replace("/", "_"), strategy, model, n, steps, delay, args.slow_rank))
            progress.advance(task)

    skip = args.skip
    step_s = {k: [job_seconds_per_step(j, skip) for j in v] for k, v in runs.items()}

    # Ratios per round (side by side), then the median over rounds.
    def ratio(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(step_s[a], step_s[b])]

    ratios = {
        "tiny: pgc / ddp": ratio("tiny/pgc", "tiny/ddp"),
        "10m: pgc / ddp": ratio("10m/pgc", "10m/ddp"),
        "10m: dgd / ddp": ratio("10m/dgd", "10m/ddp"),
        "10m: pgc_slow / ddp_slow": ratio("10m/pgc_slow", "10m/ddp_slow"),
        "10m: pgc_slow / ddp (no delay)": ratio("10m/pgc_slow", "10m/ddp"),
    }
    every = {**configs, **scaling}
    admit = {k: [min(admission(j, every[k][3])) for j in runs[k]] for k in ("tiny/pgc", "10m/pgc")}
    traffic = {
        k: [traffic_ratio(j, every[k][3], every[k][2]) for j in v] for k, v in runs.items() if every[k][0] != "ddp"
    }
    rss = {k: [max(r["peak_rss_mb"] for r in j["ranks"]) for j in v] for k, v in runs.items()}
    result = {
        "plane": "collective",
        "command": "python benchmarks/step_time.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores, gloo, {args.rounds} interleaved rounds",
        "minutes": (time.time() - started) / 60,
        "skip": skip,
        "slow": {"rank": args.slow_rank, "seconds": slow},
        "configs": {
            k: {"strategy": v[0], "model": v[1], "devices": v[2], "steps": v[3], "slow_s": v[4]}
            for k, v in every.items()
        },
        "params": {m: runs[f"{m}/ddp"][0]["ranks"][0]["params"] for m in ("tiny", "10m")}
        | {"1m": runs["1m/ddp/n2"][0]["ranks"][0]["params"]},
        "seconds_per_step": step_s,
        "ratios": {
            k: {
                "per_round": v,
                "median": statistics.median(v),
                "target_max": TARGETS.get(k),
                "met": None if k not in TARGETS else statistics.median(v) <= TARGETS[k],
            }
            for k, v in ratios.items()
        },
        "min_admission_rate": {
            k: {"per_round": v, "median": statistics.median(v), "target_min": 0.60} for k, v in admit.items()
        },
        "admission_rates": {
            k: [admission(j, every[k][3]) for j in runs[k]] for k in ("tiny/pgc", "10m/pgc", "10m/pgc_slow")
        },
        "traffic_over_ring": traffic,
        "peak_rss_mb": rss,
        "rank_stats": {k: runs[k][0]["ranks"][0]["rank_stats"] for k in runs if every[k][0] != "ddp"},
        "buffers": {k: [r["buffers"] for r in runs[k][0]["ranks"]] for k in runs if every[k][0] != "ddp"},
    }
    written = write_report(
        DOCS, "step_time", result, page=render_markdown(result), figures={"step_time.png": plot(result)}
    )
    for k, v in result["ratios"].items():
        console.print(
            f"{k}: {v['median']:.3f} (per round {', '.join(f'{x:.3f}' for x in v['per_round'])})"
            + ("" if v["target_max"] is None else f", target <= {v['target_max']}")
        )
    for path in written:
        console.print(f"wrote {path}")


def plane_configs(steps: int, slow: float) -> dict[str, tuple[str, str, int, int, float]]:
    """name -> (strategy, model, devices, steps, slow seconds), in the order of a round: each ddp run next to its
    pgc run."""
    configs: dict[str, tuple[str, str, int, int, float]] = {}
    for model in PLANE_MODELS:
        for n in (4, 8):
            configs[f"{model}/ddp/n{n}"] = ("ddp", model, n, steps, 0.0)
            configs[f"{model}/pgc_cr/n{n}"] = ("pgc_cr", model, n, steps, 0.0)
    configs["comm/ddp/n4"] = ("ddp", "comm", 4, steps, 0.0)
    configs["comm/pgc_cr/n4"] = ("pgc_cr", "comm", 4, steps, 0.0)
    configs["10m/pgc_slow/n4"] = ("pgc_cr", "10m", 4, steps, slow)
    return configs


def planes(args: argparse.Namespace) -> None:
    """The collective data plane against ddp: :func:`plane_configs`, interleaved over rounds (odd rounds run each
    pair in the reverse order, so a drift in the machine's load does not favour one side)."""
    steps = 10 if args.quick else 30
    slow = 0.5
    configs = plane_configs(steps, slow)
    out = Path(args.out) / "planes"
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    load: dict[str, list[float]] = {k: [] for k in configs}
    started = time.time()
    for r in range(args.rounds):
        names = list(configs)
        if r % 2:
            names = [names[i ^ 1] if i < len(names) - 1 else names[i] for i in range(len(names))]
        for name in names:
            strategy, model, n, k, delay = configs[name]
            load[name].append(os.getloadavg()[0])
            print(f"round {r + 1}: {name} (load {load[name][-1]:.1f})", flush=True)
            runs[name].append(
                launch(out / f"round{r}" / name.replace("/", "_"), strategy, model, n, k, delay, args.slow_rank)
            )
    skip = args.skip
    step_s = {k: [job_seconds_per_step(j, skip) for j in v] for k, v in runs.items()}

    def ratio(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(step_s[a], step_s[b])]

    ratios = {
        f"{m} n={n}: pgc_cr / ddp": ratio(f"{m}/pgc_cr/n{n}", f"{m}/ddp/n{n}") for m in PLANE_MODELS for n in (4, 8)
    }
    ratios["comm n=4: pgc_cr / ddp"] = ratio("comm/pgc_cr/n4", "comm/ddp/n4")
    ratios[SLOW_RATIO] = ratio("10m/pgc_slow/n4", "10m/ddp/n4")
    ratios[FREED_RATIO] = ratio("10m/pgc_slow/n4", "10m/pgc_cr/n4")
    pgc = [k for k, v in configs.items() if v[0] != "ddp"]
    result = {
        "command": "python benchmarks/step_time.py " + " ".join(sys.argv[1:]),
        "plane": "collective",
        "machine": f"{os.cpu_count()} CPU cores shared with other jobs, gloo, {args.rounds} interleaved rounds",
        "minutes": (time.time() - started) / 60,
        "skip": skip,
        "slow": {"rank": args.slow_rank, "seconds": slow},
        "configs": {
            k: {"strategy": v[0], "model": v[1], "devices": v[2], "steps": v[3], "slow_s": v[4]}
            for k, v in configs.items()
        },
        "params": {m: runs[f"{m}/ddp/n4"][0]["ranks"][0]["params"] for m in (*PLANE_MODELS, "comm")},
        "seconds_per_step": step_s,
        "load": load,
        "ratios": {
            k: {
                "per_round": v,
                "median": statistics.median(v),
                "target_max": None if k == FREED_RATIO else PLANE_TARGET,
                "met": None if k == FREED_RATIO else max(v) <= PLANE_TARGET,
            }
            for k, v in ratios.items()
        },
        "threads_per_rank": {
            k: [sorted({r["threads"] for r in j["ranks"]}) for j in runs[k]]
            for k in ("1m/pgc_cr/n4", "1m/pgc_cr/n8", "1m/ddp/n8")
        },
        "traffic_over_ring": {k: [traffic_ratio(j, configs[k][3], configs[k][2]) for j in runs[k]] for k in pgc},
        "control_bytes_per_step": {
            k: [max(r["buffers"].get("control_bytes_sent", 0) for r in j["ranks"]) / configs[k][3] for j in runs[k]]
            for k in pgc
        },
        "peak_rss_mb": {k: [max(r["peak_rss_mb"] for r in j["ranks"]) for j in v] for k, v in runs.items()},
    }
    write_report(DOCS, "step_time_planes", result, page=render_planes_markdown(result))
    for k, v in result["ratios"].items():
        print(f"{k}: {v['median']:.3f} (per round {_fmt_list(v['per_round'])}), target <= {v['target_max']}")


def _plane_sentence(res: dict) -> str:
    """Which data plane measured a result (results without a ``plane`` key predate the collective plane)."""
    if res.get("plane") == "collective":
        return "These rows measure the collective data plane: one all-reduce per step on a gloo data group."
    return (
        "These rows were measured on the earlier data plane (point-to-point shards, one owner per shard), which "
        "the collective data plane replaced; the collective plane against ddp: "
        "[step_time_planes.md](step_time_planes.md). `python benchmarks/step_time.py` measures the collective "
        "plane."
    )


def render_planes_markdown(res: dict) -> str:
    slow = res["slow"]
    md = [
        "# Step time: the collective data plane against ddp",
        "",
        f"Produced by `{res['command'].strip()}` ({res['machine']}; {res['minutes']:.0f} min); every number below "
        "is in docs/results/step_time_planes.json. The collective data plane: one all-reduce per step on a gloo data "
        "group. Step time is throughput (wall time from every rank past step "
        f"{res['skip']} to every rank done, per step). The machine is shared with other jobs, so absolute times are "
        "noisy: compare the ratios, each measured within one round (each pgc run next to its ddp run, the pair's "
        "order reversed in every other round). A target is met only if every round meets it; the load average "
        "(1 min) of the machine before each run is in the last table.",
        "",
        f"Models: MLP 1024-H-4 with H = 1000 (1m, {res['params']['1m']} parameters), 10000 (10m, "
        f"{res['params']['10m']}) and 25000 (25m, {res['params']['25m']}), batch 32 per rank; comm: the map's "
        f"comm-bound model, DigitsCNN(hidden=8192) ({res['params']['comm']} parameters) at batch 4 per rank. "
        f"`pgc_slow`: rank {slow['rank']} sleeps {slow['seconds']} s after every backward it runs.",
        "",
        "| ratio (same round) | median | per round | target | met in every round |",
        "|---|---:|---|---:|---|",
    ]
    for k, v in res["ratios"].items():
        target = "-" if v["target_max"] is None else f"<= {v['target_max']}"
        met = "-" if v["target_max"] is None else _met(v["per_round"], v["target_max"])
        md.append(f"| {k} | {v['median']:.3f} | {_fmt_list(v['per_round'])} | {target} | {met} |")
    if FREED_RATIO in res["ratios"]:
        freed = res["ratios"][FREED_RATIO]["median"]
        md += [
            "",
            f"A sleeping rank frees a core: with 4 ranks on {res['machine'].split()[0]} cores, the 3 ranks that "
            "compute while rank 2 sleeps share the cores among 3 instead of 4, so a step costs them down to 3/4 of "
            f"its CPU time per core; pgc with the sleeping rank against pgc without delay measured {freed:.3f} "
            "(median). The row against ddp without delay is flattered by that much: on a machine with a core per "
            "rank it would read that row's ratio divided by this one.",
        ]
    md += ["", "| configuration | seconds per step, per round |", "|---|---|"]
    md += [f"| {k} | {_fmt_list(v, 4)} |" for k, v in res["seconds_per_step"].items()]
    if "load" in res:
        md += ["", "| configuration | load average before the run, per round |", "|---|---|"]
        md += [f"| {k} | {_fmt_list(v, 1)} |" for k, v in res["load"].items()]
    md += [
        "",
        "Threads per rank (every thread of the process at step 5, training and library threads included; "
        "the distinct counts over the ranks, per round):",
        "",
        "| run | per round |",
        "|---|---|",
    ]
    md += [f"| {k} | {'; '.join(str(x) for x in v)} |" for k, v in res["threads_per_rank"].items()]
    md += [
        "",
        "Traffic: the busiest rank's bytes sent + received per step over a ring all-reduce's `4 (n-1)/n` "
        "payloads. The all-reduce's bytes are gloo's ring (`2 (m-1)/m` payloads each way, counted by the runtime, "
        "not measured on the wire); the control messages are counted as they are pushed and popped:",
        "",
        "| run | ratio per round | control bytes per step, busiest rank |",
        "|---|---|---|",
    ]
    md += [
        f"| {k} | {_fmt_list(v, 3)} | {_fmt_list(res['control_bytes_per_step'][k], 0)} |"
        for k, v in res["traffic_over_ring"].items()
    ]
    md += ["", "Peak RSS, largest rank (MB):", "", "| run | per round |", "|---|---|"]
    md += [f"| {k} | {_fmt_list(v, 0)} |" for k, v in res["peak_rss_mb"].items()]
    return "\n".join(md) + "\n"


def _met(per_round: list[float], target_max: float) -> str:
    """Met only if every round meets the target; rounds that disagree establish nothing."""
    met = [value <= target_max for value in per_round]
    return "yes" if all(met) else "**no**" if not any(met) else "unclear (the rounds disagree)"


def _fmt_list(values: list[float], digits: int = 3) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def render_markdown(res: dict) -> str:
    md = [
        "# Step time: pgc vs ddp",
        "",
        f"Produced by `{res['command'].strip()}` ({res['machine']}; {res['minutes']:.0f} min); every number "
        "below is in docs/results/step_time.json. "
        "Step time is throughput: wall time from every rank past step "
        f"{res['skip']} to every rank done, per step. MLPs on synthetic data, SGD, batch 32 per rank, "
        f"`diagnostics={{'enabled': False}}`. `slow`: rank {res['slow']['rank']} sleeps {res['slow']['seconds']} s "
        "after every backward it runs. 4 ranks share 2 cores, so a sleeping rank frees a core for the others: that "
        "flatters every `*_slow` row of a straggler-tolerant strategy, and `pgc_slow / ddp (no delay)` most.",
        "",
        _plane_sentence(res),
        "",
        f"Models: tiny 16-32-4 ({res['params']['tiny']} parameters), 10m 1024-10000-4 ({res['params']['10m']}), "
        f"1m 1024-1000-4 ({res['params']['1m']}).",
        "",
        "| configuration | seconds per step, per round |",
        "|---|---|",
    ]
    md += [f"| {k} | {_fmt_list(v, 4)} |" for k, v in res["seconds_per_step"].items()]
    md += ["", "| ratio (same round) | median | per round | target | met |", "|---|---:|---|---:|---|"]
    for k, v in res["ratios"].items():
        target = "" if v["target_max"] is None else f"<= {v['target_max']}"
        met = "" if v["met"] is None else ("yes" if v["met"] else "**no**")
        md.append(f"| {k} | {v['median']:.3f} | {_fmt_list(v['per_round'])} | {target} | {met} |")
    md += [
        "",
        "Admission rate of each rank (share of versions whose admitted set contained it; s = 1, n = 4, so "
        "0.75 is the fair share), first round:",
        "",
        "| run | rank 0 | rank 1 | rank 2 | rank 3 |",
        "|---|---:|---:|---:|---:|",
    ]
    for k, v in res["admission_rates"].items():
        md.append(f"| {k} | " + " | ".join(f"{x:.2f}" for x in v[0]) + " |")
    md += ["", "| least-admitted rank, no delay | median | per round | target |", "|---|---:|---|---:|"]
    for k, v in res["min_admission_rate"].items():
        md.append(f"| {k} | {v['median']:.2f} | {_fmt_list(v['per_round'], 2)} | >= {v['target_min']} |")
    md += [
        "",
        "Traffic: the busiest rank's bytes sent + received per step, over a ring all-reduce's "
        "`4 (n-1)/n` x payload"
        + (
            ":"
            if res.get("plane") == "collective"
            else " (payloads below 256 KiB took one shard on that plane: rank 0 then carried `2 (n-1)` payloads, "
            "which is what the tiny row shows):"
        ),
        "",
        "| run | ratio per round |",
        "|---|---|",
    ]
    md += [f"| {k} | {_fmt_list(v, 2)} |" for k, v in res["traffic_over_ring"].items()]
    md += ["", "Peak RSS, largest rank (MB):", "", "| run | per round |", "|---|---|"]
    md += [f"| {k} | {_fmt_list(v, 0)} |" for k, v in res["peak_rss_mb"].items()]
    md += ["", "![step time](step_time.png)", ""]
    return "\n".join(md)


def plot(res: dict) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [k for k in res["seconds_per_step"] if not k.startswith("1m/")]
    axes[0].bar(
        names,
        [1000 * statistics.median(res["seconds_per_step"][k]) for k in names],
        color=["C1" if "pgc" in k else "C0" for k in names],
    )
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms per step (median over rounds)")
    axes[0].tick_params(axis="x", rotation=45)
    ns = [2, 4, 8]
    for s, color in (("ddp", "C0"), ("pgc_cr", "C1")):
        axes[1].plot(
            ns,
            [1000 * statistics.median(res["seconds_per_step"][f"1m/{s}/n{n}"]) for n in ns],
            "o-",
            color=color,
            label=s,
        )
    axes[1].set_xlabel("ranks (on 2 cores)")
    axes[1].set_ylabel("ms per step, 1m model")
    axes[1].legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
