"""The microbatch chains of a backward stage run: recompute ahead of the gradient.

Why apart from the builder: a backward stage's work per microbatch is two compute tasks, not one.
The recompute (its forward again, keeping the autograd graph) needs only the saved activation; the
backward needs the gradient from the slot above, which is the critical path. Split, the device
recomputes while the gradient is still on its way. Per microbatch:

  act_up     the saved activation   <- the forward slot's act_down that saved it (and, when it
                                       is that slot's output, the next slot's act_up: this one
                                       takes it off the host); the backward ``flow_depth``
                                       microbatches back (completed: flow control)
  recompute  compute lane           <- act_up, every param_up of the run, the run's previous
                                       backward; on one device the first one also the device's
                                       previous run's last compute (completed after a run that
                                       uploads more than the farthest stage ahead, below)
  grad_up    the incoming gradient  <- the previous slot's act_down (critical path); flow
             (act_up lane)             control as act_up; both, on one device, the previous
                                       run's last uploads (issued; `forward_run` says why)
  backward   compute lane           <- recompute, grad_up   (a `COMPUTE` task: its key, its
                                       act_down and the run's grad_down are as for any stage)
  act_down   the input gradient     <- backward

Without `ScheduleOptions.inputs_ahead` the flow control is one microbatch, not ``flow_depth``: a
microbatch's act_up and grad_up wait for the previous microbatch's backward (the first one's for
the device's previous run's last compute), so no next input reaches the device while one computes.

The recompute waits for the run's previous backward, so at most one recomputed microbatch of a run
waits for its gradient (its activations stay on the device until the backward runs). On one
device a run's first recompute also waits for the previous run's last backward: without that, a
run whose weights and activation arrive early (a backward run after the fused one, whose head
weights wait for the optimizer) recomputed before the previous run had even started, and its
activations stayed on the device through all of it (an H200 ran out of memory so). Waiting for
the previous run's last backward, not just its last recompute, means the two runs' recomputed
activations never meet, so the memory model counts one. It costs nothing on one device: the
previous run's last gradient came from the run before it, long done (the fake engine's iteration
times were unchanged on every 1-device plan tried).

Where the previous run uploads more than the stage uploaded farthest ahead (a fused stage with the
LM head before a plain backward stage), that first recompute waits for the previous run's last
backward to *complete*, not only to be issued (and a fused run's first compute likewise after a
forward stage longer than the first backward stage, `forward_run`): the previous run's frozen
weights are released once that compute has run on the device (`Runtime.run`), and the memory model
counts them gone before this run builds its activations, with the farthest stage's upload in their
place (that upload waits for the same completion). Issued ahead, a 32B base's recompute was built
beside its fused stage's 7.8 GiB of frozen weights: 0.8 GiB over the model on an H100. Elsewhere
the farthest upload is at least as large, so the overlap stays within the count and no wait is
made: a wait costs the device the host's time to issue the run's first kernels. Made at every run,
it gave the fake engine's E-proportioned plan, whose host takes 2-5 ms to issue a compute, 2.8% of
bubble where `tests/test_upload_order.py` asks under 1%, which the plan keeps as made here.

On several devices the next run's gradient comes from another device: waiting there raised the
asynchronous steady bubble of 28-64-layer LLM profiles (8 devices, 16 microbatches) from about 2%
to 5-10%, so several devices keep no such dependency and the memory model counts the previous
run's last recompute beside the current one.
This module must never hold tensors or decide anything but these tasks and their dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass

from roundpipe.sched.keys import ActDownKey, ActUpKey, ComputeKey, GradUpKey, RecomputeKey
from roundpipe.sched.stage_run import IterationInProgress, StageRun, previous_act_down
from roundpipe.sched.task import ACT_DOWN, ACT_UP, COMPUTE, GRAD_UP, RECOMPUTE, Key


@dataclass(frozen=True)
class BackwardRunContext:
    """What a backward run's chains depend on outside the run itself."""

    act_bytes: int  # one microbatch's boundary activation (and its gradient)
    down_bytes: int  # the input gradient sent down (0 from the last slot)
    saved_by: int | None  # the forward slot whose act_down saved the entering activation
    read_by: int | None  # the forward slot whose act_up reads it too (the act_up here takes it)
    flow_run: Key | None  # the device's run two back (one without inputs ahead): its last compute
    previous_run_done: Key | None = None  # one device: the previous run's last compute
    flow_depth: int = 2  # microbatches of flow control (`ScheduleOptions.flow_depth`; 1 without inputs ahead)
    inputs: int = 1  # activations its act_up brings (every layer's with `ScheduleOptions.layer_inputs`)
    uploads_after: tuple[Key, ...] = ()  # one device: its previous run's last uploads (`forward_run`)
    # One device: the first recompute waits for ``previous_run_done`` to complete, not only to be
    # issued, where the previous run uploads more than the stage uploaded farthest ahead.
    previous_run_sync: bool = False


