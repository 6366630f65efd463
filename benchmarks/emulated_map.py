"""The emulated crossover map: which strategy wins, with which s, by n, straggler pattern, compute or
communication bound, and data condition (emulated: real leaders and schemes on the simulated clock, real training).

    nice -n 10 python benchmarks/emulated_map.py --round reduced --workers 2   # the reduced round (docs/results/emulator.md)
    python benchmarks/emulated_map.py --round full --workers 2 --limit 100      # the full round, 100 items at a time
    python benchmarks/emulated_map.py --round reduced --summarize-only
    nice -n 10 python benchmarks/emulated_map.py --round hard --workers 2      # the harder tasks (docs/results/hard_tasks.md)

Each round appends to ONE JSON Lines file, docs/results/emulated_map_<round>.jsonl (resumable: rerun the same command;
``--limit`` runs it in chunks), and is summarised into docs/results/emulated_map_<round>.json (per cell: each arm's
restricted mean time to both targets, the ratio against ddp with its interval and permutation test, Holm-corrected
per cell, the best arm at each s against its runner-up). Once every item is done, the same command runs the
confirmation stage (benchmarks/pgc_lab/map/confirm.py: each cell's candidate, runner-up and ddp on fresh seeds) into
docs/results/emulated_map_<round>_confirm.jsonl, also resumable; ``--confirm-complete-cells`` runs no screen item and
confirms the cells whose screen is complete (a round stopped part-way). The rounds' cells and protocols:
``benchmarks/pgc_lab/map/rounds.py``; ``--tasks`` picks the proxy tasks (``lightning_pgc/emulator/cells.py``) of every
round but ``hard``, which runs the harder tasks under their own protocol (``Protocol.for_task``).
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from pgc_lab.map.confirm import confirm_plan, confirm_summary
from pgc_lab.map.crossmap import item_key, plan_items, read_records, run_round
from pgc_lab.map.rounds import DEFAULT_TASKS, protocol_for, records_path, rounds, summary_path
from lightning_pgc.emulator.summary import cell_label, summarize
from pgc_lab.experiments.report import write_json

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--round", choices=sorted(rounds(DOCS)), default="reduced")
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), help="proxy tasks (cells.py)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="run at most this many (cell, arm) items now")
    parser.add_argument("--summarize-only", action="store_true")
    parser.add_argument("--no-confirm", action="store_true", help="skip the confirmation stage (the tests' rounds)")
    parser.add_argument(
        "--confirm-complete-cells",
        action="store_true",
        help="run no screen item now: confirm every cell whose screen is complete (a round stopped part-way)",
    )
    parser.add_argument("--out", type=Path, default=None, help="the round's records file (default docs/results/)")
    args = parser.parse_args(argv)
    cells = rounds(DOCS, args.tasks)[args.round]
    protocol = protocol_for(args.round)
    path = args.out if args.out is not None else records_path(args.round, DOCS)
    ran = 0
    if not args.summarize_only and not args.confirm_complete_cells:
        ran = run_round(path, cells, protocol, workers=args.workers, limit=args.limit)
    items, skipped = plan_items(cells, protocol)
    source = path.relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else str(path)
    tasks = sorted({c.task for c in cells if c.fixed is None})
    planned = {item_key(c, a, protocol) for c, a in items}
    records = [r for r in read_records(path) if r.get("key") in planned]  # a shared file holds other rounds' too
    summary = summarize(records, source=source)
    planned_arms = Counter(cell_label(asdict(c)) for c, _ in items)
    for cell in summary["cells"]:  # every planned arm of the cell has its record
        cell["screened"] = len(cell["arms"]) >= planned_arms[cell["label"]]
    summary.update(
        {
            "round": args.round,
            "tasks": tasks,
            "items_planned": len(items),
            "skipped_arms": skipped,
            "command": f"python benchmarks/emulated_map.py --round {args.round}"
            + ("" if args.round == "hard" else f" --tasks {' '.join(tasks)}")
            + " --workers 2",
            "protocol": asdict(protocol),
        }
    )
    screened = summary["items_done"] >= len(items) or args.confirm_complete_cells
    if screened and not args.no_confirm:  # the screen is complete (or its complete cells are asked for): confirm it
        confirm_path = path.with_name(path.stem + "_confirm.jsonl")
        screened_cells = {**summary, "cells": [c for c in summary["cells"] if c["screened"]]}
        plan = confirm_plan(screened_cells, records, protocol)
        left = None if args.limit is None else max(0, args.limit - ran)
        for cell, arms, cell_protocol in plan:
            if args.summarize_only or left == 0:
                break
            done = run_round(
                confirm_path, [cell], cell_protocol, workers=args.workers, limit=left, arms_of=lambda _c, a=arms: a
            )
            left = None if left is None else left - done
        labels = {cell_label(asdict(c)) for c in cells}  # a shared file holds other rounds' cells too
        confirmed = {k: v for k, v in confirm_summary(read_records(confirm_path)).items() if k in labels}
        for cell in summary["cells"]:
            if cell["label"] in confirmed:
                cell["confirm"] = confirmed[cell["label"]]
        summary.update(
            {
                "confirm_source": confirm_path.relative_to(ROOT).as_posix()
                if confirm_path.resolve().is_relative_to(ROOT)
                else str(confirm_path),
                "confirm_planned": len(plan),
                "confirm_done": len(confirmed),
            }
        )
    target = summary_path(args.round, DOCS) if args.out is None else path.with_suffix(".json")
    out = write_json(target, summary, newline=True)
    print(f"{summary['items_done']} of {len(items)} (cell, arm) items in {path}; summary in {out}")


if __name__ == "__main__":
    main()
