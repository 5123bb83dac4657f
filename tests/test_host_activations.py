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
    whose forward runs again with grad), 40 MiB each, downloaded by the forward stage computing
    the layer with its inputs: stage [0, 2) inputs 1, 2 and residual 1 (pieces of 40, 40, 40
    MiB, held as 64 each), stage [2, 4) inputs 3, 4 and residuals 2, 3 (pieces of 120 and 40:
    128 and 64). Unpinned, the values' own bytes."""
    residuals = LayerMemory(**{**MEM.to_dict(), "residual_bytes": (0, *[40 * MIB] * 5)})
    plain = saved_activation_bytes(PLAN.slots, MEM, "layer_input", 4, pinned=True)
    assert plain == (4 * 2 * 128 * MIB, 16)
    assert saved_activation_bytes(PLAN.slots, residuals, "layer_input", 4, pinned=True) == (
        4 * (3 * 64 + 128 + 64) * MIB,
        plain[1] + 3 * 4,
    )
    assert saved_activation_bytes(PLAN.slots, residuals, "layer_input", 4, pinned=False) == (
        4 * 7 * 40 * MIB,
        28,
    )
    # At stage grain nothing is saved beside the inputs, and without residuals the same as before.
    assert saved_activation_bytes(PLAN.slots, residuals, "stage", 4, pinned=True) == saved_activation_bytes(
        PLAN.slots, MEM, "stage", 4, pinned=True
    )
    assert residuals.without_residuals() == MEM
    with pytest.raises(roundpipe.HostMemoryError, match="28 layer inputs and residuals") as info:
        check_activation_room(PLAN.slots, residuals, "layer_input", 4, pinned=True, available=1500 * MIB)
    assert str(info.value).split("To fit: ")[1].startswith("save_residuals=False")


def test_a_forward_stage_s_many_saved_inputs_share_pinned_pieces() -> None:
    """Eight 40 MiB inputs (layers 1-8) downloaded by one forward stage: pieces of 240, 40 and 40
    MiB, held as 256, 64 and 64, where eight downloads of their own held 512."""
    eight = LayerMemory(
        param_bytes=(0,) * 10,
        grad_bytes=(0,) * 10,
        saved_bytes=(0,) * 10,
        work_bytes=(0,) * 10,
        boundary_bytes=(MIB, *[40 * MIB] * 9),
    )
    plan = Plan((range(0, 8),), range(8, 10), (range(0, 8),), t_max=1.0, num_devices=1, num_microbatches=1)
    assert saved_activation_bytes(plan.slots, eight, "layer_input", 1, pinned=True) == (
        (256 + 64 + 64) * MIB,
        8,
    )


def test_downloads_together_keep_values_and_structure_and_copy_a_shared_tensor_once() -> None:
    from roundpipe.backends.packed_download import copy_together

    shared = torch.arange(6.0)
    values = [
        {"hidden": torch.randn(3, 5), "_cos": shared, "ids": torch.arange(4)},
        (torch.randn(4, 6).t(), shared),  # not contiguous
        torch.ones(2, dtype=torch.bfloat16),
    ]
    copied = copy_together(values, lambda t: True, pinned=False)
    assert copied[0].keys() == values[0].keys() and isinstance(copied[1], tuple)
    flat = [copied[0]["hidden"], copied[0]["_cos"], copied[0]["ids"], *copied[1], copied[2]]
    expected = [values[0]["hidden"], shared, values[0]["ids"], *values[1], values[2]]
    for got, want in zip(flat, expected, strict=True):
        assert torch.equal(got, want) and got.dtype == want.dtype and got is not want
    assert copied[0]["_cos"] is copied[1][1]  # one copy, as one tensor on the device
    # Per dtype, one piece (unpinned): the hidden states, the shared table and the transposed one.
    assert copied[0]["hidden"].untyped_storage().data_ptr() == copied[1][0].untyped_storage().data_ptr()
    kept = copy_together(values, lambda t: t.dtype == torch.bfloat16, pinned=False)
    assert kept[0]["hidden"] is values[0]["hidden"] and kept[2] is not values[2]


@pytest.mark.gpu
def test_downloads_from_a_gpu_land_in_shared_pinned_pieces() -> None:
    from roundpipe.backends.packed_download import download_together

    values = [{"hidden": torch.randn(4096, 320, device="cuda", dtype=torch.bfloat16)} for _ in range(5)]
    values.append({"hidden": torch.ones(3, device="cpu")})  # a host value stays as it is
    hosts = download_together(values)
    torch.cuda.synchronize()
    pieces = {h["hidden"].untyped_storage().data_ptr() for h in hosts[:5]}
    assert len(pieces) < 5 and all(h["hidden"].is_pinned() for h in hosts[:5])
    for got, want in zip(hosts[:5], values[:5], strict=True):
        assert torch.equal(got["hidden"], want["hidden"].cpu())
    assert hosts[5]["hidden"] is values[5]["hidden"]
