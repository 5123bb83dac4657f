"""Boundary activations on a device beside the stage it computes: the part of the memory model
that follows the schedule's flow control rather than a layer's own bytes.

Why a module of its own: what is in flight is decided by `roundpipe.sched`'s dependencies (a
microbatch's input waits for the compute ``flow_depth`` microbatches back; a run's first inputs
for the device's run two before; on one device also for the previous run's last uploads to be
issued), and the count must change whenever those do, apart from the stage arithmetic in
`roundpipe.plan.memory`.

The next run's inputs. A run's first ``flow_depth`` inputs wait only for the device's run two
before it, which has ended before the current run computes, so they arrive while the current run
still computes. On one device they also wait for the current run's last upload to be issued,
which the flow control allows once the compute ``flow_depth`` microbatches before the last has
ended: from then on the current run has one input fewer ahead, and the next run's are there.
A backward run's input is large under the ``layer_input`` grain (every layer's saved input and
the gradient from above): on an H100 a Qwen3-32B-shaped plan's fused stage (its own input 42 MiB)
peaked with the next backward run's first two microbatches up beside it, 584 MiB that a count
without them leaves out (`bench/gpu_big.sh E-snapshot`: 19.77 GiB measured, 19.05 predicted without
them, 19.57 with). Several devices
make no such wait, so there the next run's inputs are counted beside all of the current run's.

Pure arithmetic over integers: never import torch, measure, or touch a device."""

from __future__ import annotations

from typing import Any

from roundpipe.plan.kinds import Grain
from roundpipe.plan.layer_memory import LayerMemory


def held_inputs(mem: LayerMemory, layers: range) -> int:
    """Every layer input of a stage kept at once (layer-grain recompute keeps them all), with the
    residuals saved beside them (only a layer_input run has any); the carried constants are one
    storage, counted once."""
    own = sum(mem.boundary_bytes[i] - mem.carried_bytes[i] + mem.residual_bytes[i] for i in layers)
    return own + max(mem.carried_bytes[i] for i in layers)


def in_flight_microbatches(num_microbatches: int, act_in_flight: int = 2) -> int:
    """How many microbatches' boundary activations `predict_peak` counts in flight: ``act_in_flight``
    (one arriving, one leaving), but never more than the iteration has. With one microbatch only
    its own edges exist (the next stage's input uploaded ahead, the gradient from above): counting a
    second pair put 4 GiB on a 262,144-token run of an 8B shape that it never holds."""
    return max(1, min(act_in_flight, num_microbatches))


def uploaded_inputs(mem: LayerMemory, slot: Any, grain: Grain) -> int:
    """What one microbatch of ``slot``'s run brings to the device before it computes: its input;
    for a backward stage also the gradient from above, and under ``layer_input`` every layer's
    saved input instead of the first one's."""
    r = slot.layers
    if slot.kind != "bwd":
        return mem.boundary_bytes[r.start]
    inputs = held_inputs(mem, r) if grain == "layer_input" else mem.boundary_bytes[r.start]
    return inputs + (mem.boundary_bytes[r.stop] if r.stop < mem.num_layers else 0)


def own_in_flight(
    mem: LayerMemory, slot: Any, held: frozenset[int], act_in_flight: int, inputs_ahead: bool, grain: Grain
) -> int:
    """A run's own boundary activations besides its computing microbatch's: ``act_in_flight``
    microbatches' uploads (`uploaded_inputs`: a backward stage's gradient from above among them)
    and a forward or fused stage's outputs; a forward stage also holds, per microbatch, the
    activations it saves for backward stages starting inside it (under layer_input, with the
    residuals its layers keep beside them, its first layer's too). Without ``inputs_ahead`` a
    backward stage's next input is uploaded only once its previous backward is done
    (`ScheduleOptions.inputs_ahead`): beside the computing microbatch's own input (in the stage)
    only its gradient is there."""
    r = slot.layers
    if slot.kind == "bwd" and not inputs_ahead:
        return mem.boundary_bytes[r.stop] - mem.carried_bytes[r.stop] if r.stop < mem.num_layers else 0
    edge = uploaded_inputs(mem, slot, grain)
    if slot.kind != "bwd" and r.stop < mem.num_layers:  # the output going down
        edge += mem.boundary_bytes[r.stop]
    if slot.kind == "fwd":
        inner = sum(mem.boundary_bytes[b] - mem.carried_bytes[b] for b in held if r.start < b < r.stop)
        inner += sum(mem.residual_bytes[b] for b in held if r.start <= b < r.stop)
        return act_in_flight * edge + (act_in_flight + 1) * inner
    return act_in_flight * edge


def boundary_in_flight(
    mem: LayerMemory,
    slot: Any,
    following: Any | None,
    held: frozenset[int],
    act_in_flight: int,
    inputs_ahead: bool = True,
    grain: Grain = "stage",
    num_devices: int = 1,
) -> int:
    """Boundary activations on the device while ``slot``'s run computes: its own (`own_in_flight`)
    and the first ``act_in_flight`` inputs of ``following``, the run its device takes next (None:
    nothing follows on the device, or the same slot returns), as the module docstring says. A
    backward run without ``inputs_ahead`` uploads nothing before the run before it has ended."""
    own = own_in_flight(mem, slot, held, act_in_flight, inputs_ahead, grain)
    if following is None or (following.kind == "bwd" and not inputs_ahead):
        return own
    ahead = act_in_flight * uploaded_inputs(mem, following, grain)
    if num_devices > 1:
        return own + ahead
    return max(own, own - uploaded_inputs(mem, slot, grain) + ahead)
