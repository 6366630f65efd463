"""Bounded staleness: the pure table and scheme (exhaustive small cases, float64 references) and the coordinator on
in-process transports (coverage rule, newest-entry replacement, waits, widening, identical replicas)."""

from __future__ import annotations

import itertools
from functools import partial
from typing import Optional

import numpy as np
import pytest
import torch

from lightning_pgc.codes import (
    BoundedScheme,
    CoverageTable,
    Entry,
    adapt_step,
    choose_partition,
    error_decomposition,
)


# ------------------------------------------------------------------------------------------------- pure math


def test_round_robin_evaluates_every_partition_once_per_step_and_only_held_ones():
    for n in range(2, 7):
        for r in range(1, n + 1):
            scheme = BoundedScheme(n, r, 2)
            for t in range(2 * r + 1):
                evaluated = [scheme.evaluated(k, t) for k in range(n)]
                assert sorted(evaluated) == list(range(n))
                for k in range(n):
                    assert evaluated[k] in scheme.partitions(k)
                    assert scheme.evaluations(k, t) == (evaluated[k],)
            # within r consecutive steps a rank visits every partition it holds
            for k in range(n):
                assert {scheme.evaluated(k, t) for t in range(5, 5 + r)} == set(scheme.partitions(k))


def test_oldest_choice_rule_exhaustive_on_small_cases():
    """Every held set of a 5-partition cyclic placement (r = 1..4), every table of ages in 0..2, every step in
    0..r and every own code (none, or one held partition at versions step-1 or step-2): the choice is a held
    partition of the largest age, counting the rank's own code; among those the first in the held order rotated
    by the step; with unknown or equal ages it is round robin."""
    n = 5
    for r in range(1, 5):
        scheme = BoundedScheme(n, r, 2, choice="oldest")
        for k in (0, 3):
            held = scheme.partitions(k)
            owns = [{}] + [{i: v} for i in held for v in (-1, 0)]
            for t in range(r + 1):
                rr = scheme.evaluations(k, t)[0]
                assert choose_partition(held, t, None) == rr and scheme.choose(k, t) == (rr,)
                assert choose_partition(held, t, [1] * n) == rr
                for ages in itertools.product(range(3), repeat=n):
                    for own in owns:
                        own = {i: v + t for i, v in own.items()}  # versions step-1 and step-2
                        eff = {i: min(ages[i], t - 1 - own[i]) if i in own else ages[i] for i in held}
                        got = choose_partition(held, t, ages, own)
                        rotated = [held[(t + j) % r] for j in range(r)]
                        assert got == next(i for i in rotated if eff[i] == max(eff.values()))
                        assert scheme.choose(k, t, ages, own) == (got,)
    with pytest.raises(ValueError, match="ages of all 5"):
        BoundedScheme(5, 2, 2, choice="oldest").choose(0, 1, [0, 0])
    with pytest.raises(ValueError, match="choice"):
        BoundedScheme(4, 2, 2, choice="newest")
    with pytest.raises(ValueError, match="room for 16 partitions"):
        BoundedScheme(17, 2, 2, choice="oldest")
    assert BoundedScheme(4, 2, 2, choice="oldest").sampled(1, 5) == (1, 2)
    assert BoundedScheme(4, 2, 2).sampled(1, 5) == (2,)


