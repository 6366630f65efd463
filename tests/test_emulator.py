"""The emulator's pure parts: exact aggregates with the schemes' own encode/decode, batched training equal to the
one-setting path, data conditions, cluster delay models, and a tiny map round end to end (resumable)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lightning_pgc.codes import StaleCache, make_scheme
from lightning_pgc.emulator.aggregate import AggregatePlan
from lightning_pgc.emulator.cluster import PATTERNS, NodeStalls, Pareto, costs_for, delay_model
from lightning_pgc.emulator.data import DataCondition, dirichlet_partitions, label_skew, partition_streams
from lightning_pgc.emulator.schedule import Version, from_json, from_records, to_json
from lightning_pgc.emulator.train import Task, emulate, emulate_grid
from lightning_pgc.emulator.clock import Costs, simulate
from lightning_pgc.delays import delay_for

SCHEMES = [("dgd", 0), ("ignore", 1), ("gc_fr", 1), ("gc_cr", 1), ("pgc_fr", 1), ("pgc_cr", 1), ("pgc_cr", 2)]


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _reference_aggregate(scheme, steps, admitted_per_step, vectors):
    """Run the real caches, encode and decode by hand: ``vectors[(j, v)]`` is partition j's gradient at version v."""
    caches = [StaleCache(scheme.partitions(k), scheme.cache_max_age) for k in range(scheme.n)]
    out = []
    for t in range(steps):
        codes, ages = {}, {}
        for k in range(scheme.n):
            for j in scheme.evaluations(k, t):
                caches[k].put(j, vectors[(j, t)], t)
            caches[k].evict(t)
            valid = caches[k].valid(t)
            codes[k] = scheme.encode(k, valid)
            ages[k] = tuple(caches[k].ages(t).values())
        admitted = admitted_per_step[t]
        out.append((scheme.decode({k: codes[k] for k in admitted}), admitted, ages))
    return out


@pytest.mark.parametrize("name, s", SCHEMES)
def test_aggregate_plan_equals_encode_then_decode(name, s):
    n, steps, dim = 6, 7, 5
    scheme = make_scheme(name, n, s)
    rng = np.random.default_rng(0)
    vectors = {(j, v): torch.tensor(rng.normal(size=dim)) for j in range(n) for v in range(steps)}
    admitted = []
    for t in range(steps):
        order = [int(k) for k in rng.permutation(n)]
        while not scheme.admits(order[: n - s]):
            order = [int(k) for k in rng.permutation(n)]
        admitted.append(tuple(order[: n - s]))
    plan = AggregatePlan(scheme)
    for t, (expected, adm, ages) in enumerate(_reference_aggregate(scheme, steps, admitted, vectors)):
        gradients = {v: torch.stack([vectors[(j, v)] for j in range(n)]) for v in range(max(0, t - scheme.c), t + 1)}
        got = plan.combine(plan.terms(t, adm, ages), gradients)
        torch.testing.assert_close(got, expected.to(torch.float64), rtol=1e-6, atol=1e-7)  # float32 payloads


def test_aggregate_plan_refuses_ages_from_another_rotation():
    plan = AggregatePlan(make_scheme("pgc_cr", 4, 1))
    with pytest.raises(ValueError, match="do not fit"):
        plan.terms(5, (0, 1, 2), {0: (0, 0), 1: (1, 0), 2: (1, 0)})


