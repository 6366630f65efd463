"""The passes over the gradient a pgc step makes and a ddp step makes, timed one by one, and the overlap ddp gets.

    python benchmarks/step_passes.py    # writes docs/results/step_time_passes.json and .md (about 3 min on 2 cores)

**Passes.** A ``pgc_cr`` step (c = 2) keeps what backward left in ``param.grad`` as the partition's cache entry (no
copy), then makes three passes over the payload: it encodes the code straight from the fresh and the cached
gradients (one fused ``add`` per parameter: reads two, writes one; ``Gradients.encode``), checks the code is finite
(one read) and writes its contribution, the code times its decode weight, into the all-reduce buffer (one read, one
write; ``codes.shares.contribute``). Lightning's ddp (``gradient_as_bucket_view=False``) copies each gradient into
its bucket divided by the world size and copies the reduced bucket back into ``param.grad``. Each pass is timed
alone on one thread at the payload size of each model of ``docs/results/step_time_planes.json``, beside the passes the
earlier data path made (a copy of ``param.grad`` into a flat slot, a finite check of the slot, a two-kernel encode)
and the alternative of pointing ``param.grad`` at a zeroed flat slot (backward then adds into it): that one is timed
on a real backward of the model, against a backward that allocates its gradients.

**Overlap.** ddp all-reduces bucket by bucket while backward runs. On 4 gloo ranks (one thread each, no Lightning)
each model is stepped four ways, interleaved: ``ddp`` (torch's DistributedDataParallel, its default 25 MB buckets),
``serial`` (the same passes with one all-reduce of the whole flat gradient after backward), ``compute`` (backward
and the optimizer, no all-reduce) and ``all_reduce`` (the flat all-reduce alone). ``serial - ddp`` is the time ddp's
overlap saves per step: the most that starting a coded step's all-reduce during backward (predicted admission)
could save.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from pgc_lab.experiments.report import write_report

DOCS = Path(__file__).resolve().parents[1] / "docs" / "results"
#: the models of the collective-plane benchmark: (pgc run, ddp run) of docs/results/step_time_planes.json
PAIRS = {
    "10m": ("10m/pgc_cr/n4", "10m/ddp/n4"),
    "25m": ("25m/pgc_cr/n4", "25m/ddp/n4"),
    "comm": ("comm/pgc_cr/n4", "comm/ddp/n4"),
}
HIDDEN = {"10m": 10_000, "25m": 25_000}  # MLP 1024-H-4, batch 32 per rank (benchmarks/step_time.py)
RANKS = 4
REPEATS = 30
OVERLAP_STEPS = 12  # per arm and round
OVERLAP_ROUNDS = 3


def _ms(fn: Callable[[], object]) -> float:
    """Milliseconds per call, the median of ``REPEATS`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def passes(numel: int) -> dict[str, dict[str, float]]:
    """Each pass over a payload of ``numel`` float32 values, in milliseconds on one thread."""
    fresh, cached, code, buf, bucket = (torch.randn(numel) for _ in range(5))
    return {
        "pgc": {
            "encode (fresh + cached, one fused add)": _ms(lambda: torch.add(fresh, cached, out=code)),
            "finite check of the code": _ms(lambda: torch.isfinite(code.sum())),
            "contribution (code times its weight)": _ms(lambda: torch.mul(code, 0.125, out=buf)),
        },
        "ddp": {
            "copy param.grad into its bucket, divided by n": _ms(lambda: torch.mul(fresh, 0.25, out=bucket)),
            "copy the bucket back into param.grad": _ms(lambda: fresh.copy_(bucket)),
        },
        "earlier": {
            "copy param.grad into its slot": _ms(lambda: code.copy_(fresh)),
            "finite check of the slot": _ms(lambda: torch.isfinite(code.sum())),
            "encode (copy, then add)": _ms(lambda: code.copy_(fresh).add_(cached)),
            "contribution (code times its weight)": _ms(lambda: torch.mul(code, 0.125, out=buf)),
        },
    }


def _mlp(hidden: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(1024, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
    x, y = torch.randn(32, 1024), torch.randint(0, 4, (32,))
    return net, lambda: torch.nn.functional.cross_entropy(net(x), y)


def _model(name: str) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    if name in HIDDEN:
        return _mlp(HIDDEN[name])
    from lightning_pgc.examples.digits import DigitsCNN

    torch.manual_seed(0)
    net = DigitsCNN(hidden=8192, sync_train_loss=False)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    return net, lambda: torch.nn.functional.cross_entropy(net(x), y)


def views(name: str) -> dict[str, float]:
    """A real backward of ``name`` that allocates ``param.grad``, then copies it into a flat slot, against one whose
    ``param.grad`` are views of a flat slot zeroed first (ms, one thread, median; the two interleaved)."""
    net, loss_fn = _model(name)
    params = list(net.parameters())
    numel = sum(p.numel() for p in params)
    slot = torch.zeros(numel)

    def allocate() -> None:
        for p in params:
            p.grad = None
        loss_fn().backward()

    def copy() -> None:
        allocate()
        torch.cat([p.grad.reshape(-1) for p in params], out=slot)  # type: ignore[union-attr]

    def view() -> None:
        slot.zero_()
        offset = 0
        for p in params:
            p.grad = slot[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        loss_fn().backward()

    arms: dict[str, Callable[[], None]] = {"allocate": allocate, "allocate + copy": copy, "zeroed views": view}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for fn in arms.values():
        fn()
    for _ in range(REPEATS):
        for k, fn in arms.items():
            started = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - started)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


# ------------------------------------------------------------------------------------------------- overlap
def _overlap_rank(rank: int, init: str, models: list[str], out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    result: dict[str, Any] = {}
    for name in models:
        net, loss_fn = _model(name)
        ddp_net = DistributedDataParallel(_model(name)[0])  # (its own copy: ddp's hooks stay on its parameters)
        ddp_opt = torch.optim.SGD(ddp_net.parameters(), lr=1e-6)
        params = list(net.parameters())
        numel = sum(p.numel() for p in params)
        flat = torch.zeros(numel)
        opt = torch.optim.SGD(params, lr=1e-6)

        def compute() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn().backward()
            opt.step()

        def serial() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn().backward()
            offset = 0
            for p in params:  # as ddp: into the bucket divided by n, all-reduce, back into param.grad
                torch.mul(p.grad.reshape(-1), 1 / RANKS, out=flat[offset : offset + p.numel()])  # type: ignore[union-attr]
                offset += p.numel()
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))  # type: ignore[union-attr]
                offset += p.numel()
            opt.step()

        def with_ddp() -> None:
            ddp_opt.zero_grad(set_to_none=True)
            _ddp_loss(name, ddp_net).backward()
            ddp_opt.step()

        def all_reduce() -> None:
            dist.all_reduce(flat)

        arms: dict[str, Callable[[], None]] = {
            "ddp": with_ddp,
            "serial": serial,
            "compute": compute,
            "all_reduce": all_reduce,
        }
        times: dict[str, list[float]] = {k: [] for k in arms}
        for k, fn in arms.items():  # warm-up
            fn()
        for _ in range(OVERLAP_ROUNDS):
            for k, fn in arms.items():
                dist.barrier()
                started = time.perf_counter()
                for _ in range(OVERLAP_STEPS):
                    fn()
                dist.barrier()
                times[k].append((time.perf_counter() - started) / OVERLAP_STEPS * 1e3)
        result[name] = {"params": numel, "ms_per_step": times}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


_INPUTS: dict[str, Any] = {}


def _ddp_loss(name: str, ddp_net: torch.nn.Module) -> torch.Tensor:
    """The model's loss through ddp's forward (so its reducer sees the backward), on the same fixed batch."""
    if name not in _INPUTS:
        torch.manual_seed(0)
        if name in HIDDEN:
            _INPUTS[name] = (torch.randn(32, 1024), torch.randint(0, 4, (32,)))
        else:
            _INPUTS[name] = (torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,)))
    x, y = _INPUTS[name]
    return torch.nn.functional.cross_entropy(ddp_net(x), y)


def overlap(models: list[str]) -> dict[str, Any]:
    """Per model: each arm's milliseconds per step (per round, barrier to barrier, on 4 ranks)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "overlap.json")
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.spawn(_overlap_rank, args=(init, models, out), nprocs=RANKS, join=True)
        measured = json.loads(Path(out).read_text())
    for m in measured.values():
        t = {k: statistics.median(v) for k, v in m["ms_per_step"].items()}
        m["median_ms"] = t
        m["saved_by_overlap_ms"] = t["serial"] - t["ddp"]
        m["communication_ms"] = t["serial"] - t["compute"]
        m["hidden_share"] = (t["serial"] - t["ddp"]) / max(t["serial"] - t["compute"], 1e-9)
        m["saved_share_of_ddp_step"] = (t["serial"] - t["ddp"]) / t["ddp"]
    return measured


def main() -> None:
    torch.set_num_threads(1)
    planes = json.loads((DOCS / "step_time_planes.json").read_text())
    cores = os.cpu_count() or 1
    started = time.time()
    models = {}
    for model, (pgc, ddp) in PAIRS.items():
        numel = int(planes["params"][model])
        timed = passes(numel)
        totals = {k: sum(v.values()) for k, v in timed.items()}
        gaps = [(a - b) * 1e3 for a, b in zip(planes["seconds_per_step"][pgc], planes["seconds_per_step"][ddp])]
        ddp_ms = [s * 1e3 for s in planes["seconds_per_step"][ddp]]
        models[model] = {
            "params": numel,
            "passes_ms": timed,
            "totals_ms": totals,
            "added_ms": totals["pgc"] - totals["ddp"],
            "estimated_wall_ms": (totals["pgc"] - totals["ddp"]) * RANKS / cores,
            "measured_gap_ms": gaps,
            "ddp_step_ms": ddp_ms,
            "five_percent_of_ddp_ms": [0.05 * s for s in ddp_ms],
            "backward_ms": views(model),
        }
    load = os.getloadavg()[0]
    result = {
        "command": "python benchmarks/step_passes.py",
        "machine": f"{cores} CPU cores shared with other jobs, 1 thread per pass",
        "load": load,
        "ranks": RANKS,
        "source": "docs/results/step_time_planes.json",
        "models": models,
        "overlap": overlap(list(PAIRS)),
        "overlap_load": os.getloadavg()[0],
        "minutes": (time.time() - started) / 60,
    }
    write_report(DOCS, "step_time_passes", result, page=render(result))
    print(render(result))


def render(res: dict) -> str:
    cores = int(res["machine"].split()[0])
    lines = [
        "# Step time: the passes over the gradient, and the overlap",
        "",
        f"Produced by `{res['command']}` ({res['machine']}, load average {res['load']:.1f}; "
        f"{res['minutes']:.0f} min); every number below is in docs/results/step_time_passes.json. Each pass is timed "
        f"alone on one thread (median of {REPEATS}) at the payload size of a model of "
        f"[{Path(res['source']).name}](step_time_planes.md). With {res['ranks']} ranks on {cores} cores a rank's "
        f"passes cost about {res['ranks']}/{cores} of their one-thread time in wall time per step; that estimate "
        "(pgc's passes minus ddp's) stands beside the gap measured there (pgc minus ddp, per round).",
        "",
        "A `pgc_cr` step (c = 2) keeps what backward left in `param.grad` as its cache entry: no pass copies the "
        "fresh gradient. The passes that remain are the encode (the fresh plus the cached gradient, one fused add "
        "per parameter, written into the code), the finite check of the code (a NaN or inf in either gradient "
        "reaches it) and the contribution (the code times its decode weight, into the all-reduce buffer). "
        "Lightning's ddp makes two passes of its own: into its buckets (divided by n) and back into `param.grad`.",
        "",
    ]
    for model, m in res["models"].items():
        lines += [
            f"**{model}** ({m['params']} parameters, float32):",
            "",
            "| step | pass | ms, one thread |",
            "|---|---|---:|",
        ]
        for arm, label in (("pgc", "pgc"), ("ddp", "ddp"), ("earlier", "pgc, earlier data path")):
            lines += [f"| {label} | {name} | {ms:.2f} |" for name, ms in m["passes_ms"][arm].items()]
            lines.append(f"| {label} | all | {m['totals_ms'][arm]:.2f} |")
        gaps = ", ".join(f"{g:.1f}" for g in m["measured_gap_ms"])
        five = ", ".join(f"{g:.1f}" for g in m["five_percent_of_ddp_ms"])
        b = m["backward_ms"]
        lines += [
            "",
            f"pgc's passes minus ddp's: {m['added_ms']:.2f} ms on one thread, about {m['estimated_wall_ms']:.1f} ms "
            f"of wall time per step; measured gap per round: {gaps} ms; 5 % of ddp's step per round: {five} ms.",
            "",
            f"Backward, one thread: {b['allocate']:.1f} ms allocating `param.grad`, {b['allocate + copy']:.1f} ms "
            f"with a copy into a flat slot after it, {b['zeroed views']:.1f} ms into `param.grad` views of a flat "
            "slot zeroed first (autograd adds into a gradient that exists: the zeroing and the read of the zeros "
            "cost more than the copy they save, so the cache keeps the tensors backward allocates instead).",
            "",
        ]
    lines += [
        "## Overlap: what ddp's bucketed all-reduce during backward saves",
        "",
        f"4 gloo ranks, one thread each (load average {res['overlap_load']:.1f} after the run), milliseconds per "
        "step, median of the rounds (the arms interleaved). `serial`: backward, then the same passes as ddp around "
        "one all-reduce of the whole gradient; `ddp`: torch's DistributedDataParallel (25 MB buckets, all-reduced "
        "as backward fills them); `compute`: backward and the optimizer alone; `all_reduce`: the all-reduce alone. "
        "`saved` = serial - ddp is what the overlap buys per step, and the most that predicted admission (admitted "
        "ranks all-reducing buckets during backward) could buy a coded step; `hidden` is its share of the "
        "communication (serial - compute).",
        "",
        "| model | ddp | serial | compute | all_reduce | saved | hidden | saved / ddp step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, m in res["overlap"].items():
        t = m["median_ms"]
        lines.append(
            f"| {model} | {t['ddp']:.1f} | {t['serial']:.1f} | {t['compute']:.1f} | {t['all_reduce']:.1f} | "
            f"{m['saved_by_overlap_ms']:.1f} | {100 * m['hidden_share']:.0f} % | "
            f"{100 * m['saved_share_of_ddp_step']:.1f} % |"
        )
    shares = [100 * m["saved_share_of_ddp_step"] for m in res["overlap"].values()]
    lines += [
        "",
        f"Predicted admission is not built: here ddp's overlap saved {min(shares):.1f} % to {max(shares):.1f} % of "
        "its step (a negative share: the serial step was the faster), so admitting ranks early could not pay for "
        "the mispredictions it would add. On CPU ranks the all-reduce's work "
        "(gloo copies and sums on the same cores) competes with backward instead of running beside it. Where "
        "communication runs beside compute (NCCL on GPUs with their own links) the bound is the `hidden` share "
        "of the all-reduce, and it is worth measuring there first.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