def _simulate_choices(
    n: int,
    r: int,
    late: list[Optional[int]],
    slow: Optional[int],
    count_own: bool,
    skips: frozenset = frozenset(),
    count_skipped: bool = True,
):
    """Pure model of the leader and ``n`` ranks under ``choice="oldest"``: at each step every rank except ``slow``
    picks a partition from the table ages at the last close (and its own codes when ``count_own``); the code of rank
    ``late[t]`` misses the close of ``t`` and enters the table just after it; a rank with ``(rank, t)`` in ``skips``
    chooses at ``t`` but computes nothing (the version closed before it got there), and remembers that choice only
    when ``count_skipped`` (as the strategy does). Returns per step the choices of the ranks that report and the
    ages at the close."""
    scheme = BoundedScheme(n, r, 2, choice="oldest")
    versions = [-1] * n  # table: version of every partition's entry (-1: the empty table's placeholder)
    own: list[dict[int, int]] = [{} for _ in range(n)]
    ages = None
    out = []
    for t, lateness in enumerate(late):
        ranks = [k for k in range(n) if k != slow]
        chosen = {k: scheme.choose(k, t, ages, own[k] if count_own else None)[0] for k in ranks}
        for k in list(chosen):
            if (k, t) in skips:
                if count_skipped:
                    own[k][chosen[k]] = t
                del chosen[k]
        for k in chosen:
            own[k][chosen[k]] = t
            if k != lateness:
                versions[chosen[k]] = max(versions[chosen[k]], t)
        ages = [t - v for v in versions]  # what the aggregate of t carries
        if lateness is not None and lateness in chosen:
            versions[chosen[lateness]] = max(versions[chosen[lateness]], t)
        out.append((chosen, ages))
    return out


def test_oldest_choice_keeps_a_full_rotation_when_one_code_per_step_misses_the_close():
    """r = 2, n = 3..6, every sequence of ranks whose code misses the close (one per step, 4 steps): the ranks'
    choices cover every partition once per step (no duplicated work), as round robin's do. Without counting the
    rank's own late code, some sequence makes two ranks compute the same partition."""
    for n in range(3, 7):
        duplicated_without_own = False
        for late in itertools.product(range(n), repeat=4):
            for chosen, _ in _simulate_choices(n, 2, list(late), None, count_own=True):
                assert sorted(chosen.values()) == list(range(n)), (n, late)
            duplicated_without_own |= any(
                len(set(c.values())) < n for c, _ in _simulate_choices(n, 2, list(late), None, count_own=False)
            )
        assert duplicated_without_own


def test_oldest_choice_stays_in_step_after_a_rank_skips_a_version():
    """r = 2, n = 3..6, any one rank skipping any one of 6 versions (it arrives after that version closed and only
    applies it): from the next version on, the ranks' choices cover every partition once per step again. A rank
    that forgot its skipped choice would pick the partition it skipped, next to that partition's other holder, and
    stay out of phase: some skip makes two ranks compute the same partition at a later step."""
    for n in range(3, 7):
        out_of_phase_without = False
        for k, t_skip in itertools.product(range(n), range(1, 6)):
            skips = frozenset({(k, t_skip)})
            runs = _simulate_choices(n, 2, [None] * 8, None, True, skips)
            for chosen, _ in runs[t_skip + 1 :]:
                assert sorted(chosen.values()) == list(range(n)), (n, k, t_skip)
            forgetful = _simulate_choices(n, 2, [None] * 8, None, True, skips, count_skipped=False)
            out_of_phase_without |= any(len(set(c.values())) < n for c, _ in forgetful[t_skip + 1 :])
        assert out_of_phase_without


def test_oldest_choice_with_a_persistently_slow_rank_covers_its_partitions_with_their_other_holders():
    """r = 2, n = 3..6, the last rank never reports: the other ranks never compute the same partition twice in a
    step, the slow rank's partitions are evaluated by their other holders at least every other step, and the ages
    at the close never exceed 1. With r = 2 these are exactly round robin's choices (round robin alternates
    between the only two assignments that give every partition one evaluator)."""
    for n in range(3, 7):
        slow = n - 1
        runs = _simulate_choices(n, 2, [None] * 12, slow, count_own=True)
        rr = BoundedScheme(n, 2, 2)
        for t, (chosen, ages) in enumerate(runs):
            assert chosen == {k: rr.evaluated(k, t) for k in range(n - 1)}
            assert len(set(chosen.values())) == n - 1
            if t >= 1:
                assert max(ages) <= 1
        for p in rr.partitions(slow):
            assert all(any(p in runs[t + d][0].values() for d in (0, 1)) for t in range(len(runs) - 1))


