"""state_dict / load_state_dict: a resumed run continues exactly like an uninterrupted one."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe
from tests.helpers import assert_weights_equal, batches, mlp

mse = nn.functional.mse_loss


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def config(async_optimizer: bool) -> roundpipe.RunConfig:
    return roundpipe.RunConfig(devices="cpu:2", num_microbatches=3, async_optimizer=async_optimizer)


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_resume_continues_exactly(async_optimizer: bool) -> None:
    data = batches(6)
    # Uninterrupted.
    full = mlp()
    with roundpipe.RoundPipe(
        full, optimizer=adamw, config=config(async_optimizer), lr_scheduler=scheduler
    ) as pipe:
        full_losses = []
        for x, y in data:
            full_losses.append(pipe.forward_backward(x, y, mse))
            pipe.step()
        pipe.synchronize()
    # Interrupted after 3 steps; the state goes through torch.save like a real checkpoint.
    first = mlp()
    with roundpipe.RoundPipe(
        first, optimizer=adamw, config=config(async_optimizer), lr_scheduler=scheduler
    ) as pipe:
        losses = []
        for x, y in data[:3]:
            losses.append(pipe.forward_backward(x, y, mse))
            pipe.step()
        state = pipe.state_dict()
    buffer = __import__("io").BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    second = mlp(seed=99)  # different initial weights: everything must come from the state
    with roundpipe.RoundPipe(
        second, optimizer=adamw, config=config(async_optimizer), lr_scheduler=scheduler
    ) as pipe:
        pipe.load_state_dict(state)
        assert pipe.step_count == 3
        for x, y in data[3:]:
            losses.append(pipe.forward_backward(x, y, mse))
            pipe.step()
        pipe.synchronize()
    assert losses == full_losses
    assert_weights_equal(second.state_dict(), full.state_dict(), rtol=0, atol=0)


def test_state_dict_holds_weights_optimizer_step_and_config() -> None:
    model = mlp()
    with roundpipe.RoundPipe(model, optimizer=adamw, config=config(True)) as pipe:
        x, y = batches(1)[0]
        pipe.forward_backward(x, y, mse)
        pipe.step()
        state = pipe.state_dict()
    assert state["step"] == 1 and state["iteration"] == 1
    assert state["config"]["async_optimizer"] is True
    assert set(state["model"]) == {n for n, _ in model.named_parameters()}
    assert "in_flight_weights" in state
    assert all("state" in opt for opt in state["host"]["optimizers"].values())


def test_load_rejects_a_mismatched_state() -> None:
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=config(False)) as pipe:
        with pytest.raises(roundpipe.ConfigError, match="not a RoundPipe state_dict"):
            pipe.load_state_dict({"weights": 1})
        state = pipe.state_dict()
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=config(True)) as pipe:
        with pytest.raises(roundpipe.ConfigError, match="resume with the same mode"):
            pipe.load_state_dict(state)
    other = nn.Sequential(nn.Linear(8, 4))
    with roundpipe.RoundPipe(other, optimizer=adamw, config=config(False)) as pipe:
        with pytest.raises(roundpipe.ConfigError, match="does not match the model"):
            pipe.load_state_dict(copy.deepcopy(state))


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_long_runs_forget_old_tasks_without_stalling(async_optimizer: bool) -> None:
    """The engine forgets finished tasks to bound memory. Dependencies may still point at them:
    a device that was last used many iterations ago (one slot, many devices) and P-copies that
    wait for uploads of every iteration of a long accumulation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))  # one layer: one fused slot, so devices take turns
    config = roundpipe.RunConfig(
        devices="fake:6", num_microbatches=6, async_optimizer=async_optimizer, trace_iterations=0
    )
    data = batches(4, batch=12)
    with roundpipe.RoundPipe(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), config=config) as pipe:
        for step in range(3):
            for _ in range(13):  # accumulate over more iterations than the trace keeps
                x, y = data[step]
                pipe.forward_backward(x, y, mse)
            pipe.step()
        for _ in range(30):  # and many single-iteration steps
            pipe.forward_backward(*data[3], mse)
            pipe.step()
        pipe.synchronize()
        assert pipe.step_count == 33
        # Memory stays bounded: only recent tasks and iterations are kept (about 23 tasks per
        # iteration here; 69 iterations ran), and the trace keeps what it was asked to keep.
        assert len(pipe._engine._tasks) < 6 * 23
        assert len(pipe.runtime.iterations) <= 1
        assert len(pipe.trace()) == 0


def test_a_training_step_leaves_nothing_for_the_cycle_collector() -> None:
    """Device memory may only be held by what the runtime holds: a reference cycle around a
    tensor keeps it until the interpreter's next full collection, which no plan can count (on a
    GPU, two such cycles held 2-3 GiB). After warm-up, steps create no cyclic garbage at all."""
    import gc

    from tests.test_transformers_parity import sgd, tiny_qwen3, token_data

    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, async_optimizer=True)
    data = token_data(4, seq=16)
    with roundpipe.RoundPipe(tiny_qwen3(), optimizer=sgd, config=config) as pipe:
        for batch in data[:2]:
            pipe.forward_backward(batch, None, None)
            pipe.step()
        pipe.synchronize()
        gc.collect()
        gc.disable()
        try:
            for batch in data[2:]:
                pipe.forward_backward(batch, None, None)
                pipe.step()
            pipe.synchronize()
            assert gc.collect() == 0
        finally:
            gc.enable()
