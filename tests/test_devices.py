"""Which devices a ``devices`` string names, and a process's share of a machine's GPUs."""

from __future__ import annotations

import pytest
import torch

from roundpipe import ConfigError, RunConfig
from roundpipe.config import local_share, parse_devices


def torchrun(rank: int, processes: int) -> dict[str, str]:
    return {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(processes)}


def test_one_process_takes_every_visible_gpu() -> None:
    assert local_share(4, "cuda", {}) == (0, 1, 2, 3)
    assert local_share(4, "cuda", torchrun(0, 1)) == (0, 1, 2, 3)


def test_processes_on_one_machine_take_equal_contiguous_shares() -> None:
    """torchrun --nproc-per-node P: every process sees every GPU; each must drive its own."""
    assert [local_share(2, "cuda", torchrun(r, 2)) for r in range(2)] == [(0,), (1,)]
    assert [local_share(8, "cuda", torchrun(r, 2)) for r in range(2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    shares = [local_share(8, "cuda", torchrun(r, 4)) for r in range(4)]
    assert sorted(i for share in shares for i in share) == list(range(8))


@pytest.mark.parametrize("count, processes", [(3, 2), (1, 2)])
def test_gpus_that_do_not_split_evenly_are_refused_saying_what_to_do(count: int, processes: int) -> None:
    with pytest.raises(ConfigError, match=r"cannot share .* equally") as info:
        local_share(count, "cuda", torchrun(0, processes))
    assert 'devices="cuda:0"' in str(info.value) and "LOCAL_WORLD_SIZE" in str(info.value)


def test_cuda_and_auto_under_torchrun_take_the_local_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert parse_devices("cuda").indices == (2, 3)
    assert RunConfig(devices="auto").device_spec().indices == (2, 3)
    assert parse_devices("cuda:0,3").indices == (0, 3)  # named devices are used as named
    assert parse_devices("cpu:2").indices == (0, 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert parse_devices("cuda").indices == (0, 1, 2, 3)


def test_cuda_devices_without_cuda_are_refused_before_anything_reads_a_card(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """devices="cuda:0" where torch has no CUDA: a ConfigError saying what to use instead, raised
    before the budget reads the card's free memory (torch's own error came from there)."""
    import roundpipe
    from roundpipe.backends import budget

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    free_memory_read: list[int] = []
    monkeypatch.setattr(
        budget, "default_budget", lambda index, reserve=None: free_memory_read.append(index) or 0
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=r'devices="cuda:0,1" but CUDA is not available') as info:
        roundpipe.RoundPipe(model, config=RunConfig(devices="cuda:0,1"))
    assert 'use devices="cpu:N"' in str(info.value)
    assert free_memory_read == []


def test_cuda_devices_that_do_not_exist_are_refused_naming_the_ones_that_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from roundpipe.backends.budget import require_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    require_devices((0, 1))
    with pytest.raises(
        ConfigError, match=r"cuda:3 does not exist: this machine has 2 CUDA device\(s\) \(cuda:0 to cuda:1\)"
    ):
        require_devices((0, 3))
