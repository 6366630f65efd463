"""The emulator's proxy tasks: deterministic data and weights, a stable corpus, targets that ddp reaches, the
runtime's running-statistics rule, AdamW batched as torch applies it, and the Lightning versions that train."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pgc.codes import make_scheme
from lightning_pgc.delays import SlowRanks
from lightning_pgc.emulator.clock import simulate
from lightning_pgc.emulator.cluster import costs_for
from lightning_pgc.emulator.data import DataCondition, partition_streams
from lightning_pgc.emulator.schedule import from_records
from lightning_pgc.emulator.cells import Protocol
from lightning_pgc.emulator.tasks import TARGET_RULE, make_task, spec, targets_from_curve, task_info
from lightning_pgc.emulator.train import Task, emulate, emulate_grid
from lightning_pgc.examples import stdlib_lm
from lightning_pgc.examples.shifted_digits import ShiftedDigitsCNN, shifted_digits_tensors
from lightning_pgc.examples.stdlib_lm import StdlibLM, corpus_info, lm_tensors


def _schedule(name: str, n: int, s: int, steps: int) -> tuple:
    scheme = make_scheme(name, n, s)
    res = simulate(scheme, steps, SlowRanks([n - 1], 1.0), costs_for(4.0))
    return scheme, from_records(res.records, res.applied[0])


def test_same_seed_same_data_and_weights() -> None:
    for name in ("lm", "bncnn"):
        a, b, c = make_task(name, 3), make_task(name, 3), make_task(name, 4)
        assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_val, b.y_val)
        pa, pb, pc = (torch.cat([p.reshape(-1) for p in t.model.parameters()]) for t in (a, b, c))
        assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    x, y, xv, yv = shifted_digits_tensors()
    shifted_digits_tensors.cache_clear()
    assert torch.equal(shifted_digits_tensors()[0], x)  # the perturbation is fixed, not drawn per call


def test_corpus_hash_is_stable_and_split_is_held_out() -> None:
    info = corpus_info()
    stdlib_lm.stdlib_corpus.cache_clear()
    data = stdlib_lm.stdlib_corpus()
    assert hashlib.sha256(data).hexdigest() == info["sha256"] and len(data) == stdlib_lm.CORPUS_BYTES
    assert task_info("lm")["corpus"] == info and info["python"].count(".") == 2
    x, y, xv, yv = lm_tensors(32)
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.shape[1] == 32 and x.max() < 256
    every = stdlib_lm.HELD_OUT_EVERY
    assert len(xv) == (len(x) + len(xv)) // every  # one window of every HELD_OUT_EVERY held out
    windows = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()[: 33 * every].reshape(every, 33)
    assert torch.equal(xv[0], windows[every - 1, :-1]) and torch.equal(x[0], windows[0, :-1])


def test_ddp_lowers_the_held_out_loss_of_the_lm() -> None:
    for name, setting in (("lm", (8e-3, 0.9)),):
        task = make_task(name, 1000)
        scheme, versions = _schedule("dgd", 4, 0, 15)
        streams = partition_streams(task.y_train.numpy(), 4, 1000, DataCondition())
        run = emulate_grid(scheme, versions, task, streams, [setting])[0]
        assert not run.diverged and run.val_loss[-1] < run.val_loss[0] - 0.1, (name, run.val_loss)


def _reference_statistics(name: str, scheme, versions, task: Task, streams, n: int) -> dict[str, torch.Tensor]:
    """What real ranks hold: each admitted rank runs its evaluations' forwards from the shared statistics, the
    aggregate's tail is their plain mean (lr 0: the weights stay put)."""
    model = task.model
    shared = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    for entry in versions:
        tails = []
        for k in entry.admitted:
            model.load_state_dict(shared, strict=False)
            model.train()
            with torch.no_grad():
                for j in scheme.evaluations(k, entry.version):
                    index = torch.tensor(streams.batch(j, entry.version, task.batch_size))
                    model(task.x_train[index])
            tails.append({key: v.clone() for key, v in model.state_dict().items() if key in shared})
        shared = {
            key: (torch.stack([t[key].double() for t in tails]).mean(0)).to(shared[key].dtype)
            if shared[key].dtype.is_floating_point
            else torch.stack([t[key] for t in tails]).double().mean(0).round().long()
            for key in shared
        }
    return shared


def test_running_statistics_follow_the_runtime_rule() -> None:
    n = 4
    for scheme_name in ("gc_cr", "pgc_cr"):  # c forwards per rank, one forward per rank
        task = make_task("bncnn", 5)
        scheme, versions = _schedule(scheme_name, n, 1, 6)
        streams = partition_streams(task.y_train.numpy(), n, 5, DataCondition())
        run = emulate_grid(scheme, versions, task, streams, [(0.0, 0.0)])[0]
        ref = _reference_statistics("bncnn", scheme, versions, make_task("bncnn", 5), streams, n)
        assert run.buffers is not None and set(run.buffers) == set(ref)
        for key in ref:
            assert torch.allclose(run.buffers[key].to(ref[key].dtype), ref[key], rtol=1e-5, atol=1e-6), key
        forwards = sum(len(scheme.evaluations(0, v.version)) for v in versions)  # gc: c per step; pgc: 1 (c at 0)
        assert int(run.buffers["1.num_batches_tracked"]) == forwards == (12 if scheme_name == "gc_cr" else 7)


