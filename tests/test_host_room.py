"""The host's compute copies in arenas of few pieces, and the check that the host has room for them.

torch's pinned allocator rounds every allocation up to a power of two, so one pinned arena of a
70B model's 4-bit bytes (36 GiB) would pin 64 GiB; `layout_pieces` cuts it into pieces that the
rounding leaves nearly whole. The room check stops a run whose copies the host cannot hold
before anything is allocated, with the count and what to change. No GPU needed: the layouts are
pure, and pinned allocations are made unpinned where a test builds them.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.optim import host_room
from roundpipe.optim.host import HostModel
from roundpipe.optim.host_room import HostCopies, check_host_room, layout_pieces, pinned_bytes
from tests.helpers import mlp

GIB = 1 << 30


def qwen3_32b_bf16() -> list[int]:
    """Bytes of the compute copies of a Qwen3-32B LoRA run, in order (embedding, 64 layers with
    their adapters, head)."""
    hidden, inter, vocab = 5120, 25600, 151936
    adapters = [16 * hidden * 2, 8192 * 16 * 2]
    layer = [hidden * 8192 * 2, *adapters, hidden * 1024 * 2, hidden * 1024 * 2, 8192 * hidden * 2]
    layer += [256, 256, hidden * inter * 2, hidden * inter * 2, inter * hidden * 2, hidden * 2, hidden * 2]
    return [vocab * hidden * 2, *layer * 64, hidden * 2, vocab * hidden * 2]


def llama_70b_nf4_bytes() -> list[int]:
    """The uint8 arena of a Llama-3.1-70B 4-bit base: packed codes and fp32 scales per linear."""
    hidden, inter = 8192, 28672
    linears = [hidden * hidden, hidden * 1024, hidden * 1024, hidden * hidden, *[hidden * inter] * 3]
    return [n for _ in range(80) for numel in linears for n in (numel // 2, numel // 64 * 4)]


def qwen3_30b_a3b_bf16() -> list[int]:
    """Qwen3-30B-A3B's compute copies: 48 layers of attention, router and 128 experts' stacked
    gate_up (805 MB) and down (403 MB) weights, between the embedding and the head."""
    hidden, vocab = 2048, 151936
    layer = [hidden * 4096 * 2, hidden * 512 * 2, hidden * 512 * 2, 4096 * hidden * 2, 128 * hidden * 2]
    layer += [128 * 1536 * hidden * 2, 128 * hidden * 768 * 2, hidden * 2, hidden * 2]
    return [vocab * hidden * 2, *layer * 48, vocab * hidden * 2]


def assert_laid_out(sizes: list[int], pieces: list[int], places: list[tuple[int, int]]) -> None:
    """Every tensor inside its piece, 64-byte aligned, no two overlapping."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for size, (piece, offset) in zip(sizes, places, strict=True):
        assert offset % 64 == 0 and offset + size <= pieces[piece]
        spans.setdefault(piece, []).append((offset, offset + size))
    for piece_spans in spans.values():
        piece_spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(piece_spans))


@pytest.mark.parametrize(
    ("sizes", "pieces_add", "one_arena_adds"),
    [
        (qwen3_32b_bf16(), 0.002, 0.047),  # 61.05 GiB: 61.12 in 17 pieces, 64 in one arena
        (llama_70b_nf4_bytes(), 0.001, 0.78),  # 35.86 GiB: 35.86 in 15 pieces, 64 in one arena
        (qwen3_30b_a3b_bf16(), 0.056, 0.12),  # 56.87 GiB: 60 in 15 pieces, 64 in one arena
    ],
)
def test_pinned_pieces_hold_every_tensor_once_and_the_rounding_adds_little(
    sizes: list[int], pieces_add: float, one_arena_adds: float
) -> None:
    pieces, places = layout_pieces(sizes, pinned=True)
    assert_laid_out(sizes, pieces, places)
    data = sum(sizes)
    assert sum(pinned_bytes(p) for p in pieces) <= (1 + pieces_add) * data
    assert pinned_bytes(data) > (1 + one_arena_adds) * data


def test_small_tensors_are_laid_out_as_well() -> None:
    sizes = [100, 64, 3000, 1, 70]
    assert_laid_out(sizes, *layout_pieces(sizes, pinned=True))


