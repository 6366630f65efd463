"""GPU check of the collective data plane on NCCL: a ResNet-18 (11.2 M parameters), pgc vs ddp, one rank per GPU.

    python benchmarks/gpu_check.py --ranks 2 --slow-seconds 0.5 --write   # on a machine with >= 2 CUDA GPUs
    python benchmarks/gpu_check.py --accelerator cpu --steps 6 --ranks 2   # a dry run of the script itself (gloo)

Every process is one Lightning "node" that sees one GPU (``CUDA_VISIBLE_DEVICES``), so ddp all-reduces with NCCL and
``PGCStrategy`` builds its data group on NCCL, with codes, aggregates and ``param.grad``
on the GPU. For each configuration it reports the step time (throughput as in step_time.py: wall time from every
rank past step ``--skip`` to every rank done, per step), whether the last aggregate has the same bits on every rank
(and the parameters too), and the host<->device copies per step counted by the profiler over three steps (CUDA
only). Random 32x32 images, nothing downloads. Prints one JSON line per configuration; ``--write`` writes
docs/gpu_check.json. On CPU (the dry run) the same code runs on gloo and no copies are counted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from lightning_pgc.experiments.launch import launch_script
from lightning_pgc.experiments.report import write_json
from lightning_pgc.experiments.stats import seconds_per_step

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torchvision
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pgc import PGCStrategy
    from lightning_pgc.callbacks.stragglers import StragglerInjector

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torchvision.models.resnet18(weights=None, num_classes=10)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock(pl.Callback):
        """Step times; host<->device copies over steps ``skip .. skip + 3`` (CUDA); the last aggregate's hash."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.copies: Any = None
            self.aggregate_sha = ""
            self._prof: Any = None

        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == args.skip and torch.cuda.is_available():
                from torch.profiler import ProfilerActivity, profile

                self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self._prof.__enter__()

        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.time())
            if self._prof is not None and trainer.global_step == args.skip + 3:
                self._prof.__exit__(None, None, None)
                names = [e.name for e in self._prof.events()]
                self.copies = sum(("HtoD" in n or "DtoH" in n) and "Memcpy" in n for n in names) / 3
                self._prof = None
            info = getattr(trainer.strategy, "last_step", None)
            if info is not None and trainer.global_step == args.steps:
                data = info.aggregate.detach().float().cpu().numpy().tobytes()
                self.aggregate_sha = hashlib.sha256(data).hexdigest()

    g = torch.Generator().manual_seed(0)
    n = 64 * args.ranks * 4
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    clock = Clock()
    callbacks: list[Any] = [clock]
    if args.slow_seconds > 0:
        callbacks.append(StragglerInjector(f"slowranks(ranks=[1], seconds={args.slow_seconds})"))
    if args.strategy == "ddp":
        strategy: Any = DDPStrategy()
    else:
        strategy = PGCStrategy(scheme=args.strategy, stragglers=1, diagnostics=False)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        num_nodes=args.ranks,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), DataLoader(data, batch_size=64, shuffle=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    st = trainer.strategy
    from lightning_pgc.experiments.callbacks import parameter_checksum

    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "times": clock.times,
                "host_copies_per_step": clock.copies,
                "aggregate_sha256": clock.aggregate_sha,
                "checksum": parameter_checksum(trainer.lightning_module),
                "device": str(trainer.strategy.root_device),
                "params": sum(p.numel() for p in trainer.lightning_module.parameters()),
                "buffers": getattr(st, "buffer_stats", {}),
                "rank_stats": st.rank_stats() if hasattr(st, "rank_stats") else [],
            }
        )
    )


def launch(args: argparse.Namespace, strategy: str, slow: float, out: Path) -> dict:
    """Start ``args.ranks`` processes (each a one-device node on its own GPU) and summarize what they wrote."""
    worker = ["--strategy", strategy, "--ranks", str(args.ranks), "--steps", str(args.steps)]
    worker += ["--skip", str(args.skip), "--accelerator", args.accelerator, "--slow-seconds", str(slow)]

    def one_gpu(rank: int) -> dict[str, str]:  # NCCL refuses two ranks on one GPU
        return {"CUDA_VISIBLE_DEVICES": str(rank)} if args.accelerator == "cuda" else {}

    ranks = launch_script(
        Path(__file__), worker, out, args.ranks, one_process_per_rank=True, rank_env=one_gpu, threads=2, timeout=900
    )
    shas = {r["aggregate_sha256"] for r in ranks}
    return {
        "strategy": strategy,
        "slow_s": slow,
        "seconds_per_step": seconds_per_step([r["times"] for r in ranks], args.skip),
        "device": ranks[0]["device"],
        "params": ranks[0]["params"],
        "buffers": ranks[0]["buffers"],
        "rank_stats": ranks[0]["rank_stats"],
        "aggregate_identical": None if strategy == "ddp" else (len(shas) == 1 and "" not in shas),
        # (ddp's BatchNorm statistics differ between ranks after the last forward: buffers are broadcast before it)
        "parameters_identical": None if strategy == "ddp" else len({r["checksum"] for r in ranks}) == 1,
        "host_copies_per_step": [r["host_copies_per_step"] for r in ranks],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="pgc_cr")
    p.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--accelerator", default="cuda")
    p.add_argument("--slow-seconds", type=float, default=0.0)
    p.add_argument("--write", action="store_true", help="write docs/gpu_check.json")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.accelerator == "cuda":
        import torch

        if torch.cuda.device_count() < args.ranks:
            raise SystemExit(
                f"--ranks {args.ranks} needs as many CUDA GPUs (one rank per GPU: NCCL), found "
                f"{torch.cuda.device_count()}"
            )
    results = []
    configs = [("ddp", 0.0), ("pgc_cr", 0.0)]
    if args.slow_seconds > 0:
        configs += [("ddp", args.slow_seconds), ("pgc_cr", args.slow_seconds)]
    for strategy, slow in configs:
        res = launch(args, strategy, slow, Path(args.out) / f"{strategy}_{slow}")
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "buffers"}), flush=True)
    if args.write:
        command = "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:])
        write_json(ROOT / "docs" / "gpu_check.json", {"command": command, "results": results})


if __name__ == "__main__":
    main()
