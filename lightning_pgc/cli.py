"""``lightning-pgc``: Lightning's own ``LightningCLI`` with the PGC strategies, delay models and recipes in reach.

Usage (the recipes live in ``recipes/``)::

    lightning-pgc fit --config recipes/digits_cnn.yaml
    lightning-pgc fit --config recipes/digits_cnn.yaml --config recipes/stragglers/seeds.yaml
    lightning-pgc validate --config recipes/digits_cnn.yaml --ckpt_path path/to/last.ckpt
    python -m lightning_pgc fit --help

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
  directory (W&B's ``save_dir``), and records the whole config in the W&B run so runs can be grouped and
  filtered by strategy, stragglers and scale.

Nothing here talks to W&B's servers: a recipe's ``WandbLogger(offline: true)`` writes local run files, and
``WANDB_MODE`` is left to the user (``offline: false`` plus a login makes runs online).
"""

from __future__ import annotations

import json
import os
import sys

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_pgc  # noqa: F401  (registers the strategy names before any Trainer is built)
from lightning_pgc.strategy import REGISTERED

#: What ``lightning-pgc fit`` trains when no ``--model`` / ``--data`` is given: the embedded digits task.
DEFAULT_MODEL = "lightning_pgc.digits.DigitsCNN"
DEFAULT_DATA = "lightning_pgc.digits.DigitsDataModule"

DESCRIPTION = (
    "Straggler-tolerant data-parallel training with pipelined gradient coding (Lightning's CLI). "
    f"Recipes: recipes/*.yaml. PGC strategy names: {', '.join(REGISTERED)}; Lightning's own (ddp, ...) work too."
)

#: Exceptions that, raised while the classes are built from the config, mean "bad configuration".
CONFIG_ERRORS = (ValueError, TypeError, KeyError, MisconfigurationException)


class PGCSaveConfigCallback(SaveConfigCallback):
    """Saves the resolved config as Lightning does and also stores it in the run of every ``WandbLogger``."""

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                config = self.parser.dump(self.config, skip_none=False, format="json")
                logger.log_hyperparams({"cli": json.loads(config)})


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
                f"{command}: error: invalid configuration: {type(err).__name__}: {err}\n{hint}"
                "(set LIGHTNING_PGC_TRACEBACK=1 for the traceback)\n"
            )
            raise SystemExit(2) from None


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

    Lightning's ``popen`` launcher starts ranks ``1..n-1`` by re-running this same command line, so the
    command must be re-runnable as is (``python -m lightning_pgc ...`` and the console script both are).
    """
    build_cli(args)


if __name__ == "__main__":
    main()
