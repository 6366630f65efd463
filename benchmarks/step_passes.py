"""The memory passes a pgc step adds to a ddp step, timed one by one, against the gap measured on the collective plane.

    python benchmarks/step_passes.py    # writes docs/step_time_passes.json and .md (about 30 s)

A ``pgc_cr`` step (c = 2) does what a ddp step does (backward, one all-reduce of the payload, the optimizer) plus
four passes over the payload that ddp does not make: it copies ``param.grad`` into the partition's slot, checks the
slot is finite, encodes the code (the weighted sum of the c cached slots: ``codes.schemes``) and writes its
contribution (the code times its decode weight) into the all-reduce buffer (``codes.shares.contribute``). Each is
timed here alone, on one thread, at the payload size of each model of ``docs/step_time_planes.json``. On the 2-core
machine of that benchmark 4 ranks share 2 cores, so a rank's passes take about ``ranks / cores`` times their
one-thread time of wall time per step; the page sets that estimate beside the gap measured there (pgc minus ddp,
seconds per step, per round).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from lightning_pgc.experiments.report import write_report

DOCS = Path(__file__).resolve().parents[1] / "docs"
#: the models of the collective-plane benchmark: (pgc run, ddp run) of docs/step_time_planes.json
PAIRS = {"10m": ("10m/pgc/n4", "10m/ddp/n4"), "comm": ("comm/pgc_cr/n4", "comm/ddp/n4")}
RANKS = 4
REPEATS = 30


def _ms(fn: Callable[[], object]) -> float:
    """Milliseconds per call, the median of ``REPEATS`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def passes(numel: int) -> dict[str, float]:
    """Each added pass over a payload of ``numel`` float32 values, in milliseconds on one thread."""
    grad, slot, other, code = (torch.randn(numel) for _ in range(4))
    return {
        "copy param.grad into its slot": _ms(lambda: slot.copy_(grad)),
        "finite check of the slot": _ms(lambda: torch.isfinite(slot.sum())),
        "encode (weighted sum of 2 slots)": _ms(lambda: torch.add(slot, other, alpha=0.5, out=code).mul_(0.5)),
        "contribution (code times its weight)": _ms(lambda: torch.mul(code, 0.25, out=other)),
    }


def main() -> None:
    torch.set_num_threads(1)
    planes = json.loads((DOCS / "step_time_planes.json").read_text())
    cores = os.cpu_count() or 1
    models = {}
    for model, (pgc, ddp) in PAIRS.items():
        numel = int(planes["params"][model])
        timed = passes(numel)
        gaps = [(a - b) * 1e3 for a, b in zip(planes["seconds_per_step"][pgc], planes["seconds_per_step"][ddp])]
        ddp_ms = [s * 1e3 for s in planes["seconds_per_step"][ddp]]
        one_thread = sum(timed.values())
        models[model] = {
            "params": numel,
            "passes_ms": timed,
            "passes_total_ms": one_thread,
            "estimated_wall_ms": one_thread * RANKS / cores,
            "measured_gap_ms": gaps,
            "ddp_step_ms": ddp_ms,
            "five_percent_of_ddp_ms": [0.05 * s for s in ddp_ms],
        }
    result = {
        "command": "python benchmarks/step_passes.py",
        "machine": f"{cores} CPU cores, 1 thread per pass",
        "ranks": RANKS,
        "source": "docs/step_time_planes.json",
        "models": models,
    }
    write_report(DOCS, "step_time_passes", result, page=render(result))
    print(render(result))


def render(res: dict) -> str:
    cores = int(res["machine"].split()[0])
    lines = [
        "# Step time: the passes a pgc step adds",
        "",
        f"Produced by `{res['command']}` ({res['machine']}); every number below is in docs/step_time_passes.json. "
        f"Each pass a `pgc_cr` step (c = 2) makes over its payload and a ddp step does not, timed alone on one "
        f"thread (median of {REPEATS}). With {res['ranks']} ranks on {cores} cores a rank's passes cost about "
        f"{res['ranks']}/{cores} of their one-thread time in wall time per step; that estimate stands beside the gap "
        f"measured in [{Path(res['source']).name}](step_time_planes.md) (pgc minus ddp, per round).",
        "",
    ]
    for model, m in res["models"].items():
        lines += [f"**{model}** ({m['params']} parameters, float32):", "", "| pass | ms, one thread |", "|---|---:|"]
        lines += [f"| {name} | {ms:.2f} |" for name, ms in m["passes_ms"].items()]
        gaps = ", ".join(f"{g:.1f}" for g in m["measured_gap_ms"])
        five = ", ".join(f"{g:.1f}" for g in m["five_percent_of_ddp_ms"])
        lines += [
            f"| all passes | {m['passes_total_ms']:.2f} |",
            "",
            f"Estimated wall time per step: {m['estimated_wall_ms']:.1f} ms; measured gap per round: {gaps} ms; "
            f"5 % of ddp's step per round: {five} ms.",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