def test_scheme_configuration_errors_are_clear():
    with pytest.raises(ValueError, match="replication"):
        BoundedScheme(4, 0, 2)
    with pytest.raises(ValueError, match="s must be < n"):
        BoundedScheme(4, 5, 2)
    with pytest.raises(ValueError, match="staleness"):
        BoundedScheme(4, 2, 0)
    with pytest.raises(ValueError, match="fresh"):
        BoundedScheme(4, 2, 2, fresh=5)
    with pytest.raises(ValueError, match="partition_sizes"):
        BoundedScheme(4, 2, 2, partition_sizes=[1, 2, 3])
    assert BoundedScheme(4, 2, 3).wait_for == 3 and BoundedScheme(4, 2, 3, fresh=1).wait_for == 1
    assert BoundedScheme(4, 2, 3).max_staleness == 2


def test_decode_is_the_weighted_mean_over_partitions_float64_reference():
    rng = np.random.default_rng(0)
    for n, sizes in [(3, None), (4, None), (5, [10, 11, 11, 10, 9]), (4, [1, 0, 2, 1])]:
        scheme = BoundedScheme(n, 2, 2, partition_sizes=sizes)
        grads = {i: torch.from_numpy(rng.normal(size=11)) for i in range(n)}
        w = np.full(n, 1.0 / n) if sizes is None else np.asarray(sizes, float) / sum(sizes)
        ref = sum(w[i] * grads[i].numpy() for i in range(n))
        for order in itertools.islice(itertools.permutations(range(n)), 0, 24, 7):
            got = scheme.decode({i: grads[i] for i in order})
            np.testing.assert_allclose(got.numpy(), ref, rtol=1e-13, atol=1e-14)
        for k in range(1, n):  # a version closed without some partitions averages the others
            for parts in itertools.combinations(range(n), k):
                if sum(w[i] for i in parts) == 0:
                    with pytest.raises(ValueError, match="their weight is 0"):
                        scheme.decode({i: grads[i] for i in parts})
                    continue
                part = sum(w[i] * grads[i].numpy() for i in parts) / sum(w[i] for i in parts)
                np.testing.assert_allclose(
                    scheme.decode({i: grads[i] for i in parts}).numpy(), part, rtol=1e-13, atol=1e-14
                )
        with pytest.raises(ValueError, match="cannot decode"):
            scheme.decode({})


def test_encode_carries_exactly_one_held_gradient_uncoded():
    scheme = BoundedScheme(4, 2, 2)
    g = torch.arange(5.0)
    assert torch.equal(scheme.encode(1, {2: g}), g)
    with pytest.raises(ValueError, match="exactly one"):
        scheme.encode(1, {1: g, 2: g})
    with pytest.raises(ValueError, match="does not hold"):
        scheme.encode(1, {3: g})


def test_table_keeps_the_newest_entry_and_the_first_of_equal_versions():
    table = CoverageTable(3)
    assert table.offer(0, rank=2, version=4)
    assert not table.offer(0, rank=0, version=3)  # older: ignored
    assert not table.offer(0, rank=0, version=4)  # equal: the first arrival stays
    assert table.entries[0] == Entry(2, 4)
    assert table.offer(0, rank=0, version=5)
    assert table.entries[0] == Entry(0, 5)
    with pytest.raises(ValueError, match="newer than version"):
        table.ages(4)


def test_coverage_rule_exhaustive_on_small_tables():
    """Every table of n <= 3 partitions with entries absent or at versions 0..3, every t in 3..5 and c in 1..4:
    t may close iff every partition has an entry with t - v < c, and the decision is exactly the table."""
    for n in (1, 2, 3):
        for versions in itertools.product([None, 0, 1, 2, 3], repeat=n):
            table = CoverageTable(n)
            for i, v in enumerate(versions):
                if v is not None:
                    table.offer(i, rank=i, version=v)
            for t in (3, 4, 5):
                for c in (1, 2, 3, 4):
                    ok = all(v is not None and t - v < c for v in versions)
                    assert (table.missing(t, c) == []) == ok
                    assert table.missing(t, c) == [i for i, v in enumerate(versions) if v is None or t - v >= c]
                    if ok:
                        assert [e.version for e in table.decision(t, c)] == list(versions)
                    else:
                        with pytest.raises(ValueError, match="not covered"):
                            table.decision(t, c)