def backward_chains(
    run: StageRun, param_keys: list[Key], built: IterationInProgress, context: BackwardRunContext
) -> Key:
    """Append the run's per-microbatch tasks to ``built``, in dependency order; return its last
    backward (the run's last compute)."""
    last_down = built.last_act_down
    backwards: list[Key] = []
    t, slot = run.iteration, run.slot
    for position, mb in enumerate(run.microbatches):
        flow: list[Key] = []
        depth = context.flow_depth
        ahead = backwards[position - depth] if position >= depth else context.flow_run
        if ahead is not None:
            flow.append(ahead)  # flow control, so it waits for completion
        up_key, grad_key = ActUpKey(t, slot, mb), GradUpKey(t, slot, mb)
        up_deps = list(flow)
        if context.saved_by is not None:
            up_deps.append(ActDownKey(t, context.saved_by, mb))
        if context.read_by is not None:
            up_deps.append(ActUpKey(t, context.read_by, mb))
        up_deps += context.uploads_after
        recompute_key, backward_key = RecomputeKey(t, slot, mb), ComputeKey(t, slot, mb)
        recompute_deps, recompute_sync = _recompute_waits(up_key, param_keys, backwards, context)
        grad_deps = [previous_act_down(last_down, run, mb), *flow, *context.uploads_after]
        down_key = ActDownKey(t, slot, mb)
        count = len(run.microbatches)
        built.tasks += (
            run.task(
                up_key,
                ACT_UP,
                up_deps,
                microbatch=mb,
                nbytes=context.act_bytes * context.inputs,
                sync_deps=flow,
            ),
            run.task(
                recompute_key,
                RECOMPUTE,
                recompute_deps,
                microbatch=mb,
                part=position,
                num_parts=count,
                sync_deps=recompute_sync,
            ),
            run.task(grad_key, GRAD_UP, grad_deps, microbatch=mb, nbytes=context.act_bytes, sync_deps=flow),
            run.task(
                backward_key,
                COMPUTE,
                [recompute_key, grad_key],
                microbatch=mb,
                part=position,
                num_parts=count,
            ),
            run.task(down_key, ACT_DOWN, [backward_key], microbatch=mb, nbytes=context.down_bytes),
        )
        last_down[mb] = down_key
        backwards.append(backward_key)
    return backwards[-1]


def _recompute_waits(
    up_key: Key, param_keys: list[Key], backwards: list[Key], context: BackwardRunContext
) -> tuple[list[Key], list[Key]]:
    """A recompute's dependencies and those of them it waits for to complete."""
    deps = [up_key, *param_keys]
    if backwards:
        return [*deps, backwards[-1]], []
    if context.previous_run_done is None:
        return deps, []
    deps.append(context.previous_run_done)
    return deps, [context.previous_run_done] if context.previous_run_sync else []
