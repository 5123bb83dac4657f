"""`forward_backward(..., wait=False)`: the next iteration submitted before this one's loss is read.

What must hold: the same numbers as the waiting loop (the look-ahead changes when work is
submitted, never what is computed), losses read in submission order whatever order the caller
asks in, at most `LOSSES_IN_FLIGHT` iterations outstanding, and a failure that drops the
iterations submitted after it says so on each of them.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.pipe import LOSSES_IN_FLIGHT
from tests.helpers import assert_weights_equal, async_reference, batches, mlp, sync_reference
from tests.test_pipe_errors import Flaky, sgd

mse = nn.functional.mse_loss


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def lagged_losses(
    pipe: roundpipe.RoundPipe, data: list[tuple[torch.Tensor, torch.Tensor]], lag: int
) -> list[float]:
    """A training loop that reads each loss ``lag`` iterations after submitting it."""
    waiting: list[roundpipe.PendingLoss] = []
    losses: list[float] = []
    for x, y in data:
        waiting.append(pipe.forward_backward(x, y, mse, wait=False))
        pipe.step()
        while len(waiting) > lag:
            losses.append(waiting.pop(0).result())
    losses += [pending.result() for pending in waiting]
    pipe.synchronize()
    return losses


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2", "cpu:3"])
@pytest.mark.parametrize("async_optimizer", [False, True])
def test_a_loop_reading_losses_late_trains_as_the_reference(devices: str, async_optimizer: bool) -> None:
    data = batches(6)
    reference = async_reference if async_optimizer else sync_reference
    ref_losses, ref_weights = reference(mlp(seed=3), adamw, data, mse)
    config = roundpipe.RunConfig(devices=devices, num_microbatches=3, async_optimizer=async_optimizer)
    with roundpipe.RoundPipe(mlp(seed=3), optimizer=adamw, config=config) as pipe:
        losses = lagged_losses(pipe, data, lag=1)
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        assert_weights_equal(pipe.module.state_dict(), ref_weights[-1])


def test_fake_devices_give_the_same_losses_late_or_waited() -> None:
    data = batches(5)
    results = []
    for lag in (0, 1):
        config = roundpipe.RunConfig(devices="fake:2", num_microbatches=4)
        with roundpipe.RoundPipe(mlp(seed=1), optimizer=adamw, config=config) as pipe:
            results.append(lagged_losses(pipe, data, lag))
    assert results[0] == results[1]


def test_losses_are_read_in_submission_order_and_kept() -> None:
    data = batches(3)
    with roundpipe.RoundPipe(mlp(seed=2), optimizer=sgd, config=roundpipe.RunConfig(devices="cpu:2")) as pipe:
        first = pipe.forward_backward(*data[0], mse, wait=False)
        second = pipe.forward_backward(*data[1], mse, wait=False)  # accumulates with the first
        assert (first.iteration, second.iteration) == (0, 1)
        late = second.result()  # reads the first one's loss on the way
        assert first.done() and second.done()
        assert repr(first).startswith("PendingLoss(iteration=0, loss=")
        pipe.step()
        assert second.result() == late  # kept: no second wait
    with roundpipe.RoundPipe(mlp(seed=2), optimizer=sgd, config=roundpipe.RunConfig(devices="cpu:2")) as pipe:
        waited = [pipe.forward_backward(*data[0], mse), pipe.forward_backward(*data[1], mse)]
    assert [first.result(), late] == waited


def test_at_most_losses_in_flight_iterations_wait_for_their_loss() -> None:
    data = batches(LOSSES_IN_FLIGHT + 2)
    config = roundpipe.RunConfig(devices="fake:2", num_microbatches=2)
    with roundpipe.RoundPipe(mlp(), optimizer=sgd, config=config) as pipe:
        pending = []
        for x, y in data:
            pending.append(pipe.forward_backward(x, y, mse, wait=False))
            pipe.step()
            # the submission beyond the bound read the oldest outstanding loss first
            assert sum(not p.done() for p in pending) <= LOSSES_IN_FLIGHT
        assert [p.done() for p in pending] == [True, True, False, False]
        pipe.synchronize()  # reads every outstanding loss
        assert all(p.done() for p in pending)


def test_a_failure_drops_the_iterations_submitted_after_it_and_says_so() -> None:
    torch.manual_seed(0)
    flaky = Flaky()
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), flaky, nn.Linear(8, 4))
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, replan=False)
    data = batches(4)
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        pipe.forward_backward(*data[0], mse)
        pipe.step()
        pipe.synchronize()
        flaky.armed = True
        failing = pipe.forward_backward(*data[1], mse, wait=False)
        pipe.step()
        dropped = pipe.forward_backward(*data[2], mse, wait=False)
        pipe.step()
        with pytest.raises(roundpipe.StageError, match="bad activation"):
            dropped.result()  # reads the failing iteration first, which raises
        with pytest.raises(roundpipe.StageError, match="bad activation"):
            failing.result()  # its own error, again
        with pytest.raises(roundpipe.TaskFailedError, match="iteration 2 was dropped before its loss was in"):
            dropped.result()
        assert dropped.done() and not isinstance(dropped._dropped, roundpipe.StageError)
        flaky.armed = False
        loss = pipe.forward_backward(*data[3], mse)  # the pipe goes on
        pipe.step()
        assert loss == loss


def test_the_awaitable_api_reads_losses_late_too() -> None:
    data = batches(4)
    ref_losses, _ = async_reference(mlp(seed=4), adamw, data, mse)

    async def main() -> list[float]:
        config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2)
        with roundpipe.RoundPipe(mlp(seed=4), optimizer=adamw, config=config) as pipe:
            waiting, losses = [], []
            for x, y in data:
                waiting.append(await pipe.aforward_backward(x, y, mse, wait=False))
                await pipe.astep()
                if len(waiting) > 1:
                    losses.append(await waiting.pop(0).aresult())
            losses.append(await waiting.pop().aresult())
            losses.append(await pipe.aforward_backward(*data[0], mse))  # waiting, as before
            return losses

    losses = asyncio.run(main())
    assert losses[:4] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)


def test_outstanding_losses_are_read_by_state_dict_and_close() -> None:
    data = batches(3)
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2)
    pipe = roundpipe.RoundPipe(mlp(seed=5), optimizer=sgd, config=config)
    first = pipe.forward_backward(*data[0], mse, wait=False)
    pipe.step()
    state = pipe.state_dict()  # waits for everything, so it reads the loss
    assert first.done() and state["iteration"] == 1
    last = pipe.forward_backward(*data[1], mse, wait=False)
    pipe.step()
    pipe.close()
    assert last.done() and last.result() == last.result()  # read by close(), kept after it
    with pytest.raises(roundpipe.PipeClosedError):
        pipe.forward_backward(*data[2], mse, wait=False)
