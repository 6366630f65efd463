"""The staleness corrections on the quadratic model: writes ``docs/results/staleness_theory.json`` (the table of
``docs/results/theory.md``, section 7).

    python benchmarks/theory_corrections.py [--kappa 100] [--dc-lambda 0.5]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from pgc_lab import corrections as tc
from pgc_lab.experiments.report import write_json

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kappa", type=float, default=100.0)
    p.add_argument("--dc-lambda", type=float, default=0.5, help="effective Hessian fraction of delay compensation")
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "staleness_theory.json"))
    args = p.parse_args()
    started = time.monotonic()
    rows = tc.correction_table(kappa=args.kappa, dc_lambda=args.dc_lambda)
    best = {}
    for c in (2, 4):
        for correction in ("none", "lookahead", "delay_compensation"):
            r, aL, m = tc.best_rate(tc.corrected_filter(correction, c, lam=args.dc_lambda), args.kappa)
            best[f"c{c}/{correction}"] = {"best_rate": r, "aL": aL, "momentum": m}
    r, aL, m = tc.best_rate(tc.window_filter(1), args.kappa)
    best["c1/fresh"] = {"best_rate": r, "aL": aL, "momentum": m}
    lookahead_k = []
    for c in (2, 4):
        for k in sorted({(c - 1) / 2, c - 1, 2 * (c - 1)}):
            f = tc.corrected_filter("lookahead", c, k=k)
            r, aL, _ = tc.best_rate(f, args.kappa, momenta=[0.9])
            lookahead_k.append(
                {
                    "c": c,
                    "k": k,
                    "momentum": 0.9,
                    "boundary": tc.boundary(0.9, f),
                    "best_rate": r,
                    "best_aL": aL,
                    "steps_per_efold": -1.0 / math.log(r),
                }
            )
    out = {
        "command": "python benchmarks/theory_corrections.py",
        "kappa": args.kappa,
        "dc_lambda": args.dc_lambda,
        "table": rows,
        "best_over_lr_and_momentum": best,
        "lookahead_k": lookahead_k,
        "wall_s": time.monotonic() - started,
    }
    write_json(Path(args.out), out)
    print(
        f"{'c':>2} {'m':>4} {'correction':>19} {'m_applied':>9} {'boundary':>9} {'a/(1-m)':>8} {'rate':>8} {'steps/e':>8}"
    )
    for row in rows:
        print(
            f"{row['c']:>2} {row['momentum']:>4} {row['correction']:>19} {row['momentum_applied']:>9.3f} "
            f"{row['boundary']:>9.4f} {row['effective_boundary']:>8.3f} {row['best_rate']:>8.4f} "
            f"{row['steps_per_efold']:>8.1f}"
        )
    for row in lookahead_k:
        print("lookahead", row)
    for k, v in best.items():
        print(k, v)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
