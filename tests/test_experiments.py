"""The experiments harness's pure parts: spec -> LightningCLI config, and reading a job folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pgc_lab.experiments import FILES, job_config, read_result
from pgc_lab.experiments.callbacks import ResourceMeter
from pgc_lab.experiments.spec import recipe_path, resolve_spec


def test_job_config_is_a_lightningcli_config_over_the_recipe(tmp_path: Path) -> None:
    config = job_config(
        {
            "strategy": "pgc_fr",
            "strategy_kwargs": {"stragglers": 1, "coding": {"warmup": "gradual"}},
            "devices": 4,
            "delay": "constant(seconds=0.01)",
            "measure": True,
            "val_every_n_steps": 5,
            "out": str(tmp_path),
            "seed": 3,
        }
    )
    trainer = config["trainer"]
    assert trainer["strategy"] == {
        "class_path": "lightning_pgc.PGCStrategy",
        "init_args": {"scheme": "pgc_fr", "stragglers": 1, "coding": {"warmup": "gradual"}},
    }
    kinds = [cb["class_path"].rsplit(".", 1)[1] for cb in trainer["callbacks"]]
    assert kinds == ["JobRecorder", "LossRecorder", "StragglerInjector", "WorkMeter", "ValidationCurve"]
    assert trainer["callbacks"][2]["init_args"] == {"delay": "constant(seconds=0.01)", "seed": 0}
    assert config["seed_everything"] == 3 and config["data"]["init_args"] == {"batch_size": 16, "seed": 3}
    assert config["model"]["init_args"] == {"lr": 0.05}
    assert yaml.safe_load(yaml.safe_dump(config)) == config  # what launch writes as job.yaml
    plain = job_config({"strategy": "ddp", "out": str(tmp_path), "lr": None, "batch_size": None})
    assert plain["trainer"]["strategy"] == "ddp" and "model" not in plain
    assert [lg["class_path"].rsplit(".", 1)[1] for lg in plain["trainer"]["logger"]] == ["CSVLogger"]
    with_wandb = job_config({"out": str(tmp_path), "wandb": {"group": "g", "config": {"label": "x"}}})
    wandb_logger = with_wandb["trainer"]["logger"][1]["init_args"]  # the packaged wandb.yaml, with the job's keys
    assert wandb_logger["offline"] is True and wandb_logger["log_model"] is False and wandb_logger["group"] == "g"
    assert wandb_logger["config"]["label"] == "x" and wandb_logger["save_dir"] == str(tmp_path.resolve())


def test_start_method_faults_and_resources_reach_the_config(tmp_path: Path) -> None:
    forked = job_config(
        {
            "strategy": "pgc",
            "start_method": "fork",
            "out": str(tmp_path),
            "resources": [50, 150],
            "faults": [{"kind": "Stall", "rank": 2, "step": 4, "seconds": 1.5}],
        }
    )
    assert forked["trainer"]["strategy"] == {
        "class_path": "lightning_pgc.PGCStrategy",
        "init_args": {
            "scheme": "pgc_cr",
            "stragglers": 1,
            "coding": {"staleness_correction": "lookahead"},
            "start_method": "fork",
        },
    }
    assert forked["trainer"]["callbacks"][3] == {
        "class_path": "lightning_pgc.callbacks.faults.Stall",
        "init_args": {"rank": 2, "step": 4, "seconds": 1.5},
    }
    assert forked["trainer"]["callbacks"][4] == {
        "class_path": "pgc_lab.experiments.callbacks.ResourceMeter",
        "init_args": {"after_steps": [50, 150]},
    }
    with pytest.raises(ValueError, match="after_steps must be positive"):
        ResourceMeter(after_steps=[0, 10])
    assert (
        job_config({"strategy": "ddp", "start_method": "fork", "out": str(tmp_path)})["trainer"]["strategy"]
        == "ddp_fork"
    )
    assert job_config({"strategy": "pgc", "out": str(tmp_path)})["trainer"]["strategy"] == "pgc"  # popen: unchanged
    with pytest.raises(ValueError, match="start_method"):
        job_config({"start_method": "thread", "out": str(tmp_path)})


def test_bad_specs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="max_step"):
        resolve_spec({"max_step": 10})
    with pytest.raises(ValueError, match="PGC strategy name"):
        job_config({"strategy": "ddp", "strategy_kwargs": {"stragglers": 1}, "out": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="digits_cnn.yaml"):
        recipe_path("nope.yaml")
    assert recipe_path("digits_cnn.yaml").name == "digits_cnn.yaml"


def test_read_result_reports_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / FILES["spec"]).write_text(json.dumps({"devices": 2}))
    (tmp_path / FILES["done"]).write_text(json.dumps({"returncode": 1, "job_wall_s": 3.0}))
    (tmp_path / FILES["log"]).write_text("Traceback: boom")
    failed = read_result(tmp_path)
    assert not failed.ok and "status 1" in failed.error and failed.log_tail.endswith("boom")
    (tmp_path / FILES["done"]).write_text(json.dumps({"returncode": 0, "job_wall_s": 3.0}))
    for r in range(2):
        (tmp_path / f"rank{r}.json").write_text(json.dumps({"rank": r, "checksum": "abc"}))
    (tmp_path / FILES["summary"]).write_text(json.dumps({"fit_wall_s": 1.5, "curve_offset_s": 0.25}))
    (tmp_path / FILES["curve"]).write_text("wall,step,loss\n0.0,1,2.3\n")
    wrong_header = read_result(tmp_path)
    assert not wrong_header.ok and "header" in wrong_header.error
    (tmp_path / FILES["curve"]).write_text("wall_s,step,train_loss\n0.0,1,2.3\n0.5,2,2.1\n")
    result = read_result(tmp_path)
    assert result.ok and result.identical_replicas and result.fit_wall_s == 1.5 and result.job_wall_s == 3.0
    assert result.curve == [(0.0, 1, 2.3), (0.5, 2, 2.1)]
    assert result.train_on_val_clock() == [(0.25, 1, 2.3), (0.75, 2, 2.1)]
    assert result.legacy()["summary"]["spec"] == {"devices": 2} and result.val_curve == [] and result.wandb is None
