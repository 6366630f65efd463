"""A run whose gradients turn NaN or inf on too many ranks at one step fails at once on every rank, saying it diverged,
instead of hanging: with ``nonfinite="skip"`` each such rank is a straggler for that version, and once the ranks
left cannot decode it, no code will ever close it (while every rank still heartbeats, so no liveness timeout fires).
Exhaustively on the leader, then on in-process runtimes, then on real processes (4 CPU ranks, gloo)."""

from __future__ import annotations

import itertools
import re

import pytest

from lightning_pgc.codes import SCHEMES, BoundedScheme, make_scheme
from pgc_lab.experiments import JobFailed
from lightning_pgc.decisions import DivergedError, Leader
from lightning_pgc.decisions.bounded import BoundedLeader
from lightning_pgc.decisions.header import Header
from tests.jobs import run_job, whole_log


def _code(leader: Leader, rank: int, version: int, now: float) -> None:
    leader.on_code(Header(version, rank, 1, (0,)), now)


def _schemes():
    for name in SCHEMES:
        for s in range(4):
            try:
                yield make_scheme(name, 4, s)
            except ValueError:
                continue


def test_the_leader_raises_at_once_exactly_when_the_ranks_left_cannot_close_the_version():
    """Every scheme on n = 4 with every s it allows, every set of ranks rejecting version 1 (after a clean version
    0), rejections before or after the other codes: after each event ``check`` raises :class:`DivergedError`, naming
    the ranks rejected so far, exactly when the codes arrived plus those of every rank that has not rejected are not
    admitted (before any timeout); otherwise, once every code is in, the version closes without the rejecting ranks
    and the next version (no rejection) is checked as usual."""
    for scheme in _schemes():
        for k in range(1, 5):
            for rejected in itertools.combinations(range(4), k):
                others = [r for r in range(4) if r not in rejected]
                for rejects_first in (True, False):
                    case = (scheme.name, scheme.s, rejected, rejects_first)
                    leader = Leader(scheme, 4, 0, timeout=60.0, max_lag=100, now=0.0)
                    for r in range(4):
                        _code(leader, r, 0, 0.1)
                    assert leader.try_close(0.1).version == 0
                    events = [("reject", r) for r in rejected] + [("code", r) for r in others]
                    if not rejects_first:
                        events.reverse()
                    so_far: list[int] = []
                    raised = False
                    for kind, r in events:
                        if kind == "reject":
                            leader.on_reject(r, 1, 0.2)
                            so_far.append(r)
                        else:
                            _code(leader, r, 1, 0.2)
                        possible = [q for q in range(4) if q not in so_far]
                        if possible and scheme.admits(possible):
                            leader.check(0.2)
                            continue
                        with pytest.raises(DivergedError) as err:
                            leader.check(0.2)
                        text = str(err.value)
                        assert f"ranks {sorted(so_far)}'s gradients for version 1 are NaN or inf" in text, case
                        assert "Lower the learning rate" in text and f"needs {scheme.wait_for} of 4" in text, case
                        raised = True
                        break
                    assert raised == (not others or not scheme.admits(others)), case
                    if raised:
                        continue
                    rec = leader.try_close(0.2)
                    assert rec is not None and rec.version == 1 and not set(rec.admitted) & set(rejected), case
                    leader.check(0.3)  # version 2: nothing rejected, nothing missing


def test_a_dead_rank_and_a_rejecting_one_together_are_more_than_s():
    """pgc_cr with s = 1: rank 3 died, and rank 1's code of the open version is not finite. Ranks 0 and 2 cannot
    decode it: the error names both causes."""
    leader = Leader(make_scheme("pgc_cr", 4, 1), 4, 0, timeout=60.0, max_lag=100, now=0.0)
    leader.on_dead(3)
    _code(leader, 0, 0, 0.1)
    leader.check(0.1)
    leader.on_reject(1, 0, 0.1)
    with pytest.raises(DivergedError, match=r"ranks \[1\]'s gradients .* and ranks \[3\] are gone.*needs 3 of 4"):
        leader.check(0.1)


def test_bounded_staleness_fails_without_enough_fresh_codes_and_leaves_out_a_partition_only_rejecters_hold():
    """Bounded staleness, n = 4, r = 2, c = 1 (no stale entry helps), fresh = 2: with 3 ranks rejecting version 0 only
    one fresh code can come, so it fails at once. With rank 1 rejecting and the others' codes arrived, partition 1
    (holders 1 and 2; rank 2's code carries partition 2) cannot be covered: the version closes without it instead of
    waiting for ever."""
    scheme = BoundedScheme(4, 2, 1, fresh=2)
    leader = BoundedLeader(scheme, 4, 0, timeout=60.0, max_lag=100, now=0.0)
    for r in (1, 2, 3):
        leader.on_reject(r, 0, 0.1)
    with pytest.raises(DivergedError, match=r"ranks \[1, 2, 3\]'s gradients for version 0"):
        leader.check(0.1)
    leader = BoundedLeader(scheme, 4, 0, timeout=60.0, max_lag=100, now=0.0)
    leader.on_reject(1, 0, 0.1)
    for r in (0, 2, 3):
        _code(leader, r, 0, 0.1)
    leader.check(0.1)
    rec = leader.try_close(0.1)
    assert rec is not None and [i for i, e in enumerate(rec.entries) if e is None] == [1]
    assert leader.uncovered == 1


@pytest.mark.parametrize("strategy", ["pgc", "bounded_staleness"])
def test_a_real_job_whose_every_gradient_turns_nan_fails_fast_saying_it_diverged(tmp_path, strategy):
    """4 CPU ranks, every rank's gradient NaN at step 5 (``nonfinite="skip"``, the default; heartbeats keep every
    rank alive and ``timeout`` is 600 s, longer than the harness's 120 s limit): the job exits non-zero, each worker
    with the leader's "Training diverged" error, instead of hanging until the harness kills it."""
    with pytest.raises(JobFailed) as failed:
        run_job(
            tmp_path,
            "nan",
            strategy=strategy,
            devices=4,
            max_steps=40,
            check_val_every_n_epoch=100,
            strategy_kwargs={"liveness": {"timeout": 600.0, "heartbeat_interval": 0.1, "heartbeat_misses": 10}},
            faults=[{"kind": "NaNGradient", "rank": r, "step": 5} for r in range(4)],
            timeout=120,
        )
    log = whole_log(failed.value.result.out)
    # (it fails as soon as the ranks left cannot decode: after the second rejection under s = 1)
    assert re.search(r"Training diverged: ranks \[\d(, \d)+\]'s gradients for version 5 are NaN or inf", log), log[
        -3000:
    ]
    for r in (1, 2, 3):
        assert re.search(rf"rank {r} \(pid \d+\) exited with status 1: .*Training diverged", log), log[-3000:]
