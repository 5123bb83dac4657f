"""CPU workers share the process's intra-op threads among their compute lanes.

Each thread that runs a parallel torch op has its own OpenMP team; N workers computing at once
with the process's whole count each oversubscribe the cores, and with more threads in teams than
cores every small op in the process pays to wake its team (`roundpipe.backends.cpu`). The count a
lane takes, and that nothing else in the process changes, is read back from torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.backends.cpu import CpuBackend, use_intra_op_threads


@pytest.fixture
def four_threads() -> Iterator[None]:
    """The process at four intra-op threads (whatever the machine's cores), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_thread(work: Callable[[], int]) -> int:
    """``work``'s result, run on a fresh thread after a parallel op there."""
    out: list[int] = []

    def run() -> None:
        torch.randn(64, 64) @ torch.randn(64, 64)
        out.append(work())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def lane_threads(backend: CpuBackend, lane: str) -> int:
    """The intra-op threads a thread started as ``lane``'s has after a parallel op."""

    def started() -> int:
        backend.lane_started(lane)
        torch.randn(64, 64) @ torch.randn(64, 64)  # would re-read a process count it inherits late
        return torch.get_num_threads()

    out: list[int] = []
    thread = threading.Thread(target=lambda: out.append(started()))
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.usefixtures("four_threads")
@pytest.mark.parametrize(("workers", "compute"), [(1, 4), (2, 2), (3, 1), (8, 1)])
def test_each_compute_lane_takes_its_share_and_nothing_else_changes(workers: int, compute: int) -> None:
    backend = CpuBackend(runtime=None, num_devices=workers)  # type: ignore[arg-type]
    assert lane_threads(backend, "d0.compute") == compute
    assert lane_threads(backend, f"d{workers - 1}.compute") == compute
    for lane in ("d0.act_up", "d0.param_up", "d0.grad_down", "host.optimizer"):
        assert lane_threads(backend, lane) == 4
    assert torch.get_num_threads() == 4  # the caller's own
    assert in_thread(torch.get_num_threads) == 4  # a thread started afterwards


@pytest.mark.usefixtures("four_threads")
def test_lanes_starting_together_each_take_their_own_count() -> None:
    """Two pipes' lanes start on threads of their own at any time: while a compute lane sets its
    count the process count is its share for a moment, and a lane reading it then would keep it
    (its reductions then summing in another order than its twin's in the other pipe)."""
    backend = CpuBackend(runtime=None, num_devices=4)  # type: ignore[arg-type]
    lanes = [f"d{i}.{kind}" for i in range(4) for kind in ("compute", "act_up", "grad_down")] * 4
    seen: dict[int, tuple[str, int]] = {}
    start = threading.Barrier(len(lanes))

    def run(index: int, lane: str) -> None:
        start.wait()
        backend.lane_started(lane)
        torch.randn(64, 64) @ torch.randn(64, 64)
        seen[index] = (lane, torch.get_num_threads())

    threads = [threading.Thread(target=run, args=(i, lane)) for i, lane in enumerate(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == len(lanes)
    for lane, count in seen.values():
        assert count == (1 if lane.endswith(".compute") else 4), lane
    assert in_thread(torch.get_num_threads) == 4


@pytest.mark.usefixtures("four_threads")
def test_use_intra_op_threads_keeps_the_count_through_later_ops() -> None:
    def work() -> int:
        use_intra_op_threads(3, 4)
        torch.randn(64, 64) @ torch.randn(64, 64)
        torch.nn.functional.gelu(torch.randn(1 << 16))
        return torch.get_num_threads()

    assert in_thread(work) == 3
    assert in_thread(torch.get_num_threads) == 4


@pytest.mark.usefixtures("four_threads")
def test_a_pipe_of_two_cpu_workers_computes_each_layer_on_two_threads() -> None:
    """Through the facade: every layer call, on either worker's compute lane, sees half the
    process's threads, and the caller's count is the same after the pipe closes."""
    seen: set[int] = set()

    class Recording(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.add(torch.get_num_threads())
            return super().forward(x)

    torch.manual_seed(0)
    model = nn.Sequential(*[Recording(16, 16) for _ in range(4)])
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=2)
    with roundpipe.RoundPipe(model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), config=config) as pipe:
        pipe.forward_backward(torch.randn(8, 16), torch.randn(8, 16), nn.functional.mse_loss)
        pipe.step()
        pipe.synchronize()
    assert seen == {2}
    assert torch.get_num_threads() == 4
