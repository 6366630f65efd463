"""Checkpoint and resume: every rank's stale cache is saved next to the checkpoint and reloaded, so a resumed run
continues the interrupted one bitwise (when the admitted sets are the same); without it, a logged warm start."""

from __future__ import annotations

import io
import logging
import os
import shutil
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_pgc import PGCStrategy
from lightning_pgc.codes import StaleCache
from lightning_pgc.strategy.gradients import Gradients
from lightning_pgc.strategy.pipeline_checkpoint import PipelineState, sidecar_dir, sidecar_path, sidecar_paths
from tests.jobs import run_job

K, C = 4, 2  # interrupted after K steps, then C = s + 1 more


def test_a_resumed_run_matches_the_uninterrupted_one_bitwise_and_only_with_its_stale_cache(tmp_path):
    """pgc_fr on 4 ranks (groups {0, 1} and {2, 3}), ranks 1 and 3 slowed by 1 s per step: every version admits
    ranks 0 and 2 (one per group, weights 1/4, a sum of two terms whatever their arrival order), so the aggregate
    is a function of the caches alone. Run A checkpoints at step K and goes on to K + C; run B resumes from that
    checkpoint for C steps; run C resumes from a copy of it without the ``.pgc`` folder."""
    common = dict(
        strategy="pgc_fr", devices=4, check_val_every_n_epoch=100, delay="slowranks(ranks=[1, 3], seconds=1.0)"
    )
    a = run_job(tmp_path, "a", max_steps=K + C, checkpoint_every_n_steps=K, **common)
    ckpt = a["out"] / "checkpoints" / f"epoch=0-step={K}.ckpt"
    assert sorted(os.listdir(sidecar_dir(str(ckpt)))) == [f"rank{k}.pt" for k in range(4)]
    assert torch.load(ckpt, weights_only=False)["pgc"]["global_step"] == K
    bare = tmp_path / "bare.ckpt"  # the same checkpoint without the per-rank pipeline files
    shutil.copy(ckpt, bare)

    b = run_job(tmp_path, "b", max_steps=K + C, ckpt_path=str(ckpt), **common)
    c = run_job(tmp_path, "c", max_steps=K + C, ckpt_path=str(bare), **common)

    for job in (a, b, c):  # the premise: the slow ranks were never admitted (else the test measured timing)
        admitted = [h[f"pgc/admitted/rank{k}"] for h in job["summary"]["diagnostics"] for k in (1, 3)]
        assert sum(admitted) == 0, "a slow rank was admitted: the machine stalled a fast rank for over 1 s"
    assert [step for _, step, _ in b["curve"]] == list(range(K + 1, K + C + 1))
    for job in (a, b, c):
        assert len({r["checksum"] for r in job["ranks"]}) == 1  # replicas identical within each run
    # B continues the pipeline: one partition per step, the cached one from step K - 1 reused at step K
    assert b["ranks"][0]["batch_sizes"] == [16] * C
    assert [r["checksum"] for r in b["ranks"]] == [r["checksum"] for r in a["ranks"]]
    assert [loss for _, _, loss in b["curve"]] == [loss for _, _, loss in a["curve"]][K:]
    assert "without the stale cache" not in b["stderr"]
    # C warms up again (warmup="full": both held partitions at step K), says so, and ends elsewhere
    assert c["ranks"][0]["batch_sizes"] == [32] + [16] * (C - 1)
    assert f"resuming at step {K} without the stale cache" in c["stderr"]
    assert "bare.ckpt.pgc/rank0.pt is missing" in c["stderr"]
    assert c["ranks"][0]["checksum"] != a["ranks"][0]["checksum"]


# ------------------------------------------------------------------------------------------ without processes
GRAD_NUMEL = 10


def _strategy(rank: int = 1, world_size: int = 4, step: int = 7, **kwargs) -> PGCStrategy:
    """A PGCStrategy on rank ``rank`` of ``world_size`` in the middle of fit at ``step`` (what ``on_train_start``
    sets up), without processes."""
    strategy = PGCStrategy(
        parallel_devices=[torch.device("cpu")] * world_size, diagnostics={"enabled": False}, **kwargs
    )
    strategy.cluster_environment = SimpleNamespace(
        global_rank=lambda: rank, local_rank=lambda: rank, node_rank=lambda: 0, world_size=lambda: world_size
    )
    strategy.scheme = strategy._make_scheme(world_size)
    strategy.cache = StaleCache(strategy.scheme.partitions(rank), max_age=strategy.scheme.cache_max_age)
    # the payload: GRAD_NUMEL gradient elements, the loss, a buffer of 2
    strategy.gradients = Gradients([torch.nn.Parameter(torch.zeros(GRAD_NUMEL))], [torch.zeros(2)], torch.device("cpu"))
    strategy._lightning_module = SimpleNamespace(trainer=SimpleNamespace(global_step=step))
    strategy._warm_start = 0
    return strategy


def _fill(strategy: PGCStrategy, entries: dict[int, int]) -> None:
    for partition, version in entries.items():
        entry = strategy.gradients.entry_of(torch.randn(GRAD_NUMEL + 1))
        strategy.cache.put(partition, entry, version, copy=False)


