"""``run_job``: the tests' way to run one job, a thin layer over :func:`pgc_lab.experiments.launch`.

It keeps the keyword form the tests were written in (``run_job(tmp_path, "pgc", strategy="pgc", devices=4)``)
and returns :meth:`JobResult.legacy`, the dict they read. Two digits-model keys are spelled out here: ``batch_norm``
(``model.batch_norm``) and ``sync_loss``, which also sets the digits model's ``sync_train_loss``.

Ranks are forked from the launching process (``start_method="fork"``) unless a test says otherwise: each rank
then skips importing Lightning (about 10 s of CPU per rank on this machine). The CLI and packaging tests keep
the ``popen`` path users run.

"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pgc_lab.experiments import launch


def run_job(tmp_path: Path, name: str, timeout: float = 240, **spec: Any) -> dict[str, Any]:
    """Run one job in ``tmp_path / name``; return {"ranks", "valves", "summary" (with "spec"), "curve", "out",
    "stderr": the whole log}. Raises :class:`~pgc_lab.experiments.JobFailed` when the job fails."""
    model = dict(spec.pop("model", {}))
    if "batch_norm" in spec:
        model["batch_norm"] = spec.pop("batch_norm")
    if "sync_loss" in spec:
        model["sync_train_loss"] = spec["sync_loss"]
    spec = {"out": str(Path(tmp_path) / name), "model": model, "start_method": "fork", **spec}
    job = launch(spec, timeout=timeout).legacy()
    job["stderr"] = whole_log(job["out"])
    return job


#: liveness settings of the fault scenarios (the strategy's ``liveness`` group): a death is noticed within about a
#: second
LIVENESS = {"heartbeat_interval": 0.1, "heartbeat_misses": 10, "timeout": 1.0}
#: the strategy keyword arguments that set them
FAST_LIVENESS = {"liveness": LIVENESS}


def kill_job(
    tmp_path: Path, name: str, strategy: str, fault: dict[str, Any], during: str = "train", **strategy_kwargs: Any
) -> dict[str, Any]:
    """The kill scenario: 16 steps on 4 CPU ranks, validating and checkpointing every 8 steps (the collectives a
    dead rank must not fail), fast liveness, and ``fault`` (a ``Kill`` spec); 2 sanity batches when the fault
    strikes ``during`` the sanity check."""
    return run_job(
        tmp_path,
        name,
        strategy=strategy,
        devices=4,
        max_steps=16,
        val_check_interval=8,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        checkpoint_every_n_steps=8,
        num_sanity_val_steps=2 if during == "sanity_check" else 0,
        strategy_kwargs={**FAST_LIVENESS, **strategy_kwargs},
        faults=[fault],
    )


def whole_log(out: Path | str) -> str:
    """The job's whole log. ``JobResult.log_tail`` keeps the last 8000 characters, and tracebacks (longer under
    CI's longer paths) can push the line a test looks for out of it."""
    return (Path(out) / "job.log").read_text(errors="replace")


MAX_LAG = 3


SOAK_RSS_GROWTH = 16 << 20


def soak(tmp_path):
    """The soak job and its checks."""
    kwargs = {"liveness": {"max_lag": MAX_LAG}}
    job = run_job(
        tmp_path,
        "soak",
        strategy="pgc_cr",
        devices=4,
        max_steps=300,
        check_val_every_n_epoch=100,
        delay="lognormal(median=0.003, sigma=0.5)",
        strategy_kwargs=kwargs,
        faults=[{"kind": "Stall", "rank": r, "step": k, "seconds": 1.0} for r, k in ((1, 60), (2, 140), (3, 220))],
        resources=[50, 150],
    )
    ranks = job["ranks"]
    assert {r["global_step"] for r in ranks} == {300} and len({r["checksum"] for r in ranks}) == 1
    assert all(r["pgc_threads_after_fit"] == [] for r in ranks)
    table = ranks[0]["rank_stats"]
    assert all(table[k]["rejoined"] >= 1 for k in (1, 2, 3)), table
    assert max(r["buffers"]["mailbox_high_water"] for r in ranks) <= MAX_LAG + 1
    losses = [loss for _, _, loss in job["curve"]]
    assert len(losses) == 300 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-20:]) / 20 < 0.25 * sum(losses[:10]) / 10
    for r in ranks:
        first, *later = r["resources"]
        assert first["step"] == 50 and [s["step"] for s in later] == [150, 300], r["resources"]
        for sample in later:
            assert sample["threads"] <= first["threads"], (r["rank"], r["resources"])
            assert sample["rss_bytes"] - first["rss_bytes"] <= SOAK_RSS_GROWTH, (r["rank"], r["resources"])
