"""Error paths: clear messages, host copies intact, the pipe usable afterwards, no thread left."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from tests.helpers import assert_weights_equal, batches, mlp, sgd

mse = nn.functional.mse_loss


class Switch:
    """One flag shared by a module and its per-device replicas (a deep copy keeps the same switch),
    so arming it reaches every device whichever plan placed the layer."""

    def __init__(self) -> None:
        self.on = False

    def __deepcopy__(self, memo: dict[int, object]) -> Switch:
        return self


class Flaky(nn.Module):
    """Raises once armed, else the identity."""

    def __init__(self) -> None:
        super().__init__()
        self.switch = Switch()

    @property
    def armed(self) -> bool:
        return self.switch.on

    @armed.setter
    def armed(self, value: bool) -> None:
        self.switch.on = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise ValueError("bad activation")
        return x


def roundpipe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("roundpipe")]


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_layer_exception_names_layer_stage_device_microbatch_and_pipe_recovers(async_optimizer: bool) -> None:
    torch.manual_seed(0)
    flaky = Flaky()
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), flaky, nn.Linear(8, 4))
    config = roundpipe.RunConfig(
        devices="cpu:2", num_microbatches=2, async_optimizer=async_optimizer, replan=False
    )
    data = batches(3)
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        pipe.forward_backward(*data[0], mse)
        pipe.step()
        pipe.synchronize()
        before = copy.deepcopy(model.state_dict())
        flaky.armed = True
        with pytest.raises(roundpipe.StageError) as info:
            pipe.forward_backward(*data[1], mse)
        message = str(info.value)
        assert "layer 2 (2) raised ValueError: bad activation" in message
        assert "stage " in message and "on device " in message and "microbatch " in message
        assert isinstance(info.value.__cause__, ValueError)
        pipe.synchronize()
        # Host copies intact: the failed iteration changed nothing.
        assert_weights_equal(model.state_dict(), before, rtol=0, atol=0)
        flaky.armed = False
        loss = pipe.forward_backward(*data[2], mse)
        pipe.step()
        pipe.synchronize()
        assert loss == loss  # a number, not NaN
    assert roundpipe_threads() == []


def test_loss_fn_errors_are_reported_with_the_stage() -> None:
    def broken_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise KeyError("oops")

    with roundpipe.RoundPipe(mlp(), optimizer=sgd, config=roundpipe.RunConfig(devices="cpu:2")) as pipe:
        with pytest.raises(roundpipe.StageError, match=r"loss_fn raised KeyError: 'oops' \(stage FB"):
            pipe.forward_backward(*batches(1)[0], broken_loss)
        with pytest.raises(roundpipe.StageError, match="the loss must be a scalar tensor, got shape"):
            pipe.forward_backward(*batches(1)[0], lambda out, t: out)


def test_inputs_that_cannot_be_split() -> None:
    with roundpipe.RoundPipe(
        mlp(), optimizer=sgd, config=roundpipe.RunConfig(devices="cpu:2", num_microbatches=4)
    ) as pipe:
        x, y = batches(1)[0]
        with pytest.raises(roundpipe.InputError, match="has 3 sample\\(s\\) but num_microbatches=4"):
            pipe.forward_backward(x[:3], y[:3], mse)
        with pytest.raises(roundpipe.InputError, match="inputs have batch size 12 but targets have 5"):
            pipe.forward_backward(x, y[:5], mse)
        with pytest.raises(roundpipe.InputError, match="0-d tensor"):
            pipe.forward_backward(torch.tensor(1.0), None, mse)
        with pytest.raises(roundpipe.InputError, match="disagree on the batch size"):
            pipe.forward_backward({"a": x, "b": x[:4]}, y, mse)
        with pytest.raises(roundpipe.InputError, match="loss_fn is required"):
            pipe.forward_backward(x, y)
        # Still usable.
        pipe.forward_backward(x, y, mse)


def test_model_that_is_not_a_sequence_lists_what_is_supported() -> None:
    with pytest.raises(roundpipe.ModelError, match=r"(?s)Sequential.*Qwen3ForCausalLM"):
        roundpipe.RoundPipe(nn.Linear(3, 3), optimizer=sgd)


def test_bad_config_messages() -> None:
    with pytest.raises(roundpipe.ConfigError, match="devices: 'gpu' is not understood"):
        roundpipe.RunConfig(devices="gpu")
    with pytest.raises(roundpipe.ConfigError, match="num_microbatches"):
        roundpipe.RunConfig(num_microbatches=0)
    with pytest.raises(roundpipe.ConfigError, match="precision"):
        roundpipe.RunConfig(precision="fp8")
    with pytest.raises(roundpipe.ConfigError, match="round_size=9 exceeds num_microbatches=4"):
        roundpipe.RunConfig(round_size=9, num_microbatches=4)
    with pytest.raises(roundpipe.ConfigError, match=r"config must be a roundpipe\.RunConfig"):
        roundpipe.RoundPipe(mlp(), config={"devices": "cpu:2"})  # type: ignore[arg-type]


def test_optimizer_factory_must_return_an_optimizer() -> None:
    with pytest.raises(roundpipe.ModelError, match=r"not a torch\.optim\.Optimizer"):
        roundpipe.RoundPipe(mlp(), optimizer=lambda params: params)  # type: ignore[arg-type,return-value]


def test_closed_pipe_refuses_work_and_leaves_no_threads() -> None:
    pipe = roundpipe.RoundPipe(mlp(), optimizer=sgd, config=roundpipe.RunConfig(devices="cpu:3"))
    pipe.forward_backward(*batches(1)[0], mse)
    assert roundpipe_threads()
    pipe.close()
    pipe.close()  # idempotent
    assert roundpipe_threads() == []
    with pytest.raises(roundpipe.PipeClosedError, match="closed"):
        pipe.forward_backward(*batches(1)[0], mse)


SLOW = {"on": False}


class Slow(nn.Module):
    """Blocks its worker for a while when switched on (a hung kernel, as the watchdog sees it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if SLOW["on"]:
            import time

            time.sleep(0.8)
        return x


def test_watchdog_names_the_running_task_and_state_dict_still_works() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Slow(), nn.Linear(8, 4))
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2, stall_timeout_s=0.2, replan=False)
    pipe = roundpipe.RoundPipe(model, optimizer=sgd, config=config)
    try:
        x, y = batches(1)[0]
        pipe.forward_backward(x, y, mse)
        pipe.step()
        pipe.synchronize()
        SLOW["on"] = True
        with pytest.raises(
            roundpipe.ScheduleError, match=r"watchdog: no task finished for 0\.2 s; still running: compute"
        ):
            pipe.forward_backward(x, y, mse)
        with pytest.raises(roundpipe.PipeClosedError, match="watchdog"):
            pipe.forward_backward(x, y, mse)
        state = pipe.state_dict()
        assert state["step"] == 1
        assert_weights_equal(state["model"], {k: v for k, v in model.state_dict().items()}, rtol=0, atol=0)
    finally:
        SLOW["on"] = False
        pipe.close()
    assert roundpipe_threads() == []


