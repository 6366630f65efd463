"""GPU check of the data plane: several processes on one GPU, a ResNet-18 (11.2 M parameters), pgc vs ddp.

    python benchmarks/gpu_check.py --slow-seconds 0.5 --write   # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py --accelerator cpu --steps 4 --ranks 2   # a dry run of the script itself

Every process is one Lightning "node" with one device, all on ``cuda:0`` (NCCL refuses two ranks on one GPU, so
both strategies use gloo for their process groups: ddp all-reduces CUDA tensors through gloo's host staging;
pgc copies gradients into pinned host buffers asynchronously and back). Random 32x32 images, nothing downloads.
Prints one JSON line per configuration and writes docs/gpu_check.json. Throughput as in step_time.py: wall time
from every rank past step ``--skip`` to every rank done, per step; optional slow rank (``--slow-seconds``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torchvision
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pgc import PGCStrategy
    from lightning_pgc.stragglers import StragglerInjector

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
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, *_: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.time())

    g = torch.Generator().manual_seed(0)
    n = 64 * args.ranks * 4
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    clock = Clock()
    callbacks: list[Any] = [clock]
    if args.slow_seconds > 0:
        callbacks.append(StragglerInjector(f"slowranks(ranks=[1], seconds={args.slow_seconds})"))
    if args.strategy == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo")
    else:
        strategy = PGCStrategy(scheme=args.strategy, stragglers=1, diagnostics=False, process_group_backend="gloo")
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, num_nodes=args.ranks, strategy=strategy,
                         max_steps=args.steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), DataLoader(data, batch_size=64, shuffle=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    st = trainer.strategy
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "times": clock.times,
        "device": str(trainer.strategy.root_device),
        "params": sum(p.numel() for p in trainer.lightning_module.parameters()),
        "buffers": getattr(st, "buffer_stats", {}),
        "rank_stats": st.rank_stats() if hasattr(st, "rank_stats") else [],
    }))


def launch(args: argparse.Namespace, strategy: str, slow: float, out: Path) -> dict:
    """Start ``args.ranks`` processes by hand (each a one-device node on the same GPU) and read their results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(args.ranks):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(r),
               "LOCAL_RANK": "0", "WORLD_SIZE": str(args.ranks), "OMP_NUM_THREADS": "2"}
        cmd = [sys.executable, __file__, "--worker", "--strategy", strategy, "--out", str(out), "--ranks",
               str(args.ranks), "--steps", str(args.steps), "--accelerator", args.accelerator,
               "--slow-seconds", str(slow)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{strategy} failed:\n" + "\n".join(log[-3000:] for log in logs))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    start = max(r["times"][args.skip - 1] for r in ranks)
    end = max(r["times"][-1] for r in ranks)
    return {"strategy": strategy, "slow_s": slow, "seconds_per_step": (end - start) / (args.steps - args.skip),
            "device": ranks[0]["device"], "params": ranks[0]["params"], "buffers": ranks[0]["buffers"],
            "rank_stats": ranks[0]["rank_stats"]}


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
    results = []
    configs = [("ddp", 0.0), ("pgc_cr", 0.0)]
    if args.slow_seconds > 0:
        configs += [("ddp", args.slow_seconds), ("pgc_cr", args.slow_seconds)]
    for strategy, slow in configs:
        res = launch(args, strategy, slow, Path(args.out) / f"{strategy}_{slow}")
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "buffers"}), flush=True)
    if args.write:
        (ROOT / "docs" / "gpu_check.json").write_text(json.dumps(
            {"command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]), "results": results}, indent=1))


if __name__ == "__main__":
    main()
