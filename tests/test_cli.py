"""The ``lightning-pgc`` CLI and every recipe, run for a few steps through the real command line.

Multi-process runs go through a subprocess (``python -m lightning_pgc ...``): Lightning's popen launcher starts
ranks 1..n-1 by re-running that command, which cannot work from inside pytest. Each run uses 2 CPU ranks,
``OMP_NUM_THREADS=1`` and W&B offline, in a fresh working directory; nothing is downloaded. The CIFAR-10
recipe runs on a tiny CIFAR-format data set written by :func:`lightning_pgc.examples.cifar.write_synthetic_cifar10`.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pgc.examples.cifar import write_synthetic_cifar10

# Packaged recipe names: the CLI resolves them inside the installed package (the runs' cwd has no such files).
DIGITS = "digits_cnn.yaml"
CIFAR = "cifar10_resnet18.yaml"
SEEDS = "stragglers/seeds.yaml"
FAST = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.enable_progress_bar=false"]


def run_cli(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m lightning_pgc ARGS`` in ``cwd``; returns the finished process (output in ``.stdout``)."""
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    for key in (
        "LOCAL_RANK",
        "NODE_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PL_GLOBAL_SEED",
        "LIGHTNING_PGC_TRACEBACK",
    ):
        env.pop(key, None)
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "lightning_pgc", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def check_ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout


def only(paths: list[Path]) -> Path:
    assert len(paths) == 1, paths
    return paths[0]


# ------------------------------------------------------------------------------------------ no training


def test_help_lists_subcommands(tmp_path: Path) -> None:
    out = check_ok(run_cli(tmp_path, "--help"))
    assert "lightning-pgc" in out
    for subcommand in ("fit", "validate", "test"):
        assert subcommand in out
    assert "pgc_cr" in out  # the registered PGC names are advertised


def test_version_and_recipes_listing(capsys: pytest.CaptureFixture[str]) -> None:
    import lightning_pgc
    from lightning_pgc import recipe_files as recipes
    from lightning_pgc.cli import main

    main(["--version"])  # answered before LightningCLI is built (the wheel test runs the console script)
    assert capsys.readouterr().out.strip() == f"lightning-pgc {lightning_pgc.__version__}"
    main(["recipes"])
    listing = capsys.readouterr().out
    names = recipes.available()
    assert {
        "digits_cnn.yaml",
        "cifar10_resnet18.yaml",
        "wandb.yaml",
        "strategies/ddp.yaml",
        "stragglers/seeds.yaml",
    } <= set(names)
    for name in names:
        assert name in listing
    assert recipes.resolve("recipes/digits_cnn.yaml") == recipes.resolve("digits_cnn.yaml")  # the old spelling
    assert recipes.resolve("nope.yaml") is None


def test_local_file_shadows_the_packaged_recipe(tmp_path: Path) -> None:
    from lightning_pgc.cli import resolve_configs
    from lightning_pgc.recipe_files import resolve

    packaged = str(resolve("digits_cnn.yaml"))
    assert resolve_configs(["fit", "--config", "digits_cnn.yaml", "-c=x"]) == ["fit", "--config", packaged, "-c=x"]
    assert resolve_configs(["--config=strategies/ddp.yaml"]) == ["--config=" + str(resolve("strategies/ddp.yaml"))]
    assert resolve_configs(["--config", "missing.yaml"]) == ["--config", "missing.yaml"]  # LightningCLI reports it
    # a local digits_cnn.yaml (here: one that asks for an unknown strategy) is what runs, not the packaged one
    (tmp_path / "digits_cnn.yaml").write_text("trainer:\n  strategy: pgc_local_copy\n")
    proc = run_cli(tmp_path, "fit", "--config", "digits_cnn.yaml", "--trainer.accelerator=cpu", timeout=120)
    assert proc.returncode == 2 and "pgc_local_copy" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trainer.strategy=pgc_nope"], "invalid strategy name"),
        # pgc_fr needs c = s+1 to divide n: 2 does not divide 3 ranks. Refused before any rank starts.
        (["--config", "strategies/pgc_fr_gradual.yaml", "--trainer.devices=3"], "divide"),
    ],
    ids=["unknown-name", "fr-on-3-ranks"],
)
def test_bad_strategy_is_a_clean_error(tmp_path: Path, args: list[str], message: str) -> None:
    proc = run_cli(tmp_path, "fit", "--config", str(DIGITS), "--trainer.accelerator=cpu", *args, timeout=120)
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert "lightning-pgc fit: error: invalid configuration" in proc.stdout
    assert message in proc.stdout
    assert "Traceback" not in proc.stdout
    assert not (tmp_path / "outputs").exists()  # nothing started