def _adamw_mlp(seed: int) -> Task:
    t = make_task("mlp", seed)
    return Task(t.model, t.x_train, t.y_train, t.x_val, t.y_val, 8, optimizer="adamw", weight_decay=0.01)


def test_adamw_batched_over_settings_matches_torch() -> None:
    task = _adamw_mlp(2)
    scheme, versions = _schedule("pgc_cr", 4, 1, 8)
    streams = partition_streams(task.y_train.numpy(), 4, 2, DataCondition())
    settings = [(4e-3, 0.9), (1e-3, 0.0)]
    grid = emulate_grid(scheme, versions, task, streams, settings)
    for (lr, m), run in zip(settings, grid):
        one = emulate(scheme, versions, _adamw_mlp(2), streams, lr, m)  # torch.optim.AdamW
        assert one.params is not None and run.params is not None
        assert torch.allclose(one.params, run.params, rtol=0, atol=1e-6)
        assert not torch.allclose(one.params, task.model[1].weight.new_zeros(one.params.shape))


def _fit_lowers_loss(module: pl.LightningModule, x: torch.Tensor, y: torch.Tensor, loss_of) -> None:
    module.train()
    with torch.no_grad():
        before = float(loss_of(module(x), y))
    trainer = pl.Trainer(
        max_steps=25,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
    module.train()
    with torch.no_grad():
        after = float(loss_of(module(x), y))
    assert after < before, (before, after)


def test_lightning_versions_train() -> None:
    torch.manual_seed(0)
    x, y, _, _ = lm_tensors(32)
    _fit_lowers_loss(StdlibLM(lr=1e-2), x[:256], y[:256], stdlib_lm.lm_loss)
    xi, yi, _, _ = shifted_digits_tensors()
    _fit_lowers_loss(ShiftedDigitsCNN(lr=0.05), xi[:256], yi[:256], torch.nn.functional.cross_entropy)


def test_the_target_rule_takes_the_running_minimum_at_each_version_rounded_up() -> None:
    steps = [0, 5, 10, 15, 20]
    loss = [3.0, 2.5, 2.6, 2.31234, 2.2]
    assert targets_from_curve(steps, loss, early_at=7, late_at=17) == (2.5, 2.313)
    assert targets_from_curve(steps, [3.0, 2.5, 2.6, 2.7, 2.8], 7, 17) == (2.5, 2.5)  # a rise does not lower it
    with pytest.raises(ValueError, match="no finite validation loss"):
        targets_from_curve([10, 20], [1.0, 0.5], early_at=5, late_at=15)
    with pytest.raises(ValueError, match="no finite validation loss"):
        targets_from_curve(steps, [float("nan")] * 5, 7, 17)


def test_the_harder_tasks_constants_are_the_target_rules_shipped_results() -> None:
    shipped = json.loads((Path(__file__).resolve().parents[1] / "docs/results/task_targets.json").read_text())
    assert shipped["rule"] == TARGET_RULE
    for task in TARGET_RULE["tasks"]:
        run = shipped["tasks"][task]
        s = spec(task)
        assert run["constants"] == {
            "horizon": s.horizon,
            "targets": list(s.targets),
            "val_every": s.val_every,
            "map_lrs": list(s.map_lrs or ()),
            "map_momenta": list(s.map_momenta or ()),
        }, task
        # the shipped curve gives the shipped targets, and the chosen lr has the lowest final loss
        rule = TARGET_RULE
        assert list(targets_from_curve(run["steps"], run["mean_curve"], rule["early_at"], rule["late_at"])) == list(
            s.targets
        )
        assert run["chosen_lr"] == min(run["lrs"], key=lambda lr: (run["final_loss"][f"{lr:g}"], -lr))
        assert s.map_lrs == tuple(round(run["chosen_lr"] * f, 10) for f in rule["lr_factors"])


def test_a_harder_task_brings_its_own_protocol_and_the_digits_tasks_keep_the_maps() -> None:
    base = Protocol()
    assert base.for_task("mlp") == base and base.for_task("cnn") == base
    for task in ("lm", "bncnn"):
        p, s = base.for_task(task), spec(task)
        assert (p.lrs, p.momenta, p.targets, p.budget_steps, p.val_every) == (
            s.map_lrs,
            s.map_momenta,
            s.targets,
            s.horizon,
            s.val_every,
        )
        assert p.max_versions >= p.budget_steps and p.tuning_seeds == base.tuning_seeds
    assert base.for_task("lm").lrs[0] < 0.05  # AdamW's grid, not SGD's


def test_validating_every_k_versions_takes_the_same_losses_at_those_versions() -> None:
    scheme, versions = _schedule("pgc_cr", 4, 1, 12)
    every = []
    for k in (1, 5):
        task = make_task("mlp", 3)
        streams = partition_streams(task.y_train.numpy(), 4, 3, DataCondition())
        every.append(emulate_grid(scheme, versions, task, streams, [(0.2, 0.9)], val_every=k)[0])
    one, five = every
    assert five.val_steps == [0, 5, 10, 12]  # and after the last version
    assert [one.val_loss[s] for s in five.val_steps] == five.val_loss
    assert torch.equal(one.params, five.params)
    with pytest.raises(ValueError, match="val_every"):
        emulate_grid(scheme, versions, make_task("mlp", 3), streams, [(0.2, 0.9)], val_every=0)
