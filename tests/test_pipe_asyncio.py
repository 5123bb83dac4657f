"""Embedding in asyncio: the async API never blocks the caller's loop; the sync API works
inside a running loop and from other threads."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from torch import nn

import roundpipe
from tests.helpers import batches, mlp, sgd

mse = nn.functional.mse_loss


async def test_heartbeat_keeps_ticking_while_training() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)], nn.Linear(256, 4)
    )
    x, y = torch.randn(64, 256), torch.randn(64, 4)
    config = roundpipe.RunConfig(devices="cpu:2", num_microbatches=8)
    gaps: list[float] = []
    stop = asyncio.Event()

    async def heartbeat() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    with roundpipe.RoundPipe(model, optimizer=sgd, config=config) as pipe:
        beat = asyncio.ensure_future(heartbeat())
        started = time.perf_counter()
        for _ in range(3):
            await pipe.aforward_backward(x, y, mse)
            await pipe.astep()
        await pipe.asynchronize()
        elapsed = time.perf_counter() - started
        stop.set()
        await beat
    assert elapsed > 0.05  # the work really ran while we were ticking
    assert len(gaps) > 5
    assert max(gaps) < 0.05, f"the caller's loop stalled for {max(gaps) * 1e3:.1f} ms"


async def test_sync_api_inside_a_running_loop() -> None:
    x, y = batches(1)[0]
    with roundpipe.RoundPipe(mlp(), optimizer=sgd, config=roundpipe.RunConfig(devices="cpu:2")) as pipe:
        loss = pipe.forward_backward(x, y, mse)  # blocks this loop's thread, but must not deadlock
        pipe.step()
        pipe.synchronize()
    assert loss > 0


def test_sync_api_from_another_thread() -> None:
    x, y = batches(1)[0]
    results: list[float] = []
    with roundpipe.RoundPipe(mlp(), optimizer=sgd, config=roundpipe.RunConfig(devices="cpu:2")) as pipe:
        worker = threading.Thread(target=lambda: results.append(pipe.forward_backward(x, y, mse)))
        worker.start()
        worker.join()
        results.append(pipe.forward_backward(x, y, mse))
    assert len(results) == 2 and results[0] > 0
