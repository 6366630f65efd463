"""A job spec (a flat dict) and the LightningCLI config it stands for.

A job *is* a LightningCLI config: :func:`job_config` turns a spec into the config that
``lightning-pgc fit --config <recipe> --config job.yaml`` runs, on top of any packaged or local recipe. The spec
only names what experiments vary; everything else comes from the recipe.

Spec keys (all optional; :data:`DEFAULTS` has the values):

- ``recipe``: a packaged recipe name or a path (default ``digits_cnn.yaml``);
- ``strategy`` (any Lightning strategy name, ``ddp`` and the registered PGC names included) and
  ``strategy_kwargs`` (non-empty: ``PGCStrategy`` by ``class_path`` with the registered name's arguments,
  overridden by these; an option group given as a dict, ``{"coordinator": {"staleness": 3}}``, overrides only the
  fields it names);
- ``start_method``: how Lightning starts the ranks (``popen``: re-run the command per rank, as users do;
  ``fork``: fork them from the launching process after its imports, which saves each rank the seconds of
  importing Lightning; the test suite uses it). ``ddp`` becomes ``ddp_fork``;
- ``devices``, ``accelerator``, ``max_steps``, ``max_epochs``, ``val_check_interval``,
  ``check_val_every_n_epoch``, ``limit_val_batches``, ``num_sanity_val_steps`` (default 0): the ``trainer``
  arguments of the same names;
- ``seed``: ``seed_everything`` and the data module's ``seed`` (its train/validation split);
- ``lr`` (``model.init_args.lr``), ``batch_size`` (``data.init_args.batch_size``), ``model`` and ``data`` (dicts
  merged into ``model.init_args`` / ``data.init_args``); ``None`` keeps the recipe's value;
- ``delay`` and ``delay_seed``: the :class:`~lightning_pgc.StragglerInjector` (replaces the recipe's callbacks);
- ``faults``: a list of ``{"kind": "Stall" | "Freeze" | "Kill" | "Terminate" | "NaNGradient" | "NaNBuffers", "rank", "step",
  ...}``, the :mod:`lightning_pgc.callbacks.faults` callbacks with those arguments;
- ``sync_loss``: :class:`LossRecorder` averages the logged loss over ranks under non-PGC strategies;
- ``compute_s_per_eval``: :class:`SimulatedCompute` seconds per gradient evaluation (0: none);
- ``measure``: add :class:`WorkMeter` (per-rank work, waits, FLOPs);
- ``resources``: steps after which :class:`ResourceMeter` samples each rank's resident memory and thread count
  (it samples again when training ends; ``None``: not added);
- ``val_every_n_steps``: add :class:`ValidationCurve`;
- ``diagnostics`` / ``valve``: :class:`~lightning_pgc.PGCDiagnostics` / :class:`~lightning_pgc.StalenessValve`
  arguments (``None``: not added by the job; the strategy attaches its own diagnostics by default);
- ``ckpt_path`` (resume), ``save_checkpoint`` (a path written when training ends),
  ``checkpoint_every_n_steps`` (a ``ModelCheckpoint`` under ``<out>/checkpoints``; ``checkpoint_on_exception``:
  it also saves when training stops on an exception, a SIGTERM included);
- ``wandb``: ``{project, group, name, tags, offline, config}``: the packaged ``wandb.yaml`` logger with these
  settings, next to the CSV logger; every W&B run gets the flat keys of :func:`lightning_pgc.cli.run_config`;
- ``threads``: ``OMP_NUM_THREADS`` of every rank;
- ``out``: the job folder (every result file goes there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lightning_pgc import recipe_files as recipes

__all__ = ["DEFAULTS", "current_kwargs", "current_spec", "job_config", "resolve_spec", "recipe_path"]

DEFAULTS: dict[str, Any] = {
    "recipe": "digits_cnn.yaml",
    "strategy": "pgc",
    "strategy_kwargs": {},
    "start_method": "popen",
    "devices": 4,
    "accelerator": "cpu",
    "delay": "none",
    "delay_seed": 0,
    "faults": [],
    "max_steps": 100,
    "max_epochs": -1,
    "batch_size": 16,
    "lr": 0.05,
    "model": {},
    "data": {},
    "seed": 0,
    "threads": 1,
    "val_check_interval": None,
    "check_val_every_n_epoch": 1,
    "limit_val_batches": 1.0,
    "num_sanity_val_steps": 0,
    "ckpt_path": None,
    "save_checkpoint": None,
    "checkpoint_every_n_steps": None,
    "checkpoint_on_exception": False,
    "sync_loss": True,
    "compute_s_per_eval": 0.0,
    "measure": False,
    "resources": None,
    "val_every_n_steps": None,
    "wandb": None,
    "diagnostics": None,
    "valve": None,
    "out": "outputs/job",
}


def resolve_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` over :data:`DEFAULTS`; unknown keys are refused (a typo would otherwise be ignored silently).

    Raises:
        KeyError: a key that is not in :data:`DEFAULTS`.
    """
    unknown = sorted(set(spec) - set(DEFAULTS))
    if unknown:
        raise KeyError(f"unknown job spec keys {unknown}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **spec}


#: The strategy keywords of the records made before ``PGCStrategy`` grouped its options: keyword -> (group, field).
#: The records keep them as they are; :func:`current_kwargs` reads them in today's form.
FLAT_KEYWORDS: dict[str, tuple[str, str]] = {
    **{k: ("coordinator", k) for k in ("replication", "staleness", "fresh", "widen_after", "max_staleness", "choice")},
    **{k: ("coding", k) for k in ("warmup", "staleness_correction", "lookahead_steps", "dc_lambda", "max_condition")},
    **{k: ("liveness", k) for k in ("timeout", "max_lag", "heartbeat_interval", "heartbeat_misses", "failover")},
    "max_stragglers": ("auto", "max_stragglers"),
    "auto_margin": ("auto", "margin"),
    "diagnostics_every": ("diagnostics", "every_n_steps"),
}


def current_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Strategy keyword arguments in today's form: a record's flat keywords (``{"replication": 2, "staleness":
    4}``) moved into their option groups (``{"coordinator": {"replication": 2, "staleness": 4}}``); arguments already
    in today's form are returned as they are."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "diagnostics" and isinstance(value, bool):
            key, value = "diagnostics", {"enabled": value}
        elif key in FLAT_KEYWORDS:
            group, field = FLAT_KEYWORDS[key]
            key, value = group, {field: value}
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            value = {**out[key], **value}
        out[key] = value
    return out


def current_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with its ``strategy_kwargs`` in today's form (:func:`current_kwargs`), e.g. a recorded job's."""
    if not spec.get("strategy_kwargs"):
        return dict(spec)
    return {**spec, "strategy_kwargs": current_kwargs(dict(spec["strategy_kwargs"]))}


def recipe_path(name: str) -> Path:
    """A local recipe file if ``name`` is one, else the packaged recipe of that name.

    Raises:
        FileNotFoundError: neither exists.
    """
    if Path(name).exists():
        return Path(name).resolve()
    packaged = recipes.resolve(name)
    if packaged is None:
        raise FileNotFoundError(f"no recipe {name!r} (no such file, and packaged: {', '.join(recipes.available())})")
    return packaged


def _strategy(spec: dict[str, Any]) -> Any:
    name, kwargs = spec["strategy"], dict(spec["strategy_kwargs"])
    method = spec["start_method"]
    if method not in ("popen", "fork", "spawn", "forkserver"):
        raise ValueError(f"start_method must be popen, fork, spawn or forkserver, got {method!r}")
    if method != "popen":
        if name == "ddp":
            return f"ddp_{method}"
        if name != "auto":
            kwargs.setdefault("start_method", method)
    if not kwargs:
        return name
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_pgc  # noqa: F401  (registers the names)
    from lightning_pgc.strategy import PGCStrategy

    if name not in StrategyRegistry or StrategyRegistry[name]["strategy"] is not PGCStrategy:
        raise ValueError(f"strategy_kwargs need a PGC strategy name, got {name!r}")
    init = dict(StrategyRegistry[name]["init_params"])
    for key, value in kwargs.items():  # a group's dict overrides the registered group's fields one by one
        base = init.get(key)
        init[key] = {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
    return {"class_path": "lightning_pgc.PGCStrategy", "init_args": init}


def _wandb_logger(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """The packaged ``wandb.yaml`` logger block with the job's project, group, name, tags and folder; its W&B
    config holds the job's knobs (``lr``, ``batch_size``, ``steps``, ...) and ``wandb.config``; the flat keys
    ``scheme``, ``n``, ``s``, ``c``, ``delay``, ``seed`` come from the CLI (:func:`lightning_pgc.cli.run_config`)."""
    options = dict(spec["wandb"])
    fragment = yaml.safe_load(recipes.resolve("wandb.yaml").read_text())  # type: ignore[union-attr]
    logger = fragment["trainer"]["logger"]
    init = dict(logger["init_args"])
    init.update({"save_dir": str(out), "offline": bool(options.get("offline", True))})
    for key in ("project", "group", "name", "tags"):
        if options.get(key) is not None:
            init[key] = options[key]
    init["config"] = {
        "lr": spec["lr"],
        "batch_size": spec["batch_size"],
        "steps": spec["max_steps"],
        "compute_s_per_eval": spec["compute_s_per_eval"],
        "val_every_n_steps": spec["val_every_n_steps"],
        "strategy_kwargs": spec["strategy_kwargs"],
        **options.get("config", {}),
    }
    return {"class_path": logger["class_path"], "init_args": init}


def job_config(spec: dict[str, Any]) -> dict[str, Any]:
    """The LightningCLI config (to pass after the recipe) that runs ``spec``; see the module docstring.

    Raises:
        KeyError: an unknown spec key.
        ValueError: ``strategy_kwargs`` with a strategy that is not a PGC name.
    """
    spec = resolve_spec(spec)
    out = Path(spec["out"]).resolve()
    cb = "pgc_lab.experiments.callbacks."
    callbacks: list[dict[str, Any]] = [
        {"class_path": cb + "JobRecorder", "init_args": {"out": str(out), "save_checkpoint": spec["save_checkpoint"]}},
        {"class_path": cb + "LossRecorder", "init_args": {"out": str(out), "sync": bool(spec["sync_loss"])}},
        {
            "class_path": "lightning_pgc.StragglerInjector",
            "init_args": {"delay": spec["delay"], "seed": int(spec["delay_seed"])},
        },
    ]
    for fault in spec["faults"]:
        args = dict(fault)
        callbacks.append({"class_path": "lightning_pgc.callbacks.faults." + args.pop("kind"), "init_args": args})
    if spec["compute_s_per_eval"]:
        callbacks.append(
            {"class_path": cb + "SimulatedCompute", "init_args": {"seconds": float(spec["compute_s_per_eval"])}}
        )
    if spec["measure"]:
        callbacks.append({"class_path": cb + "WorkMeter"})
    if spec["resources"] is not None:
        callbacks.append(
            {"class_path": cb + "ResourceMeter", "init_args": {"after_steps": [int(k) for k in spec["resources"]]}}
        )
    if spec["val_every_n_steps"]:
        callbacks.append(
            {
                "class_path": cb + "ValidationCurve",
                "init_args": {"out": str(out), "every": int(spec["val_every_n_steps"])},
            }
        )
    if spec["diagnostics"] is not None:
        callbacks.append({"class_path": "lightning_pgc.PGCDiagnostics", "init_args": dict(spec["diagnostics"])})
    if spec["valve"] is not None:
        callbacks.append({"class_path": "lightning_pgc.StalenessValve", "init_args": dict(spec["valve"])})
    if spec["checkpoint_every_n_steps"]:
        callbacks.append(
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {
                    "dirpath": str(out / "checkpoints"),
                    "save_top_k": -1,
                    "save_last": True,
                    "every_n_train_steps": int(spec["checkpoint_every_n_steps"]),
                    "save_on_exception": bool(spec["checkpoint_on_exception"]),
                },
            }
        )
    loggers: list[dict[str, Any]] = [
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(out), "name": "logs"}}
    ]
    if spec["wandb"]:
        loggers.append(_wandb_logger(spec, out))
    trainer: dict[str, Any] = {
        "accelerator": spec["accelerator"],
        "devices": spec["devices"],
        "strategy": _strategy(spec),
        "max_steps": spec["max_steps"],
        "max_epochs": spec["max_epochs"],
        "val_check_interval": spec["val_check_interval"],
        "check_val_every_n_epoch": spec["check_val_every_n_epoch"],
        "limit_val_batches": spec["limit_val_batches"],
        "callbacks": callbacks,
        "logger": loggers,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": bool(spec["checkpoint_every_n_steps"]),
        "num_sanity_val_steps": spec["num_sanity_val_steps"],
        "deterministic": False,
    }
    model = dict(spec["model"])
    if spec["lr"] is not None:
        model.setdefault("lr", spec["lr"])
    data = dict(spec["data"])
    if spec["batch_size"] is not None:
        data.setdefault("batch_size", spec["batch_size"])
    data.setdefault("seed", spec["seed"])
    config: dict[str, Any] = {"seed_everything": spec["seed"], "trainer": trainer}
    if model:
        config["model"] = {"init_args": model}
    if data:
        config["data"] = {"init_args": data}
    if spec["ckpt_path"]:
        config["ckpt_path"] = str(spec["ckpt_path"])
    return config
