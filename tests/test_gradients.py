"""The flat payload of one fit (lightning_pgc.strategy.gradients): what a rank sends and what it applies."""

from __future__ import annotations

import torch

from lightning_pgc.strategy.gradients import Gradients


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Flatten(), torch.nn.Linear(12, 2)
    )


def test_a_stored_gradient_comes_back_as_param_grad_with_the_loss_and_the_buffers_alongside():
    model = _model().to(memory_format=torch.channels_last)
    gradients = Gradients.of(model, torch.device("cpu"))
    params = list(model.parameters())
    buffers = [b for b in model.buffers() if b.numel() > 0]
    assert gradients.grad_numel == sum(p.numel() for p in params)
    assert gradients.numel == gradients.grad_numel + 1 + sum(b.numel() for b in buffers)
    assert gradients.dtype == torch.float32 and gradients.nbytes == 4 * gradients.numel

    model(torch.randn(4, 2, 4, 4)).square().mean().backward()
    expected = [p.grad.clone() for p in params]
    gradients.begin_step()  # a new step drops param.grad ...
    assert all(p.grad is None for p in params) and gradients.fresh == set()
    model(torch.randn(4, 2, 4, 4)).sum().backward()
    model.zero_grad(set_to_none=True)
    for p, g in zip(params, expected):  # ... and stores what the training step left in it
        p.grad = g.clone()
    gradients.store(3, torch.tensor(1.5))
    slot = gradients.slot(3)
    assert gradients.fresh == {3} and gradients.slots == {3: slot} and float(slot[gradients.grad_numel]) == 1.5

    params[-1].requires_grad_(False)  # frozen mid-fit: no gradient, as without PGC
    gradients.apply(slot[: gradients.grad_numel])
    assert params[-1].grad is None
    for p, g in zip(params[:-1], expected[:-1]):
        assert torch.equal(p.grad, g) and p.grad.stride() == p.stride()

    tail = gradients.flat_buffers(torch.float32)
    assert tail.numel() == gradients.numel - gradients.grad_numel - 1
    for b in buffers:
        b.add_(7)
    gradients.load_buffers(tail)  # the running statistics and the (integer) batch count come back
    assert torch.equal(torch.cat([b.reshape(-1).float() for b in buffers]), tail)


def test_non_finite_slots_are_found_and_clear_drops_every_slot():
    model = torch.nn.Linear(3, 1)
    gradients = Gradients.of(model, torch.device("cpu"))
    for partition, value in ((0, 1.0), (1, float("nan")), (2, float("inf"))):
        for p in model.parameters():
            p.grad = torch.full_like(p, value)
        gradients.store(partition, None)
    assert gradients.nonfinite() == [1, 2]
    gradients.clear()
    assert gradients.slots == {} and gradients.fresh == set()
