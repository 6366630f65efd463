"""benchmarks/seed_experiment.py without running a job: the arms come from the packaged fragments, every job of
the set gets the cluster delays and its own seed, and the SLURM / torchrun launchers write runnable scripts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import seed_experiment as se  # noqa: E402


def test_arms_are_the_fragments_with_c_in_2_4_8():
    arms = se.arm_fragments()
    assert set(arms) == {
        "ddp",
        "dgd",
        "pgc_cr_c2",
        "pgc_cr_c4",
        "pgc_cr_c8",
        "bounded_c2",
        "bounded_c4",
        "bounded_c8",
        "gc_cr_c2",
        "gc_cr_c4",
    }
    assert se.strategy_of(arms["ddp"], 3) == ("ddp", {})
    assert se.strategy_of(arms["dgd"], 3) == ("dgd", {"seed": 3})
    assert se.strategy_of(arms["pgc_cr_c8"], 1) == ("pgc_cr", {"scheme": "pgc_cr", "stragglers": 7, "seed": 1})
    assert se.strategy_of(arms["bounded_c4"], 0) == (
        "pgc_cr",
        {"scheme": "bounded", "coordinator": {"replication": 2, "staleness": 4}, "seed": 0},
    )
    assert (se.arm_of("bounded_c4").key, se.arm_of("gc_cr_c2").key, se.arm_of("ddp").key) == (
        "bounded_c4",
        "gc_cr_c2",
        "ddp",
    )


def test_slurm_and_torchrun_scripts(tmp_path):
    se.main(
        [
            "--launcher",
            "slurm",
            "--out",
            str(tmp_path / "s"),
            "--seeds",
            "0",
            "1",
            "--arms",
            "ddp",
            "pgc_cr_c4",
            "--data-dir",
            str(tmp_path / "data"),
            "--sbatch=--partition=gpu",
        ]
    )
    folders = sorted(p.name for p in (tmp_path / "s").iterdir() if p.is_dir())
    assert folders == ["ddp__seed0", "ddp__seed1", "pgc_cr_c4__seed0", "pgc_cr_c4__seed1"]
    job = yaml.safe_load((tmp_path / "s" / "pgc_cr_c4__seed1" / "job.yaml").read_text())
    strategy = job["trainer"]["strategy"]["init_args"]
    assert (strategy["scheme"], strategy["stragglers"], strategy["seed"]) == ("pgc_cr", 3, 1)
    assert job["trainer"]["devices"] == 8 and job["trainer"]["accelerator"] == "gpu" and job["seed_everything"] == 1
    injector = next(c for c in job["trainer"]["callbacks"] if c["class_path"].endswith("StragglerInjector"))
    assert injector["init_args"] == {
        "delay": "lognormal(median=0.05, sigma=0.5) + spikes(prob=0.005, low=10.0, high=30.0)",
        "seed": 1,
    }
    assert "model" not in job or "lr" not in job["model"]["init_args"]  # the recipe's learning rate
    spec = json.loads((tmp_path / "s" / "pgc_cr_c4__seed1" / "spec.json").read_text())
    assert spec["recipe"] == "cifar10_resnet18.yaml" and spec["measure"] and spec["val_every_n_steps"] == 44
    script = (tmp_path / "s" / "pgc_cr_c4__seed1" / "job.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=8" in script and "#SBATCH --partition=gpu" in script
    assert "srun " in script and "job_done.json" in script
    submit = (tmp_path / "s" / "submit.sh").read_text()
    assert submit.count("sbatch /") == 4
    se.main(
        [
            "--launcher",
            "torchrun",
            "--out",
            str(tmp_path / "t"),
            "--seeds",
            "0",
            "--arms",
            "dgd",
            "--delay-scale",
            "0.01",
        ]
    )
    run = (tmp_path / "t" / "run.sh").read_text()
    assert "torchrun --standalone --nproc_per_node=8 -m lightning_pgc fit" in run
    assert subprocess.run(["bash", "-n", str(tmp_path / "t" / "run.sh")]).returncode == 0
    job = yaml.safe_load((tmp_path / "t" / "dgd__seed0" / "job.yaml").read_text())
    injector = next(c for c in job["trainer"]["callbacks"] if c["class_path"].endswith("StragglerInjector"))
    assert (
        injector["init_args"]["delay"] == "lognormal(median=0.0005, sigma=0.5) + spikes(prob=0.005, low=0.1, high=0.3)"
    )
