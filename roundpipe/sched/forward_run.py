"""The microbatch chains of a forward or fused stage run.

Why apart from the builder: with `backward_run` beside it, the builder keeps only what relates
runs to each other (weights, versions, the device's history) and the per-microbatch shape of each
run kind lives in one small module each. Per microbatch of a forward or fused run:

  act_up   the input            <- the previous slot's act_down; the compute ``flow_depth``
                                   (`ScheduleOptions`, two by default) microbatches back
                                   (completed); a run's first inputs only once the device's run
                                   two before has completed, as its weights (without that, every
                                   run whose input was ready would upload it, and a device would
                                   hold many runs' activations); on one device also the previous
                                   run's last uploads (issued: `uploads_after`)
  compute  compute lane         <- act_up, every parameter upload, the previous microbatch;
                                   a fused run's first one, on one device after a run that
                                   uploads more than its farthest stage ahead, that run's last
                                   compute (completed: `backward_run` says why)
  act_down the output           <- compute

A device's uploads run in the order they are issued (CUDA: one stream). Issued early, a run's
upload waits on the device for the activation its previous slot is still computing, and every
upload issued after it waits too: on one H100, workload E's next run's inputs, issued while the
flow control still held the current run's last ones, stopped some of those behind them 7-23 ms a
microbatch, and the device, given the next run's first compute before the current run's last,
kept two runs' weights and started the following upload late (up to 54 ms idle a forward run;
`bench/upload_order.py` replays it on the fake stream backend). So on one device a run's uploads
wait for the previous run's last ones to be issued: the device then takes runs in their order.
Several devices keep no such dependency: a run's input comes from another device there, which the
host waits for before issuing its upload, so it cannot stop a stream.

This module must never hold tensors or decide anything but these tasks and their dependencies.
"""

from __future__ import annotations

from roundpipe.plan.kinds import SlotKind
from roundpipe.sched.keys import ActDownKey, ActUpKey, ComputeKey
from roundpipe.sched.stage_run import IterationInProgress, StageRun, previous_act_down
from roundpipe.sched.task import ACT_DOWN, ACT_UP, COMPUTE, Key


def forward_chains(
    run: StageRun,
    param_keys: list[Key],
    built: IterationInProgress,
    act_bytes: int,
    down_bytes: int,
    two_runs_back: Key | None,
    flow_depth: int = 2,
    uploads_after: list[Key] | tuple[Key, ...] = (),
    first_after: Key | None = None,
) -> Key:
    """Append the run's per-microbatch tasks to ``built``; return the run's last compute.
    ``uploads_after``: the device's previous run's last uploads (one device; module docstring);
    ``first_after``: a compute the first one waits to complete (a fused run after a heavier
    forward run on one device, as `backward_run` makes a first recompute wait)."""
    fused = run.kind == SlotKind.FUSED
    last_down = built.last_act_down
    computes: list[Key] = []
    for position, mb in enumerate(run.microbatches):
        up_key = ActUpKey(run.iteration, run.slot, mb)
        up_deps: list[Key] = []
        up_sync: list[Key] = []
        if run.slot > 0:
            up_deps.append(previous_act_down(last_down, run, mb))
        # Flow control, so it waits for completion.
        ahead = computes[position - flow_depth] if position >= flow_depth else two_runs_back
        if ahead is not None:
            up_sync.append(ahead)
            up_deps.append(ahead)
        up_deps += uploads_after
        compute_key = ComputeKey(run.iteration, run.slot, mb)
        compute_deps = [up_key, *param_keys]
        compute_sync: list[Key] = []
        if computes:
            compute_deps.append(computes[-1])
        elif first_after is not None:
            compute_deps.append(first_after)
            compute_sync.append(first_after)
        down_key = ActDownKey(run.iteration, run.slot, mb)
        built.tasks += (
            run.task(up_key, ACT_UP, up_deps, microbatch=mb, nbytes=act_bytes, sync_deps=up_sync),
            run.task(
                compute_key,
                COMPUTE,
                compute_deps,
                microbatch=mb,
                part=position,
                num_parts=len(run.microbatches),
                sync_deps=compute_sync,
            ),
            run.task(down_key, ACT_DOWN, [compute_key], microbatch=mb, nbytes=down_bytes),
        )
        if fused:
            built.loss_keys.append(compute_key)
        last_down[mb] = down_key
        computes.append(compute_key)
    return computes[-1]
