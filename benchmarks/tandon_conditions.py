"""Conditioning of Tandon's ``B`` for the (n, s) table of docs/math.md, and the two facts math.md states about it.

    python benchmarks/tandon_conditions.py

For every (n, s): ``best_tandon_b(n, s)`` (best of seeds 0..7 by the worst ``cond(B_K)`` over received sets,
exact when ``C(n, s) <= MAX_ENUMERATED_SUBSETS``, else over a seeded sample), whether ``make_scheme("gc_cr")``
admits it at the default ``max_condition``, and the spread over single seeds. Also:

- ``sampled_vs_exact``: for (24, 4), the seed a 5000-set sample picks and the one all 10626 sets pick, with
  each one's exact worst case;
- ``residual_counterexample``: (32, 4) with seed 2, the worst received set: its condition number, the
  least-squares residual ``|a^T B_K - 1|_inf`` (which passes ``RESIDUAL_TOL``) and ``max |a|``;
- ``decode_error``: the float64 and float32 decode error on the worst received set of the chosen (24, 4) B.

Writes docs/results/tandon_conditions.json (every number of the table and the prose in docs/math.md) and prints it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from lightning_pgc.codes import make_scheme
from pgc_lab.experiments.report import write_json
from lightning_pgc.codes.tandon import (
    MAX_ENUMERATED_SUBSETS,
    RESIDUAL_TOL,
    SAMPLED_SUBSETS,
    SEED_TRIES,
    best_tandon_b,
    decoding_subsets,
    subset_conditions,
    tandon_b,
)

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    (4, 1),
    (6, 2),
    (8, 3),
    (10, 3),
    (12, 3),
    (12, 5),
    (16, 3),
    (16, 4),
    (20, 3),
    (20, 4),
    (24, 3),
    (24, 4),
    (32, 4),
    (32, 8),
    (48, 8),
    (64, 8),
]


def row(n: int, s: int) -> dict:
    started = time.monotonic()
    _, worst, used = best_tandon_b(n, s)
    seconds = time.monotonic() - started
    subsets = decoding_subsets(n, s)
    per_seed = [float(subset_conditions(tandon_b(n, s, seed), subsets).max()) for seed in range(SEED_TRIES)]
    try:
        make_scheme("gc_cr", n, s)
        admitted = True
    except ValueError:
        admitted = False
    return {
        "n": n,
        "s": s,
        "subsets_total": math.comb(n, s),
        "exact": math.comb(n, s) <= MAX_ENUMERATED_SUBSETS,
        "subsets_checked": len(subsets),
        "worst_condition": worst,
        "seed_used": used,
        "admitted": admitted,
        "single_seed_min": min(per_seed),
        "single_seed_max": max(per_seed),
        "single_seed_spread": max(per_seed) / min(per_seed),
        "seconds": seconds,
    }


def main() -> None:
    rows = []
    for n, s in CASES:
        rows.append(row(n, s))
        print(json.dumps(rows[-1]), flush=True)
    every = decoding_subsets(24, 4, max_subsets=10**6)
    _, sampled_worst, sampled_seed = best_tandon_b(24, 4, max_subsets=5000)
    _, exact_worst, exact_seed = best_tandon_b(24, 4)
    sampled_vs_exact = {
        "n": 24,
        "s": 4,
        "sample": 5000,
        "sampled_choice": {
            "seed": sampled_seed,
            "sampled_worst": sampled_worst,
            "exact_worst": float(subset_conditions(tandon_b(24, 4, sampled_seed), every).max()),
        },
        "exact_choice": {"seed": exact_seed, "exact_worst": exact_worst},
    }
    B = tandon_b(32, 4, seed=2)
    all32 = decoding_subsets(32, 4, max_subsets=10**6)
    conds = subset_conditions(B, all32)
    K = all32[int(conds.argmax())]
    BK = B[K]
    a, *_ = np.linalg.lstsq(BK.T, np.ones(32), rcond=None)
    counterexample = {
        "n": 32,
        "s": 4,
        "seed": 2,
        "ranks": K.tolist(),
        "condition": float(conds.max()),
        "residual": float(np.max(np.abs(a @ BK - 1.0))),
        "residual_tol": RESIDUAL_TOL,
        "max_abs_a": float(np.abs(a).max()),
    }
    sc = make_scheme("gc_cr", 24, 4)
    c24 = subset_conditions(sc.B, every)
    R = every[int(c24.argmax())].tolist()
    gen = torch.Generator().manual_seed(0)
    g = {j: torch.randn(4096, generator=gen, dtype=torch.float64) for j in range(24)}
    ref = sum(g.values()) / 24
    codes = {k: sc.encode(k, {j: g[j] for j in sc.partitions(k)}) for k in R}
    rel = lambda x: float((x.double() - ref).norm() / ref.norm())  # noqa: E731
    decode_error = {
        "n": 24,
        "s": 4,
        "condition": float(c24.max()),
        "float64": rel(sc.decode(codes)),
        "float32": rel(sc.decode({k: v.float() for k, v in codes.items()})),
    }
    result = {
        "command": "python benchmarks/tandon_conditions.py",
        "max_enumerated_subsets": MAX_ENUMERATED_SUBSETS,
        "sampled_subsets": SAMPLED_SUBSETS,
        "seed_tries": SEED_TRIES,
        "rows": rows,
        "sampled_vs_exact": sampled_vs_exact,
        "residual_counterexample": counterexample,
        "decode_error": decode_error,
    }
    path = write_json(ROOT / "docs" / "results" / "tandon_conditions.json", result)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
