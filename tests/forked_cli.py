"""`roundpipe` command processes forked from one interpreter that has already imported what
``roundpipe train`` of a tiny Qwen3 model loads (torch, transformers' Qwen3, the training loop).

Why: the multi-process tests start several ``roundpipe train`` processes at once, and each fresh
interpreter spends seconds importing the same modules on a machine of two cores. A
``multiprocessing`` fork server imports this module once; every process forked from it starts with
those imports done and runs `roundpipe.cli.main` with its own environment (torchrun's variables,
``ROUNDPIPE_FAULTS``) and its own log file, then exits as ``python -m roundpipe.cli`` would: exit
handlers run and the garbage collector sees what the run left (where "Task was destroyed but it is
pending!" would show). What only a fresh interpreter shows (an interrupt while modules load, the
real ``__main__`` entry) is tested with real processes elsewhere (tests/test_reliability.py, the
torchrun test).

This module must never do anything at import but import: no thread, no torch operation, nothing a
fork would copy half-done into every process.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import sys
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import transformers.models.qwen3.modeling_qwen3  # noqa: F401  (the tiny model's class)

import roundpipe.cli
import roundpipe.cli.train_command
import roundpipe.train.report
import roundpipe.train.trainer
from roundpipe.data.tokenizer import load_tokenizer  # noqa: F401

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload([__name__])


def _run(argv: list[str], env: dict[str, str], log: str) -> None:
    """The forked process: ``roundpipe ARGV`` with ``env`` as its whole environment, stdout and
    stderr to ``log``; exits with the command's status."""
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # read at start in a fresh process
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        code = roundpipe.cli.main(argv)
    finally:
        gc.collect()  # as at interpreter exit: finalizers of what the run left behind
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        Path(f"{log}.ended").write_text(repr(time.time()))
    sys.exit(code)


class CliProcess:
    """One forked ``roundpipe`` process, waited for like a `subprocess.Popen`."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.process: BaseProcess = _CONTEXT.Process(target=_run, args=(list(argv), dict(env), str(log)))
        self.process.start()

    def finish(self, timeout: float) -> tuple[int, str, float] | None:
        """Exit status, output and the time it ended (its command returned, or now for a process
        killed); None if it is still running after ``timeout`` seconds."""
        self.process.join(timeout)
        code = self.process.exitcode
        if code is None:
            return None
        ended = Path(f"{self.log}.ended")
        return (
            code,
            self.log.read_text(errors="replace"),
            float(ended.read_text()) if ended.exists() else time.time(),
        )

    def kill(self) -> None:
        """SIGKILL, if it still runs."""
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


def start(argv: list[str], env: dict[str, str], log: Path) -> CliProcess:
    """``roundpipe ARGV`` in a process forked from the preloaded server, with environment ``env``."""
    return CliProcess(argv, env, log)
