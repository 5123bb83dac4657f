"""Training on CPU workers equals plain PyTorch (the numerics contract in docs/design.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe
from tests.helpers import assert_weights_equal, async_reference, batches, mlp, sync_reference
from tests.helpers import sgd_momentum as sgd

mse = nn.functional.mse_loss


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def run_pipe(
    model: nn.Module, optimizer, data, *, devices: str, microbatches: int, async_optimizer: bool, **cfg
):
    config = roundpipe.RunConfig(
        devices=devices, num_microbatches=microbatches, async_optimizer=async_optimizer, **cfg
    )
    losses, weights = [], []
    with roundpipe.RoundPipe(model, optimizer=optimizer, config=config) as pipe:
        for x, y in data:
            losses.append(pipe.forward_backward(x, y, mse))
            pipe.step()
            pipe.synchronize()
            weights.append(copy.deepcopy(pipe.module.state_dict()))
        trace = pipe.trace()
    trace.check_rules()
    return losses, weights


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2", "cpu:3"])
@pytest.mark.parametrize("microbatches", [1, 4, 5])
def test_sync_matches_plain_loop_after_every_step(devices: str, microbatches: int) -> None:
    data = batches(4)
    ref_losses, ref_weights = sync_reference(mlp(), adamw, data, mse)
    losses, weights = run_pipe(
        mlp(), adamw, data, devices=devices, microbatches=microbatches, async_optimizer=False
    )
    for got, want in zip(weights, ref_weights, strict=True):
        assert_weights_equal(got, want)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2", "cpu:3", "fake:4"])
def test_async_matches_staleness_one_loop(devices: str) -> None:
    data = batches(5)
    ref_losses, ref_weights = async_reference(mlp(), sgd, data, mse)
    losses, weights = run_pipe(mlp(), sgd, data, devices=devices, microbatches=4, async_optimizer=True)
    for got, want in zip(weights, ref_weights, strict=True):
        assert_weights_equal(got, want)
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_same_losses_on_one_two_and_four_devices(async_optimizer: bool) -> None:
    data = batches(3)
    runs = [
        run_pipe(mlp(), sgd, data, devices=d, microbatches=4, async_optimizer=async_optimizer)[0]
        for d in ("cpu:1", "cpu:2", "cpu:4")
    ]
    assert runs[0] == runs[1] == runs[2]


def test_gradient_accumulation_sums_over_calls() -> None:
    data = batches(4)
    # Reference: two backward calls before each step.
    ref = mlp()
    opt = sgd(list(ref.parameters()))
    for i in range(0, 4, 2):
        for x, y in data[i : i + 2]:
            mse(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    model = mlp()
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=3, async_optimizer=False)
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        for i in range(0, 4, 2):
            for x, y in data[i : i + 2]:
                pipe.forward_backward(x, y, mse)
            pipe.step()
        pipe.synchronize()
    assert_weights_equal(model.state_dict(), ref.state_dict())


class Embed(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class TiedHead(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.scale * h @ self.weight.t()


def tied_model() -> nn.Sequential:
    torch.manual_seed(3)
    weight = nn.Parameter(torch.randn(11, 6) * 0.3)
    return nn.Sequential(Embed(weight), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), TiedHead(weight))


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_tied_parameters_get_one_optimizer_entry_and_summed_gradients(async_optimizer: bool) -> None:
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randint(0, 11, (8, 5), generator=g), torch.randint(0, 11, (8, 5), generator=g))
        for _ in range(3)
    ]
    reference = sync_reference if not async_optimizer else async_reference
    ref_losses, ref_weights = reference(tied_model(), adamw, data, ce)
    model = tied_model()
    config = roundpipe.RunConfig(devices="cpu:3", num_microbatches=4, async_optimizer=async_optimizer)
    with roundpipe.RoundPipe(model, optimizer=adamw, config=config) as pipe:
        assert sum(len(o.param_groups[0]["params"]) for o in pipe.host.optimizers.values()) == 6
        losses = []
        for x, y in data:
            losses.append(pipe.forward_backward(x, y, ce))
            pipe.step()
        pipe.synchronize()
    assert model[0].weight is model[4].weight
    assert_weights_equal(model.state_dict(), ref_weights[-1])
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_clipping_and_lr_scheduler_match_torch() -> None:
    data = batches(4)
    ref = mlp()
    opt = adamw(list(ref.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in data:
        mse(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        sched.step()
        opt.zero_grad()
    model = mlp()
    config = roundpipe.RunConfig(
        devices="cpu:2", num_microbatches=2, async_optimizer=False, max_grad_norm=0.05
    )
    with roundpipe.RoundPipe(
        model,
        optimizer=adamw,
        config=config,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    ) as pipe:
        for x, y in data:
            pipe.forward_backward(x, y, mse)
            pipe.step()
        pipe.synchronize()
        trace = pipe.trace()
    assert any(t.kind == "grad_norm" for t in trace)
    assert_weights_equal(model.state_dict(), ref.state_dict())


def test_dropout_masks_match_between_forward_and_recompute() -> None:
    """Stage splits differ between forward and backward; the gradient must still be that of one
    consistent dropout mask per (iteration, layer, microbatch) - checked against a plain loop that
    seeds each layer the same way - and identical on 1, 2 and 3 devices."""
    model_fn = lambda: mlp(depth=5, dropout=0.5)  # noqa: E731
    x, y = batches(1, batch=8)[0]
    seed = 7
    microbatches = 2
    ref = model_fn()
    for mb, (xm, ym) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)):
        out = xm
        for index, layer in enumerate(ref):
            torch.manual_seed(hash((seed, 0, index, mb)) & 0x7FFF_FFFF)
            out = layer(out)
        (mse(out, ym) / microbatches).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    for devices in ("cpu:1", "cpu:2", "cpu:3"):
        model = model_fn()
        config = roundpipe.RunConfig(
            devices=devices, num_microbatches=microbatches, async_optimizer=False, seed=seed, replan=False
        )
        with roundpipe.RoundPipe(
            model, optimizer=lambda p: torch.optim.SGD(p, lr=1.0), config=config
        ) as pipe:
            assert pipe.runtime.uses_rng
            pipe.forward_backward(x, y, mse)
            pipe.synchronize()
            grads = {n: pipe.host.master[id(p)].grad for n, p in model.named_parameters()}
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6)


def test_fp16_loss_scaling_skips_a_step_with_inf_gradients() -> None:
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, async_optimizer=False, precision="fp16")
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        scale = pipe._scaler.scale
        x, y = batches(1)[0]
        pipe.forward_backward(x * 1e6, y, mse)  # overflows in fp16: inf gradients
        pipe.step()
        pipe.synchronize()
        assert_weights_equal(model.state_dict(), before)  # step skipped
        assert pipe._scaler.scale == scale / 2 and pipe._scaler.skipped_steps == 1
        loss = pipe.forward_backward(x, y, mse)
        pipe.step()
        pipe.synchronize()
    assert loss == pytest.approx(mse(mlp()(x), y).item(), rel=2e-2)
    changed = any(not torch.equal(model.state_dict()[k], before[k]) for k in before)
    assert changed


def test_bf16_trains_close_to_fp32() -> None:
    data = batches(3)
    _, ref_weights = sync_reference(mlp(), sgd, data, mse)
    _, weights = run_pipe(
        mlp(), sgd, data, devices="cpu:2", microbatches=2, async_optimizer=False, precision="bf16"
    )
    assert_weights_equal(weights[-1], ref_weights[-1], rtol=5e-2, atol=5e-2)


class SplitTwo(nn.Module):
    """Returns a tuple: a differentiable half and an integer tensor that must travel unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.proj(x))
        return h, (h[:, 0] > 0).long()


class UseTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.bias = nn.Parameter(torch.zeros(2, 4))

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, sign = pair
        return self.proj(h) + self.bias[sign]


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": self.proj(x), "_scale": torch.full((x.shape[0], 1), 0.5)}


class DictIn(nn.Module):
    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tanh(d["h"]) * d["_scale"]


def structured_model() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(DictOut(), DictIn(), nn.Linear(8, 8), SplitTwo(), UseTwo())


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:3"])
def test_tuple_and_dict_activations_between_layers(devices: str) -> None:
    data = batches(3)
    _, ref_weights = sync_reference(structured_model(), sgd, data, mse)
    _, weights = run_pipe(
        structured_model(), sgd, data, devices=devices, microbatches=3, async_optimizer=False
    )
    for got, want in zip(weights, ref_weights, strict=True):
        assert_weights_equal(got, want)