def _task(n_features=64):
    torch.manual_seed(0)
    x = torch.randn(200, n_features)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(n_features, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return Task(model, x[:160], y[:160], x[160:], y[160:], batch_size=4), y[:160]


@pytest.mark.parametrize("name, s", [("pgc_cr", 1), ("gc_fr", 1), ("ignore", 2)])
def test_grid_of_settings_matches_one_setting_runs(name, s):
    n = 6
    scheme = make_scheme(name, n, s)
    res = simulate(scheme, 12, "lognormal(median=0.02, sigma=1.0)", Costs(compute_s=0.05), delay_seed=3)
    schedule = from_records(res.records, res.applied[0])
    settings = [(0.1, 0.0), (0.3, 0.9)]
    task, labels = _task()
    start = [p.detach().clone() for p in task.model.parameters()]
    streams = partition_streams(labels.numpy(), n, 0, DataCondition("iid"))
    grid = emulate_grid(scheme, schedule, task, streams, settings)
    for setting, run in zip(settings, grid):
        with torch.no_grad():
            for p, p0 in zip(task.model.parameters(), start):
                p.copy_(p0)
        single = emulate(scheme, schedule, task, streams, *setting)
        torch.testing.assert_close(run.params, single.params, rtol=1e-5, atol=1e-6)
        assert run.val_loss == pytest.approx(single.val_loss, rel=1e-5)
        assert run.train_loss == pytest.approx(single.train_loss, rel=1e-5)
    assert grid[0].val_loss[-1] != pytest.approx(grid[1].val_loss[-1])


@pytest.mark.parametrize(
    "scheme_name, correction, k",
    [
        ("pgc_cr", "lookahead", None),
        ("pgc_fr", "lookahead", 1.0),
        ("pgc_cr", "delay_compensation", None),
        ("pgc_fr", "momentum", None),
    ],
)
def test_corrected_grid_matches_one_setting_runs_and_differs_from_uncorrected(scheme_name, correction, k):
    n = 6
    scheme = make_scheme(scheme_name, n, 1)
    res = simulate(scheme, 12, "lognormal(median=0.02, sigma=1.0)", Costs(compute_s=0.05), delay_seed=3)
    schedule = from_records(res.records, res.applied[0])
    settings = [(0.1, 0.5), (0.3, 0.9)]
    task, labels = _task()
    start = [p.detach().clone() for p in task.model.parameters()]
    streams = partition_streams(labels.numpy(), n, 0, DataCondition("iid"))
    kwargs = {"correction": correction, "lookahead_steps": k, "dc_lambda": 5.0}
    grid = emulate_grid(scheme, schedule, task, streams, settings, **kwargs)
    plain = emulate_grid(scheme, schedule, task, streams, settings)
    for setting, run, uncorrected in zip(settings, grid, plain):
        with torch.no_grad():
            for p, p0 in zip(task.model.parameters(), start):
                p.copy_(p0)
        single = emulate(scheme, schedule, task, streams, *setting, **kwargs)
        torch.testing.assert_close(run.params, single.params, rtol=1e-5, atol=1e-6)
        assert run.train_loss == pytest.approx(single.train_loss, rel=1e-5)
        assert not torch.allclose(run.params, uncorrected.params, atol=1e-4)  # the correction changed training


def test_a_correction_for_a_scheme_without_stale_entries_is_refused():
    task, labels = _task()
    scheme = make_scheme("gc_fr", 4, 1)
    res = simulate(scheme, 3, "lognormal(median=0.02, sigma=1.0)", Costs(compute_s=0.05))
    streams = partition_streams(labels.numpy(), 4, 0, DataCondition("iid"))
    with pytest.raises(ValueError, match="fresh gradients only"):
        emulate_grid(scheme, from_records(res.records), task, streams, [(0.1, 0.0)], correction="lookahead")


def test_stale_and_dropped_gradients_change_training_exact_codes_do_not():
    n = 4
    task, labels = _task()
    start = [p.detach().clone() for p in task.model.parameters()]
    streams = partition_streams(labels.numpy(), n, 0, DataCondition("iid"))
    finals = {}
    for name, s in (("dgd", 0), ("gc_cr", 1), ("pgc_cr", 1), ("ignore", 1)):
        scheme = make_scheme(name, n, s)
        res = simulate(scheme, 10, "slowranks(ranks=[2], seconds=0.5)", Costs(compute_s=0.05))
        with torch.no_grad():
            for p, p0 in zip(task.model.parameters(), start):
                p.copy_(p0)
        finals[name] = emulate(scheme, from_records(res.records), task, streams, 0.2, 0.5).params
    torch.testing.assert_close(finals["gc_cr"], finals["dgd"], rtol=1e-5, atol=1e-6)  # exact: full gradient
    assert not torch.allclose(finals["pgc_cr"], finals["dgd"], atol=1e-4)
    assert not torch.allclose(finals["ignore"], finals["dgd"], atol=1e-4)


def test_schedule_json_round_trip():
    versions = [Version(0, (2, 0), {2: (0,), 0: (0, 1)}, 0.5, {2: 0.5, 0: 0.5})]
    assert from_json(json.loads(json.dumps(to_json(versions)))) == versions


# ------------------------------------------------------------------------------------------------- data
@pytest.mark.parametrize("n, alpha", [(4, 0.1), (16, 0.1), (16, 100.0), (64, 0.5)])
def test_dirichlet_split_is_a_partition_with_the_stated_skew(n, alpha):
    labels = np.random.default_rng(1).integers(0, 10, size=1000)
    parts = dirichlet_partitions(labels, n, alpha, seed=3)
    assert len(parts) == n and all(len(p) >= 1 for p in parts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    assert [p.tolist() for p in parts] == [p.tolist() for p in dirichlet_partitions(labels, n, alpha, seed=3)]
    iid = label_skew(labels, DataCondition("iid").partitions(labels, n, 3), 10)
    skew = label_skew(labels, parts, 10)
    if alpha <= 0.5:
        assert skew > 0.5 > iid
    else:
        assert skew < 0.3


def test_data_condition_refuses_bad_settings():
    with pytest.raises(ValueError, match="iid"):
        DataCondition("shards")
    with pytest.raises(ValueError, match="alpha"):
        DataCondition("dirichlet", 0.0)
    with pytest.raises(ValueError, match="non-empty"):
        dirichlet_partitions(np.zeros(3, dtype=int), 4, 0.1, 0)


def test_iid_streams_are_the_runtimes_streams():
    from lightning_pgc.sampling import PartitionStreams

    labels = np.arange(100) % 10
    ours, theirs = partition_streams(labels, 4, 7, DataCondition("iid")), PartitionStreams(100, 4, 7)
    assert all(ours.batch(j, t, 8) == theirs.batch(j, t, 8) for j in range(4) for t in range(30))


# ---------------------------------------------------------------------------------------------- cluster
def test_node_stalls_hit_a_whole_node_at_once():
    model = NodeStalls(prob=0.3, seconds=2.0, node_size=8, seed=5)
    d = np.array([[delay_for(model, 0, k, t) for k in range(32)] for t in range(200)])
    per_node = d.reshape(200, 4, 8)
    assert (per_node == per_node[:, :, :1]).all()  # every worker of a node alike
    assert set(np.unique(d)) == {0.0, 2.0}
    assert abs((d > 0).mean() - 0.3) < 0.06
    assert not (per_node[:, 0, 0] == per_node[:, 1, 0]).all()  # nodes independent


def test_pareto_tail_and_mean():
    model = Pareto(scale=0.02, alpha=3.0)
    d = np.array([delay_for(model, 0, 0, t) for t in range(20000)])
    assert d.mean() == pytest.approx(model.mean_seconds(0), rel=0.1)
    assert (d > 0.02 * (10 ** (1 / 3) - 1)).mean() == pytest.approx(0.1, abs=0.01)  # P(X > x) = (1+x)^-alpha
    with pytest.raises(ValueError):
        Pareto(scale=0.02, alpha=0.0)


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("n", [4, 16, 256])
def test_every_pattern_builds_for_every_n(pattern, n):
    model = delay_model(pattern, n, seed=1)
    d = [delay_for(model, 1, k, t) for k in range(n) for t in range(3)]
    assert all(x >= 0 and math.isfinite(x) for x in d)
    if pattern == "none":
        assert max(d) == 0.0
    if pattern == "slow node":  # the slow node is slowed every step
        assert min(delay_for(model, 1, n - 1, t) for t in range(20)) >= 0.2


def test_costs_state_the_ratio():
    c = costs_for(4.0, compute_s=0.1)
    assert c.compute_s / (c.code_s + c.aggregate_s) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="ratio"):
        costs_for(0.0)
    with pytest.raises(ValueError, match="pattern"):
        delay_model("gremlins", 8)


def test_import_lightning_pgc_does_not_load_the_emulator():
    import subprocess
    import sys

    code = (
        "import sys, lightning_pgc, lightning_pgc.cli; "
        "print(sorted(m for m in sys.modules if m.startswith('lightning_pgc.emulator')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