def test_plan_error_from_the_pipe_says_what_to_change() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with pytest.raises(roundpipe.PlanError, match=r"(?s)layer 0 \('0'\).*raise RunConfig\.mem_limit_bytes"):
        roundpipe.RoundPipe(model, optimizer=sgd, config=roundpipe.RunConfig(mem_limit_bytes=1000))


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise ValueError("bad gradient")


class BackwardFails(nn.Module):
    """The identity whose backward raises."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailingBackward.apply(x)


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2"])
def test_an_error_in_a_backward_is_a_stage_error_naming_the_stage(devices: str) -> None:
    model = nn.Sequential(*mlp(), BackwardFails(), nn.Linear(4, 4))
    config = roundpipe.RunConfig(devices=devices, num_microbatches=2, async_optimizer=False)
    (x, y) = batches(1)[0]
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        with pytest.raises(
            roundpipe.StageError, match=r"the backward of stage \S+ \(layers .*ValueError: bad gradient"
        ):
            pipe.forward_backward(x, y, mse)
            pipe.synchronize()


def test_step_without_new_gradients_is_refused_and_changes_nothing() -> None:
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=2, async_optimizer=False)
    (x, y) = batches(1)[0]
    with roundpipe.RoundPipe(mlp(), optimizer=sgd, config=config) as pipe:
        with pytest.raises(roundpipe.UsageError, match=r"call forward_backward\(\.\.\.\) first"):
            pipe.step()  # nothing computed yet
        pipe.forward_backward(x, y, mse)
        pipe.step()
        pipe.synchronize()
        before = copy.deepcopy(pipe.module.state_dict())
        with pytest.raises(roundpipe.UsageError, match="no forward_backward since the last step"):
            pipe.step()
        assert pipe.step_count == 1
        pipe.synchronize()
        assert_weights_equal(pipe.module.state_dict(), before, rtol=0, atol=0)
        pipe.forward_backward(x, y, mse)  # still usable
        pipe.step()
        assert pipe.step_count == 2


def allocator_error() -> Exception:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 MiB")


def autotuning_error() -> Exception:
    """How inductor's autotuning, compiling a new graph variant, re-raises the allocator's error."""
    try:
        raise allocator_error()
    except torch.OutOfMemoryError as exc:
        try:
            raise RuntimeError(f"Failed to run autotuning code block: {exc}") from exc
        except RuntimeError as wrapped:
            return wrapped


class _FailsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, make: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.make = make
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:  # type: ignore[override]
        raise ctx.make()


class RunsOutOfMemory(nn.Module):
    """Once armed, raises ``make()`` in its forward or in its backward (as a CUDA kernel or
    inductor would), else the identity."""

    def __init__(self, make: Any = allocator_error, in_backward: bool = False) -> None:
        super().__init__()
        self.switch = Switch()
        self.make, self.in_backward = make, in_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.switch.on:
            return x
        if self.in_backward:
            return _FailsBackward.apply(x, self.make)
        raise self.make()


@pytest.mark.parametrize("in_backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("make", [allocator_error, autotuning_error], ids=["allocator", "autotuning"])
def test_out_of_memory_in_any_form_is_named_as_one(make: Any, in_backward: bool) -> None:
    """The allocator's error, or inductor's re-raise of it, in a layer's forward or backward: the
    user sees `DeviceOutOfMemoryError` (with the prediction and what was held), not a broken layer."""
    model = nn.Sequential(nn.Linear(8, 16), RunsOutOfMemory(make, in_backward), nn.Linear(16, 4))
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=2, replan=False)
    data = batches(1)
    model[1].switch.on = True
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        with pytest.raises(roundpipe.DeviceOutOfMemoryError) as info:
            pipe.forward_backward(*data[0], mse)
        assert "out of memory" in str(info.value) and "of stage " in str(info.value)
        model[1].switch.on = False
    assert roundpipe_threads() == []


def test_out_of_memory_names_the_stage_and_what_the_runtime_held() -> None:
    torch.manual_seed(0)
    oom = RunsOutOfMemory()
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), oom, nn.Linear(64, 4))
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=2, replan=False)
    data = batches(2)
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        pipe.forward_backward(*data[0], mse)
        pipe.step()
        pipe.synchronize()
        oom.switch.on = True
        with pytest.raises(roundpipe.DeviceOutOfMemoryError) as info:
            pipe.forward_backward(*data[1], mse)
        message = str(info.value)
        assert "out of memory in layer 3" in message and "of stage " in message
        # What the runtime held when it failed: the failing run's weights (64 x 64 + 64 fp32 floats
        # at least), labelled with their iteration and slot.
        held = message.split("held on cpu at the failure (iteration 1): ")[1]
        label, size, unit = held.split(";")[0].rsplit(" ", 2)
        assert label.startswith("weights+grads it1 slot"), held
        assert float(size) * {"B": 1, "KiB": 1024}[unit] >= (64 * 64 + 64) * 4, held
        assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
        oom.switch.on = False
    assert roundpipe_threads() == []


def test_tensors_outside_the_runtime_state_are_grouped_by_shape() -> None:
    from roundpipe.backends.holdings import tensors_elsewhere

    kept = [torch.zeros(300, 7), torch.zeros(300, 7)]
    named = torch.zeros(1000)
    found = tensors_elsewhere(torch.device("cpu"), {named.untyped_storage().data_ptr()}, top=1000)
    assert "[300, 7] float32 x2 16.41 KiB" in found, found
    assert "[1000] float32" not in found
    del kept
