"""Trace replay by block resampling (emulator/traces.py): stalls keep their length, persistent slowness and
simultaneous stalls survive, the block length follows the longest stall, and the map's ``"trace:PATH"`` pattern."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_pgc.delays import delay_for
from lightning_pgc.emulator.cluster import delay_model, trace_delay_model
from lightning_pgc.emulator.traces import (
    TraceDelays,
    block_length,
    load_trace,
    resample_index,
    stall_runs,
    trace_delays,
)
from lightning_pgc.step_trace import TRACE_FORMAT

T, K = 200, 10  # trace length, stall length


def _stalled(k: int = K, start: int = 50) -> np.ndarray:
    own = np.full((4, T), 0.1)
    own[1, start : start + k] += 1.0  # rank 1 stalls for k consecutive steps
    return own


def _runs(row: np.ndarray) -> list[int]:
    """Lengths of the maximal runs of nonzero entries."""
    out, run = [], 0
    for x in [*row.tolist(), 0.0]:
        if x > 0:
            run += 1
        elif run:
            out.append(run)
            run = 0
    return out


def _intact_per_trace(block: int, draws: int = 400) -> float:
    """Mean number of whole ``K``-step stalls per ``T`` resampled steps (the trace itself has exactly one)."""
    _, delays = trace_delays(_stalled())
    found = 0
    for seed in range(draws):
        model = TraceDelays(delays, block, seed)
        row = np.array([model.sample(1, t, np.random.default_rng(0)) for t in range(T)])
        found += sum(1 for r in _runs(row) if r >= K)
    return found / draws


def test_stall_runs_and_block_length():
    own = _stalled()
    assert stall_runs(own) == [(1, 50, K)]
    assert block_length(own) == 4 * K
    assert block_length(np.full((2, 27), 0.1)) == 3  # no stall: ceil(T^(1/3))
    own[0, :] *= 2.25  # a persistently slow rank is slow, not stalled
    assert stall_runs(own) == [(1, 50, K)]
    long = np.full((2, 30), 0.1)
    long[0, 5:20] += 1.0  # a stall longer than a quarter of the trace: no cut, rotations only
    assert block_length(long) == 30


def test_block_resampling_keeps_a_stall_intact_in_expectation():
    """With L = 4k a k-step stall survives whole in (L - k + 1) / L of the expected copies (more form at block
    edges); single-step resampling almost never rebuilds it."""
    block = block_length(_stalled())
    intact = _intact_per_trace(block)
    assert intact >= (block - K + 1) / block - 0.12
    assert intact <= 1.0 + 0.15  # and it does not multiply
    assert _intact_per_trace(1) < 0.01


def test_resampling_is_stationary_and_blocks_are_consecutive():
    idx = resample_index(T, 20, seed=3, length=1000)
    assert idx.shape == (1000,)
    for b in range(0, 1000, 20):
        block = idx[b : b + 20]
        assert np.all(np.diff(block) % T == 1)  # consecutive recorded steps, modulo the trace
    counts = np.bincount(np.concatenate([resample_index(T, 20, s, 200) for s in range(300)]), minlength=T)
    assert counts.min() > 0.6 * counts.mean() and counts.max() < 1.4 * counts.mean()  # every step equally likely
    with pytest.raises(ValueError, match="block length"):
        resample_index(T, T + 1, 0, 10)


def test_persistent_and_simultaneous_slowness_survive():
    own = np.full((4, T), 0.1)
    own[3] *= 2.0  # rank 3 is always twice as slow
    together = np.random.default_rng(0).random(T) < 0.1
    own[:, together] += 0.5  # cluster-wide stalls
    _, delays = trace_delays(own)
    model = TraceDelays(delays, block_length(own), seed=5)
    rng = np.random.default_rng(0)
    got = np.array([[model.sample(r, t, rng) for t in range(300)] for r in range(4)])
    assert (got[3] >= 0.1 - 1e-12).all()  # rank 3 slow at every step
    assert np.array_equal(got[0] > 0, got[1] > 0) and np.array_equal(got[0] > 0, got[2] > 0)  # stalls together
    # more emulated ranks than recorded: copies replay the same rows with their own block starts
    copy = np.array([model.sample(7, t, rng) for t in range(300)])
    assert (copy >= 0.1 - 1e-12).all() and not np.array_equal(copy, got[3])


def test_the_map_pattern_reads_a_trace_file(tmp_path):
    own = _stalled()
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"format": TRACE_FORMAT, "version": 2, "n": 4, "own_s": own.tolist()}))
    model = delay_model(f"trace:{path}", 8, seed=2)
    assert isinstance(model, TraceDelays) and model == trace_delay_model(path, 8, seed=2)
    assert model.block == 4 * K
    # scaled to the map's compute (0.1 s per gradient): this trace's typical step is already 0.1 s
    assert max(delay_for(model, 0, 1, t) for t in range(400)) == pytest.approx(1.0)
    assert load_trace(path).allreduce_s is None
    with pytest.raises(ValueError, match="not a step trace"):
        path.write_text(json.dumps({"format": "x"}))
        load_trace(path)


def test_a_rewritten_trace_file_is_read_again(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"format": TRACE_FORMAT, "version": 2, "n": 4, "own_s": _stalled().tolist()}))
    assert trace_delay_model(path, 4).block == 4 * K
    path.write_text(json.dumps({"format": TRACE_FORMAT, "version": 2, "n": 4, "own_s": np.full((4, T), 0.1).tolist()}))
    assert trace_delay_model(path, 4).block == 6  # no stall now: ceil(200^(1/3))
