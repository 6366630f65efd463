"""The audit of the shipped emulated map: what it covers and where its protocol's rules bind, as one JSON object.

    python benchmarks/map_audit.py                 # the rounds the docs show (shipped_summaries)
    python benchmarks/map_audit.py --records docs/results/emulated_map_full.jsonl

Fields: ``tasks``, ``arms`` (the arm families: strategy and correction, without ``c``), ``n`` (cluster sizes),
``min_seeds_per_arm`` (the fewest evaluation seeds of any (cell, arm)), ``edge_choices`` (tuned settings still on an
edge of the grid after the edge rule), ``missed_everywhere`` (``"arm | cell"`` of the arms that missed the late target
on every tuning setting), ``node_cells_covered`` (every cell of a node-level pattern has an arm with ``s`` at or
above the node size), and where they come from (``records``: the files, ``items``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_pgc.emulator.cluster import NODE_PATTERNS, node_size
from pgc_lab.map.crossmap import read_records
from pgc_lab.map.rounds import DOCS, round_records, shipped_summary, summary_path
from lightning_pgc.emulator.summary import cell_label

__all__ = ["arm_family", "audit", "main", "shipped_records", "shipped_summaries"]


def arm_family(arm: dict[str, Any]) -> str:
    """An arm's family: its strategy, and its correction if any (``pgc_fr lookahead``)."""
    correction = arm.get("correction", "none")
    return arm["strategy"] if correction == "none" else f"{arm['strategy']} {correction}"


def audit(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The audit of a round's records (:func:`~lightning_pgc.emulator.cells.run_arm`'s)."""
    if not records:
        raise ValueError("no records to audit")
    tuned = [r for r in records if r["cell"].get("fixed") is None]
    node_cells: dict[str, bool] = {}
    for r in records:
        cell = r["cell"]
        if cell["pattern"] in NODE_PATTERNS:
            label = cell_label(cell)
            covered = r["arm"]["s"] >= node_size(cell["n"])
            node_cells[label] = node_cells.get(label, False) or covered
    return {
        "tasks": sorted({r["cell"]["task"] for r in records}),
        "arms": sorted({arm_family(r["arm"]) for r in records}),
        "n": sorted({r["cell"]["n"] for r in records}),
        "min_seeds_per_arm": min(len(r["eval"]["time_late"]) for r in records),
        "edge_choices": sum(bool(r["tuning"].get("edge")) for r in tuned),
        "missed_everywhere": sorted(
            f"{r['arm']['label']} | {cell_label(r['cell'])}" for r in tuned if r["tuning"].get("missed_everywhere")
        ),
        "node_cells_covered": all(node_cells.values()),
        "node_cells": len(node_cells),
        "items": len(records),
    }


def shipped_summaries(docs: Path = DOCS) -> list[dict[str, Any]]:
    """The summaries of the rounds the docs show: the shipped round of the digits tasks
    (:func:`~pgc_lab.map.rounds.shipped_summary`) and the hard round of the harder tasks, where it has
    run."""
    out = [json.loads(shipped_summary(docs).read_text())]
    hard = summary_path("hard", docs)
    if hard.exists():
        out.append(json.loads(hard.read_text()))
    return out


def shipped_records(docs: Path = DOCS) -> tuple[list[Path], list[dict[str, Any]]]:
    """The records files of the rounds the docs show (:func:`shipped_summaries`), and those rounds' records."""
    summaries = shipped_summaries(docs)
    return [docs.parents[1] / s["source"] for s in summaries], [r for s in summaries for r in round_records(s, docs)]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--records", type=Path, nargs="+", default=None, help="rounds' records (default: the shipped rounds)"
    )
    args = parser.parse_args(argv)
    if args.records is None:
        paths, records = shipped_records()
    else:
        paths, records = args.records, [r for path in args.records for r in read_records(path)]
    if not records:
        raise SystemExit(f"{', '.join(map(str, paths))}: no records (run benchmarks/emulated_map.py first)")
    out = audit(records)
    out["records"] = [
        p.resolve().relative_to(DOCS.parents[1]).as_posix() if p.resolve().is_relative_to(DOCS.parents[1]) else str(p)
        for p in paths
    ]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
