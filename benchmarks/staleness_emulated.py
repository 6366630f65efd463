"""The staleness corrections on the emulated cluster, n = 16 to 256 (emulated: the real leaders and schemes on the
simulated clock, real training of the digits MLP; see docs/results/emulator.md).

    python benchmarks/staleness_emulated.py --price        # the round's estimated CPU cost, before running it
    python benchmarks/staleness_emulated.py                # run (resumable) into docs/results/staleness_emulated.jsonl
    python benchmarks/staleness_emulated.py --render-only  # docs/staleness_emulated.{json,md} from the records

One append-only JSON Lines file (one line per finished (cell, arm), rerun the command to resume), summarised into
docs/results/staleness_emulated.json and the generated page docs/results/staleness_emulated.md. Every arm (dgd, pgc_fr at c = 2
and 4 with each correction, including the ones that do not help, and the bounded-staleness scheme with replication 2
and window c = 2, uncorrected and with the corrections the strategy allows for it) is tuned the same way: the emulated map's protocol
(lr x momentum on tuning seeds disjoint from the evaluation seeds, scored by time to the late target), with its lr
grid extended by 1.6 so that dgd's best learning rate is not the grid's edge, and 20 evaluation seeds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

from lightning_pgc.emulator.cells import LRS, MapArm, MapCell, Protocol
from pgc_lab.map.crossmap import item_key, plan_items, read_records, run_round
from pgc_lab.map.rounds import cost, records_path
from lightning_pgc.emulator.scoring import compare, holm, restricted_mean
from lightning_pgc.staleness import default_lookahead
from pgc_lab.experiments.report import write_report

ROOT = Path(__file__).resolve().parents[1]

DOCS = ROOT / "docs" / "results"
NAME = "staleness_emulated"
RECORDS = DOCS / f"{NAME}.jsonl"
SUMMARY = DOCS / f"{NAME}.json"
PAGE = DOCS / f"{NAME}.md"
COMMAND = "nice -n 15 env OMP_NUM_THREADS=1 python benchmarks/staleness_emulated.py"

#: log-normal jitter (every worker, every step), compute-bound: where pgc_fr already matched ddp's time in the emulated
#: map's first reduced round, so where a correction decides whether the pipeline wins
CELLS: list[MapCell] = [MapCell(n, "lognormal", "compute") for n in (16, 64, 256)]
#: this round's grid: the map's learning rates, the momenta it was run with, no edge rule (its records' keys)
PROTOCOL = Protocol(
    eval_seeds=tuple(range(20)), lrs=tuple(sorted({*LRS, 1.6})), momenta=(0.0, 0.5, 0.7, 0.8, 0.9), extend=False
)
#: the issue's targets: steps to target against dgd's at c = 2 and c = 4, time to target at c = 2
TARGETS = {"steps_c2": 1.15, "steps_c4": 1.3, "time_c2": 0.8}


def arms_of(cell: MapCell) -> list[MapArm]:
    """dgd (the ``ddp`` arm) and pgc_fr at c = 2 and 4: uncorrected, look-ahead with ``k = (c-1)/2`` (the window's mean
    age) and with ``k = c - 1`` (both explicit, so that a record says which it ran), delay compensation
    (``dc_lambda`` 0.04) and momentum accounting. At n = 256 (the costly cell) only the uncorrected arm and
    look-ahead with ``k = c - 1``: at n = 16 and 64 delay compensation and momentum accounting did not move from the
    uncorrected arm and ``k = c - 1`` was the better look-ahead.

    Then bounded staleness (replication 2, window ``c = 2``, the strategy's default ``fresh = n - 1``): uncorrected,
    look-ahead with the strategy's default ``k`` for it (the nominal mean age ``1 / n``, explicit in the record) and,
    below n = 256, momentum accounting (delay compensation does not apply to it: a rank sends only its fresh
    gradient)."""
    arms = [MapArm("ddp")]
    for c in (2, 4):
        full = [
            MapArm("pgc_fr", c),
            MapArm("pgc_fr", c, "lookahead", lookahead_steps=(c - 1) / 2),
            MapArm("pgc_fr", c, "lookahead", lookahead_steps=float(c - 1)),
            MapArm("pgc_fr", c, "delay_compensation"),
            MapArm("pgc_fr", c, "momentum"),
        ]
        if cell.n >= 256:
            full = [full[0], full[2]]
        arms.extend(full)
    bounded = MapArm("bounded_staleness", 2)
    k = default_lookahead(bounded.scheme(cell.n))
    arms += [bounded, MapArm("bounded_staleness", 2, "lookahead", lookahead_steps=k)]
    if cell.n < 256:
        arms.append(MapArm("bounded_staleness", 2, "momentum"))
    return arms


def price(protocol: Protocol = PROTOCOL) -> dict[str, Any]:
    """The round's CPU cost, estimated with the emulated map's cost model (the reduced round,
    docs/results/emulated_map_reduced.json: measured CPU s per item by n, a line ``a + b n`` through them elsewhere),
    scaled from that round's protocol (tuning taken as about 60 % of an item) to this one's. Also per strategy, and for
    the items the records file does not hold yet (what a plain run would run now), estimated both ways: with that
    cost model and with this round's own measured mean CPU s per item at the same n (where it has records)."""
    path = records_path("reduced", DOCS)
    reduced_records = [r for r in read_records(path) if r["cell"].get("fixed") is None]
    c = cost(json.loads(path.with_suffix(".json").read_text()), reduced_records, DOCS)
    measured = {k: v["mean"] for k, v in c["per_item_cpu_s"].items()}
    ref = reduced_records[0]["protocol"]
    ref_settings = len(ref["lrs"]) * len(ref["momenta"]) * len(ref["tuning_seeds"])
    settings = len(protocol.lrs) * len(protocol.momenta) * len(protocol.tuning_seeds)
    scale = 0.6 * settings / ref_settings + 0.4 * len(protocol.eval_seeds) / len(ref["eval_seeds"])
    items, _ = plan_items(CELLS, protocol, arms_of)
    records = read_records(RECORDS)
    done = {r.get("key") for r in records}
    own: dict[int, list[float]] = {}
    for r in records:
        own.setdefault(r["cell"]["n"], []).append(r["cpu_s"])
    todo_own = 0.0
    per_n: dict[int, int] = {}
    total, todo, todo_items = 0.0, 0.0, 0
    per_strategy: dict[str, dict[str, float]] = {}
    for cell, arm in items:
        per_n[cell.n] = per_n.get(cell.n, 0) + 1
        each = measured.get(f"n={cell.n} mlp", c["line_a_s"] + c["line_b_s_per_worker"] * cell.n) * scale
        total += each
        row = per_strategy.setdefault(arm.strategy, {"items": 0, "cpu_s_estimate": 0.0})
        row["items"] += 1
        row["cpu_s_estimate"] += each
        if item_key(cell, arm, protocol) not in done:
            todo += each
            todo_items += 1
            todo_own += float(np.mean(own[cell.n])) if cell.n in own else each
    return {
        "items": len(items),
        "items_per_n": per_n,
        "scale": scale,
        "cpu_s_estimate": total,
        "per_strategy": per_strategy,
        "todo_items": todo_items,
        "todo_cpu_s_estimate": todo,
        "todo_cpu_s_from_this_round": todo_own,
    }


def _mean(xs: list[float]) -> Optional[float]:
    return float(np.mean(xs)) if xs else None


def _comparison(arm: list[Any], base: list[Any], budget: float) -> dict[str, Any]:
    comp = compare(arm, base, budget)
    return {"ratio": comp.ratio, "low": comp.low, "high": comp.high, "p": comp.p}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cell and arm: the chosen setting, seeds that reached the late target, mean steps (versions) to it over the
    seeds that reached it, restricted mean time to it (misses at the budget), and paired comparisons (ratio of
    restricted means, seeded bootstrap interval, sign-flip p, Holm per cell and family) of steps and time with dgd and
    with the uncorrected arm of the same strategy and ``c``. Steps of a miss are censored at the protocol's
    ``max_versions``."""
    order = {item_key(cell, arm, PROTOCOL): i for i, (cell, arm) in enumerate(plan_items(CELLS, PROTOCOL, arms_of)[0])}
    records = sorted((r for r in records if r.get("key") in order), key=lambda r: order[r["key"]])  # the plan's order
    by_cell: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_cell.setdefault(r["cell"]["n"], []).append(r)
    cells = []
    for n, recs in sorted(by_cell.items()):
        budget = recs[0]["budget_s"]
        max_versions = recs[0]["protocol"]["max_versions"]
        base = next((r for r in recs if r["arm"]["strategy"] == "ddp"), None)
        uncorrected = {
            (r["arm"]["strategy"], r["arm"]["c"]): r
            for r in recs
            if r["arm"]["strategy"] != "ddp" and "correction" not in r["arm"]
        }
        mean_age_k = {
            (r["arm"]["strategy"], r["arm"]["c"]): r
            for r in recs
            if r["arm"].get("correction") == "lookahead" and r["arm"]["lookahead_steps"] == (r["arm"]["c"] - 1) / 2
        }
        arms = []
        families: dict[str, list[tuple[dict[str, Any], str]]] = {"vs_dgd": [], "vs_none": [], "vs_mean_age_k": []}
        for r in recs:
            ev = r["eval"]
            steps = [v for v in ev["versions_late"] if v is not None]
            row: dict[str, Any] = {
                "arm": r["arm"]["label"],
                "strategy": r["arm"]["strategy"],
                "c": r["arm"]["c"],
                "correction": r["arm"].get("correction", "none"),
                "lookahead_steps": r["arm"].get("lookahead_steps"),
                "lr": r["tuning"]["chosen"]["lr"],
                "momentum": r["tuning"]["chosen"]["momentum"],
                "lr_at_grid_edge": r["tuning"]["chosen"]["lr"]
                in (min(r["protocol"]["lrs"]), max(r["protocol"]["lrs"])),
                "seeds": len(ev["time_late"]),
                "reached": sum(t is not None for t in ev["time_late"]),
                "diverged": sum(bool(d) for d in ev["diverged"]),
                "steps_to_target": _mean([float(v) for v in steps]),
                "time_to_target_s": restricted_mean(ev["time_late"], budget),
                "cpu_s": r["cpu_s"],
            }
            longer = r["arm"].get("correction") == "lookahead" and r["arm"]["lookahead_steps"] == r["arm"]["c"] - 1
            same = (r["arm"]["strategy"], r["arm"]["c"])
            for family, other in (
                ("vs_dgd", base),
                ("vs_none", uncorrected.get(same)),
                ("vs_mean_age_k", mean_age_k.get(same) if longer else None),
            ):
                if other is None or other is r or (family == "vs_none" and r["arm"]["strategy"] == "ddp"):
                    continue
                ev0 = other["eval"]
                row[f"steps_{family}"] = _comparison(ev["versions_late"], ev0["versions_late"], max_versions)
                row[f"time_{family}"] = _comparison(ev["time_late"], ev0["time_late"], budget)
                families[family] += [(row[f"steps_{family}"], "p"), (row[f"time_{family}"], "p")]
            arms.append(row)
        for fam in families.values():
            for (comp, _), p in zip(fam, holm([c["p"] for c, _ in fam]) if fam else []):
                comp["p_holm"] = p
        cells.append({"n": n, "cell": recs[0]["cell"], "budget_s": budget, "arms": arms})
    return {
        "label": "emulated",
        "source": str(RECORDS.relative_to(ROOT)),
        "command": COMMAND,
        "protocol": {  # validation after every version: the interval is left out, as from the items' keys
            k: list(v) if isinstance(v, tuple) else v
            for k, v in vars(PROTOCOL).items()
            if not (k == "val_every" and v == 1)
        },
        "targets": TARGETS,
        "items_planned": len(plan_items(CELLS, PROTOCOL, arms_of)[0]),
        "items_done": len(records),
        "cpu_s_total": sum(r["cpu_s"] for r in records),
        "cells": cells,
    }


def _ratio(d: Optional[dict[str, Any]]) -> str:
    if d is None:
        return "-"
    mark = "*" if d["p_holm"] < 0.05 else ""
    return f"{d['ratio']:.2f}x [{d['low']:.2f}, {d['high']:.2f}]{mark}"


def render(summary: dict[str, Any]) -> str:
    p = summary["protocol"]
    lines = [
        "# Staleness corrections on the emulated cluster (emulated)",
        "",
        "<!-- generated by benchmarks/staleness_emulated.py from docs/results/staleness_emulated.json; rerun it to update -->",
        "",
        f"Command: `{summary['command']}` (records: `{summary['source']}`, one line per (cell, arm)).",
        "",
        "- **Emulated**: the real leaders and schemes on the simulated clock, real training of the digits MLP "
        "(64-64-10, 8 samples per partition evaluation), the staleness corrections applied with the strategy's own "
        "`StalenessCorrection` (docs/results/emulator.md). Time is virtual: one partition gradient is 0.1 s, and the "
        "corrections' bookkeeping costs nothing on this clock.",
        "- Cells: log-normal jitter (median 0.02 s, sigma 1.5, every worker every step), compute-bound, iid data; "
        f"budget {summary['cells'][0]['budget_s']:g} virtual s per run (300 ideal steps)."
        if summary["cells"]
        else "- No cell finished yet.",
        f"- Tuning, the same for every arm: lr {p['lrs']} x momentum {p['momenta']} on seeds {p['tuning_seeds']}, "
        f"scored by restricted mean time to validation loss {p['targets'][1]:g}; evaluation of the chosen setting on "
        f"seeds {p['eval_seeds'][0]}-{p['eval_seeds'][-1]} (disjoint). `dgd` is the emulator's `ddp` arm (the same "
        "aggregate). Momentum accounting runs each setting at `max(0, m - D/(1+D))`, `D` the window's nominal mean "
        "age (pgc_fr: `(c-1)/2`; bounded: `(n - fresh)/n = 1/n`); its row is labelled by the momentum chosen.",
        "- bounded: the bounded-staleness scheme, replication `r = 2`, window `c = 2`, `fresh = n - 1`; its look-ahead "
        "runs the strategy's default `k` for it (the nominal mean age `1/n`).",
        "- Steps: versions to the target, mean over the seeds that reached it. Time: restricted mean (a miss counts as "
        "the budget). Ratios: of restricted means (steps of a miss censored at "
        f"{p['max_versions']} versions), paired by seed, seeded 95 % bootstrap interval; `*`: Holm-corrected "
        "sign-flip p < 0.05 within the cell (one family for the comparisons with dgd, one for those with the "
        "uncorrected arm of the same strategy and c).",
        f"- {summary['items_done']} of {summary['items_planned']} (cell, arm) items, "
        f"{summary['cpu_s_total'] / 60:.1f} CPU minutes.",
        "",
    ]
    for cell in summary["cells"]:
        lines += [
            f"## n = {cell['n']}",
            "",
            "| arm | chosen lr, momentum | reached | steps to target | time to target (s) | steps vs dgd | "
            "time vs dgd | steps vs none | time vs none |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for a in cell["arms"]:
            label = "dgd" if a["arm"] == "ddp" else a["arm"]
            steps = "-" if a["steps_to_target"] is None else f"{a['steps_to_target']:.1f}"
            edge = " (grid edge)" if a["lr_at_grid_edge"] else ""
            lines.append(
                f"| {label} | {a['lr']:g}, {a['momentum']:g}{edge} | {a['reached']}/{a['seeds']} | {steps} | "
                f"{a['time_to_target_s']:.2f} | {_ratio(a.get('steps_vs_dgd'))} | {_ratio(a.get('time_vs_dgd'))} | "
                f"{_ratio(a.get('steps_vs_none'))} | {_ratio(a.get('time_vs_none'))} |"
            )
        lines.append("")
        for a in cell["arms"]:
            if a.get("steps_vs_mean_age_k"):
                lines.append(
                    f"- {a['arm']} against k = {(a['c'] - 1) / 2:g} (the window's mean age): steps "
                    f"{_ratio(a['steps_vs_mean_age_k'])}, time {_ratio(a['time_vs_mean_age_k'])}."
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--price", action="store_true", help="print the estimated CPU cost and exit")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--limit", type=int, default=None, help="run at most this many (cell, arm) items now")
    args = parser.parse_args(argv)
    if args.price:
        print(json.dumps(price(), indent=1))
        return
    if not args.render_only:
        run_round(RECORDS, CELLS, PROTOCOL, workers=1, limit=args.limit, arms_of=arms_of)
    summary = summarize(read_records(RECORDS))
    write_report(DOCS, NAME, summary, page=render(summary), newline=True)
    print(f"{summary['items_done']} of {summary['items_planned']} items; {SUMMARY} and {PAGE}")


if __name__ == "__main__":
    main()
