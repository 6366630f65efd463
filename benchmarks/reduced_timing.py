"""How long the reduced round of the emulated map takes to regenerate from nothing, and whether it regenerates the
shipped results: the round's own command, into an empty folder, timed on the wall clock.

    python benchmarks/reduced_timing.py            # runs the round (about half an hour on 2 cores), writes the JSON
    python benchmarks/reduced_timing.py --render   # prints the page's lines from the results file

The command is the shipped summary's (``docs/results/emulated_map_reduced.json``, ``command``) with ``--out`` into a
temporary folder, so nothing in docs/ is touched but this script's results file,
``docs/results/reduced_round_timing.json``. It records the wall seconds, the machine's cores and load average before
and after, and, per cell, whether the regenerated summary chose the same setting and gave the same time to the late
target for every arm, the same winner and the same confirmation as the shipped one.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "docs" / "results" / "emulated_map_reduced.json"
RESULTS = ROOT / "docs" / "results" / "reduced_round_timing.json"
#: relative tolerance on an arm's restricted mean time (the records are JSON floats)
RTOL = 1e-9


def _arms(cell: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    return {a["arm"]: (a["lr"], a["momentum"], a["rmean_late_s"]) for a in cell["arms"]}


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:2] == b[:2] and abs(a[2] - b[2]) <= RTOL * max(1.0, abs(a[2]))


def _winner(cell: dict[str, Any]) -> Any:
    return (cell.get("winner") or {}).get("arm")


def _verdict(cell: dict[str, Any]) -> Any:
    confirm = cell.get("confirm") or {}
    return confirm.get("candidate"), confirm.get("wins"), confirm.get("sure")


def compare(shipped: dict[str, Any], regenerated: dict[str, Any]) -> list[dict[str, Any]]:
    """Per shipped cell: the arms whose setting or time to the late target differ, and whether the winner and the
    confirmation's verdict are the same."""
    theirs = {c["label"]: c for c in regenerated["cells"]}
    rows = []
    for cell in shipped["cells"]:
        other = theirs.get(cell["label"])
        if other is None:
            rows.append({"cell": cell["label"], "present": False})
            continue
        ours, new = _arms(cell), _arms(other)
        rows.append(
            {
                "cell": cell["label"],
                "present": True,
                "arms": len(ours),
                "arms_differing": sorted(a for a in ours if a not in new or not _same(ours[a], new[a])),
                "same_winner": _winner(cell) == _winner(other),
                "same_confirmation": _verdict(cell) == _verdict(other),
            }
        )
    return rows


def run() -> dict[str, Any]:
    shipped = json.loads(SHIPPED.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "emulated_map_reduced.jsonl"
        argv = shlex.split(shipped["command"])[1:] + ["--out", str(out)]
        load_before = os.getloadavg()
        started = time.perf_counter()
        subprocess.run([sys.executable, *argv], cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - started
        load_after = os.getloadavg()
        regenerated = json.loads(out.with_suffix(".json").read_text())
    rows = compare(shipped, regenerated)
    return {
        "command": "OMP_NUM_THREADS=1 " + shipped["command"] + " --out <empty folder>/emulated_map_reduced.jsonl",
        "wall_s": round(wall, 1),
        "cores": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
        "items": regenerated["items_done"],
        "confirm_done": regenerated.get("confirm_done"),
        "cpu_s_total": regenerated.get("cpu_s_total"),
        "cells": rows,
        "cells_identical": sum(1 for r in rows if r["present"] and not r["arms_differing"]),
        "cells_same_verdict": sum(1 for r in rows if r["present"] and r["same_winner"] and r["same_confirmation"]),
    }


def render(results: dict[str, Any]) -> str:
    """One paragraph for docs/emulator.md."""
    n = len(results["cells"])
    return (
        f"Measured: the reduced round regenerated from nothing in {results['wall_s'] / 60:.1f} minutes of wall time "
        f"on {results['cores']} cores ({results['items']} items and {results['confirm_done']} confirmed cells; "
        f"`python benchmarks/reduced_timing.py`, [reduced_round_timing.json](results/reduced_round_timing.json)). "
        f"{results['cells_identical']} of {n} cells gave every arm the shipped setting and time to the late target, "
        f"and {results['cells_same_verdict']} of {n} the shipped winner and confirmation."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="print the page's paragraph from the results file")
    args = parser.parse_args(argv)
    if not args.render:
        results = run()
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(render(json.loads(RESULTS.read_text())))


if __name__ == "__main__":
    main()
