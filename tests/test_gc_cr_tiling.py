"""gc_cr where c divides n: the tiling construction decodes every received set exactly, at n up to 256, fast."""

from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest
import torch

from lightning_pgc.codes import Scheme, make_scheme
from lightning_pgc.codes.tandon import tiling_b, tiling_decoding_vector


def _grads(n: int, seed: int, numel: int = 64) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {j: torch.randn(numel, generator=gen, dtype=torch.float64) for j in range(n)}


def _codes(sc: Scheme, g: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {k: sc.encode(k, {j: g[j] for j in sc.partitions(k)}) for k in range(sc.n)}


def _check(
    sc: Scheme, stragglers: set[int], codes: dict[int, torch.Tensor], ref: torch.Tensor, rng: random.Random
) -> None:
    order = [k for k in range(sc.n) if k not in stragglers]
    rng.shuffle(order)  # arrival order
    out = sc.decode({k: codes[k] for k in order})
    assert torch.allclose(out, ref, rtol=0, atol=1e-12), sorted(stragglers)
    coeff = sc.coefficients(order)
    assert torch.allclose(coeff, torch.full((sc.n,), 1.0 / sc.n, dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize(("n", "s"), [(4, 1), (6, 2), (8, 3), (9, 2), (12, 3), (12, 5), (16, 3)])
def test_every_straggler_set_decodes_exactly_small_n(n: int, s: int) -> None:
    sc = make_scheme("gc_cr", n, s)
    assert sc.construction == "tiling" and sc.worst_condition == 1.0
    g = _grads(n, n * 31 + s)
    ref, codes = sum(g.values()) / n, _codes(sc, g)
    rng = random.Random(n + s)
    for size in range(s + 1):  # every straggler set of size <= s
        for stragglers in itertools.combinations(range(n), size):
            _check(sc, set(stragglers), codes, ref, rng)


@pytest.mark.parametrize(("n", "s"), [(64, 7), (128, 15), (256, 63)])
def test_sampled_straggler_sets_decode_exactly_large_n(n: int, s: int) -> None:
    started = time.perf_counter()
    sc = make_scheme("gc_cr", n, s)
    assert time.perf_counter() - started < 2.0  # built in O(n c), not by a search over received sets
    assert sc.construction == "tiling"
    g = _grads(n, n + s, numel=16)
    ref, codes = sum(g.values()) / n, _codes(sc, g)
    rng = random.Random(n * s)
    sets = [set(range(s)), set(range(n - s, n)), {k * (s + 1) for k in range(min(s, n // (s + 1)))}]
    sets += [set(rng.sample(range(n), s)) for _ in range(10)]  # bursts, a whole tiling's ranks, random sets
    for stragglers in sets:
        _check(sc, stragglers, codes, ref, rng)


def test_tiling_b_rows_and_tilings() -> None:
    B = tiling_b(12, 2)
    assert B.sum(axis=1).tolist() == [3.0] * 12 and B.sum(axis=0).tolist() == [3.0] * 12
    for k in range(12):
        assert np.flatnonzero(B[k]).tolist() == sorted((k + i) % 12 for i in range(3))
    a = tiling_decoding_vector(12, 2, [k for k in range(12) if k not in (0, 4)])  # tilings 0 and 1 broken
    kept = [k for k in range(12) if k not in (0, 4)]
    assert [k for k, w in zip(kept, a) if w] == [2, 5, 8, 11]
    assert np.allclose(a @ B[kept], 1.0)


def test_tiling_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="divide"):
        tiling_b(10, 2)
    with pytest.raises(ValueError, match="no whole tiling"):
        tiling_decoding_vector(6, 1, [2, 3, 4, 5])  # ranks 0 and 1 missing: both tilings broken (more than s)
    assert make_scheme("gc_cr", 10, 2).construction == "tandon"  # c = 3 does not divide 10: Tandon's search
