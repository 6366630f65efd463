"""``lightning-pgc``: Lightning's own ``LightningCLI`` with the PGC strategies, delay models and recipes in reach.

Usage (recipes are shipped inside the package; ``lightning-pgc recipes`` lists them)::

    lightning-pgc fit --config digits_cnn.yaml
    lightning-pgc fit --config digits_cnn.yaml --config stragglers/seeds.yaml
    lightning-pgc fit --config digits_cnn.yaml --config wandb.yaml          # + a W&B run (offline)
    lightning-pgc validate --config digits_cnn.yaml --ckpt_path path/to/last.ckpt
    lightning-pgc recipes
    lightning-pgc advise trace.json        # which strategy and s, from a StepTimeTrace of a real run
    lightning-pgc --version
    python -m lightning_pgc fit --help

``--config NAME`` reads the local file ``NAME`` when there is one (relative to the working directory), else
the packaged recipe of that name (:mod:`lightning_pgc.recipe_files`), so an installed wheel runs the recipes from
any directory and a local copy of a recipe shadows the packaged one.

Why a thin subclass and not a custom parser: everything stays plain ``LightningCLI`` (subcommands ``fit``,
``validate``, ``test``, ``predict``; ``--config`` files merge left to right; ``--print_config``), so users'
Lightning knowledge applies. The subclass only

- imports :mod:`lightning_pgc`, which registers ``pgc``, ``pgc_cr``, ``pgc_fr``, ... in Lightning's
  ``StrategyRegistry`` (so ``trainer.strategy: pgc_cr`` works as a string; ``class_path:
  lightning_pgc.PGCStrategy`` works through the typed ``__init__`` without the registry);
- takes model and data by ``class_path`` (subclass mode), defaulting to the embedded digits task, so
  ``lightning-pgc fit`` with no config trains something real without any download;
- turns configuration errors raised while building the classes (an unknown strategy name, an invalid
  scheme, ``(n, s)`` a scheme cannot serve) into a one-line message and exit status 2 instead of a traceback
  (set ``LIGHTNING_PGC_TRACEBACK=1`` to get the traceback);
- saves the resolved config next to the logs as usual, overwriting only where a logger has no per-run
  directory (W&B's ``save_dir``), and gives every W&B run the same flat config keys (:func:`run_config`:
  ``strategy``, ``scheme``, ``n``, ``s``, ``c``, ``delay``, ``delay_seed``, ``seed``) plus the whole resolved
  config under ``cli``, so runs from the command line, the demo and the benchmark grid line up in the W&B UI.

Nothing here talks to W&B's servers: the packaged ``wandb.yaml`` fragment sets ``WandbLogger(offline: true)``,
which writes local run files, and ``WANDB_MODE`` is left to the user (``offline: false`` plus a login makes
runs online).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_pgc  # noqa: F401  (registers the strategy names before any Trainer is built)
from lightning_pgc import recipe_files as recipes
from lightning_pgc.strategy import PGCStrategy, REGISTERED
from lightning_pgc.callbacks.stragglers import StragglerInjector

#: What ``lightning-pgc fit`` trains when no ``--model`` / ``--data`` is given: the embedded digits task.
DEFAULT_MODEL = "lightning_pgc.examples.digits.DigitsCNN"
DEFAULT_DATA = "lightning_pgc.examples.digits.DigitsDataModule"

DESCRIPTION = (
    "Straggler-tolerant data-parallel training with pipelined gradient coding (Lightning's CLI). "
    "--config NAME takes a local file, else the packaged recipe NAME (list them: lightning-pgc recipes). "
    f"PGC strategy names: {', '.join(REGISTERED)}; Lightning's own (ddp, ...) work too. "
    "lightning-pgc --version prints the version."
)

#: Exceptions that, raised while the classes are built from the config, mean "bad configuration".
CONFIG_ERRORS = (ValueError, TypeError, KeyError, MisconfigurationException)


def run_config(trainer: Trainer, seed: Optional[int] = None) -> dict[str, Any]:
    """The flat description of a run that every W&B run carries, read from the live trainer.

    Args:
        trainer: a trainer whose strategy is set up (its ``world_size`` is final).
        seed: the run's ``seed_everything`` value, if known.

    Returns:
        ``strategy`` (Lightning's strategy name: ``pgc`` for every :class:`~lightning_pgc.PGCStrategy`),
        ``scheme`` (the PGC scheme, e.g. ``pgc_cr``, ``ignore``, ``gc_fr``; for other strategies their name),
        ``n`` (ranks), ``s`` (tolerated stragglers, 0 outside PGC), ``c`` (copies per partition, 1 outside
        PGC), ``delay``/``delay_seed``/``delay_scale`` (the first
        :class:`~lightning_pgc.StragglerInjector`'s model, ``"none"`` without one) and ``seed``.
    """
    strategy = trainer.strategy
    n = int(trainer.world_size)
    name = str(getattr(strategy, "strategy_name", type(strategy).__name__))
    if isinstance(strategy, PGCStrategy):
        scheme = getattr(strategy, "scheme", None)  # built once the ranks are set up
        if scheme is None:
            scheme = strategy._make_scheme(n)
        scheme_name, s, c = str(scheme.name), int(scheme.s), int(scheme.c)
    else:
        scheme_name, s, c = name, 0, 1
    injector = next((cb for cb in trainer.callbacks if isinstance(cb, StragglerInjector)), None)
    return {
        "strategy": name,
        "scheme": scheme_name,
        "n": n,
        "s": s,
        "c": c,
        "delay": str(injector.delay) if injector is not None else "none",
        "delay_seed": injector.seed if injector is not None else None,
        "delay_scale": injector.scale if injector is not None else None,
        "seed": seed,
    }


class PGCSaveConfigCallback(SaveConfigCallback):
    """Saves the resolved config as Lightning does and gives every ``WandbLogger`` run the flat
    :func:`run_config` keys plus the whole resolved config under ``cli``."""

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        if not loggers:
            return
        config = json.loads(self.parser.dump(self.config, skip_none=False, format="json"))
        seed = config.get("seed_everything")
        flat = run_config(trainer, seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None)
        for logger in loggers:
            logger.log_hyperparams({**flat, "cli": config})


def resolve_configs(args: Sequence[str]) -> list[str]:
    """``args`` with every ``--config``/``-c`` value that is not an existing local file replaced by the
    packaged recipe of that name, when there is one (otherwise left for LightningCLI to report)."""
    out: list[str] = []
    expect = False
    for arg in args:
        if expect:
            out.append(_resolve_one(arg))
            expect = False
        elif arg in ("--config", "-c"):
            out.append(arg)
            expect = True
        elif arg.startswith("--config="):
            out.append("--config=" + _resolve_one(arg.split("=", 1)[1]))
        else:
            out.append(arg)
    return out


def _resolve_one(value: str) -> str:
    if Path(value).exists():
        return value
    packaged = recipes.resolve(value)
    return str(packaged) if packaged is not None else value


def print_recipes() -> None:
    """``lightning-pgc recipes``: one line per packaged recipe with its summary and where it lives."""
    names = recipes.available()
    width = max(len(name) for name in names)
    for name in names:
        print(f"{name:<{width}}  {recipes.describe(name)}")
    print(f"\n(in {recipes.folder()}; a local file of the same name takes precedence)")


class PGCLightningCLI(LightningCLI):
    """``LightningCLI`` with subclass-mode model/data (default: the digits task) and clean config errors."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except CONFIG_ERRORS as err:
            if os.environ.get("LIGHTNING_PGC_TRACEBACK"):
                raise
            command = f"lightning-pgc {self.subcommand}" if self.subcommand else "lightning-pgc"
            hint = ""
            if "strategy" in str(err):
                hint = f"PGC strategy names: {', '.join(REGISTERED)} (or class_path: lightning_pgc.PGCStrategy)\n"
            sys.stderr.write(
                f"{command}: error: invalid configuration: {type(err).__name__}: {union_reason(str(err))}\n{hint}"
                "(set LIGHTNING_PGC_TRACEBACK=1 for the traceback)\n"
            )
            raise SystemExit(2) from None


def union_reason(message: str) -> str:
    """The reason inside jsonargparse's "Does not validate against any of the Union subtypes" dump.

    ``trainer.strategy`` is ``Union[str, Strategy]``: a ``class_path`` config that fails in ``PGCStrategy.__init__``
    (e.g. an unknown scheme) is reported as a dump of both subtypes' errors and the whole namespace; the ``str``
    subtype's "Expected a <class 'str'>" and the dump say nothing. An option group (``Union[dataclass, dict]``)
    that fails its own checks nests a second dump, whose ``dict`` subtype's "Expected a <class 'dict'>" says nothing
    either. Other messages are returned unchanged.
    """
    union = "Does not validate against any of the Union subtypes"
    if union not in message or "Errors:" not in message:
        return message
    errors = message.split("Errors:", 1)[1].split("Given value type:", 1)[0]
    reasons = [line.strip()[2:] for line in errors.splitlines() if line.strip().startswith("- ")]
    silent = ("Expected a <class 'str'>", "Expected a <class 'dict'>", union)
    reasons = [r for r in reasons if not r.startswith(silent)]
    return "; ".join(reasons) if reasons else message


def build_cli(args: ArgsType = None, run: bool = True) -> PGCLightningCLI:
    """Parse ``args`` (default ``sys.argv[1:]``; a list, or a dict/Namespace config) and, if ``run``, run the
    subcommand; ``run=False`` only builds model, data and trainer and expects no subcommand."""
    return PGCLightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=0,  # reproducible by default (Lightning's `True` picks 0 anyway, with a warning)
        save_config_callback=PGCSaveConfigCallback,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "lightning-pgc", "description": DESCRIPTION},
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of ``lightning-pgc`` and ``python -m lightning_pgc`` (returns None: the console script
    passes the return value to ``sys.exit``).

    Args:
        args: the command line without the program name (default ``sys.argv[1:]``), or a dict/Namespace
            config as ``LightningCLI`` accepts. ``recipes`` and ``--version`` are answered here; in a list,
            ``--config`` values are resolved by :func:`resolve_configs`.

    Lightning's ``popen`` launcher starts ranks ``1..n-1`` by re-running this same command line, so the
    command must be re-runnable as is (``python -m lightning_pgc ...`` and the console script both are; every
    rank resolves the recipe names the same way).
    """
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, (list, tuple)):
        if list(argv[:1]) in (["--version"], ["-V"]):
            print(f"lightning-pgc {lightning_pgc.__version__}")
            return
        if list(argv[:1]) == ["recipes"]:
            print_recipes()
            return
        if list(argv[:1]) == ["advise"]:  # the emulator is research code: imported only for this subcommand
            from lightning_pgc.emulator.advise import main as advise_main

            code = advise_main([str(a) for a in argv[1:]])
            if code:
                raise SystemExit(code)
            return
        argv = resolve_configs([str(a) for a in argv])
    build_cli(argv)


if __name__ == "__main__":
    main()
