"""Why a persistently slow replica of four did not come out at about half of ddp's time, measured part by part.

    nice python benchmarks/advise_diagnosis.py

On the synthetic trace of ``benchmarks/advise_trace.py --synthetic 2`` (4 ranks, rank 3 twice as slow at every step,
compute-to-communication 4), with the emulator's own pieces:

1. **Resampling**: the simulated clock's mean time per version of each arm against ddp's, with the trace's delays
   resampled one step at a time (``L = 1``) and in blocks (the trace's block length). A persistent slowdown is a
   property of a rank's whole row, so both keep it: the clock removes the slow replica's cost either way. On a
   trace with a stall of many steps instead, the longest stall the replay rebuilds, per resampling.
2. **The proxy task**: versions to the late target of ``ignore_stragglers`` (s = 1, dropping the same partition
   every version, as it does when one replica is always last) against ddp's, at ddp's tuned setting, on schedules
   without delays, over :data:`SEEDS` seeds: what dropping a quarter of the gradients costs the digits MLP.
3. **The statistics**: the smallest Holm p an arm can reach with 6 seeds over 4 comparisons (the previous advise),
   and with the map's 16 seeds over the family of every arm at n = 4.

Writes docs/results/advise_diagnosis.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SEEDS = tuple(range(8))


def clock_ratios(own: np.ndarray, blocks: dict[str, int], arms: list[Any], versions: int = 200) -> dict[str, Any]:
    from lightning_pgc.emulator.cluster import COMPUTE_S, costs_for
    from lightning_pgc.emulator.clock import simulate
    from lightning_pgc.emulator.traces import TraceDelays, trace_delays

    typical, delays = trace_delays(own)
    delays = delays * (COMPUTE_S / typical)
    costs = costs_for(4.0)
    out: dict[str, Any] = {}
    for name, block in blocks.items():
        per: dict[str, float] = {}
        for arm in arms:
            means = []
            for seed in SEEDS:
                res = simulate(arm.scheme(own.shape[0]), versions, TraceDelays(delays, block, seed), costs, seed)
                times = [r.closed_at for r in res.records]
                means.append((times[-1] - times[0]) / (len(times) - 1))
            per[arm.label] = float(np.mean(means))
        out[name] = {"block": block, "s_per_version": per, "vs_ddp": {k: v / per["ddp"] for k, v in per.items()}}
    return out


REPLAYED = 2000  #: steps replayed to look for the longest rebuilt stall


def longest_rebuilt(own: np.ndarray, block: int, rank: int, steps: int = REPLAYED) -> int:
    """The longest run of consecutive stalled steps of ``rank`` in ``steps`` replayed steps."""
    from lightning_pgc.emulator.traces import STALL_FRACTION, TraceDelays, trace_delays

    typical, delays = trace_delays(own)
    model = TraceDelays(delays, block, seed=0)
    rng = np.random.default_rng(0)
    stalled = [model.sample(rank, t, rng) > STALL_FRACTION * typical for t in range(steps)]
    best = run = 0
    for hit in stalled:
        run = run + 1 if hit else 0
        best = max(best, run)
    return best


def dropped_versions(lr: float, momentum: float, target: float) -> dict[str, Any]:
    """Versions to ``target`` of ddp and of ignore_stragglers dropping partition 3 at every version (no delays)."""
    from lightning_pgc.emulator.cells import MapArm, _digits, _model
    from lightning_pgc.emulator.data import DataCondition, partition_streams
    from lightning_pgc.emulator.schedule import Version
    from lightning_pgc.emulator.train import Task, emulate

    x, y, xv, yv = _digits()
    out: dict[str, list[Any]] = {"ddp": [], "ignore_stragglers c=2": []}
    for seed in SEEDS:
        for label, admitted in (("ddp", (0, 1, 2, 3)), ("ignore_stragglers c=2", (0, 1, 2))):
            arm = MapArm("ddp") if label == "ddp" else MapArm("ignore_stragglers", 2)
            scheme = arm.scheme(4)
            schedule = [Version(t, admitted, {k: (0,) for k in admitted}, float(t + 1)) for t in range(300)]
            model, batch = _model("mlp", seed)
            streams = partition_streams(y.numpy(), 4, seed, DataCondition("iid"))
            run = emulate(scheme, schedule, Task(model, x, y, xv, yv, batch), streams, lr, momentum, stop_below=target)
            out[label].append(next((s for s, v in zip(run.val_steps, run.val_loss) if v <= target), None))
    reached = [(a, b) for a, b in zip(out["ignore_stragglers c=2"], out["ddp"]) if a is not None and b is not None]
    return {
        "lr": lr,
        "momentum": momentum,
        "target": target,
        "versions": out,
        "ratio_of_means": float(np.mean([a for a, _ in reached]) / np.mean([b for _, b in reached])),
    }


def main() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import advise_trace

    from lightning_pgc.emulator.advise import candidate_arms, p_floor
    from lightning_pgc.emulator.cells import MapArm
    from lightning_pgc.emulator.traces import block_length

    torch.set_num_threads(1)
    started = time.process_time()
    own = np.asarray(advise_trace.synthetic(2.0)["own_s"])
    arms = [MapArm("ddp"), MapArm("ignore_stragglers", 2), MapArm("pgc_fr", 2), MapArm("bounded_staleness", 2)]
    clock = clock_ratios(own, {"single steps": 1, "blocks": block_length(own)}, arms)
    stall = np.full((4, 200), 0.1)
    stall[1, 50:70] += 1.0  # rank 1 stalls for 20 consecutive steps
    stalls = {
        "stall_steps": 20,
        "replayed_steps": REPLAYED,
        "block": block_length(stall),
        "longest_rebuilt_single_steps": longest_rebuilt(stall, 1, 1),
        "longest_rebuilt_blocks": longest_rebuilt(stall, block_length(stall), 1),
    }
    family = 2 * (len(candidate_arms(4)) - 1)
    dropped = dropped_versions(0.4, 0.8, 0.3)
    result = {
        "command": "python benchmarks/advise_diagnosis.py",
        "label": "emulated",
        "trace": "python benchmarks/advise_trace.py --synthetic 2 (rank 3 twice as slow at every step)",
        "seeds": list(SEEDS),
        "clock": clock,
        "stalls": stalls,
        "dropped": dropped,
        "expected_ignore_ratio": clock["blocks"]["vs_ddp"]["ignore_stragglers c=2"] * dropped["ratio_of_means"],
        "p_floor": {
            # the previous advise: lr x momentum in {0.2, 0.4} x {0, 0.9}, 150 ideal steps, 1 tuning seed, s = 1,
            # 6 evaluation seeds, Holm over its 4 arms against ddp
            "previous": {
                "lrs": [0.2, 0.4],
                "momenta": [0.0, 0.9],
                "budget_steps": 150,
                "seeds": 6,
                "comparisons": 4,
                "p": p_floor(6, 4),
            },
            "now": {"seeds": 16, "comparisons": family, "p": p_floor(16, family)},
        },
        "cpu_s": time.process_time() - started,
    }
    (ROOT / "docs" / "results" / "advise_diagnosis.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
