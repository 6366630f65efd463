"""The map's statistics on small cases, against their definitions."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lightning_pgc.emulator.scoring import holm, sign_flip_p


def _by_definition(diffs: list[float]) -> float:
    observed = abs(sum(diffs))
    sums = [abs(sum(s * d for s, d in zip(signs, diffs))) for signs in itertools.product((1, -1), repeat=len(diffs))]
    return sum(x >= observed - 1e-12 * max(1.0, observed) for x in sums) / len(sums)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 11])
def test_sign_flip_p_counts_every_sign_pattern(m):
    rng = np.random.default_rng(m)
    for diffs in (rng.normal(size=m).tolist(), rng.integers(-2, 3, size=m).astype(float).tolist()):
        assert sign_flip_p(diffs) == pytest.approx(_by_definition(diffs), abs=0)


def test_sign_flip_p_edges():
    assert sign_flip_p([0.0, 0.0, 0.0]) == 1.0
    assert sign_flip_p([1.0] * 10) == 2 / 2**10  # only all-plus and all-minus are as extreme
    with pytest.raises(ValueError):
        sign_flip_p([])
    with pytest.raises(ValueError):
        sign_flip_p([1.0] * 21)


def test_holm_steps_down_and_stays_monotone():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
