"""Measure the theory's constants in real digits runs and draw the figures of docs/results/theory.md.

    python benchmarks/theory_run.py [--steps 300] [--every 10] [--out outputs/theory_run]

Runs the digits recipe on 4 real CPU processes (:func:`pgc_lab.experiments.launch` with
``PGCDiagnostics(theory_every_n_steps=...)``) for ``pgc_cr`` with
``s = 1`` and ``s = 3`` and for ``pgc_fr`` with ``s = 1``, under small log-normal delays; every ``--every`` steps rank 0
recomputes every copy in every rank's cache and logs ``pgc/theory/...``. Also evaluates the quadratic mechanism
checks (delayed-gradient stability boundary, staleness error against the delay). Writes
``docs/results/theory_run.json``, ``docs/results/theory_decomposition.png``, ``docs/results/theory_constants.png``,
``docs/results/theory_estimator.png``, ``docs/results/theory_quadratic.png`` and prints every path it writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lightning_pgc.theory import quadratic as th
from pgc_lab.experiments import launch
from pgc_lab.experiments.report import save_figure, write_json, write_report

ROOT = Path(__file__).resolve().parents[1]

RUNS = {
    "pgc_cr s=1 (c=2)": dict(strategy="pgc", strategy_kwargs={"scheme": "pgc_cr", "stragglers": 1}),
    "pgc_cr s=3 (c=4)": dict(strategy="pgc", strategy_kwargs={"scheme": "pgc_cr", "stragglers": 3}),
    "pgc_fr s=1 (c=2)": dict(strategy="pgc", strategy_kwargs={"scheme": "pgc_fr", "stragglers": 1}),
}
KEYS = [
    "total_sq",
    "subset_sq",
    "sampling_sq",
    "staleness_sq",
    "grad_sq",
    "gamma_hat",
    "gamma_avg",
    "xi_hat",
    "xi_within",
    "lemma3_mean_sq",
    "lemma3_ref_sq",
    "lemma3_gap_ratio",
    "subset_mse_uniform",
    "subset_var_uniform",
    "subset_bias_uniform",
    "subset_mse_empirical",
    "subset_bias_empirical",
    "subset_var_empirical",
    "copy_cos",
    "copy_noise_corr",
    "copy_sampling_corr",
    "lemma4_cross_ratio",
    "oldest_age",
    "L_full",
    "decomp_residual",
    "recon_residual",
    "exact",
    "partial_caches",
    "cost_s",
    "cross_subset_sampling",
    "cross_subset_staleness",
    "cross_sampling_staleness",
]


def series(history: list[dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    rows = [(int(h["step"]), h[f"pgc/theory/{key}"]) for h in history if f"pgc/theory/{key}" in h]
    return [s for s, _ in rows], [v for _, v in rows]


def prefixed(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Rows saved without the ``pgc/theory/`` prefix, keyed again as the diagnostics log them."""
    return [{"step": h["step"], **{f"pgc/theory/{k}": v for k, v in h.items() if k != "step"}} for h in rows]


def summarize(history: list[dict[str, float]], skip: int) -> dict[str, float]:
    out = {}
    for key in KEYS:
        steps, values = series(history, key)
        values = [v for s, v in zip(steps, values) if s >= skip]
        if values:
            out[key] = statistics.median(values)
    steps, _ = series(history, "total_sq")
    totals = {
        k: sum(series(history, k)[1][i] for i, s in enumerate(steps) if s >= skip)
        for k in (
            "total_sq",
            "subset_sq",
            "sampling_sq",
            "staleness_sq",
            "cross_subset_sampling",
            "cross_subset_staleness",
            "cross_sampling_staleness",
        )
    }
    out["share"] = {k: totals[k] / totals["total_sq"] for k in totals if k != "total_sq"}
    return out


def expectation_ratios(history: list[dict[str, float]], skip: int) -> dict[str, float]:
    """The paper's constants as ratios of expectations (sum over the measurements from step ``skip`` on, over sum),
    which is what the theorems bound, not medians of per-step ratios:

    - ``gamma_hat``: ``sum |grad F(beta_t) - grad F(beta_v)|^2 / sum |grad F(beta_t)|^2`` (oldest copy ``v``);
    - ``gamma_avg``: ``sum staleness_sq / sum |grad F(beta_t)|^2``;
    - ``lemma3_gap_ratio``: ``(sum E_R|g_hat|^2 - sum |g_bar|^2) / sum |g_bar|^2``.
    """
    rows = [h for h in history if int(h["step"]) >= skip and "pgc/theory/grad_sq" in h]
    grad = sum(h["pgc/theory/grad_sq"] for h in rows)
    gamma = sum(h["pgc/theory/gamma_hat"] * h["pgc/theory/grad_sq"] for h in rows if "pgc/theory/gamma_hat" in h)
    stale = sum(h["pgc/theory/staleness_sq"] for h in rows)
    mean = sum(h["pgc/theory/lemma3_mean_sq"] for h in rows if "pgc/theory/lemma3_mean_sq" in h)
    ref = sum(h["pgc/theory/lemma3_ref_sq"] for h in rows if "pgc/theory/lemma3_mean_sq" in h)
    return {
        "gamma_hat": gamma / grad,
        "gamma_avg": stale / grad,
        "lemma3_gap_ratio": (mean - ref) / ref,
        "measurements": len(rows),
    }


