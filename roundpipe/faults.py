"""Fault injection at named points, for the reliability tests and the soak (bench/soak.py).

Why in the package: a test of "SIGTERM during step 3 saves and exits 143" or "SIGKILL while the
checkpoint of step 5 is half written leaves the previous one intact" must hit the same point every
time. Sleeping and then signalling from outside hits a different point on every machine; a
process that signals itself at a named point does not. The points are a handful of calls in the
training loop and the checkpoint writer, each costing one dictionary lookup when nothing is armed.

``ROUNDPIPE_FAULTS`` arms them: a comma-separated list of ``SIGNAL@POINT`` or
``SIGNAL@POINT:N`` entries (``SIGINT@step:3,SIGINT@step:3``, ``SIGKILL@save:5``,
``SIGINT@import``). Each entry fires once, in the order given, when the point is reached (with
that number). Points: ``import`` (the training loop module is being imported), ``step:N`` (step
N's forward and backward have run, its optimizer step not yet requested), ``save:N`` (the
checkpoint of step N has its weights written but not its manifest). This module must never act
when the variable is unset, and never import anything heavy.
"""

from __future__ import annotations

import os
import signal

ENV = "ROUNDPIPE_FAULTS"

_armed: list[tuple[signal.Signals, str]] | None = None


def _parse(text: str) -> list[tuple[signal.Signals, str]]:
    entries = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, point = item.partition("@")
        try:
            sig = signal.Signals[name.upper()]
        except KeyError:
            raise ValueError(
                f"{ENV}: {item!r}: unknown signal {name!r} (e.g. SIGINT, SIGTERM, SIGKILL)"
            ) from None
        if not sep or not point:
            raise ValueError(f"{ENV}: {item!r}: expected SIGNAL@POINT or SIGNAL@POINT:N")
        entries.append((sig, point))
    return entries


def fault_point(point: str, number: int | None = None) -> None:
    """Send this process the first armed signal whose point is ``point`` (``point:number``)."""
    global _armed
    if _armed is None:
        text = os.environ.get(ENV, "")
        _armed = _parse(text) if text else []
    if not _armed:
        return
    name = point if number is None else f"{point}:{number}"
    for index, (sig, where) in enumerate(_armed):
        if where == name:
            del _armed[index]
            os.kill(os.getpid(), sig)
            return


__all__ = ["ENV", "fault_point"]