def test_cifar_datamodule_on_tiny_copy(tmp_path: Path) -> None:
    import torch

    from lightning_pgc.examples.cifar import CIFAR10DataModule

    write_synthetic_cifar10(tmp_path, per_batch=10)
    dm = CIFAR10DataModule(str(tmp_path), batch_size=4, num_workers=0, val_split=0.2, check_integrity=False)
    dm.setup("fit")
    assert len(dm.train_set) == 40 and len(dm.val_set) == 10
    assert not set(dm.train_set.indices) & set(dm.val_set.indices)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.long
    assert -3 < float(x.min()) and float(x.max()) < 3  # normalised, not raw bytes
    restored = pickle.loads(pickle.dumps(dm.train_set))  # DataLoader workers under spawn/forkserver
    assert len(restored) == 40 and type(restored.base).__name__ == "UncheckedCIFAR10"
    dm.setup("test")
    assert len(dm.test_set) == 10
    # The official-release check refuses a re-packed copy, and says how to proceed.
    with pytest.raises(FileNotFoundError, match="check_integrity false"):
        CIFAR10DataModule(str(tmp_path), check_integrity=True).setup("fit")


def test_cifar_missing_data_says_how_to_get_it(tmp_path: Path) -> None:
    from lightning_pgc.examples.cifar import CIFAR10DataModule

    with pytest.raises(FileNotFoundError, match=r"--data.download true.*--data.data_dir"):
        CIFAR10DataModule(str(tmp_path / "nowhere")).setup("fit")


def test_resnet18_cifar_is_adapted_to_32x32() -> None:
    import torch

    from lightning_pgc.examples.cifar import ResNet18CIFAR

    model = ResNet18CIFAR()
    assert model.net.conv1.kernel_size == (3, 3) and model.net.conv1.stride == (1, 1)
    assert isinstance(model.net.maxpool, torch.nn.Identity)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


# ------------------------------------------------------------------------------------------ recipes, for real


def test_digits_recipe_fit_then_validate_checkpoint(tmp_path: Path) -> None:
    out = check_ok(
        run_cli(
            tmp_path, "fit", "--config", str(DIGITS), *FAST, "--trainer.max_steps=3", "--trainer.log_every_n_steps=1"
        )
    )
    assert "`max_steps=3` reached" in out
    run_dir = tmp_path / "outputs" / "digits" / "digits_cnn" / "version_0"
    ckpt = only(list((run_dir / "checkpoints").glob("*.ckpt")))
    assert ckpt.name == "epoch=0-step=3.ckpt"
    assert "train_loss_step" in (run_dir / "metrics.csv").read_text()
    config = (run_dir / "config.yaml").read_text()
    assert "strategy: pgc" in config and "StragglerInjector" in config

    # `validate` on that checkpoint, with the same recipe (PGC strategy, 2 ranks).
    out = check_ok(run_cli(tmp_path, "validate", "--config", str(DIGITS), *FAST, f"--ckpt_path={ckpt}"))
    assert "val_acc" in out and "val_loss" in out


@pytest.mark.parametrize("strategy", ["pgc_fr_gradual", "ddp", "bounded_staleness"])
def test_seeds_fragment_and_strategy_fragments(tmp_path: Path, strategy: str) -> None:
    """The documented comparison: recipe + the cluster stragglers (tiny scale) + a strategy fragment, either PGC
    by class_path or the ddp baseline; the same delay draws in both."""
    fragment = f"strategies/{strategy}.yaml"
    out = check_ok(
        run_cli(
            tmp_path,
            "fit",
            "--config",
            str(DIGITS),
            "--config",
            str(SEEDS),
            "--config",
            str(fragment),
            *FAST,
            "--trainer.callbacks.init_args.scale=0.001",
            "--trainer.max_steps=3",  # devices=2 beats its 8
        )
    )
    assert "`max_steps=3` reached" in out
    run_dir = tmp_path / "outputs" / "digits" / "digits_cnn" / "version_0"
    assert only(list((run_dir / "checkpoints").glob("*.ckpt"))).name == "epoch=0-step=3.ckpt"
    config = (run_dir / "config.yaml").read_text()
    assert "spikes(prob=0.005, low=10, high=30)" in config  # the fragment's injector replaced the recipe's
    assert "scale: 0.001" in config
    assert re.search(r"devices: '?2'?", config)
    if strategy == "ddp":
        assert re.search(r"^  strategy: ddp$", config, re.M)
    elif strategy == "bounded_staleness":
        assert "class_path: lightning_pgc.PGCStrategy" in config
        assert "scheme: bounded" in config and "replication: 2" in config and "staleness: 2" in config
        assert "choice: round_robin" in config
    else:  # the class_path form reached the Trainer with its init_args
        assert "class_path: lightning_pgc.PGCStrategy" in config
        assert "scheme: pgc_fr" in config and "warmup: gradual" in config


