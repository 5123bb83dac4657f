"""The processes of one `roundpipe train` run under torchrun: who writes, what each trains on, and
how they agree to stop.

Why a module of its own: the loop should read the same with one process or several. `Ranks` is
what the loop asks (its share of a batch, the global loss of a step, whether to stop, a barrier),
and for one process every answer is trivial. Under torchrun (``WORLD_SIZE`` > 1) `ProcessRanks`
answers through a gloo group of its own:

- **Data**: the batch of step ``s`` is the *global* batch (``--batch-size`` rows, a function of
  the options and ``s``); rank ``r`` of ``n`` trains on rows ``r*b/n .. (r+1)*b/n``. The data
  position is the step, so a checkpoint resumes at the same place with any number of processes.
- **One writer**: rank 0 alone decides the run directory and writes metrics.jsonl, TensorBoard
  events, the trace files and checkpoints; the others wait at a barrier after each save. Every
  rank loads the same checkpoint on ``--resume`` (the file system must be shared).
- **Agreement**: once per step the processes all-reduce their loss and any stop signal, so a
  SIGINT/SIGTERM on one process, or a non-finite loss on one share, stops every process after the
  same step, and the checkpoint rank 0 then writes is the state of all of them.
- **Naming the culprit**: each process records in torchrun's store how far it got (step and
  phase); when a collective fails or times out, the error names the ranks that are behind.

This module must never decide what is trained (the loop does), and must issue its collectives
only from the loop's thread, in the loop's order, the same on every process.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from roundpipe.errors import ConfigError
from roundpipe.optim.distributed import DistributedError, torchrun_environment
from roundpipe.train.config import TrainConfig, option_name
from roundpipe.train.result import Reporter
from roundpipe.train.signals import StopRequest

SETUP_TIMEOUT_S = 600.0  # start-up (a large model loads slowly), saves, exports: at least this long
PHASES = ("forward_backward", "step", "agreement", "save", "end")


def world_size() -> int:
    """Processes of this job: torchrun's ``WORLD_SIZE``, else the size of a default group the
    caller initialised, else 1."""
    if torchrun_environment():
        return int(os.environ["WORLD_SIZE"])
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_shares(config: TrainConfig, world: int) -> None:
    """Every process must get the same whole number of rows, enough for its microbatches."""
    if world < 2:
        return
    if config.batch_size % world:
        raise ConfigError(
            f"--batch-size {config.batch_size} is the global batch and must split evenly over the {world} "
            f"processes (WORLD_SIZE={world}); use a multiple of {world}"
        )
    share = config.batch_size // world
    if share < config.microbatches:
        raise ConfigError(
            f"each of the {world} processes trains on {share} of the --batch-size {config.batch_size} rows, "
            f"too few for --microbatches {config.microbatches} (each process's own); lower --microbatches "
            f"to {share} or raise --batch-size to {config.microbatches * world}"
        )


def init_group(timeout_s: float) -> None:
    """The default gloo group from torchrun's variables, as ``init_method="env://"`` makes it, but
    with its keys under a prefix of this attempt: after ``torchrun --max-restarts`` restarts the
    processes, the store still holds the dead processes' addresses under the same keys, and gloo
    would try to connect to them."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    prefixed = dist.PrefixStore(f"roundpipe/attempt{attempt}/", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world, timeout=timeout)