def quadratic_checks() -> dict[str, list[float]]:
    taus = list(range(9))
    pure = [th.pure_delay_threshold(t) for t in taus]
    spectral = [th.stability_threshold(np.eye(t + 1)[t]) for t in taus]
    simulated = [th.simulated_threshold(np.eye(t + 1)[t], steps=3000) for t in taus]
    cs = list(range(1, 10))
    pipeline = [th.stability_threshold(np.full(c, 1.0 / c)) for c in cs]
    delays = list(range(1, 9))
    err, bound = th.staleness_error_curve(np.diag([1.0, 0.05]), eta=0.002, delays=delays, t=400, beta0=[1.0, 1.0])
    return {
        "tau": taus,
        "pure_delay_closed_form": pure,
        "pure_delay_spectral": spectral,
        "pure_delay_simulated": simulated,
        "c": cs,
        "pipeline_averaged": pipeline,
        "delays": delays,
        "staleness_error": err.tolist(),
        "lipschitz_bound": bound.tolist(),
        "slope": th.loglog_slope(delays, err),
        "max_rel_error_simulated": max(abs(a - b) / b for a, b in zip(simulated, pure)),
    }


def plot(results: dict, quad: dict) -> dict[str, Any]:
    """The four figures, by file name in docs/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: dict[str, Any] = {}
    names = list(results)
    colors = {
        "subset_sq": "tab:orange",
        "sampling_sq": "tab:blue",
        "staleness_sq": "tab:red",
        "total_sq": "black",
        "grad_sq": "tab:green",
    }
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), names):
        hist = results[name]["history"]
        for key, label in [
            ("total_sq", "|g_hat - grad F|^2 (total)"),
            ("sampling_sq", "sampling"),
            ("subset_sq", "subset selection"),
            ("staleness_sq", "staleness"),
            ("grad_sq", "|grad F|^2"),
        ]:
            s, v = series(hist, key)
            keep = [(a, b) for a, b in zip(s, v) if a > 0]  # step 0: the warm-up step has no staleness at all
            ax.plot(
                [a for a, _ in keep],
                [b for _, b in keep],
                label=label,
                color=colors[key],
                lw=1.2,
                ls="--" if key == "grad_sq" else "-",
            )
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("step")
    np.atleast_1d(axes)[0].set_ylabel("squared norm")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.suptitle("Exact decomposition of the aggregate's error (digits, 4 ranks; cross terms not shown)")
    fig.tight_layout()
    figures["theory_decomposition.png"] = fig

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        hist = results[name]["history"]
        s, v = series(hist, "gamma_hat")
        axes[0].plot(s[1:], v[1:], label=f"{name}: gamma_hat (oldest version)")
        s, v = series(hist, "xi_hat")
        axes[1].plot(s, v, label=f"{name}: xi_hat")
    for ax, title in zip(axes, ["staleness bias gamma_hat", "noise ratio xi_hat (batch 16)"]):
        ax.axhline(1.0, color="gray", ls=":", label="the theorems need < 1")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    figures["theory_constants.png"] = fig

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        hist = results[name]["history"]
        s, v = series(hist, "lemma3_gap_ratio")
        axes[0].plot(s, v, label=name)
        s, v = series(hist, "copy_noise_corr")
        axes[1].plot(s, v, label=f"{name}: corr(e_stale, e_fresh)", lw=1)
    axes[0].set_title("Lemma 3: (E_R|g_hat|^2 - |g_bar|^2) / |g_bar|^2, uniform stragglers")
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=7)
    axes[1].axhline(0.0, color="gray", ls=":")
    axes[1].set_title("Lemma 4: correlation of same-partition copies' errors")
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    figures["theory_estimator.png"] = fig

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(quad["tau"], quad["pure_delay_closed_form"], "k-", label="2 sin(pi / (2(2 tau + 1)))")
    axes[0].plot(quad["tau"], quad["pure_delay_simulated"], "o", mfc="none", label="simulated (bisection)")
    axes[0].plot(
        [c - 1 for c in quad["c"]],
        quad["pipeline_averaged"],
        "s-",
        color="tab:red",
        label="PGC pipeline, ages 0..c-1 averaged (x = c-1)",
    )
    axes[0].set_xlabel("delay tau (= c - 1)")
    axes[0].set_ylabel("largest stable eta * h")
    axes[0].set_title("Delayed gradient on a quadratic: stability boundary")
    axes[0].legend(fontsize=8)
    axes[1].loglog(quad["delays"], quad["staleness_error"], "o-", label="|grad F(b_t) - grad F(b_(t-tau))|^2")
    axes[1].loglog(quad["delays"], quad["lipschitz_bound"], "--", label="L^2 |b_t - b_(t-tau)|^2")
    axes[1].set_xlabel("delay tau")
    axes[1].set_title(f"staleness error vs delay: log-log slope {quad['slope']:.3f}")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    figures["theory_quadratic.png"] = fig
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=10, help="theory_every_n_steps")
    p.add_argument("--skip", type=int, default=20, help="steps left out of the medians (warm-up)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--delay", default="lognormal(median=0.003, sigma=1.0)")
    p.add_argument("--out", default=str(ROOT / "outputs" / "theory_run"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "results"))
    p.add_argument("--replot", action="store_true", help="only redraw the figures from docs/results/theory_run.json")
    p.add_argument(
        "--resummarize",
        action="store_true",
        help="only recompute the per-run summaries (medians, shares, expectation ratios) of "
        "docs/results/theory_run.json from its saved series, with --skip",
    )
    args = p.parse_args()
    out, docs = Path(args.out), Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    if args.resummarize:
        path = docs / "theory_run.json"
        saved = json.loads(path.read_text())
        for name, rows in saved["series"].items():
            saved["runs"][name]["medians"] = summarize(prefixed(rows), args.skip)
            saved["runs"][name]["expectation_ratios"] = expectation_ratios(prefixed(rows), args.skip)
            print(name, json.dumps(saved["runs"][name]["expectation_ratios"]))
        saved["resummarized"] = "python benchmarks/theory_run.py --resummarize " + f"--skip {args.skip}"
        print(write_json(path, saved))
        return
    if args.replot:
        saved = json.loads((docs / "theory_run.json").read_text())
        results = {name: {"history": prefixed(rows)} for name, rows in saved["series"].items()}
        for name, fig in plot(results, saved["quadratic"]).items():
            print(save_figure(fig, docs / name))
        return

    results = {}
    for name, cfg in RUNS.items():
        started = time.time()
        job = launch(
            dict(
                out=str(out / name.split(" (")[0].replace(" ", "_").replace("=", "")),
                devices=4,
                max_steps=args.steps,
                batch_size=16,
                lr=args.lr,
                delay=args.delay,
                check_val_every_n_epoch=10_000,
                val_every_n_steps=args.steps,
                diagnostics={"every_n_steps": args.every, "theory_every_n_steps": args.every},
                **cfg,
            ),
            timeout=900,
        )
        hist = job.diagnostics
        theory_rows = [h for h in hist if "pgc/theory/total_sq" in h]
        admitted = {r: statistics.mean(h.get(f"pgc/admitted/rank{r}", 0.0) for h in hist) for r in range(4)}
        results[name] = {
            "spec": {k: v for k, v in job.spec.items() if k != "out"},
            "medians": summarize(hist, args.skip),
            "expectation_ratios": expectation_ratios(hist, args.skip),
            "admitted_fraction": admitted,
            "skipped_steps": [r["skipped_steps"] for r in job.ranks],
            "val_acc": job.val_curve[-1][3],  # rank 0, whole validation set, after the last step
            "identical_replicas": job.identical_replicas,
            "wall_s": time.time() - started,
            "history": [
                {"step": h["step"], **{k[len("pgc/theory/") :]: v for k, v in h.items() if k.startswith("pgc/theory/")}}
                for h in theory_rows
            ],
        }
        med = results[name]["medians"]
        print(
            f"{name}: gamma_hat {med.get('gamma_hat', float('nan')):.3g}  xi_hat {med['xi_hat']:.3g}  "
            f"shares {json.dumps({k: round(v, 3) for k, v in med['share'].items()})}  "
            f"admitted {admitted}  cost {med['cost_s']:.2f} s",
            flush=True,
        )
    quad = quadratic_checks()
    figures = plot({name: {"history": prefixed(r["history"])} for name, r in results.items()}, quad)
    payload = {
        "command": "python benchmarks/theory_run.py " + " ".join(sys.argv[1:]),
        "args": vars(args),
        "runs": {k: {kk: vv for kk, vv in v.items() if kk != "history"} for k, v in results.items()},
        "series": {k: v["history"] for k, v in results.items()},
        "quadratic": quad,
    }
    for w in write_report(docs, "theory_run", payload, figures=figures):
        print(w)


if __name__ == "__main__":
    main()
