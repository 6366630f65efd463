"""The emulator under bounded staleness: the aggregate of a version is the one the runtime's per-rank shares add up
to, read from the leader's plan (or, for schedules without plans, from the ages under round robin), and an emulated
bounded run trains, with the strategy's corrections."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_pgc.codes import BoundedScheme
from lightning_pgc.emulator.aggregate import AggregatePlan, BoundedPlan, plan_for
from lightning_pgc.emulator.clock import Costs, simulate
from lightning_pgc.emulator.data import DataCondition, partition_streams
from lightning_pgc.emulator.schedule import Version, from_json, from_records, to_json
from lightning_pgc.emulator.train import Task, emulate, emulate_grid
from lightning_pgc.codes.shares import contribute, reference_decode

DELAY = "lognormal(median=0.02, sigma=1.5)"


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _schedule(scheme: BoundedScheme, steps: int, seed: int = 1) -> list[Version]:
    res = simulate(scheme, steps, DELAY, Costs(compute_s=0.05, code_s=0.01), delay_seed=seed)
    return from_records(res.records, res.applied[0])


SCHEMES = [
    lambda: BoundedScheme(8, 2, 3),
    lambda: BoundedScheme(6, 3, 2, fresh=3),
    lambda: BoundedScheme(5, 2, 2, fresh=2, partition_sizes=[3, 1, 2, 5, 4]),
]


@pytest.mark.parametrize("make", SCHEMES)
def test_bounded_terms_are_what_the_ranks_shares_add_up_to(make):
    scheme = make()
    schedule = _schedule(scheme, 25)
    assert any(v < e.version for e in schedule for v, _, _ in BoundedPlan(scheme).terms_of(e))  # stale entries used
    assert any(len(a) > 1 for e in schedule for a in e.ages.values())  # a rank named for two partitions
    n, dim = scheme.n, 5
    gen = torch.Generator().manual_seed(0)
    gradients = {v: torch.randn(n, dim, generator=gen, dtype=torch.float64) for v in range(len(schedule))}
    plan = plan_for(scheme)
    assert isinstance(plan, BoundedPlan)
    for entry in schedule:
        assert entry.plan is not None
        # each rank's code of version v carries the partition the plan names for it, evaluated at model version v
        codes = {(k, v): gradients[v][i] for i, k, v in entry.plan if k >= 0}
        expected = reference_decode(scheme, entry.plan, codes, dim)
        shares = torch.zeros(dim, dtype=torch.float64)
        for k in range(n):
            mine = {v: c for (r, v), c in codes.items() if r == k}
            shares += contribute(scheme, entry.plan, k, mine, dim, torch.empty(dim, dtype=torch.float64))
        got = plan.combine(plan.terms_of(entry), gradients)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got, shares, rtol=1e-12, atol=1e-12)


def test_a_left_out_partition_averages_the_others():
    scheme = BoundedScheme(4, 2, 2)
    plan = BoundedPlan(scheme)
    entries = ((0, 0, 5), (1, -1, 5), (2, 1, 4), (3, 3, 5))
    terms = plan.terms(5, (0, 1, 3), {}, entries, {0: 1 / 3, 1: 1 / 3, 3: 1 / 3})
    assert [(v, i) for v, i, _ in sorted(terms)] == [(4, 2), (5, 0), (5, 3)]
    assert [w for _, _, w in sorted(terms)] == pytest.approx([1 / 3] * 3)


def test_plans_survive_json_and_a_schedule_without_them_is_refused():
    scheme = BoundedScheme(8, 2, 3)
    schedule = _schedule(scheme, 25, seed=4)
    plan = BoundedPlan(scheme)
    rows = to_json(schedule)
    assert from_json(json.loads(json.dumps(rows))) == schedule
    assert plan.keep(schedule) >= scheme.window
    without = from_json([{k: v for k, v in r.items() if k != "plan"} for r in rows])
    with pytest.raises(ValueError, match="has none"):
        plan.terms_of(without[0])


def test_bounded_records_that_do_not_fit_are_refused():
    scheme = BoundedScheme(4, 2, 2)
    plan = BoundedPlan(scheme)
    with pytest.raises(ValueError, match="does not hold"):
        plan.terms(5, (0, 2, 3), {}, ((0, 0, 5), (1, 2, 5), (2, 2, 4), (3, 3, 5)))
    with pytest.raises(ValueError, match="recorded weights"):
        plan.terms(5, (0, 1, 2, 3), {}, ((0, 0, 5), (1, 1, 5), (2, 2, 5), (3, 3, 5)), {0: 0.5, 1: 0.5, 2: 0, 3: 0})
    with pytest.raises(ValueError, match="admitted"):
        plan.terms(5, (0, 1), {}, ((0, 0, 5), (1, 1, 5), (2, 2, 5), (3, 3, 5)))
    with pytest.raises(ValueError, match="listed twice"):
        plan.terms(5, (0, 1), {}, ((0, 0, 5), (0, 1, 5)))
    with pytest.raises(ValueError, match="BoundedPlan"):
        AggregatePlan(scheme)


def _task():
    torch.manual_seed(0)
    x = torch.randn(200, 64)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return Task(model, x[:160], y[:160], x[160:], y[160:], batch_size=4), y[:160]


def test_an_emulated_bounded_run_trains_and_the_corrections_change_it():
    n = 6
    scheme = BoundedScheme(n, 2, 2)
    schedule = _schedule(scheme, 40, seed=3)
    task, labels = _task()
    start = [p.detach().clone() for p in task.model.parameters()]
    streams = partition_streams(labels.numpy(), n, 0, DataCondition("iid"))
    settings = [(0.1, 0.5), (0.2, 0.0)]
    plain = emulate_grid(scheme, schedule, task, streams, settings)
    for run in plain:
        assert not run.diverged
        assert run.val_loss[-1] < 0.8 * run.val_loss[0]  # it trains

    def reset() -> None:
        with torch.no_grad():
            for p, p0 in zip(task.model.parameters(), start):
                p.copy_(p0)

    for correction in ("lookahead", "momentum"):
        reset()
        grid = emulate_grid(scheme, schedule, task, streams, settings, correction=correction)
        for setting, run, uncorrected in zip(settings, grid, plain):
            reset()
            single = emulate(scheme, schedule, task, streams, *setting, correction=correction)
            torch.testing.assert_close(run.params, single.params, rtol=1e-5, atol=1e-6)
            assert run.train_loss == pytest.approx(single.train_loss, rel=1e-5)
            if correction == "momentum" and setting[1] == 0.0:  # nothing to lower: max(0, 0 - mu) = 0
                torch.testing.assert_close(run.params, uncorrected.params)
            else:
                assert not torch.allclose(run.params, uncorrected.params, atol=1e-4)  # the correction changed training


def test_delay_compensation_under_bounded_is_refused():
    scheme = BoundedScheme(4, 2, 2)
    task, labels = _task()
    streams = partition_streams(labels.numpy(), 4, 0, DataCondition("iid"))
    with pytest.raises(ValueError, match="fresh gradient"):
        emulate_grid(scheme, _schedule(scheme, 3), task, streams, [(0.1, 0.0)], correction="delay_compensation")