def test_every_rank_saves_its_cache_next_to_the_checkpoint_and_a_resume_reloads_it_bit_for_bit(tmp_path):
    ckpt = str(tmp_path / "epoch=0-step=7.ckpt")
    saver = _strategy(rank=1)
    _fill(saver, {1: 6, 2: 5})
    checkpoint: dict = {"global_step": 7}
    saver.save_checkpoint(checkpoint, ckpt)  # rank 1: only its pipeline file, Lightning's file is rank 0's
    assert not os.path.exists(ckpt) and os.path.exists(sidecar_path(ckpt, 1)) and "pgc" not in checkpoint
    rank0 = _strategy(rank=0)
    _fill(rank0, {0: 6})
    rank0.save_checkpoint(checkpoint, ckpt)
    assert checkpoint["pgc"] == {
        "world_size": 4,
        "scheme": "pgc_cr",
        "global_step": 7,
        "warm_start": 0,
        "pipeline": "epoch=0-step=7.ckpt.pgc",
    }
    assert torch.load(ckpt, weights_only=True)["pgc"] == checkpoint["pgc"]

    resumed = _strategy(rank=1)
    assert resumed.load_checkpoint(ckpt)["global_step"] == 7
    state = resumed._checkpoints.resumed(7)
    assert state is not None and state.warm_start == 0
    resumed._checkpoints.fill(state)
    assert resumed.cache.versions() == {1: 6, 2: 5}  # expired entries too: as they were
    saved = saver.cache.entries()
    for p, (_, entry) in resumed.cache.entries().items():  # gradient and loss bit for bit
        assert torch.equal(resumed.gradients.flat(entry), saver.gradients.flat(saved[p][1]))
    assert resumed._checkpoints.resume_from is None  # used once

    # ModelCheckpoint dropping the checkpoint: every rank removes its own file, the last one the folder
    saver.remove_checkpoint(ckpt)
    assert os.path.exists(sidecar_dir(ckpt)) and not os.path.exists(sidecar_path(ckpt, 1))
    rank0.remove_checkpoint(ckpt)
    assert not os.path.exists(ckpt) and not os.path.exists(sidecar_dir(ckpt))


@pytest.mark.parametrize("scheme, s", [("pgc_cr", 1), ("gc_cr", 1), ("dgd", 0), ("bounded", 1)])
def test_outside_fit_or_without_a_pipeline_only_lightnings_checkpoint_is_written(tmp_path, caplog, scheme, s):
    strategy = _strategy(rank=0, scheme=scheme, stragglers=s)
    if scheme == "pgc_cr":
        strategy.cache = None  # fit ended: the pipeline was released
    else:  # the cache holds this step's gradients only: nothing for a resume to continue
        _fill(strategy, {strategy.cache.partitions[0]: 6})
    checkpoint: dict = {"global_step": 7}
    strategy.save_checkpoint(checkpoint, str(tmp_path / "after.ckpt"))
    assert "pgc" not in checkpoint and os.listdir(tmp_path) == ["after.ckpt"]
    if scheme != "pgc_cr":  # and a resume of such a scheme has nothing to warn about
        strategy.load_checkpoint(str(tmp_path / "after.ckpt"))
        with caplog.at_level(logging.WARNING, logger="lightning_pgc.strategy"):
            assert strategy._checkpoints.resumed(7) is None
        assert not caplog.records and strategy._checkpoints.resume_from is None


def _resume(tmp_path, caplog, saved: Optional[PGCStrategy], resumed: PGCStrategy, step: int = 7, info: bool = True):
    """Rank 1's pipeline file from ``saved`` (none if ``None``), then ``resumed``'s restore from it."""
    ckpt = str(tmp_path / "x.ckpt")
    if saved is not None:
        TorchCheckpointIO().save_checkpoint(saved._checkpoints.state().to_dict(), sidecar_path(ckpt, 1))
    resumed._checkpoints.resume_from = (ckpt, {"global_step": 7} if info else None)
    with caplog.at_level(logging.WARNING, logger="lightning_pgc.strategy"):
        return resumed._checkpoints.resumed(step)


@pytest.mark.parametrize(
    "saved, resumed, step, info, reason",
    [
        (None, {}, 7, True, "x.ckpt.pgc/rank1.pt is missing (copy the .pgc folder"),
        (None, {}, 7, False, "the checkpoint has no PGC pipeline state (saved by another strategy or scheme"),
        ({"scheme": "pgc_fr"}, {}, 7, True, "scheme: saved 'pgc_fr', now 'pgc_cr'"),
        ({"seed": 3}, {}, 7, True, "seed (partition split and data streams): saved 3, now 0"),
        ({}, {}, 9, True, "global step (this file belongs to another save of the checkpoint): saved 7, now 9"),
    ],
)
def test_a_resume_without_a_usable_cache_warms_up_again_and_says_why(
    tmp_path, caplog, saved, resumed, step, info, reason
):
    saver = None
    if saved is not None:
        saver = _strategy(rank=1, **saved)
        _fill(saver, {p: 6 for p in saver.cache.partitions})
    assert _resume(tmp_path, caplog, saver, _strategy(rank=1, **resumed), step=step, info=info) is None
    message = caplog.records[-1].getMessage()
    assert f"resuming at step {step} without the stale cache: " in message and reason in message
    assert "warms up again (coding.warmup='full': every held partition is evaluated at that step)" in message


