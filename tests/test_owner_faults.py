"""Shard owners that die, freeze or leave, on 4 real CPU ranks (gloo): with ``shard_bytes`` below the payload every
rank owns a shard, as for any real model, and the job survives each of them (tests/test_dead_ranks.py has the
protocol on in-process queues). A file of its own so that pytest-xdist runs it beside tests/test_faults.py."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests.jobs import kill_job, run_job, soak


@pytest.mark.parametrize("strategy", ["pgc", "bounded_staleness"])
def test_a_killed_shard_owner_is_survived_its_shard_moves_to_a_live_rank(tmp_path, strategy):
    """SIGKILL of rank 2 at step 3 with 4 shards (``shard_bytes`` below the payload: every rank owns one, as for
    any real model): its shard moves to a live rank, and the other three finish fit with validation and
    checkpoints, identical replicas and ``pgc/alive`` 3; the launching process exits 0. Under bounded staleness the
    live ranks send the new owner their kept codes and the leader forgets rank 2's entries."""
    job = kill_job(tmp_path, "kill_owner", strategy, {"kind": "Kill", "rank": 2, "step": 3}, shard_bytes=64)
    ranks = job["ranks"]
    assert ranks[2] is None
    live = [ranks[r] for r in (0, 1, 3)]
    assert len({r["checksum"] for r in live}) == 1 and {r["global_step"] for r in live} == {16}
    assert re.search(r"rank 2 died at version \d+ .*its shard\(s\) \[2\] move to live ranks", job["stderr"]), job[
        "stderr"
    ][-3000:]
    assert re.search(r"shard 2 to rank [013]", job["stderr"]), job["stderr"][-3000:]
    alive = [row["pgc/alive"] for row in job["summary"]["diagnostics"] if "pgc/alive" in row]
    assert alive and alive[-1] == 3.0
    windows = [row for row in job["summary"]["diagnostics"] if "pgc/bounded/window" in row]
    assert bool(windows) == (strategy == "bounded_staleness")
    assert math.isfinite(job["summary"]["metrics"]["val_loss"])
    ckpt = torch.load(tmp_path / "kill_owner" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 16


def test_a_frozen_shard_owner_is_fenced_off_and_rejoins_when_it_resumes(tmp_path):
    """SIGSTOP of rank 2 for 3 s at step 3 with 4 shards: after a heartbeat window (1 s) its shard moves to a live
    rank and the others go on; after SIGCONT it rejoins by state transfer. All four finish with identical replicas."""
    job = run_job(
        tmp_path,
        "freeze_owner",
        strategy="pgc",
        devices=4,
        max_steps=40,
        check_val_every_n_epoch=100,
        compute_s_per_eval=0.02,
        strategy_kwargs={"heartbeat_interval": 0.1, "heartbeat_misses": 10, "shard_bytes": 64},
        faults=[{"kind": "Freeze", "rank": 2, "step": 3, "seconds": 3.0}],
    )
    ranks = job["ranks"]
    assert len({r["checksum"] for r in ranks}) == 1 and {r["global_step"] for r in ranks} == {40}
    assert re.search(r"rank 2 owns shards \[2\] and sent no heartbeat .*\(frozen\)", job["stderr"]), job["stderr"][
        -3000:
    ]
    assert re.search(r"shard 2 to rank [013]", job["stderr"]) and "rank 2: rejoined at version" in job["stderr"]
    assert ranks[0]["rank_stats"][2]["rejoined"] >= 1


def test_a_300_step_soak_with_every_rank_owning_a_shard_neither_hangs_nor_grows(tmp_path):
    """The soak of tests/test_faults.py with 4 shards, so every rank's owner bookkeeping (late codes, published
    shards, codes kept for a move) runs through the stalls and rejoins too: no hang, identical replicas, one
    rejoin or more per stalled rank, no thread or resident-memory growth."""
    soak(tmp_path, shard_bytes=64)
