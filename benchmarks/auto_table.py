"""The versions-to-target factors of ``scheme="auto"`` (``lightning_pgc/auto_factors.json``), derived from an emulated map.

``python benchmarks/auto_table.py [--summary docs/results/emulated_map_reduced.json]`` rewrites the shipped table from a
summary of the emulated map (the format of :func:`lightning_pgc.emulator.summary.summarize`: ``source`` names the
round's records, ``cells[*].cell`` each cell's ``n``, ``pattern`` and ``task``, ``cells[*].arms[*].arm`` the arm
labels such as ``ignore_stragglers c=2``).

The rule (:func:`derive`), fixed before reading any map:

* The summary reports times to target, not versions, so the factors come from the records it summarizes (its
  ``source``, one JSON object per (cell, arm): ``arm.label`` and ``eval.versions_late``, the versions each evaluation
  seed took to reach the late target, null when it missed).
* A cell's factor of an arm is the median over seeds of ``versions_late(arm) / versions_late(ddp)`` on the same seed
  (seeds where either missed are left out); an arm's factor is the median of its cell factors over the cells of one
  ``(n, task)`` with a straggler pattern (``none`` is left out: there ``ignore_stragglers`` drops whichever rank is
  last by a hair, which is not the regime the factor is used in).
* One table per ``(n, task)`` of the map, with the cells it came from; cells whose data split is not i.i.d. are
  left out (the auto rule knows nothing of the data), and so is the map's ``pgc_auto`` arm (it runs on the table).
* Where a run's ``n`` has tables of several tasks, it reads each arm's largest factor among them
  (:meth:`~lightning_pgc.decisions.auto.FactorTable.from_dict`).

On a new map (new arms, such as staleness corrections or ``bounded``) rerun the command: the arms' labels are keys
of the table as they are, and :class:`~lightning_pgc.decisions.auto.FactorTable` reads the entry whose ``n`` is
nearest the run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "lightning_pgc" / "auto_factors.json"


def _records(path: Path) -> Iterable[dict[str, Any]]:
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _cell_key(cell: dict[str, Any]) -> tuple[Any, ...]:
    return (cell["n"], cell["pattern"], cell["bound"], cell["data"], cell["task"])


def derive(summary: dict[str, Any], records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The factor table (JSON-ready) of a summary and the records it summarizes (see the module docstring)."""
    wanted = {_cell_key(c["cell"]) for c in summary["cells"] if c["cell"]["data"] == "iid"}
    versions: dict[tuple[Any, ...], dict[str, list[Optional[int]]]] = defaultdict(dict)
    for r in records:
        key = _cell_key(r["cell"])
        if key in wanted and key[1] != "none":
            versions[key][r["arm"]["label"]] = r["eval"]["versions_late"]
    by_table: dict[tuple[int, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    cells: dict[tuple[int, str], list[str]] = defaultdict(list)
    for key, arms in sorted(versions.items(), key=lambda kv: str(kv[0])):
        base = arms.get("ddp")
        if base is None:
            continue
        n, pattern, bound, _, task = key
        cells[(n, task)].append(f"{pattern} | {bound}")
        for label, vs in arms.items():
            if label == "ddp" or label.startswith("pgc_auto"):  # (its own arm: the table must not depend on it)
                continue
            ratios = [a / b for a, b in zip(vs, base) if a is not None and b is not None and b > 0]
            if ratios:
                by_table[(n, task)][label].append(statistics.median(ratios))
    tables = []
    for (n, task), arms in sorted(by_table.items()):
        tables.append(
            {
                "n": n,
                "task": task,
                "cells": cells[(n, task)],
                "factors": {
                    label: {"factor": round(statistics.median(f), 4), "cells": len(f)}
                    for label, f in sorted(arms.items())
                },
            }
        )
    return {
        "source": summary.get("source", ""),
        "summary": summary.get("_path", ""),
        "command": "python benchmarks/auto_table.py --summary " + summary.get("_path", ""),
        "rule": "per (n, task): median over the cells with stragglers (i.i.d. data) of the median over seeds of "
        "versions_late(arm) / versions_late(ddp)",
        "tables": tables,
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", default="docs/results/emulated_map_reduced.json")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    summary_path = Path(args.summary)
    summary = json.loads(
        (ROOT / summary_path).read_text() if not summary_path.is_absolute() else summary_path.read_text()
    )
    summary["_path"] = str(args.summary)
    table = derive(summary, _records(ROOT / summary["source"]))
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out}: {[(t['n'], t['task'], len(t['factors'])) for t in table['tables']]}")


if __name__ == "__main__":
    main()