def test_a_resume_on_fewer_ranks_warms_up_again(tmp_path, caplog):
    saver = _strategy(rank=1)
    _fill(saver, {1: 6, 2: 6})
    assert _resume(tmp_path, caplog, saver, _strategy(rank=1, world_size=2)) is None
    assert "rank1.pt is from another run (ranks: saved 4, now 2)" in caplog.records[-1].getMessage()


def test_an_unreadable_pipeline_file_warms_up_again(tmp_path, caplog):
    ckpt = tmp_path / "x.ckpt"
    os.makedirs(sidecar_dir(str(ckpt)))
    with open(sidecar_path(str(ckpt), 1), "wb") as f:
        f.write(b"not a torch file")
    strategy = _strategy(rank=1)
    strategy._checkpoints.resume_from = (str(ckpt), {})
    with caplog.at_level(logging.WARNING, logger="lightning_pgc.strategy"):
        assert strategy._checkpoints.resumed(7) is None
    assert "x.ckpt.pgc/rank1.pt could not be read (" in caplog.records[-1].getMessage()


def test_pipeline_state_round_trips_and_refuses_malformed_files():
    flat = torch.arange(12, dtype=torch.float32)
    state = PipelineState(
        rank=2,
        world_size=4,
        scheme="pgc_fr",
        partitions=(2, 3),
        seed=1,
        grad_numel=10,
        dtype="float32",
        global_step=5,
        warm_start=0,
        entries={3: (4, flat)},
    )
    saved = io.BytesIO()
    torch.save(state.to_dict(), saved)
    saved.seek(0)
    back = PipelineState.from_dict(torch.load(saved, weights_only=True))
    assert {k: v for k, v in vars(back).items() if k != "entries"} == {
        k: v for k, v in vars(state).items() if k != "entries"
    }
    assert list(back.entries) == [3] and back.entries[3][0] == 4 and torch.equal(back.entries[3][1], flat)
    assert back.mismatch(state) is None
    assert back.mismatch(PipelineState(**{**vars(state), "grad_numel": 11})) == (
        "gradient size (the model changed): saved 10, now 11"
    )
    assert "payload dtype: saved 'float32', now 'float64'" in back.mismatch(
        PipelineState(**{**vars(state), "dtype": "float64"})
    )
    for bad, match in [
        ({**state.to_dict(), "format": 0}, "not a PGC pipeline file of format 1"),
        ({k: v for k, v in state.to_dict().items() if k != "seed"}, "malformed PGC pipeline file \\(KeyError"),
        ({**state.to_dict(), "entries": {3: {"version": 5, "flat": flat}}}, "entry of partition 3 at version 5"),
        ({**state.to_dict(), "entries": {1: {"version": 4, "flat": flat}}}, "entry of partition 1 at version 4"),
        ({**state.to_dict(), "entries": {3: {"version": 4, "flat": flat[:10]}}}, "at least 11 elements"),
    ]:
        with pytest.raises(ValueError, match=match):
            PipelineState.from_dict(bad)


def test_a_symlinked_last_checkpoint_finds_the_pipeline_of_its_target(tmp_path, caplog):
    """``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symlink; a ``last.ckpt.pgc`` folder left by an
    earlier ``save_last=True`` run belongs to another step and is passed over."""
    target = tmp_path / "epoch=0-step=7.ckpt"
    target.write_bytes(b"")
    link = tmp_path / "last.ckpt"
    link.symlink_to(target.name)
    assert sidecar_paths(str(link), 1) == [
        str(tmp_path / "last.ckpt.pgc" / "rank1.pt"),
        str(tmp_path / "epoch=0-step=7.ckpt.pgc" / "rank1.pt"),
    ]
    assert sidecar_paths(str(target), 1) == [sidecar_path(str(target), 1)]
    checkpoint_io = TorchCheckpointIO()
    old, now = _strategy(rank=1, step=5), _strategy(rank=1, step=7)
    _fill(old, {1: 4})
    _fill(now, {1: 6, 2: 5})
    checkpoint_io.save_checkpoint(old._checkpoints.state().to_dict(), sidecar_path(str(link), 1))
    checkpoint_io.save_checkpoint(now._checkpoints.state().to_dict(), sidecar_path(str(target), 1))
    resumed = _strategy(rank=1)
    resumed._checkpoints.resume_from = (str(link), {})
    with caplog.at_level(logging.WARNING, logger="lightning_pgc.strategy"):
        state = resumed._checkpoints.resumed(7)
    assert state is not None and {p: v for p, (v, _) in state.entries.items()} == {1: 6, 2: 5}
    assert not caplog.records