def test_adapt_step_lowers_and_recovers_within_bounds():
    lr = partial(adapt_step, threshold=0.5, recover_below=0.1, factor=0.5, lowest=0.125, highest=1.0)
    assert lr(0.6, value=1.0) == 0.5 and lr(0.6, value=0.125) == 0.125
    assert lr(0.3, value=0.5) == 0.5 and lr(0.05, value=0.5) == 1.0 and lr(0.05, value=1.0) == 1.0
    window = partial(adapt_step, threshold=0.5, recover_below=None, factor=-1, lowest=1, highest=4)
    assert window(0.6, value=4) == 3 and window(0.6, value=1) == 1 and window(0.01, value=3) == 3


def test_error_decomposition_is_exact_and_the_card_drops_a_cross_term():
    """Random float64 vectors: total = staleness + noise + cross to rounding; card_rhs + card_gap = total with
    card_gap = 2 <a, m - g>; the Lipschitz bound holds for a linear gradient map; fresh-only gives no staleness."""
    rng = np.random.default_rng(1)
    A = torch.from_numpy(rng.normal(size=(6, 6)))
    A = A @ A.T  # gradient of a quadratic: grad F(beta) = A beta, L = |A|_2
    beta = {v: torch.from_numpy(rng.normal(size=6)) for v in (3, 4, 5)}
    grad = {v: A @ b for v, b in beta.items()}
    versions, weights = [5, 3, 4, 5], [0.25] * 4
    g = torch.from_numpy(rng.normal(size=6))
    out = error_decomposition(grad[5], grad, versions, weights, g, beta[5], beta)
    a, m = grad[5], sum(w * grad[v] for v, w in zip(versions, weights))
    assert out["total"] == pytest.approx(float((a - g).pow(2).sum()), rel=1e-12)
    assert out["staleness"] + out["noise"] + out["cross"] == pytest.approx(out["total"], rel=1e-12)
    assert out["card_gap"] == pytest.approx(2 * float(a @ (m - g)), rel=1e-10, abs=1e-10)
    assert out["card_rhs"] + out["card_gap"] == pytest.approx(out["total"], rel=1e-12)
    L = float(torch.linalg.matrix_norm(A, ord=2))
    assert out["staleness_mean"] <= L**2 * out["displacement"] * (1 + 1e-12)
    assert out["cos_min"] == pytest.approx(float(a @ grad[3] / (a.norm() * grad[3].norm())), rel=1e-12)
    fresh = error_decomposition(grad[5], grad, [5, 5], [0.5, 0.5], g)
    assert fresh["staleness"] == 0 and fresh["staleness_mean"] == 0 and fresh["cos_min"] == pytest.approx(1.0)


def _trainer(strategy, devices=4):
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )


def test_registered_name_and_bad_configurations_fail_in_the_launching_process():
    import lightning_pgc  # noqa: F401
    from lightning_pgc import PGCStrategy

    strategy = _trainer("bounded_staleness").strategy
    assert isinstance(strategy, PGCStrategy) and strategy.scheme_name == "bounded"
    assert repr(strategy._make_scheme(4)) == "BoundedScheme(n=4, replication=2, staleness=2, fresh=3)"
    with pytest.raises(ValueError, match="s must be < n"):
        _trainer(PGCStrategy(scheme="bounded", coordinator={"replication": 5}), devices=4)
    with pytest.raises(ValueError, match=r"coordinator\.staleness must be an int >= 1, got 0"):
        PGCStrategy(scheme="bounded", coordinator={"staleness": 0})
    with pytest.raises(ValueError, match="fresh must be in"):  # (at most n: known once the ranks are)
        _trainer(PGCStrategy(scheme="bounded", coordinator={"fresh": 9}), devices=4)
    with pytest.raises(ValueError, match=r"coordinator options apply to scheme='bounded' only"):
        PGCStrategy(scheme="pgc_cr", coordinator={"replication": 3, "staleness": 3})
    with pytest.raises(ValueError, match=r"coordinator\.max_staleness must be None or >= staleness \(4\)"):
        PGCStrategy(scheme="bounded", coordinator={"staleness": 4, "max_staleness": 3})
    with pytest.raises(ValueError, match=r"coordinator\.widen_after must be seconds >= 0"):
        PGCStrategy(scheme="bounded", coordinator={"widen_after": -1.0})


