"""Fault injection at named points, for the reliability tests and the soak (bench/soak.py).

Why in the package: a test of "SIGTERM during step 3 saves and exits 143" or "SIGKILL while the
checkpoint of step 5 is half written leaves the previous one intact" must hit the same point every
time. Sleeping and then signalling from outside hits a different point on every machine; a
process that signals itself at a named point does not. The points are a handful of calls in the
training loop and the checkpoint writer, each costing one dictionary lookup when nothing is armed.

``ROUNDPIPE_FAULTS`` arms them: a comma-separated list of ``SIGNAL@POINT`` or
``SIGNAL@POINT:N`` entries (``SIGINT@step:3,SIGINT@step:3``, ``SIGKILL@save:5``,
``SIGINT@startup``). Each entry fires once, when its point is first reached (entries of one
point in the order given). Points: ``startup`` (``roundpipe train`` has parsed its options and
is about to load torch and the training code), ``step:N`` (step
N's forward and backward have run, its optimizer step not yet requested), ``save:N`` (the
checkpoint of step N has its weights written but not its manifest).

Under torchrun every process reads the same variable, so an entry can name one process:
``SIGKILL@step:3@rank:1`` fires in rank 1 only. ``HANG`` in place of a signal makes the process
sleep there (a peer that stopped answering, for the tests of `roundpipe train` under torchrun)
until a signal handler raises or the process is killed, and ``NAN`` makes `fault_point` return
True, which the training loop takes as a NaN loss at ``step:N``. Entries fire in the first attempt of a
torchrun job only (``TORCHELASTIC_RESTART_COUNT`` unset or 0): a process killed once and
restarted by ``torchrun --max-restarts`` is not killed again at the same point. This module must
never act when the variable is unset, and never import anything heavy.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "ROUNDPIPE_FAULTS"
HANG = "HANG"  # not a signal: sleep at the point, as a process that stopped answering
NAN = "NAN"  # not a signal: fault_point returns True (the loop's loss of that step becomes NaN)
_HANG_SLICE_S = 3600.0

_armed: list[tuple[signal.Signals | str, str]] | None = None


def _this_process(where: str, item: str) -> bool:
    """Whether an entry's ``@rank:R`` suffix (if any) names this process's ``RANK``."""
    rank = where.partition("@rank:")[2]
    if not rank:
        return True
    if not rank.isdigit():
        raise ValueError(f"{ENV}: {item!r}: expected @rank:R with R a number")
    return int(os.environ.get("RANK", "0")) == int(rank)


def _parse(text: str) -> list[tuple[signal.Signals | str, str]]:
    entries: list[tuple[signal.Signals | str, str]] = []
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, where = item.partition("@")
        action: signal.Signals | str
        try:
            action = name.upper() if name.upper() in (HANG, NAN) else signal.Signals[name.upper()]
        except KeyError:
            raise ValueError(
                f"{ENV}: {item!r}: unknown signal {name!r} (e.g. SIGINT, SIGTERM, SIGKILL, HANG or NAN)"
            ) from None
        point = where.partition("@rank:")[0]
        if not sep or not point:
            raise ValueError(
                f"{ENV}: {item!r}: expected SIGNAL@POINT, SIGNAL@POINT:N or SIGNAL@POINT:N@rank:R"
            )
        if _this_process(where, item) and first_attempt:
            entries.append((action, point))
    return entries


def arm(spec: str | None) -> None:
    """Arm the faults of ``spec`` (the ``ROUNDPIPE_FAULTS`` syntax) in this process, replacing
    any left; None reads the variable again at the next point. For tests and the soak's runs."""
    global _armed
    _armed = None if spec is None else _parse(spec)


def fault_point(point: str, number: int | None = None) -> bool:
    """Send this process the armed signals whose point is ``point`` (``point:number``), or hang
    there; True when a ``NAN`` entry is due there."""
    global _armed
    if _armed is None:
        text = os.environ.get(ENV, "")
        _armed = _parse(text) if text else []
    if not _armed:
        return False
    name = point if number is None else f"{point}:{number}"
    due = [sig for sig, where in _armed if where == name]
    _armed = [(sig, where) for sig, where in _armed if where != name]
    for sig in due:  # one at a time: Python runs the handler between two iterations
        if isinstance(sig, signal.Signals):
            os.kill(os.getpid(), sig)
        while sig == HANG:  # until killed (a handler that raises also ends it)
            time.sleep(_HANG_SLICE_S)
    return NAN in due


__all__ = ["ENV", "HANG", "NAN", "arm", "fault_point"]