class Ranks:
    """One process: it writes, trains on the whole batch, and agrees with itself."""

    rank = 0
    world = 1

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def share(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return batch

    def reached(self, step: int, phase: str) -> None:
        """This process reached ``phase`` of step ``step`` (1-based)."""

    def agree(self, step: int, loss: float, stop: StopRequest, reporter: Reporter) -> float:
        """The global loss of ``step``; sets ``stop`` when any process was asked to stop."""
        return loss

    def stopping(self, stop: StopRequest) -> bool:
        """Whether to start no further step (agreed by every process)."""
        return stop.is_set()

    def from_writer(self, value: Any) -> Any:
        """Rank 0's ``value``, on every process."""
        return value

    def check_setup(self, error: BaseException | None, config: TrainConfig) -> None:
        """Raise ``error`` (or another process's) on every process, so none goes on alone."""
        if error is not None:
            raise error

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the processes."""
        return values

    def barrier(self) -> None:
        pass

    def failed(self, exc: BaseException, step: int, what: str = "") -> BaseException:
        """The error to raise for ``exc``, raised in step ``step`` (while doing ``what``)."""
        return exc

    def close(self) -> None:
        pass


class ProcessRanks(Ranks):
    """One of several processes started by torchrun; see the module's docstring."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.timeout_s = timeout_s
        self.owns_default = not dist.is_initialized()
        if self.owns_default:
            init_group(max(timeout_s, SETUP_TIMEOUT_S))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Steps are timed by --dist-timeout; start-up, saves and exports (whose length grows with
        # the model) by a group that waits at least `SETUP_TIMEOUT_S`.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.slow_group = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=max(timeout_s, SETUP_TIMEOUT_S))
        )
        self.agreed_stop = False
        self.where = (0, 0)  # (step, phase index) this process last reached
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self.store: Any = _get_default_store()
        except (ImportError, RuntimeError):  # diagnosis only: errors then name no culprit
            self.store = None

    def share(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = next(iter(batch.values())).shape[0] // self.world
        part = slice(self.rank * rows, (self.rank + 1) * rows)
        return {key: value[part] for key, value in batch.items()}

    def reached(self, step: int, phase: str) -> None:
        self.where = (step, PHASES.index(phase))
        if self.store is not None:
            try:
                self.store.set(f"roundpipe/train/where/{self.rank}", f"{step},{self.where[1]}")
            except RuntimeError:
                self.store = None

    def _call(self, op: Any, *args: Any, what: str, slow: bool = False) -> Any:
        try:
            return op(*args, group=self.slow_group if slow else self.group)
        except RuntimeError as exc:
            raise self.failed(exc, self.where[0], what) from exc

    def agree(self, step: int, loss: float, stop: StopRequest, reporter: Reporter) -> float:
        self.reached(step, "agreement")
        table = torch.zeros(self.world, 2, dtype=torch.float64)
        table[self.rank, 0] = loss
        table[self.rank, 1] = int(stop.signal) if stop.signal is not None else 0
        self._call(self.dist.all_reduce, table, what=f"agreeing on the loss after step {step}")
        signals = [(r, int(s)) for r, s in enumerate(table[:, 1].tolist()) if s]
        if signals:
            self.agreed_stop = True
            if not stop.is_set():
                rank, number = signals[0]
                stop.set(signal.Signals(number))
                reporter.note(
                    f"rank {rank} received {signal.Signals(number).name}: every process stops after step "
                    f"{step} and rank 0 saves the checkpoint"
                )
        return float(table[:, 0].mean())

    def stopping(self, stop: StopRequest) -> bool:
        return self.agreed_stop

    def from_writer(self, value: Any) -> Any:
        box = [value if self.writer else None]
        self._call(
            self.dist.broadcast_object_list, box, 0, what="receiving rank 0's run directory", slow=True
        )
        return box[0]

    def check_setup(self, error: BaseException | None, config: TrainConfig) -> None:
        mine = (str(error) if error is not None else None, config.model_dump_json(exclude={"resume"}))
        gathered: list[Any] = [None] * self.world
        self._call(
            self.dist.all_gather_object,
            gathered,
            mine,
            what="checking the options of every process",
            slow=True,
        )
        if error is not None:
            raise error
        for rank, (message, options) in enumerate(gathered):
            if message is not None:
                raise ConfigError(f"rank {rank} could not start: {message}")
            if options != gathered[0][1]:
                theirs, first = json.loads(options), json.loads(gathered[0][1])
                differ = ", ".join(
                    f"{option_name(key)} {theirs.get(key)!r} (rank 0: {first.get(key)!r})"
                    for key in sorted(set(theirs) | set(first))
                    if theirs.get(key) != first.get(key)
                )
                raise ConfigError(
                    f"rank {rank} was started with other options than rank 0: {differ}; every process of "
                    "`torchrun ... roundpipe train` must get the same options"
                )

    def sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        self._call(self.dist.all_reduce, tensor, what="summing the evaluation")
        return [float(v) for v in tensor.tolist()]

    def barrier(self) -> None:
        self._call(self.dist.barrier, what="waiting for the other processes", slow=True)

    def failed(self, exc: BaseException, step: int, what: str = "") -> BaseException:
        if isinstance(exc, DistributedError) and str(exc).startswith(f"rank {self.rank}: step"):
            return exc  # already said
        if not isinstance(exc, RuntimeError):
            return exc
        during = f" while {what}" if what else ""
        return DistributedError(
            f"rank {self.rank}: step {step} failed{during}: {exc}{self._behind()}. Every process stops; "
            "restart them all from the last checkpoint (torchrun --max-restarts does it; docs/distributed.md), "
            "or raise --dist-timeout if a process is only slow"
        )

    def _behind(self) -> str:
        """Which ranks are behind this one (hung or dead), from what they recorded in the store."""
        if self.store is None:
            return ""
        late = []
        for rank in range(self.world):
            key = f"roundpipe/train/where/{rank}"
            try:
                if rank == self.rank or not self.store.check([key]):
                    continue
                step, phase = (int(v) for v in self.store.get(key).decode().split(","))
            except (RuntimeError, ValueError):
                continue
            if (step, phase) < self.where:
                late.append(f"rank {rank} is behind, last seen in step {step} ({PHASES[phase]})")
        return ("; " + "; ".join(late) + ": it hangs or died (see its log)") if late else ""

    def close(self) -> None:
        self.dist.destroy_process_group(self.group)
        self.dist.destroy_process_group(self.slow_group)
        if self.owns_default:
            self.dist.destroy_process_group()


def make_ranks(config: TrainConfig) -> Ranks:
    """`ProcessRanks` under torchrun with several processes, else the single process's `Ranks`."""
    world = world_size()
    check_shares(config, world)
    return ProcessRanks(config.dist_timeout) if world > 1 else Ranks()


class RankNotes:
    """What a process other than rank 0 reports: its notes only, prefixed with its rank (rank 0
    draws the progress and the summary for all of them)."""

    def __init__(self, reporter: Reporter, rank: int) -> None:
        self.reporter = reporter
        self.rank = rank

    def start(self, config: TrainConfig, out_dir: Path, start_step: int, model_info: dict[str, Any]) -> None:
        pass

    def step(self, record: dict[str, Any]) -> None:
        pass

    def evaluation(self, record: dict[str, Any]) -> None:
        pass

    def note(self, message: str) -> None:
        self.reporter.note(f"rank {self.rank}: {message}")

    def finish(self, result: Any) -> None:
        pass


__all__ = [
    "ProcessRanks",
    "RankNotes",
    "Ranks",
    "check_shares",
    "make_ranks",
    "world_size",
]