def test_an_unpinned_arena_is_one_piece_in_order() -> None:
    sizes = [100, 64, 3000, 1]
    pieces, places = layout_pieces(sizes, pinned=False)
    assert pieces == [128 + 64 + 3008 + 64]
    assert places == [(0, 0), (0, 128), (0, 192), (0, 3200)]


def test_pinned_bytes_is_the_power_of_two_at_or_above() -> None:
    assert [pinned_bytes(n) for n in (0, 1, 64, 65, 3 * GIB)] == [0, 1, 64, 128, 4 * GIB]


def test_meminfo_is_read_in_bytes_and_an_unreadable_one_is_unknown(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072 kB\nMemFree:  100 kB\nMemAvailable:   65536 kB\n")
    assert host_room.available_host_bytes(str(meminfo)) == 65536 * 1024
    assert host_room.available_host_bytes(str(tmp_path / "none")) is None


def test_the_check_passes_when_it_fits_or_nothing_is_known_and_names_the_fixes_when_not() -> None:
    copies = HostCopies({"bf16": 70 * GIB}, pinned=True, frozen_copied=70 * GIB)
    check_host_room(copies, None)
    check_host_room(copies, 70 * GIB)
    with pytest.raises(
        roundpipe.HostMemoryError, match=r"need 70\.00 GiB \(bf16 compute copies 70\.00 GiB, pinned"
    ) as info:
        check_host_room(copies, 60 * GIB)
    assert "base_format='nf4'" in str(info.value) and "60.00 GiB available" in str(info.value)
    assert "LoRA" not in str(info.value)  # nothing trains: no advice about trainable parameters
    assert isinstance(info.value, MemoryError)


def frozen_except_last(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    last: Any = list(model.children())[-1]
    last.weight.requires_grad_(True)
    return model


def test_a_host_model_that_cannot_fit_stops_before_touching_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = frozen_except_last(mlp(0, width=64, depth=4)).to(torch.float64)  # copied into fp32
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    monkeypatch.setattr(host_room, "available_host_bytes", lambda meminfo=host_room.MEMINFO: 4096)
    with pytest.raises(
        roundpipe.HostMemoryError, match=r"fp32 compute copies .*fp32 optimizer copies"
    ) as info:
        HostModel(list(model.children()), model)
    assert "fp32 optimizer copies" in str(info.value)  # the trainable weight is fp64: an fp32 master
    for name, param in model.named_parameters():
        assert param.data_ptr() == pointers[name] and torch.equal(param, before[name])


def test_copies_are_counted_as_allocated_and_fit_a_roomy_host(monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[HostCopies] = []
    monkeypatch.setattr(host_room, "check_host_room", lambda copies, available: counted.append(copies))
    model = frozen_except_last(mlp(0, width=64, depth=4))
    host = HostModel(list(model.children()), model, precision="bf16")
    (copies,) = counted
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) * 2
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert copies.frozen_copied == frozen
    assert copies.masters == 0 and copies.gradients == 4 * trainable  # the module's fp32 is the master
    assert copies.compute["bf16"] >= frozen + 2 * trainable
    for param in model.parameters():  # every compute copy holds its weight
        assert torch.equal(host.compute[id(param)], param.detach().to(torch.bfloat16))


def test_views_of_a_pinned_layout_hold_each_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinned layout's pieces, allocated unpinned here (no GPU), give each parameter its place."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    model = frozen_except_last(mlp(0, width=48, depth=6))
    params = list(model.parameters())
    arenas = host_room.Arenas(params, [list(model.named_parameters())], lambda p: torch.bfloat16, pinned=True)
    views = [arenas.view(p) for p in params]
    for param, view in zip(params, views, strict=True):
        view.copy_(param.detach())
    for param, view in zip(params, views, strict=True):
        assert view.shape == param.shape and torch.equal(view, param.detach().to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compute_copies_are_pinned_pieces_holding_each_weight() -> None:
    model = frozen_except_last(mlp(0, width=256, depth=8))
    host = HostModel(list(model.children()), model, precision="bf16", pin_memory=True)
    storages = set()
    for param in model.parameters():
        copy = host.compute[id(param)]
        assert copy.is_pinned() and torch.equal(copy, param.detach().to(torch.bfloat16))
        storages.add(copy.untyped_storage().data_ptr())
    assert 1 < len(storages) < len(list(model.parameters()))  # pieces: fewer than one per tensor
