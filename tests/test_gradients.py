"""The flat payload of one fit (lightning_pgc.strategy.gradients): what a rank caches, encodes and applies."""

from __future__ import annotations

import pytest
import torch

from lightning_pgc.codes import make_scheme
from lightning_pgc.strategy.gradients import Gradients


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Flatten(), torch.nn.Linear(12, 2)
    )


def _backward(model: torch.nn.Module, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    loss = model(torch.randn(4, 2, 4, 4)).square().mean()
    loss.backward()
    return loss


def test_the_cache_entry_is_what_backward_left_in_param_grad_and_the_code_is_the_schemes_encode_of_it():
    """No copy: each entry holds the very tensors backward allocated (a ``channels_last`` conv included), and the
    code written from them per parameter is bit for bit the scheme's encode of the flat gradients."""
    model = _model().to(memory_format=torch.channels_last)
    gradients = Gradients.of(model, torch.device("cpu"))
    params = list(model.parameters())
    entries, flats = {}, {}
    for partition, seed in ((1, 0), (2, 1)):  # rank 1 of pgc_cr n=4 s=1 holds partitions 1 and 2
        gradients.begin_step()
        assert all(p.grad is None for p in params)  # backward allocates: it never adds into a cached entry
        loss = _backward(model, seed)
        storage = [p.grad.data_ptr() for p in params]
        entries[partition] = gradients.adopt(partition, loss)
        assert [t.data_ptr() for t in entries[partition].tensors] == storage
        flats[partition] = torch.cat(
            [p.grad.permute(0, 2, 3, 1).reshape(-1) if p.dim() == 4 else p.grad.reshape(-1) for p in params]
            + [loss.detach().reshape(1)]
        )
        assert torch.equal(gradients.flat(entries[partition]), flats[partition])
    for name in ("pgc_cr", "gc_cr"):  # a fused two-term sum in float32; Tandon's coefficients in float64
        scheme = make_scheme(name, 4, 1)
        code = torch.full((gradients.numel,), 7.0, dtype=scheme.payload_dtype)
        gradients.encode(scheme.code_coefficients(1, (1, 2)), entries, code)
        expected = scheme.encode(1, {j: f.double() if name == "gc_cr" else f for j, f in flats.items()})
        assert torch.equal(code[: gradients.grad_numel + 1], expected)
        assert gradients.finite(code)


def test_a_saved_flat_entry_comes_back_as_views_in_each_parameters_layout():
    model = _model().to(memory_format=torch.channels_last)
    gradients = Gradients.of(model, torch.device("cpu"))
    gradients.begin_step()
    entry = gradients.adopt(0, _backward(model, 0))
    flat = gradients.flat(entry)
    back = gradients.entry_of(flat)
    assert back.loss == entry.loss
    for p, a, b in zip(model.parameters(), entry.tensors, back.tensors):
        assert torch.equal(a, b) and b.stride() == p.stride()


def test_param_grad_points_at_the_aggregate_with_the_buffers_alongside():
    model = _model().to(memory_format=torch.channels_last)
    gradients = Gradients.of(model, torch.device("cpu"))
    params = list(model.parameters())
    buffers = [b for b in model.buffers() if b.numel() > 0]
    assert gradients.grad_numel == sum(p.numel() for p in params)
    assert gradients.numel == gradients.grad_numel + 1 + sum(b.numel() for b in buffers)
    assert gradients.dtype == torch.float32 and gradients.nbytes == 4 * gradients.numel

    gradients.begin_step()
    entry = gradients.adopt(3, _backward(model, 0))
    expected = [t.clone() for t in entry.tensors]
    aggregate = gradients.flat(entry)
    params[-1].requires_grad_(False)  # frozen mid-fit: no gradient, as without PGC
    gradients.apply(aggregate[: gradients.grad_numel])
    assert params[-1].grad is None
    for p, g in zip(params[:-1], expected[:-1]):
        assert torch.equal(p.grad, g) and p.grad.stride() == p.stride()
        assert aggregate.data_ptr() <= p.grad.data_ptr() < aggregate.data_ptr() + 4 * aggregate.numel()  # a view

    tail = gradients.flat_buffers(torch.float32)
    assert tail.numel() == gradients.numel - gradients.grad_numel - 1
    for b in buffers:
        b.add_(7)
    gradients.load_buffers(tail)  # the running statistics and the (integer) batch count come back
    assert torch.equal(torch.cat([b.reshape(-1).float() for b in buffers]), tail)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_entry_makes_the_code_non_finite_and_is_named(bad):
    model = torch.nn.Linear(3, 1)
    gradients = Gradients.of(model, torch.device("cpu"))
    entries = {}
    for partition, value in ((0, 1.0), (1, bad)):
        for p in model.parameters():
            p.grad = torch.full_like(p, 1.0)
        model.bias.grad.fill_(value)  # one coordinate of one parameter
        entries[partition] = gradients.adopt(partition, None)
        gradients.zero_grad()
    code = torch.zeros(gradients.numel)
    gradients.encode({0: 1.0, 1: 1.0}, entries, code)
    assert not gradients.finite(code)
    assert gradients.nonfinite(entries) == [1]
    gradients.encode({0: 1.0}, entries, code)
    assert gradients.finite(code) and gradients.nonfinite({0: entries[0]}) == []
    gradients.clear()
    assert gradients.fresh == {}


def test_a_non_finite_buffer_makes_the_payload_non_finite_though_the_gradient_is_finite():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    gradients = Gradients.of(model, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    entries = {0: gradients.adopt(0, None)}
    model[1].running_var[1] = float("nan")  # one rank's statistics
    code = torch.zeros(gradients.numel)
    gradients.encode({0: 1.0}, entries, code)
    code[gradients.grad_numel + 1 :] = gradients.flat_buffers(code.dtype)
    assert not gradients.finite(code)
    assert gradients.finite(code, buffers=False) and gradients.nonfinite(entries) == []
