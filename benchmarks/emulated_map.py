"""The emulated crossover map: which strategy wins, with which s, by n, straggler pattern, compute or
communication bound, and data condition (emulated: real leaders and schemes on the simulated clock, real training).

    python benchmarks/emulated_map.py --round reduced   # about 30-40 min of one core (lr up to 0.8)
    python benchmarks/emulated_map.py --round full      # the whole map (its cost: docs/emulator.md)
    python benchmarks/emulated_map.py --round reduced --summarize-only

Each round appends to ONE JSON Lines file, docs/emulated_map_<round>.jsonl (resumable: rerun the same command), and
is summarised into docs/emulated_map_<round>.json (per cell: each arm's restricted mean and median time to both
targets, the ratio against ddp with its interval, Holm-corrected tests, the winner if any).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_pgc.emulator.cells import Cell, Protocol  # noqa: E402
from lightning_pgc.emulator.cluster import PATTERNS  # noqa: E402
from lightning_pgc.emulator.crossmap import plan_items, read_records, run_round  # noqa: E402
from lightning_pgc.emulator.summary import summarize  # noqa: E402

DOCS = ROOT / "docs"
#: The three delay models of the real 4-rank map (docs/grid_map.json), for the cells that mirror it.
REAL_DELAYS = {
    "stalls": ("lognormal + stalls", "lognormal(median=0.02, sigma=0.5) + spikes(prob=0.002, low=1.0, high=3.0)"),
    "slowrank": ("slow node", "lognormal(median=0.02, sigma=0.5) + slowranks(ranks=[{last}], seconds=0.1)"),
    "exp": ("exponential", "exponential(mean=0.1)"),
}


def mirror_costs() -> tuple[float, float, float, float]:
    """The simulated clock's costs fitted to real 4-rank runs (docs/sim_validation.json), with the real map's
    25 ms of simulated compute per gradient in place of the fit's own."""
    fit = json.loads((DOCS / "sim_validation.json").read_text())
    c = fit["costs"]
    return (c["compute_s"] - fit["compute_per_eval"] + 0.025, c["overhead_s"], c["code_s"], c["aggregate_s"])


#: our arm label -> the real map's arm key (its ``dgd`` is our ddp: the same mathematics)
REAL_ARMS = {
    "ddp": "dgd",
    "ignore_stragglers c=2": "ignore_c2",
    "gc_fr c=2": "gc_fr_c2",
    "gc_cr c=2": "gc_cr_c2",
    "pgc_fr c=2": "pgc_fr_c2",
    "pgc_cr c=2": "pgc_cr_c2",
}


def mirror_cells() -> list[Cell]:
    """The real map's three sleep-cost cells at n = 4: its delays, model, batch, and each arm's chosen lr and
    momentum (no tuning here), on the simulated clock fitted to real runs."""
    costs = mirror_costs()
    chosen = json.loads((DOCS / "grid_map.json").read_text())["chosen_setting"]
    fixed = tuple(
        (ours, chosen[f"sleep/{theirs}"]["lr"], chosen[f"sleep/{theirs}"]["momentum"])
        for ours, theirs in REAL_ARMS.items()
    )
    return [
        Cell(4, f"real map: {name}", "compute", task="cnn", delay=spec, costs=costs, cs=(2,), fixed=fixed)
        for name, (_, spec) in REAL_DELAYS.items()
    ]


def rounds() -> dict[str, list[Cell]]:
    patterns = list(PATTERNS)
    core = ["none", "lognormal", "slow node", "node stalls"]
    reduced = (
        mirror_cells()
        + [Cell(4, p, b) for b in ("compute", "comm") for p in core]
        + [Cell(16, p, "compute") for p in core]
        + [Cell(16, "slow node", "comm")]
        + [Cell(16, p, "compute", data="dirichlet") for p in ("none", "slow node")]
        + [Cell(64, "lognormal", "compute", cs=(2,))]
    )
    full = (
        mirror_cells()
        + [Cell(n, p, b) for n in (4, 16, 64) for b in ("compute", "comm") for p in patterns]
        + [Cell(n, p, "compute", data="dirichlet") for n in (16, 64) for p in ("none", "lognormal", "slow node")]
        + [Cell(n, "lognormal", "compute") for n in (8, 32, 128)]
        + [Cell(256, p, "compute") for p in core]
        + [Cell(256, "lognormal", "comm")]
    )
    tiny = [Cell(4, "slow node", "compute"), Cell(4, "none", "compute", data="dirichlet")]
    return {"tiny": tiny, "reduced": reduced, "full": full}


def tiny_protocol() -> Protocol:
    return Protocol(
        budget_steps=60,
        max_versions=80,
        tuning_seeds=(1000,),
        eval_seeds=(0, 1, 2),
        lrs=(0.2, 0.4),
        momenta=(0.0, 0.9),
        targets=(0.9, 0.6),
    )


#: the learning rates the shipped reduced round was tuned over (the grid before 1.6 was added): the reduced round keeps
#: them, so its file stays resumable and its summary regenerable
REDUCED_LRS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.8)


def protocol_for(round_name: str) -> Protocol:
    """The tuning protocol of a round (the full round: the default grid, lr up to 1.6)."""
    if round_name == "tiny":
        return tiny_protocol()
    if round_name == "reduced":
        return Protocol(lrs=REDUCED_LRS)
    return Protocol()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round", choices=sorted(rounds()), default="reduced")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="run at most this many (cell, arm) items now")
    parser.add_argument("--summarize-only", action="store_true")
    parser.add_argument("--out", type=Path, default=DOCS, help="folder of the round's files (default docs/)")
    args = parser.parse_args(argv)
    cells = rounds()[args.round]
    protocol = protocol_for(args.round)
    path = args.out / f"emulated_map_{args.round}.jsonl"
    if not args.summarize_only:
        run_round(path, cells, protocol, workers=args.workers, limit=args.limit)
    items, skipped = plan_items(cells, protocol)
    summary = summarize(read_records(path), source=str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
    summary.update(
        {
            "round": args.round,
            "items_planned": len(items),
            "skipped_arms": skipped,
            "command": f"python benchmarks/emulated_map.py --round {args.round}",
            "protocol": asdict(protocol),
        }
    )
    out = path.with_suffix(".json")
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{summary['items_done']} of {len(items)} (cell, arm) items in {path}; summary in {out}")


if __name__ == "__main__":
    main()
