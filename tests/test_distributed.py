"""Data parallel across two processes on localhost (gloo, one CPU worker each).

What must hold: averaging each process's gradient of its half of the batch gives the weights of
one process on the whole batch (sync and async), every process ends with bitwise-equal weights,
one process resumes from their checkpoint, weights that diverge are named, a process that fails makes the other fail soon, not hang, and
the order of the steps those collectives need changes no number.
Both processes run every phase (tests/distributed_worker.py): starting a process costs seconds.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RunConfig
from roundpipe.assembly import schedule_options
from roundpipe.checkpoint import load_checkpoint
from roundpipe.sched.task import STEP
from tests.distributed_worker import CLIP, MODES, STEPS, adamw, global_data
from tests.helpers import assert_weights_equal, async_reference, mlp, sync_reference, train_steps

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 10  # the worker's RunConfig.distributed.timeout_s


_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()
_PICKER = random.Random(os.getpid())


def free_port() -> int:
    """A port free now, below the kernel's range for outgoing connections, and never handed out
    before in this test run. Why remembered: the port is free again once this socket closes, and
    until the job's rank 0 binds it (seconds later, after its imports) another caller, such as the
    train runs started from another thread at the same moment, would be handed the same one. Why
    below that range: meanwhile any process's outgoing connection (a rank's store client) may be
    given a port from it, and rank 0's bind then fails with "address already in use"."""
    low = _ephemeral_low()
    with _PORTS_LOCK:
        while True:
            port = _PICKER.randrange(max(1024, low - 10_000), low)
            if port in _PORTS_GIVEN:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _PORTS_GIVEN.add(port)
            return port


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def clipped_reference() -> dict[str, torch.Tensor]:
    """One process on the global batch with the same clipping (its clipping is tested elsewhere)."""
    config = RunConfig(devices="cpu:1", num_microbatches=4, async_optimizer=False, max_grad_norm=CLIP)
    pipe = RoundPipe(mlp(seed=0), adamw(), config)
    weights = train_steps(pipe, global_data(), nn.functional.mse_loss)[-1]
    pipe.close()
    return weights


def start_workers(out: Path) -> list[subprocess.Popen[str]]:
    """Both processes of tests/distributed_worker.py, writing to ``out`` (started before the
    test run's first test by tests/conftest.py, so they run on the core the suite leaves idle)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    procs = []
    for rank in range(2):
        # To a file: a pipe that nobody reads until the module's tests run could fill and stop it.
        with open(out / f"log{rank}.txt", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.distributed_worker", str(out)],
                    cwd=ROOT,
                    env=dict(env, RANK=str(rank)),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
    return procs


@pytest.fixture(scope="module")
def run(distributed_workers: tuple[Path, list[subprocess.Popen[str]]] | None) -> dict[str, Any]:
    """Compute the single-process references while the processes run, then wait for both."""
    assert distributed_workers is not None, "tests/conftest.py starts them for the selected tests"
    out, procs = distributed_workers
    references = {
        "sync": sync_reference(mlp(seed=0), adamw(), global_data(), nn.functional.mse_loss)[1][-1],
        "async": async_reference(mlp(seed=0), adamw(), global_data(), nn.functional.mse_loss)[1][-1],
        "clip": clipped_reference(),
    }
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=120))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail("a distributed worker hung for 120 s")
    logs = [(out / f"log{rank}.txt").read_text() for rank in range(2)]
    return {"out": out, "logs": logs, "codes": codes, "references": references}


@pytest.mark.parametrize("mode", MODES)
def test_two_processes_equal_one_on_the_global_batch(run: dict[str, Any], mode: str) -> None:
    out = run["out"]
    assert (out / f"{mode}0.pt").exists(), run["logs"]
    weights = [torch.load(out / f"{mode}{rank}.pt") for rank in range(2)]
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), f"{name} differs between the ranks"
    assert_weights_equal(weights[0], run["references"][mode], rtol=1e-5)
    if mode == "clip":  # clipping acted: the norm of the averaged gradient was above CLIP
        assert not torch.allclose(weights[0]["0.weight"], run["references"]["sync"]["0.weight"])


def test_one_process_resumes_from_a_two_process_checkpoint(run: dict[str, Any]) -> None:
    """The processes' states are equal, so one process continues from rank 0's checkpoint as the
    global-batch run would."""
    config = RunConfig(
        devices="cpu:1", num_microbatches=4, async_optimizer=False, distributed={"mode": "off"}
    )
    pipe = RoundPipe(mlp(seed=0), adamw(), config)
    load_checkpoint(pipe, run["out"] / "checkpoint")
    data = global_data(STEPS + 1)
    weights = train_steps(pipe, data[STEPS:], nn.functional.mse_loss)[-1]
    pipe.close()
    assert_weights_equal(weights, sync_reference(mlp(seed=0), adamw(), data, nn.functional.mse_loss)[1][-1])


def test_diverged_weights_are_named(run: dict[str, Any]) -> None:
    for rank in range(2):
        message = (run["out"] / f"diverge{rank}.txt").read_text()
        assert "diverged after step 1" in message and "ranks [1] differ from rank 0" in message


def test_a_failed_process_stops_the_other(run: dict[str, Any]) -> None:
    log0, log1 = run["logs"]
    assert run["codes"][1] != 0 and "rank 1 fails on purpose" in log1
    assert run["codes"][0] != 0, log0
    assert "DistributedError: rank 0" in log0 and "Another process probably stopped" in log0, log0
    started = float((run["out"] / "failing0.txt").read_text())
    ended = float((run["out"] / "ended0.txt").read_text())
    assert ended - started < TIMEOUT_S + 20, "rank 0 took too long to stop"


@pytest.mark.parametrize("async_optimizer", [False, True])
def test_ordered_steps_run_deepest_first_and_change_no_number(
    monkeypatch: pytest.MonkeyPatch, one_torch_thread: None, async_optimizer: bool
) -> None:
    """The order every process needs for its collectives, in one process on two workers: the
    steps of each optimizer step run one after another, deepest unit first, and the weights are
    the reference's."""
    import roundpipe.pipe

    def ordered(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(schedule_options(*args, **kwargs), ordered_steps=True)

    monkeypatch.setattr(roundpipe.pipe, "schedule_options", ordered)
    config = RunConfig(devices="cpu:2", num_microbatches=4, async_optimizer=async_optimizer)
    pipe = RoundPipe(mlp(seed=0), adamw(), config)
    weights = train_steps(pipe, global_data(), nn.functional.mse_loss)[-1]
    trace = pipe.trace()
    pipe.close()
    reference = async_reference if async_optimizer else sync_reference
    assert_weights_equal(
        weights, reference(mlp(seed=0), adamw(), global_data(), nn.functional.mse_loss)[1][-1]
    )
    steps = sorted((t for t in trace.records if t.kind == STEP), key=lambda t: t.start_t)
    order = [(t.step, t.layers.start) for t in steps]
    assert order == sorted(order, key=lambda s: (s[0], -s[1])), order
    trace.check_rules()
