"""What a device task reads stays alive until the device has run it, across streams.

On CUDA each lane is a stream and releases are deferred (`Runtime.defer_release`): a tensor
allocated on one stream (an upload) and read by kernels on another (a compute) must be held until
the reading task has completed, or the allocator hands its block to the next upload on the first
stream while the kernels still read it. A backward stage's recompute and backward both read the
uploaded activation; autograd keeps only some of it (what the layers saved, such as a decoder's
rotary tables) and lets go of each saved tensor once it has launched that node's kernels. An
H200 showed the result: NaN losses on a 1.7B model with 15 backward stages on one GPU, gone under
``CUDA_LAUNCH_BLOCKING=1`` (docs/design.md, "A backward stage is two compute tasks"). Here the CPU runtime runs
with deferred releases, and the test checks, when each backward is issued, that every tensor of
its uploaded activation is held for it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import roundpipe
import roundpipe.planning.replan
from roundpipe.backends import runtime as runtime_module
from roundpipe.backends.holdings import _tensors
from roundpipe.plan import Plan
from roundpipe.sched.task import Task
from tests.helpers import tiny_causal_lm


def split_plan(costs: Any, num_devices: int, num_microbatches: int, *args: Any, **kwargs: Any) -> Plan:
    """Embedding and first decoder forward, the second decoder and the head fused, a backward
    stage over the first decoder and one over the embedding (units: embedding, 2 decoders, head)."""
    return Plan.from_stages(
        [range(0, 2)], range(2, 4), [range(1, 2), range(0, 1)], costs, num_devices, num_microbatches
    )


def test_a_backward_holds_its_whole_uploaded_activation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roundpipe.planning.replan, "choose_evaluated_plan", split_plan)
    uploaded: dict[tuple[int, int, int], Any] = {}
    checked: list[tuple[int, int, int]] = []
    recompute, compute = runtime_module.Runtime.recompute, runtime_module.Runtime.compute

    def recording_recompute(self: runtime_module.Runtime, task: Task) -> None:
        key = (task.iteration, task.slot, task.microbatch)
        uploaded[key] = self.inbox[runtime_module.SlotKey(*key)]
        recompute(self, task)

    def checking_compute(self: runtime_module.Runtime, task: Task) -> None:
        compute(self, task)
        key = (task.iteration, task.slot, task.microbatch)
        if key in uploaded:  # a backward: it must hold every tensor the upload brought
            held = {id(t) for t in _tensors(self._holds.get(task.key, []))}
            missing = [t.shape for t in _tensors(uploaded.pop(key)) if id(t) not in held]
            assert not missing, f"backward {key} does not hold uploaded tensors of shapes {missing}"
            checked.append(key)

    handlers = {**runtime_module._HANDLERS, "recompute": recording_recompute, "compute": checking_compute}
    monkeypatch.setattr(runtime_module, "_HANDLERS", handlers)
    model = tiny_causal_lm("qwen3", vocab=64)
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=2, async_optimizer=False, replan=False)
    with roundpipe.RoundPipe(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), config=config) as pipe:
        assert pipe.plan.bwd_stages == (range(1, 2), range(0, 1))
        pipe.runtime.defer_release = True  # as the CUDA backend runs it
        ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            pipe.forward_backward({"input_ids": ids, "labels": ids.clone()})
            pipe.step()
        pipe.synchronize()
    assert len(checked) == 2 * 2 * 2  # 2 iterations x 2 backward stages x 2 microbatches
    assert not pipe.runtime._holds  # every hold was let go once its task had run


@pytest.mark.parametrize("deferred", [True, False])
def test_a_backward_runs_frozen_weights_go_at_its_last_compute(
    monkeypatch: pytest.MonkeyPatch, deferred: bool
) -> None:
    """A fused or backward run's frozen weights are let go by its last compute (held for it where
    releases are deferred, so they go once the device has run it), not by its gradient download,
    which on CUDA queues behind the run's outgoing gradients; the adapters and their gradients
    stay for that download, and every gradient still lands."""
    from tests.test_transformers_parity import lora

    monkeypatch.setattr(roundpipe.planning.replan, "choose_evaluated_plan", split_plan)
    at_download: list[tuple[int, int, int]] = []  # (slot, frozen left, adapters left)
    frozen_held: list[tuple[int, int]] = []  # per fused or backward run: (frozen tensors, held of them)
    run_task, grad_down = runtime_module.Runtime.run, runtime_module.Runtime.grad_down

    def checking_run(self: runtime_module.Runtime, task: Task) -> None:
        last = task.kind == "compute" and task.stage_kind != "fwd" and task.part == task.num_parts - 1
        run = runtime_module.RunKey(task.device, task.iteration, task.round, task.slot)
        named = self.transient.get(run, {}).values() if last else ()
        frozen = {id(t) for params in named for t in params.values() if not t.requires_grad}
        run_task(self, task)
        if last:
            held = {id(t) for t in _tensors(self._holds.get(task.key, []))}
            frozen_held.append((len(frozen), len(frozen & held)))

    def checking_grad_down(self: runtime_module.Runtime, task: Task) -> None:
        run = runtime_module.RunKey(task.device, task.iteration, task.round, task.slot)
        tensors = [t for named in self.transient.get(run, {}).values() for t in named.values()]
        at_download.append(
            (task.slot, sum(not t.requires_grad for t in tensors), sum(t.requires_grad for t in tensors))
        )
        grad_down(self, task)

    monkeypatch.setattr(runtime_module.Runtime, "run", checking_run)
    monkeypatch.setattr(
        runtime_module, "_HANDLERS", {**runtime_module._HANDLERS, "grad_down": checking_grad_down}
    )
    model = lora(tiny_causal_lm("qwen3", vocab=64))
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=2, async_optimizer=False, replan=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with roundpipe.RoundPipe(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), config=config) as pipe:
        pipe.runtime.defer_release = deferred
        ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
        pipe.forward_backward({"input_ids": ids, "labels": ids.clone()})
        pipe.step()
        pipe.synchronize()
    assert {slot for slot, _, adapters in at_download if adapters} == {1, 2}  # fused, first decoder's
    assert all(frozen == 0 for _, frozen, _ in at_download), at_download
    # Deferred: every frozen tensor of the fused and backward runs was held by their last computes.
    assert frozen_held and all(count > 0 for count, _ in frozen_held), frozen_held
    assert all(held == (count if deferred else 0) for count, held in frozen_held), frozen_held
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert len(moved) == len(before)  # every adapter's gradient landed and was applied
    assert not pipe.runtime._holds
