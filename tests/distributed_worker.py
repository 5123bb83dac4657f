"""One process of the two-process data-parallel tests (tests/test_distributed.py).

Run as ``python -m tests.distributed_worker OUT_DIR`` with torchrun's variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set, so RoundPipe picks the group up as under torchrun.
Each process trains on its half of every global batch of `global_data`. One pair of processes
runs every phase, since starting one costs seconds:
  1. sync, async, then sync with clipping, 3 steps each: the final weights go to OUT_DIR/{mode}{rank}.pt,
     and rank 0 writes the sync run's checkpoint to OUT_DIR/checkpoint;
  2. a run whose rank 1 has another learning rate: the divergence error goes to
     OUT_DIR/diverge{rank}.txt;
  3. rank 1 raises in its second forward_backward and exits; rank 0 must then fail, not hang
     (it writes OUT_DIR/failing0.txt first, so the test can time how long it takes).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import roundpipe
from roundpipe.checkpoint import save_checkpoint
from tests.helpers import batches, mlp, train_steps

STEPS = 3
GLOBAL_BATCH = 8
MODES = ("sync", "async", "clip")  # clip: sync with max_grad_norm, the norm of averaged gradients
CLIP = 0.05
RENDEZVOUS_TIMEOUT_S = 120


def global_data(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches; the first ``STEPS`` are the same for any ``steps``."""
    return batches(steps, batch=GLOBAL_BATCH, seed=5)


def adamw(lr: float = 1e-2) -> Any:
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def local_data(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    share = GLOBAL_BATCH // world
    return [
        (x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]) for x, y in global_data()
    ]


def make_pipe(
    async_optimizer: bool, lr: float = 1e-2, max_grad_norm: float | None = None, timeout_s: float = 10
) -> roundpipe.RoundPipe:
    config = roundpipe.RunConfig(
        devices="cpu:1",
        num_microbatches=2,
        async_optimizer=async_optimizer,
        max_grad_norm=max_grad_norm,
        distributed={"mode": "on", "timeout_s": timeout_s, "check_every": 1},
    )
    return roundpipe.RoundPipe(mlp(seed=0), adamw(lr), config)


def train(rank: int, world: int, out: Path) -> None:
    for mode in MODES:
        # The first pipe initialises torch.distributed, and its timeout is the rendezvous's: it
        # waits for the other process's imports, which on a loaded two-core machine (the suite and
        # its background runs beside) can take longer than the 10 s the failure test times.
        timeout_s = RENDEZVOUS_TIMEOUT_S if mode == MODES[0] else 10
        pipe = make_pipe(mode == "async", max_grad_norm=CLIP if mode == "clip" else None, timeout_s=timeout_s)
        weights = train_steps(pipe, local_data(rank, world), nn.functional.mse_loss)
        torch.save(weights[-1], out / f"{mode}{rank}.pt")
        if mode == "sync" and rank == 0:  # one writer: the processes' states are equal
            save_checkpoint(pipe, out / "checkpoint", data_step=STEPS)
        pipe.close()
    pipe = make_pipe(False, lr=1e-2 if rank == 0 else 2e-2)
    try:
        train_steps(pipe, local_data(rank, world), nn.functional.mse_loss)
        message = "no error"
    except roundpipe.RoundPipeError as exc:
        message = str(exc)
    (out / f"diverge{rank}.txt").write_text(message)


def fail(rank: int, world: int, out: Path) -> None:
    pipe = make_pipe(False)
    if rank == 0:
        (out / "failing0.txt").write_text(str(time.time()))
    calls = 0

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if rank == 1 and calls > 2:  # the second forward_backward (two microbatches each)
            raise RuntimeError("rank 1 fails on purpose")
        return nn.functional.mse_loss(output, target)

    train_steps(pipe, local_data(rank, world), loss_fn)


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        train(rank, world, out)
        fail(rank, world, out)
    finally:  # when it ended, for the test that times how soon a failure stops the other
        (out / f"ended{rank}.txt").write_text(str(time.time()))


if __name__ == "__main__":
    main()
