"""The ResNet-18 / CIFAR-10 experiment: ResNet-18 on CIFAR-10, 8 workers, log-normal jitter and 10-30 s stalls, c in {2, 4, 8}.

    # on an 8-GPU SLURM node: write one sbatch script per (arm, seed) and submit them
    python benchmarks/seed_experiment.py --launcher slurm --out /scratch/pgc_seed --data-dir /data/cifar10 --submit
    # on an 8-GPU machine, or a node of an allocation: torchrun, one job after the other (run.sh)
    python benchmarks/seed_experiment.py --launcher torchrun --out runs/seed && bash runs/seed/run.sh
    # here (CPU), scaled down: 2 ranks, 3 steps, the synthetic CIFAR-shaped set, delays x 0.001
    python benchmarks/seed_experiment.py --launcher local --out outputs/seed_smoke --synthetic-data \\
        --devices 2 --accelerator cpu --arms dgd pgc_cr_c2 --seeds 0 --steps 3 --val-every 1 \\
        --delay-scale 0.001 --batch-size 4 --num-workers 0
    # afterwards, any launcher: read every job folder and render the table
    python benchmarks/seed_experiment.py --collect --out /scratch/pgc_seed

The arms are the packaged fragments ``seed_experiment/*.yaml`` (``dgd``, ``pgc_cr_c{2,4,8}``,
``bounded_c{2,4,8}``, ``gc_cr_c{2,4}``) and ``strategies/ddp.yaml``, each on top of ``cifar10_resnet18.yaml``
with the straggler model of ``stragglers/seeds.yaml`` (read from that file; ``--delay-scale`` multiplies it).
Every job is an experiments-harness spec (:mod:`pgc_lab.experiments.spec`): its folder holds
``spec.json`` and ``job.yaml`` (``lightning-pgc fit --config cifar10_resnet18.yaml --config job.yaml`` runs it)
and, once finished, the harness's result files (validation curve on rank 0 every ``--val-every`` steps, work
meter with gradient evaluations and FLOPs, utilization, the strategy's diagnostics with gradient ages).
``--collect`` reads them back (:func:`pgc_lab.experiments.read_result`) and writes
``seed_experiment.json`` and ``seed_experiment.md`` into ``--out``: per arm the time to ``--target`` validation
loss, paired ratios against ``dgd`` and ``ddp`` with 95 % t intervals over the seeds, accuracy at equal wall
clock, gradient evaluations, utilization and max age (the grid's statistics, :mod:`crossover`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import yaml

from lightning_pgc import recipe_files as recipes
from pgc_lab.experiments import FILES, job_config, launch, read_result
from pgc_lab.experiments import crossover as cx
from pgc_lab.experiments import runs as single
from pgc_lab.experiments.report import write_report
from pgc_lab.experiments.spec import recipe_path, resolve_spec

RECIPE = "cifar10_resnet18.yaml"
STRAGGLERS = "stragglers/seeds.yaml"
DDP = "strategies/ddp.yaml"


def arm_fragments() -> dict[str, str]:
    """Arm key -> packaged fragment: ``ddp`` and every ``seed_experiment/*.yaml``."""
    names = [n for n in recipes.available() if n.startswith("seed_experiment/")]
    return {"ddp": DDP, **{Path(n).stem: n for n in names}}


def arm_of(key: str) -> cx.GridArm:
    """The grid's arm for a fragment key (``pgc_cr_c4`` -> GridArm("pgc_cr", 4)), for the shared statistics."""
    if key in ("ddp", "dgd"):
        return cx.GridArm(key)
    family, c = key.rsplit("_c", 1)
    return cx.GridArm(family, int(c))


def strategy_of(fragment: str, seed: int) -> tuple[str, dict[str, Any]]:
    """(strategy name, kwargs) of the spec that runs ``fragment``'s strategy with the partition seed ``seed``."""
    strategy = yaml.safe_load(recipe_path(fragment).read_text())["trainer"]["strategy"]
    if isinstance(strategy, str):
        return strategy, ({} if strategy == "ddp" else {"seed": seed})
    return "pgc_cr", {**strategy["init_args"], "seed": seed}  # the uncorrected scheme's defaults, overridden


def seeds_delay(scale: float) -> str:
    """The delay model of ``stragglers/seeds.yaml`` times ``scale`` (times the fragment's own ``scale``)."""
    from lightning_pgc.delays import parse_delay

    injector = yaml.safe_load(recipe_path(STRAGGLERS).read_text())["trainer"]["callbacks"][0]["init_args"]
    return str(parse_delay(injector["delay"]).scaled(scale * float(injector.get("scale", 1.0))))


def job_spec(key: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    strategy, kwargs = strategy_of(arm_fragments()[key], seed)
    data: dict[str, Any] = {"data_dir": str(Path(args.data_dir).resolve()), "num_workers": args.num_workers}
    if args.synthetic_data:
        data["check_integrity"] = False
    return {
        "recipe": RECIPE,
        "strategy": strategy,
        "strategy_kwargs": kwargs,
        "devices": args.devices,
        "accelerator": args.accelerator,
        "delay": seeds_delay(args.delay_scale),
        "delay_seed": seed,
        "seed": seed,
        "max_steps": args.steps,
        "max_epochs": args.epochs,
        "lr": None,
        "batch_size": args.batch_size,
        "data": data,
        "check_val_every_n_epoch": 100_000,
        "val_every_n_steps": args.val_every,
        "sync_loss": False,
        "measure": True,
        "threads": args.threads,
        "out": str(Path(args.out).resolve() / f"{key}__seed{seed}"),
    }


def prepare(spec: dict[str, Any]) -> Path:
    """Write a job's folder (``spec.json``, ``job.yaml``) without running it; returns the folder."""
    spec = resolve_spec(spec)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / FILES["spec"]).write_text(json.dumps(spec, indent=1))
    (out / FILES["config"]).write_text(yaml.safe_dump(job_config(spec), sort_keys=False))
    return out


def fit_command(out: Path) -> str:
    """The training command of a prepared job (its ranks come from torchrun or srun)."""
    return (
        f"-m lightning_pgc fit --config {shlex.quote(str(recipe_path(RECIPE)))} "
        f"--config {shlex.quote(str(out / FILES['config']))}"
    )


def wrapped(out: Path, runner: str, threads: int) -> str:
    """Shell lines that run a job with ``runner`` and write ``job_done.json`` as the local launcher does."""
    return "\n".join(
        [
            f"cd {shlex.quote(str(out))}",
            f"export OMP_NUM_THREADS={threads} WANDB_MODE=${{WANDB_MODE:-offline}}",
            "start=$(date +%s)",
            f"{runner} {fit_command(out)} > {FILES['log']} 2>&1",
            "rc=$?",
            f'printf \'{{"returncode": %d, "job_wall_s": %d}}\\n\' $rc $(( $(date +%s) - start )) > {FILES["done"]}',
        ]
    )


def sbatch_script(out: Path, args: argparse.Namespace) -> str:
    return "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --job-name=pgc-seed-{out.name}",
            "#SBATCH --nodes=1",
            f"#SBATCH --ntasks-per-node={args.devices}   # one rank per GPU; must equal trainer.devices",
            f"#SBATCH --gres=gpu:{args.devices}",
            f"#SBATCH --cpus-per-task={max(args.num_workers, 1) + 1}",
            f"#SBATCH --time={args.time}",
            f"#SBATCH --output={out / 'slurm-%j.out'}",
            *([f"#SBATCH {extra}" for extra in args.sbatch]),
            wrapped(out, f"srun {shlex.quote(sys.executable)}", args.threads),
            "",
        ]
    )


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Read every job folder under ``--out`` and write seed_experiment.{json,md} there."""
    root = Path(args.out).resolve()
    records: dict[str, dict[int, Any]] = {}
    keys, seeds = [], set()
    for folder in sorted(p for p in root.iterdir() if (p / FILES["spec"]).exists()):
        key, seed = folder.name.rsplit("__seed", 1)
        result = read_result(folder)
        cfg = single.Config(arm_of(key).family, max(arm_of(key).c - 1, 0), arm_of(key).c)
        run = single.read_run(cfg, int(seed), result)
        row = single.run_row(run, args.target, None)
        records.setdefault(key, {})[int(seed)] = cx.compact_record(row, run.val, run.ok, run.error)
        keys.append(key) if key not in keys else None
        seeds.add(int(seed))
    order = list(arm_fragments())
    arms = [arm_of(k) for k in sorted(keys, key=lambda k: order.index(k) if k in order else len(order))]
    recipe_lr = yaml.safe_load(recipe_path(RECIPE).read_text())["model"]["init_args"]["lr"]
    cell = cx.summarize_cell(records, arms, sorted(seeds), args.target, {a.key: recipe_lr for a in arms})
    result = {"out": str(root), "target": args.target, "seeds": sorted(seeds), "cell": cell, "records": records}
    text = "\n".join(
        [
            f"# Seed experiment: {len(arms)} arms, seeds {sorted(seeds)}, target validation loss {args.target}",
            "",
            f"Status: {cx.map_cell_text(cell)}",
            "",
            cx.cell_table(cell),
            "",
        ]
    )
    write_report(root, "seed_experiment", result, page=text)
    print(text)
    return result


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=["local", "torchrun", "slurm"], default="local")
    p.add_argument("--collect", action="store_true", help="only read the job folders and render the table")
    p.add_argument("--out", required=True, help="one folder per (arm, seed) goes here")
    p.add_argument("--arms", nargs="+", default=None, help=f"default: all of {list(arm_fragments())}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--steps", type=int, default=-1, help="max_steps (-1: --epochs decides)")
    p.add_argument("--epochs", type=int, default=40, help="max_epochs (the recipe's 40)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank and partition (default: the recipe's 128)")
    p.add_argument("--val-every", type=int, default=44, help="steps between validations on rank 0 (44: an epoch)")
    p.add_argument("--target", type=float, default=0.6, help="target validation loss")
    p.add_argument("--delay-scale", type=float, default=1.0, help="multiplies the cluster delays (1: 10-30 s stalls)")
    p.add_argument("--data-dir", default="data/cifar10")
    p.add_argument(
        "--synthetic-data",
        action="store_true",
        help="write a CIFAR-shaped random set into --data-dir first (smoke runs)",
    )
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    p.add_argument("--time", default="04:00:00", help="SLURM time limit per job")
    p.add_argument(
        "--sbatch",
        action="append",
        default=[],
        help="an extra #SBATCH line (repeatable), e.g. --sbatch=--partition=gpu",
    )
    p.add_argument("--submit", action="store_true", help="slurm: run sbatch on every script now")
    p.add_argument("--timeout", type=float, default=None, help="local: seconds before a job is killed")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.collect:
        return collect(args)
    fragments = arm_fragments()
    keys = args.arms or list(fragments)
    unknown = sorted(set(keys) - set(fragments))
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {list(fragments)}")
    if args.synthetic_data:
        from lightning_pgc.examples.cifar import write_synthetic_cifar10

        write_synthetic_cifar10(args.data_dir)
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    specs = [job_spec(key, seed, args) for seed in args.seeds for key in keys]
    if args.launcher == "local":
        for spec in specs:
            result = launch(spec, timeout=args.timeout, check=False)
            print(f"{Path(spec['out']).name}: {'ok' if result.ok else 'FAILED: ' + result.error}", flush=True)
        return collect(args)
    lines = [
        "#!/bin/bash",
        f"# generated by benchmarks/seed_experiment.py --launcher {args.launcher}: one job "
        "after the other (torchrun), or one sbatch per job (slurm)",
        "set -u",
    ]
    for spec in specs:
        out = prepare(spec)
        if args.launcher == "torchrun":
            lines.append(wrapped(out, f"torchrun --standalone --nproc_per_node={args.devices}", args.threads))
        else:
            script = out / "job.sbatch"
            script.write_text(sbatch_script(out, args))
            lines.append(f"sbatch {shlex.quote(str(script))}")
            if args.submit:
                subprocess.run(["sbatch", str(script)], check=True)
    name = "run.sh" if args.launcher == "torchrun" else "submit.sh"
    (root / name).write_text("\n".join(lines) + "\n")
    print(
        f"wrote {len(specs)} job folders and {root / name}; afterwards: python benchmarks/seed_experiment.py "
        f"--collect --out {root}"
    )
    return {"jobs": [s["out"] for s in specs], "script": str(root / name)}


if __name__ == "__main__":
    main()
