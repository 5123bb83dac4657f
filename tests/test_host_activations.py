"""The activations one round of a plan saves on the host, and the check that the host has room.

A forward stage saves each backward stage's input (with layer_input grain every layer's) for each
microbatch of a round; from a GPU each lands in its own pinned allocation, rounded up to a power
of two. A plan whose round needs more than the host has stops before the first forward with the
count and what to change. Deterministic: integer memory tables, a fixed available figure.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.plan import Plan
from roundpipe.plan.memory import LayerMemory
from roundpipe.planning import host_activations
from roundpipe.planning.host_activations import check_activation_room, saved_activation_bytes
from tests.helpers import batches, mlp, sgd

MIB = 1 << 20
# Layer j's input: 40 MiB own (a Qwen3-32B hidden state of 4,096 tokens) + 1 MiB carried constants.
MEM = LayerMemory(
    param_bytes=(0,) * 6,
    grad_bytes=(0,) * 6,
    saved_bytes=(0,) * 6,
    work_bytes=(0,) * 6,
    boundary_bytes=(MIB, *[41 * MIB] * 5),
    carried_bytes=(0, *[MIB] * 5),
)
PLAN = Plan(
    (range(0, 2), range(2, 4)),
    range(4, 6),
    (range(2, 4), range(0, 2)),
    t_max=1.0,
    num_devices=1,
    num_microbatches=4,
)


def test_a_round_saves_each_backward_stage_input_or_every_backward_layer_input() -> None:
    # Stage grain: the fused stage's input (4) and the backward stage at 2; layer 0 is the data.
    assert saved_activation_bytes(PLAN.slots, MEM, "stage", 4, pinned=False) == (2 * 4 * 40 * MIB, 8)
    # layer_input: layers 1, 2, 3 of the backward stages and the fused stage's 4.
    assert saved_activation_bytes(PLAN.slots, MEM, "layer_input", 4, pinned=False) == (4 * 4 * 40 * MIB, 16)
    # Pinned downloads: 40 MiB each is held as 64 MiB.
    assert saved_activation_bytes(PLAN.slots, MEM, "stage", 4, pinned=True) == (2 * 4 * 64 * MIB, 8)


def test_the_check_passes_within_the_host_or_unknown_and_names_the_fixes_past_it() -> None:
    check_activation_room(PLAN.slots, MEM, "layer_input", 4, pinned=True, available=1024 * MIB)
    with pytest.raises(
        roundpipe.HostMemoryError, match=r"16 layer inputs .* 1\.00 GiB as pinned downloads"
    ) as info:
        check_activation_room(PLAN.slots, MEM, "layer_input", 4, pinned=True, available=1000 * MIB)
    assert "recompute_grain='stage' (only each backward stage's input" in str(info.value)
    with pytest.raises(roundpipe.HostMemoryError) as stage:
        check_activation_room(PLAN.slots, MEM, "stage", 4, pinned=True, available=100 * MIB)
    assert "only each backward stage's input" not in str(stage.value)  # it is the grain already


def test_a_run_whose_round_cannot_fit_the_host_stops_before_its_first_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []

    def available(meminfo: str = "") -> int:
        seen.append(1)
        return 1  # one byte: no activation fits

    monkeypatch.setattr(host_activations, "available_host_bytes", available)
    model = mlp(0, width=64, depth=6)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=4, memory_budget="64KiB", replan=False)
    (x, y), *_ = batches(1, batch=16)
    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        with pytest.raises(roundpipe.HostMemoryError, match="layer inputs on the host per round"):
            pipe.forward_backward(x, y, nn.functional.mse_loss)
    assert seen
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])


def test_a_run_with_room_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[Any] = []
    real = host_activations.saved_activation_bytes

    def counting(*args: Any, **kwargs: Any) -> tuple[int, int]:
        counted.append(real(*args, **kwargs))
        return counted[-1]

    monkeypatch.setattr(host_activations, "saved_activation_bytes", counting)
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=4, memory_budget="64KiB", replan=False)
    (x, y), *_ = batches(1, batch=16)
    with roundpipe.RoundPipe(mlp(0, width=64, depth=6), optimizer=sgd, config=config) as pipe:
        loss = pipe.forward_backward(x, y, nn.functional.mse_loss)
        plan = pipe.plan
    assert loss > 0 and plan.bwd_stages  # a split plan, whose backward stages read saved inputs
    ((nbytes, count),) = counted
    assert count > 0 and nbytes == count * 4 * 64 * 4  # 4 rows of 64 fp32 per microbatch


def test_a_run_s_trace_counts_the_activation_bytes_each_transfer_moved() -> None:
    """The graph of a real run knows no activation sizes (its ``act_bytes`` is a cost model's);
    each transfer records the bytes it moved, so a trace's link figures count them."""
    config = roundpipe.RunConfig(devices="cpu:1", num_microbatches=4, memory_budget="64KiB", replan=False)
    (x, y), *_ = batches(1, batch=16)
    with roundpipe.RoundPipe(mlp(0, width=64, depth=6), optimizer=sgd, config=config) as pipe:
        pipe.forward_backward(x, y, nn.functional.mse_loss)
        pipe.synchronize()
        tasks = [t for t in pipe.trace() if t.iteration == 0]
    row = 4 * 64 * 4  # a microbatch of 4 rows of 64 fp32
    moved = {kind: {t.nbytes for t in tasks if t.kind == kind} for kind in ("act_up", "grad_up", "act_down")}
    assert moved["grad_up"] == {row}
    data = 4 * 8 * 4  # layer 0's input: the microbatch's 4 rows of 8 (a slice: not its batch's storage)
    assert moved["act_up"] <= {row, data} and row in moved["act_up"]
    assert moved["act_down"] <= {row, 0} and row in moved["act_down"]  # the last run downloads nothing


def test_with_residuals_each_backward_layer_saves_one_more_download_beside_its_input() -> None:
    """The residual of every layer of a backward stage (1, 2, 3 here; not the fused stage's 4,
    whose forward runs again with grad), 40 MiB each, a pinned download of its own."""
    residuals = LayerMemory(**{**MEM.to_dict(), "residual_bytes": (0, *[40 * MIB] * 5)})
    plain = saved_activation_bytes(PLAN.slots, MEM, "layer_input", 4, pinned=True)
    assert saved_activation_bytes(PLAN.slots, residuals, "layer_input", 4, pinned=True) == (
        plain[0] + 3 * 4 * 64 * MIB,
        plain[1] + 3 * 4,
    )
    # At stage grain nothing is saved beside the inputs, and without residuals the same as before.
    assert saved_activation_bytes(PLAN.slots, residuals, "stage", 4, pinned=True) == saved_activation_bytes(
        PLAN.slots, MEM, "stage", 4, pinned=True
    )
    assert residuals.without_residuals() == MEM
    with pytest.raises(roundpipe.HostMemoryError, match="28 layer inputs and residuals") as info:
        check_activation_room(PLAN.slots, residuals, "layer_input", 4, pinned=True, available=1024 * MIB)
    assert str(info.value).split("To fit: ")[1].startswith("save_residuals=False")
