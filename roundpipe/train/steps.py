"""The step loop of `roundpipe.train.trainer`: submit each step, read its loss late, evaluate and
save at step boundaries, stop together under torchrun, and settle after an interrupt.

Why a module of its own: the trainer sets a run up and writes what it produced; this is the part
that runs once per step, whose ordering (which loss is read when, what a stop or a non-finite
loss cuts short) is what makes a resumed run exact. It must never print (everything goes through
the `Progress` it is handed), never swallow an error, and never leave a step half applied.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from roundpipe.errors import RoundPipeError
from roundpipe.faults import fault_point
from roundpipe.pipe import PendingLoss, RoundPipe
from roundpipe.train.config import TrainConfig
from roundpipe.train.progress import Progress
from roundpipe.train.ranks import Ranks
from roundpipe.train.signals import StopRequest


def steps_agreed(progress: Progress, batches: Iterator[dict[str, torch.Tensor]], stop: StopRequest) -> bool:
    """`_steps`, then every process's work finished; a failure under torchrun names this rank,
    the step and the ranks that are behind."""
    try:
        interrupted = _steps(progress, batches, stop)
        progress.pipe.synchronize()
    except (RoundPipeError, RuntimeError) as exc:
        failure = progress.ranks.failed(exc, progress.step + 1)
        if failure is exc:
            raise
        raise failure from exc
    return interrupted


def _steps(progress: Progress, batches: Iterator[dict[str, torch.Tensor]], stop: StopRequest) -> bool:
    """Train until ``config.steps``, a stop request or a non-finite loss; True when a
    KeyboardInterrupt cut it short. Under torchrun each process trains on its share of every
    global batch, and they all stop after the same step (`Ranks.agree`).

    Each step's loss is read ``config.loss_lag`` steps after it was submitted
    (``forward_backward(..., wait=False)``), so the devices compute step s while this loop hands
    them step s + 1. Where the loop needs the state of step s itself (an evaluation, a checkpoint,
    the last step) it reads step s's loss before submitting another. A non-finite loss comes to
    light one step late, and that next step was applied (the last good checkpoint is still the
    one saved before). A stop request (a signal) stops after the last step submitted when it came,
    as without the lag: no step is submitted once it is set. Under torchrun the lag is 0."""
    pipe, config, ranks = progress.pipe, progress.config, progress.ranks
    waiting: list[tuple[int, PendingLoss]] = []  # submitted steps whose loss is not read yet
    poisoned: set[int] = set()  # tests: steps whose loss this process turns NaN (`fault_point`)
    lag = loss_lag(config, ranks)

    try:
        while True:
            if (
                progress.step < config.steps
                and not ranks.stopping(stop)
                and not progress.non_finite
                and not (waiting and _at_boundary(config, waiting[-1][0]))
            ):
                step = progress.step + 1
                ranks.reached(step, "forward_backward")
                waiting.append(
                    (step, pipe.forward_backward(ranks.share(next(batches)), None, None, wait=False))
                )
                if fault_point("step", step):  # tests: this process's loss turns NaN
                    poisoned.add(step)
                ranks.reached(step, "step")
                pipe.step()
                progress.step = step
                if len(waiting) <= lag and not _at_boundary(config, step):
                    continue  # read its loss after the next step is submitted
            if not waiting:
                break
            step, pending = waiting.pop(0)
            loss = _read_loss(progress, step, pending, stop, step in poisoned)
            if progress.non_finite:
                continue  # the steps already submitted are still read and logged, then it stops
            if not progress.check_finite(loss, step):
                continue
            if _evaluates(config, step):
                progress.evaluate()
            if _saves(config, step):
                progress.save()  # None (and the run stopped) when the weights are not finite
    except KeyboardInterrupt:
        _interrupted(progress, waiting)
        return True
    return False


def _interrupted(progress: Progress, waiting: list[tuple[int, PendingLoss]]) -> None:
    """After a KeyboardInterrupt raised outside our handler (another thread's signal set-up, or
    code of the caller's): bring the pipe to a step boundary so the checkpoint is still exact,
    and log the losses of the steps that ran (or were settled) but were not logged."""
    settled = _settle(progress.pipe, progress.step)
    for step, pending in waiting:
        if step <= settled and pending.done():
            try:
                progress.log(step, pending.result())
            except RoundPipeError:  # dropped by a failure: nothing to log
                pass
    progress.step = settled


def loss_lag(config: TrainConfig, ranks: Ranks) -> int:
    """How late the loop reads each loss. Under torchrun the processes agree after every step
    whether to go on (`Ranks.agree`), and a stop must come after the step it was asked in: each
    loss is read before the next step is submitted."""
    return config.loss_lag if ranks.world == 1 else 0


def _read_loss(
    progress: Progress, step: int, pending: PendingLoss, stop: StopRequest, poisoned: bool
) -> float:
    """Step ``step``'s loss (the global one under torchrun; NaN where ``poisoned``), logged."""
    loss = float("nan") if poisoned else pending.result()
    loss = progress.ranks.agree(step, loss, stop, progress.reporter)
    progress.log(step, loss)
    return loss


def _settle(pipe: RoundPipe, step: int) -> int:
    """After a KeyboardInterrupt anywhere in a step: let in-flight work finish and, if the step's
    forward_backward already ran, apply its optimizer step. Returns the steps completed."""
    pipe.synchronize()
    # One forward_backward per step here: the iteration count tells whether step `step`'s ran.
    iterations = pipe.iteration_count
    if pipe.step_count == step and iterations == step + 1:
        pipe.step()
        pipe.synchronize()
    return pipe.step_count


def _evaluates(config: TrainConfig, step: int) -> bool:
    return bool(config.eval_every and step % config.eval_every == 0)


def _saves(config: TrainConfig, step: int) -> bool:
    """The last step's checkpoint is saved after the loop, not here."""
    return bool(config.save_every and step % config.save_every == 0 and step < config.steps)


def _at_boundary(config: TrainConfig, step: int) -> bool:
    """Whether the loop needs this step's own state after it (so reads its loss at once)."""
    return step == config.steps or _evaluates(config, step) or _saves(config, step)
