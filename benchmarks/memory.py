"""Peak resident memory of every rank under ddp and under each scheme, diagnostics on and off, on CPU ranks.

    python benchmarks/memory.py                                   # 10 M and 100 M parameters (about 18 min on 2 cores)
    python benchmarks/memory.py --sizes 10 --schemes pgc_cr       # one size, one scheme (and ddp)
    python benchmarks/memory.py --sizes 100 --schemes pgc_cr gc_cr --merge   # add 100 M rows to the results file
    python benchmarks/memory.py --from-json                       # only rewrite docs/results/memory.md
    python benchmarks/memory.py --resume                          # go on after an interruption (OUT/rows.jsonl)

A run whose ranks are still going after ``--run-timeout`` seconds (900) is killed, every rank, and kept as a row that
says so; so is a run that fails.

Each run is one ``Trainer.fit`` of an MLP ``1024-H-4`` (H = 10 000: 10 M parameters; H = 100 000: 100 M) on 4 CPU
ranks (gloo), batch 32 per rank, plain SGD, ``--steps`` steps with the probe diagnostics every
``--diagnostics-every`` steps (so that ``L_hat`` is measured at least twice). Each rank reports its peak resident
set size (``ru_maxrss``: the high-water mark of the process, transient copies included). Runs are sequential (one at
a time, to bound the machine's memory).

The goal per rank: ddp's peak on that rank plus one gradient (4 bytes per parameter) per partition the rank
caches (the partitions it holds: ``c`` for the coded schemes and ``bounded``, 1 for ``ignore`` and ``dgd``). The Tandon-coded schemes
(``gc_cr``, ``pgc_cr_naive``) code in float64 by design (their decoding weights need it): their code and the
all-reduce's buffer are twice a float32 gradient each, which the table shows.

Writes docs/results/memory.json and docs/results/memory.md (every number in the page is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"
RESULTS = DOCS

SIZES = {10: 10_000, 100: 100_000}  # millions of parameters -> hidden width of the 1024-H-4 MLP
SCHEMES = ["pgc_cr", "pgc_fr", "gc_cr", "gc_fr", "pgc_cr_naive", "ignore", "dgd", "bounded"]
RANKS = 4
FLOAT64_CODES = {"gc_cr", "pgc_cr_naive"}  # the Tandon-coded schemes: a code is two float32 gradients' bytes
BATCH = 32


def run_worker(args: argparse.Namespace) -> None:
    """One fit (rank 0; Lightning re-launches the command for the other ranks)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_pgc  # noqa: F401  (registers the strategy names)
    from lightning_pgc import PGCStrategy

    torch.set_num_threads(1)
    hidden = SIZES[args.size]

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(1024, hidden), nn.ReLU(), nn.Linear(hidden, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    samples = BATCH * RANKS * 4
    data = TensorDataset(torch.randn(samples, 1024, generator=g), torch.randint(0, 4, (samples,), generator=g))
    strategy: Any = "ddp"
    if args.strategy != "ddp":
        strategy = PGCStrategy(
            scheme=args.strategy,
            stragglers=0 if args.strategy == "dgd" else 1,
            diagnostics={"enabled": bool(args.diagnostics), "every_n_steps": args.diagnostics_every},
            liveness={"timeout": 600.0},
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = MLP()
    trainer.fit(module, DataLoader(data, batch_size=BATCH, shuffle=True))
    st: Any = trainer.strategy
    scheme = getattr(st, "scheme", None)
    result = {
        "rank": trainer.global_rank,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params": sum(p.numel() for p in module.parameters()),
        "cached": len(scheme.partitions(trainer.global_rank)) if scheme is not None else 0,
        "buffers": getattr(st, "buffer_stats", {}),
    }
    Path(args.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def runs(schemes: list[str]) -> list[tuple[str, bool]]:
    """(strategy, diagnostics) of every run at one size: ddp first."""
    return [("ddp", False)] + [(s, d) for s in schemes for d in (True, False)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "outputs" / "memory"))
    p.add_argument("--strategy", default="pgc_cr")
    p.add_argument("--size", type=int, default=10, choices=list(SIZES))
    p.add_argument("--diagnostics", type=int, default=1)
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--schemes", nargs="+", default=SCHEMES, choices=SCHEMES)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--diagnostics-every", type=int, default=4)
    p.add_argument("--merge", action="store_true", help="keep the results file's rows of the sizes and schemes not run")
    p.add_argument("--from-json", action="store_true", help="only rewrite docs/results/memory.md from its results file")
    p.add_argument("--resume", action="store_true", help="keep the runs OUT/rows.jsonl holds from an interrupted run")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds before a run's ranks are killed")
    args = p.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.from_json:
        (DOCS / "memory.md").write_text(render(json.loads((RESULTS / "memory.json").read_text())))
        return
    from pgc_lab.experiments.launch import launch_script

    started = time.time()
    scratch = Path(args.out) / "rows.jsonl"  # every finished run, as it finishes (--resume reads it)
    done = {}
    if args.resume and scratch.exists():
        for line in scratch.read_text().splitlines():
            row = json.loads(line)
            done[(row["size_m"], row["strategy"], row["diagnostics"])] = row
    elif scratch.exists():
        scratch.unlink()
    rows = []
    for size in args.sizes:
        for strategy, diagnostics in runs(args.schemes):
            if (size, strategy, diagnostics) in done:
                rows.append(done[(size, strategy, diagnostics)])
                continue
            name = f"{size}m/{strategy}/{'diag' if diagnostics else 'nodiag'}"
            print(name, flush=True)
            argv = ["--strategy", strategy, "--size", str(size), "--diagnostics", str(int(diagnostics))]
            argv += ["--steps", str(args.steps), "--diagnostics-every", str(args.diagnostics_every)]
            row: dict[str, Any] = {"size_m": size, "strategy": strategy, "diagnostics": diagnostics}
            try:
                ranks = launch_script(
                    Path(__file__), argv, Path(args.out) / name.replace("/", "_"), RANKS, timeout=args.run_timeout
                )
            except (RuntimeError, TimeoutError) as exc:  # one run's failure is a result, not the end of the others
                row["failed"] = str(exc).splitlines()[0]
                print(f"  {row['failed']}", flush=True)
            else:
                row["params"] = ranks[0]["params"]
                row["cached"] = [r["cached"] for r in ranks]
                row["peak_rss_mb"] = [r["peak_rss_mb"] for r in ranks]
                row["buffers"] = [r["buffers"] for r in ranks]  # the runtime's buffer_stats of every rank
            row["load"] = os.getloadavg()[0]
            rows.append(row)
            with open(scratch, "a") as f:
                f.write(json.dumps(row) + "\n")
    commands = ["python benchmarks/memory.py " + " ".join(sys.argv[1:])]
    minutes = (time.time() - started) / 60
    if args.merge and (RESULTS / "memory.json").exists():
        old = json.loads((RESULTS / "memory.json").read_text())
        ran = {(r["size_m"], r["strategy"]) for r in rows}
        rows = [r for r in old["runs"] if (r["size_m"], r["strategy"]) not in ran] + rows
        commands = old.get("commands", [old.get("command", "")]) + commands
        minutes += old["minutes"]
    result = {
        "commands": commands,
        "machine": f"{os.cpu_count()} CPU cores shared with other jobs, gloo, {RANKS} ranks",
        "minutes": minutes,
        "steps": args.steps,
        "diagnostics_every": args.diagnostics_every,
        "runs": add_goals(sorted(rows, key=_order)),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps(result, indent=1) + "\n")
    (DOCS / "memory.md").write_text(render(result))


def _order(row: dict) -> tuple[int, int, bool]:
    """Rows by size, then ddp and the schemes in :data:`SCHEMES` order, diagnostics on first."""
    return row["size_m"], (["ddp", *SCHEMES]).index(row["strategy"]), not row["diagnostics"]


def add_goals(rows: list[dict]) -> list[dict]:
    """Each run's goal per rank (ddp's peak on that rank plus one gradient per cached partition) and its excess
    over it, in MB and in gradients (4 bytes per parameter)."""
    ddp = {r["size_m"]: r["peak_rss_mb"] for r in rows if r["strategy"] == "ddp" and "failed" not in r}
    for r in rows:
        if "failed" in r or r["size_m"] not in ddp:
            continue
        grad_mb = 4 * r["params"] / 2**20
        base = ddp[r["size_m"]]
        goal = [b + (0 if r["strategy"] == "ddp" else k * grad_mb) for b, k in zip(base, r["cached"])]
        r["gradient_mb"] = grad_mb
        r["goal_mb"] = goal
        r["over_goal_gradients"] = [(m - g) / grad_mb for m, g in zip(r["peak_rss_mb"], goal)]
        r["over_ddp_gradients"] = [(m - b) / grad_mb for m, b in zip(r["peak_rss_mb"], base)]
        if r.get("buffers") and all(r["buffers"]):  # the excess less the buffers a rank held for running behind
            code = 2 if r["strategy"] in FLOAT64_CODES else 1
            fewest = [min(b.get(k, 0) for b in r["buffers"]) for k in ("aggregate_buffers", "code_messages")]
            lag = [
                b.get("aggregate_buffers", 0) - fewest[0] + code * (b.get("code_messages", 0) - fewest[1])
                for b in r["buffers"]
            ]
            r["lag_buffer_gradients"] = lag
            r["over_goal_less_lag_gradients"] = [x - k for x, k in zip(r["over_goal_gradients"], lag)]
    return rows


def _buffers(row: dict) -> str:
    """The aggregate and code buffers the runtime allocated on rank 0, then each distinct pair on the others."""
    stats = row.get("buffers")
    if not stats or not stats[0]:
        return "-"

    def pair(b: dict) -> tuple[int, int]:
        return b.get("aggregate_buffers", 0), b.get("code_messages", 0)

    others = sorted({pair(b) for b in stats[1:]})
    return f"{pair(stats[0])[0]}, {pair(stats[0])[1]} / " + "; ".join(f"{a}, {c}" for a, c in others)


def render(res: dict) -> str:
    md = [
        "# Memory: peak resident size of every rank, ddp and each scheme",
        "",
        f"Produced by {' and '.join(f'`{c.strip()}`' for c in res['commands'])} ({res['machine']}; "
        f"{res['minutes']:.0f} min); every number below is "
        "in [memory.json](memory.json). Each run is one fit of an MLP 1024-H-4 on 4 CPU ranks, "
        f"{res['steps']} steps of plain SGD, the probe diagnostics (when on) every {res['diagnostics_every']} steps. "
        "Peak RSS is the process's high-water mark (transient copies included), in MB; rank 0 is the leader. "
        "The goal of a rank: ddp's peak on that rank plus one gradient per partition it caches. `over goal` and "
        "`over ddp` count gradients (4 bytes per parameter) above the goal and above ddp, on the rank where the "
        "excess is largest.",
        "",
        "The Tandon-coded schemes (`gc_cr`, `pgc_cr_naive`) code in float64 (their decoding weights need it): "
        "their code and the all-reduce's buffer hold two float32 gradients' worth of bytes each, above the goal "
        "by design. CPU only: no device memory was measured (the CUDA path keeps the same buffers on the device).",
        "",
        "A rank that runs behind the others holds what they already produced for it: the aggregate of a version "
        "they closed while it was still computing, and under the pipelined schemes the code it keeps for the next "
        "version, each one buffer of a gradient's size (`aggregate, code buffers`: how many the runtime allocated "
        "on each rank). With the diagnostics on, the leader is that rank: its "
        "probe is one more forward and backward on a fixed batch every few steps, which the others do not wait "
        "for. Where rank 0 has more buffers than the others, that is the part of its excess the diagnostics cause "
        "by slowing it, not memory they keep (their own state is a sample of coordinates). `over goal, less lag "
        "buffers` takes out of every rank's excess the buffers it held beyond the fewest any rank held in that run "
        "(a Tandon code counts two gradients). A rank further behind than `max_lag` versions is detached and rejoins by state transfer, "
        "which bounds them. `bounded` keeps its last codes on every rank by design (a successor leader rebuilds "
        "its table from them), which is its excess with the diagnostics off.",
        "",
    ]
    for size in sorted({r["size_m"] for r in res["runs"]}):
        rows = [r for r in res["runs"] if r["size_m"] == size]
        measured = [r for r in rows if "gradient_mb" in r]
        md += [
            f"**{size} M parameters** ({measured[0]['params']} parameters, one float32 gradient "
            f"{measured[0]['gradient_mb']:.0f} MB):",
            "",
            "| run | diagnostics | rank 0 | rank 1 | rank 2 | rank 3 | cached | over goal | over ddp | aggregate, code buffers (rank 0 / others) | over goal, less lag buffers |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        for r in rows:
            if "gradient_mb" not in r:
                md.append(
                    f"| {r['strategy']} | {'on' if r['diagnostics'] else 'off'} | {r['failed']} | | | | | | | | |"
                )
                continue
            rss = " | ".join(f"{m:.0f}" for m in r["peak_rss_mb"])
            md.append(
                f"| {r['strategy']} | {'on' if r['diagnostics'] else 'off'} | {rss} | {max(r['cached'])} | "
                f"{max(r['over_goal_gradients']):.2f} | {max(r['over_ddp_gradients']):.2f} | {_buffers(r)} | "
                + (f"{max(r['over_goal_less_lag_gradients']):.2f} |" if "over_goal_less_lag_gradients" in r else "- |")
            )
        md.append("")
    return "\n".join(md)


if __name__ == "__main__":
    main()
