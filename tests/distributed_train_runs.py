"""The multi-process `roundpipe train` runs that tests/test_distributed_train.py checks, started
before the first test of the run (tests/conftest.py) and collected by that module's fixture.

Why started early: they are seconds of processes that wait on nothing the suite does, and the
suite runs its tests one after another on one core; started first, they run on the core it leaves
idle. Each run's outputs serve several tests. Everything a run is judged by is in its files (run
directory, per-rank log, the time its command returned), so when it was started changes nothing a
test checks. A run never started (its tests deselected) costs nothing; one never collected (the
run stopped early) is killed when the test run ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from roundpipe import faults
from roundpipe.cli import main
from tests import forked_cli
from tests.helpers import train_args
from tests.test_distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
HANG_TIMEOUT_S = 5
BACKGROUND_NICENESS = 10  # added to the suite's own
ELASTIC_TEST = "test_torchrun_restarts_a_killed_rank_from_the_last_checkpoint"


def launch(argv: list[str], env_faults: str, logs: Path, world: int = 2) -> list[forked_cli.CliProcess]:
    """``roundpipe ARGV`` as ``world`` processes with the variables torchrun sets, each forked
    from the preloaded server (tests/forked_cli.py) and logging to ``logs``.rank{R}.log."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", faults.ENV: env_faults})
    return [
        forked_cli.start(argv, dict(env, RANK=str(rank)), logs.with_name(f"{logs.name}.rank{rank}.log"))
        for rank in range(world)
    ]


def finish(proc: forked_cli.CliProcess, timeout: float = 120) -> tuple[int, str, float]:
    """Exit code, output and the time it ended."""
    done = proc.finish(timeout)
    if done is None:
        proc.kill()
        pytest.fail(f"{proc.log} did not end within {timeout} s: {proc.log.read_text()}")
    return done


def start_elastic(model_config: Path, out: Path) -> subprocess.Popen[str] | None:
    """``torchrun --max-restarts 1`` of 4 steps whose rank 1 is killed in step 3 of the first
    attempt: a real torchrun, whose agent starts each process as ``python -m roundpipe.cli``.
    Its stdout and stderr go to files (a pipe nobody reads yet would fill and stop it)."""
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        return None
    argv = train_args(model_config, out, "elastic", 4, "--sync", "--save-every", "2", "--json")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env[faults.ENV] = "SIGKILL@step:3@rank:1"  # in the first attempt only
    command = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "-m",
        "roundpipe.cli",
    ]
    with open(out / "elastic.stdout", "w") as stdout, open(out / "elastic.stderr", "w") as stderr:
        return subprocess.Popen([*command, *argv], env=env, stdout=stdout, stderr=stderr, text=True)


@dataclass
class Started:
    """The processes of one set of runs, writing under ``out``, started by ``launcher``: a thread,
    since the first fork waits seconds for the fork server's imports, which the suite need not
    wait for."""

    out: Path
    launcher: threading.Thread
    elastic: subprocess.Popen[str] | None = None
    launched: dict[str, list[forked_cli.CliProcess]] = field(default_factory=dict)
    collected: dict[str, Any] = field(default_factory=dict)

    def processes(self) -> dict[str, list[forked_cli.CliProcess]]:
        """The forked runs' processes by run name, once all are started."""
        self.launcher.join()
        if len(self.launched) != 4:
            pytest.fail("starting the forked runs failed (the traceback is in the captured output above)")
        return self.launched


def lower_this_threads_priority() -> None:
    """Below the suite's (Linux: niceness is per thread, and a process started from this thread
    inherits it): the runs take the core the suite leaves idle, never the suite's own."""
    if sys.platform == "linux":
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + BACKGROUND_NICENESS)


def start_runs(model_config: Path, out: Path, elastic: bool) -> Started:
    """Two processes stopped by a SIGTERM on rank 1 at step 3; two whose rank 1 hangs in step 2;
    two whose rank 1 has a NaN loss at step 3; two training asynchronously from the first step;
    and, if ``elastic``, the torchrun job."""

    def launch_all() -> None:
        lower_this_threads_priority()
        started.elastic = start_elastic(model_config, out) if elastic else None  # the longest: first
        two_argv = train_args(model_config, out, "two", 5, "--sync", "--json")
        started.launched["two"] = launch(two_argv, "SIGTERM@step:3@rank:1", out / "two")
        hang_argv = train_args(model_config, out, "hang", 4, "--sync", "--dist-timeout", str(HANG_TIMEOUT_S))
        started.launched["hang"] = launch(hang_argv, "HANG@step:2@rank:1", out / "hang")
        nan_argv = train_args(model_config, out, "nan", 4, "--sync", "--save-every", "1")
        started.launched["nan"] = launch(nan_argv, "NAN@step:3@rank:1", out / "nan")
        started.launched["two-async"] = launch(
            async_args(model_config, out, "two-async"), "", out / "two-async"
        )

    started = Started(out, threading.Thread(target=launch_all, name="start the runs", daemon=True))
    started.launcher.start()
    return started


def async_args(model_config: Path, out: Path, name: str) -> list[str]:
    """4 asynchronous steps from the first (no synchronous warm-up, which would cover them all),
    with the default weight prediction and lr ramp."""
    return train_args(model_config, out, name, 4, "--async", "--async-warmup-steps", "0", "--json")


def collect(started: Started, model_config: Path) -> dict[str, Any]:
    """The reference runs (one process on the whole batch: 5 sync steps with a checkpoint at
    each, and the asynchronous run) in this process, then every started run's outcome: exit
    codes, logs, end times."""
    if started.collected:
        return started.collected
    out = started.out
    done: dict[str, Any] = {"out": out, "elastic": None}
    one = train_args(model_config, out, "one", 5, "--sync", "--save-every", "1", "--keep-checkpoints", "5")
    done["one"] = main(one)
    done["one-async"] = main(async_args(model_config, out, "one-async"))
    runs = started.processes()
    done["hang0"] = finish(runs["hang"][0])
    runs["hang"][1].kill()  # it sleeps until killed, as a hung process does
    done["hang1"] = finish(runs["hang"][1])
    done["two"] = [finish(proc) for proc in runs["two"]]
    done["nan"] = [finish(proc) for proc in runs["nan"]]
    done["two-async"] = [finish(proc) for proc in runs["two-async"]]
    if started.elastic is not None:
        try:
            started.elastic.wait(timeout=240)
        except subprocess.TimeoutExpired:
            started.elastic.terminate()
            pytest.fail(f"torchrun did not end within 240 s: {(out / 'elastic.stderr').read_text()}")
        output = ((out / "elastic.stdout").read_text(), (out / "elastic.stderr").read_text())
        done["elastic"] = (started.elastic.returncode, *output)
    started.collected = done
    return done


def stop(started: Started) -> None:
    """Whatever still runs (the test run ended before the runs were collected)."""
    started.launcher.join()
    for procs in started.launched.values():
        for proc in procs:
            proc.kill()
    if started.elastic is not None and started.elastic.poll() is None:
        started.elastic.terminate()  # torchrun's agent stops its processes on SIGTERM
        try:
            started.elastic.wait(timeout=30)
        except subprocess.TimeoutExpired:
            started.elastic.kill()