@pytest.mark.parametrize("choice", ["round_robin", "oldest"])
def test_real_ranks_persistent_slow_rank_bounded_ages_identical_replicas_and_window_valve(tmp_path, choice):
    """4 CPU ranks, r = 2, c = 3, rank 3 sleeps 1 s in every step it computes; the valve (action='window',
    threshold 0) lowers c to 2 at its first check. Steps advance without rank 3 (which catches up by applying
    published aggregates), every aggregate's entries are younger than the window in effect, the valve took the
    same decisions on every rank, replicas are bit-identical, and the logged error decomposition adds up. Under
    both partition choices: with "oldest" the loader yields both held mini-batches, each rank computes the one the
    last aggregate's table names, and the fast ranks cover the slow rank's partitions as closely as round robin."""
    from tests.jobs import run_job

    steps = 30
    job = run_job(
        tmp_path,
        "bounded",
        strategy="bounded_staleness",
        strategy_kwargs={"coordinator": {"staleness": 3, "choice": choice}},
        devices=4,
        max_steps=steps,
        delay="slowranks(ranks=[3], seconds=1.0)",
        check_val_every_n_epoch=100,
        diagnostics={"every_n_steps": 5},
        valve={"action": "window", "threshold": 0.0, "check_every_n_steps": 5, "min_window": 2},
    )
    ranks = job["ranks"]
    assert len({r["checksum"] for r in ranks}) == 1 and {r["global_step"] for r in ranks} == {steps}
    assert ranks[3]["injected_sleep_s"] >= 1.0 and ranks[3]["skipped_steps"] >= 1
    # the loader's batches: one mini-batch of 16 per step, or both held ones under "oldest" (one is computed)
    assert {b for r in ranks for b in r["batch_sizes"]} == {16 * (2 if choice == "oldest" else 1)}
    assert all(r["skipped_steps"] == 0 for r in ranks[:3])
    # the others did not wait for rank 3: it slept 1 s in each step it computed, yet the fit took less than the
    # sleep that waiting for it in every step would add (a ratio within the run, not a wall-clock bound)
    assert job["summary"]["fit_wall_s"] < steps * ranks[3]["injected_sleep_s"] / (steps - ranks[3]["skipped_steps"])

    valves = job["valves"]
    assert [(e["step"], e["window"]) for e in valves[0]["events"]] == [(5.0, 2.0)]
    for v in valves:
        assert v["window"] == 2 and v["events"] == valves[0]["events"] and v["checks"] == valves[0]["checks"]

    history = job["summary"]["diagnostics"]
    assert [h["step"] for h in history] == list(range(steps))
    for h in history:
        assert h["pgc/max_age"] < h["pgc/bounded/window"] <= 3
    assert all(h["pgc/bounded/window"] == 2 for h in history[7:])
    assert max(h["pgc/max_age"] for h in history) == 1  # stale entries were used
    last = history[-1]
    assert sum(v for k, v in last.items() if k.startswith("pgc/bounded/delay_count/")) == 4 * steps
    probes = [h for h in history if "pgc/bounded/err_total" in h]
    assert len(probes) == steps // 5
    for h in probes:
        parts = h["pgc/bounded/err_staleness"] + h["pgc/bounded/err_noise"] + h["pgc/bounded/err_cross"]
        assert parts == pytest.approx(h["pgc/bounded/err_total"], rel=1e-6, abs=1e-9)
        assert h["pgc/bounded/err_card_rhs"] + h["pgc/bounded/err_card_gap"] == pytest.approx(
            h["pgc/bounded/err_total"], rel=1e-6, abs=1e-9
        )
        assert -1.0 <= h["pgc/bounded/stale_fresh_cos"] <= 1.0 + 1e-9
