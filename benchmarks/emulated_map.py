"""The emulated crossover map: which strategy wins, with which s, by n, straggler pattern, compute or
communication bound, and data condition (emulated: real leaders and schemes on the simulated clock, real training).

    python benchmarks/emulated_map.py --round reduced   # about 30-40 min of one core (lr up to 0.8)
    python benchmarks/emulated_map.py --round full      # the whole map (its cost: docs/emulator.md)
    python benchmarks/emulated_map.py --round reduced --summarize-only

Each round appends to ONE JSON Lines file, docs/emulated_map_<round>.jsonl (resumable: rerun the same command), and
is summarised into docs/emulated_map_<round>.json (per cell: each arm's restricted mean and median time to both
targets, the ratio against ddp with its interval, Holm-corrected tests, the winner if any). The rounds' cells and
protocols: ``lightning_pgc/emulator/rounds.py``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from lightning_pgc.emulator.crossmap import plan_items, read_records, run_round
from lightning_pgc.emulator.rounds import protocol_for, rounds
from lightning_pgc.emulator.summary import summarize
from lightning_pgc.experiments.report import write_json

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round", choices=sorted(rounds(DOCS)), default="reduced")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="run at most this many (cell, arm) items now")
    parser.add_argument("--summarize-only", action="store_true")
    parser.add_argument("--out", type=Path, default=DOCS, help="folder of the round's files (default docs/)")
    args = parser.parse_args(argv)
    cells = rounds(DOCS)[args.round]
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
    out = write_json(path.with_suffix(".json"), summary, newline=True)
    print(f"{summary['items_done']} of {len(items)} (cell, arm) items in {path}; summary in {out}")


if __name__ == "__main__":
    main()