def test_wandb_fragment_composes_with_a_recipe_and_logs_the_flat_run_keys(tmp_path: Path) -> None:
    """`--config wandb.yaml` after the digits recipe and the ddp fragment: an offline W&B run whose config has
    the same flat keys the demo and the grid give their (PGC) runs (tests/test_grid.py checks those)."""
    out = check_ok(
        run_cli(
            tmp_path,
            "fit",
            "--config",
            DIGITS,
            "--config",
            "strategies/ddp.yaml",
            "--config",
            "wandb.yaml",
            *FAST,
            "--trainer.max_steps=2",
        )
    )
    assert "`max_steps=2` reached" in out
    records = only(list((tmp_path / "outputs" / "wandb").glob("offline-run-*/run-*.wandb"))).read_bytes()
    for key in (b"scheme", b"delay_seed", b"delay_scale", b"lognormal(median=0.005, sigma=0.5)", b"cli", b"ddp"):
        assert key in records, key


def test_cifar_recipe_on_tiny_cifar(tmp_path: Path) -> None:
    write_synthetic_cifar10(tmp_path / "data" / "cifar10")
    out = check_ok(
        run_cli(
            tmp_path,
            "fit",
            "--config",
            str(CIFAR),
            *FAST,
            "--data.check_integrity=false",
            "--data.batch_size=8",
            "--data.num_workers=0",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.log_every_n_steps=1",
        )
    )
    assert "`max_epochs=1` reached" in out
    save_dir = tmp_path / "outputs" / "cifar10"
    ckpt = only(list(save_dir.glob("lightning-pgc/*/checkpoints/*.ckpt")))
    assert ckpt.name == "epoch=0-step=2.ckpt"
    run_file = only(list(save_dir.glob("wandb/offline-run-*/run-*.wandb")))  # W&B offline, no account
    data = run_file.read_bytes()
    assert b"val_acc" in data and b"train_loss_step" in data
    assert b"pgc_cr" in data  # the CLI config (trainer.strategy) is stored in the W&B run

    # `test` on the checkpoint: the 10 test images through ResNet18CIFAR.test_step on 2 ranks.
    out = check_ok(
        run_cli(
            tmp_path,
            "test",
            "--config",
            str(CIFAR),
            *FAST,
            f"--ckpt_path={ckpt}",
            "--data.check_integrity=false",
            "--data.batch_size=8",
            "--data.num_workers=0",
        )
    )
    assert "test_acc" in out and "test_loss" in out


@pytest.mark.parametrize(
    "init_args, message",
    [
        ("{scheme: pgc_xx}", "invalid configuration: ValueError: unknown scheme 'pgc_xx'; choose one of"),
        ("{liveness: {timeout: 5m}}", "liveness.timeout must be float, got str '5m'"),
        (
            "{scheme: bounded, coordinator: {staleness: 0}}",
            "ValueError: coordinator.staleness must be an int >= 1, got 0",
        ),
        ("{scheme: bounded, coordinator: {stalenes: 3}}", "PGCStrategy(coordinator=...): unknown option 'stalenes'"),
        ("{timeout: 5}", "Option 'timeout' is not accepted"),  # a group's field is no keyword of its own
    ],
    ids=["scheme", "group-type", "group-value", "group-unknown-key", "flat-keyword"],
)
def test_class_path_errors_name_the_parameter_not_a_union_dump(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], init_args: str, message: str
) -> None:
    from lightning_pgc.cli import build_cli

    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  strategy:\n"
        f"    class_path: lightning_pgc.PGCStrategy\n    init_args: {init_args}\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["--config", str(config)], run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Given value: Namespace" not in err


@pytest.mark.parametrize(
    "recipe, expected",
    [
        (
            "strategies/bounded_staleness.yaml",
            {"coordinator": {"replication": 2, "staleness": 2}, "liveness": {"timeout": 300.0}},
        ),
        ("strategies/pgc_fr_gradual.yaml", {"coding": {"warmup": "gradual"}, "diagnostics": {"every_n_steps": 25}}),
        ("seed_experiment/bounded_c4.yaml", {"coordinator": {"replication": 2, "staleness": 4}}),
    ],
)
def test_recipes_with_nested_option_groups_build_the_strategy(recipe: str, expected: dict) -> None:
    """A recipe's nested groups (``init_args: {coordinator: {replication: 2, staleness: 3}}``) reach the strategy as
    its dataclasses; one field of a group on the command line overrides that field and keeps the recipe's others."""
    from lightning_pgc import CoordinatorOptions, PGCStrategy
    from lightning_pgc.cli import build_cli, resolve_configs
    from lightning_pgc.strategy.options import GROUPS

    args = resolve_configs(["--config", DIGITS, "--config", recipe, "--trainer.logger=false", *FAST])
    strategy = build_cli(args, run=False).trainer.strategy
    assert isinstance(strategy, PGCStrategy)
    for group, fields in expected.items():
        assert getattr(strategy, group) == GROUPS[group](**fields)
    if "coordinator" in expected:
        args.append("--trainer.strategy.init_args.coordinator.staleness=3")
        changed = build_cli(args, run=False).trainer.strategy
        assert changed.coordinator == CoordinatorOptions(replication=2, staleness=3)
        assert changed.liveness == strategy.liveness
