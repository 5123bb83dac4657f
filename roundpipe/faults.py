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


def arm(spec: str | None) -> None:
    """Arm the faults of ``spec`` (the ``ROUNDPIPE_FAULTS`` syntax) in this process, replacing
    any left; None reads the variable again at the next point. For tests and the soak's runs."""
    global _armed
    _armed = None if spec is None else _parse(spec)


def fault_point(point: str, number: int | None = None) -> None:
    """Send this process the first armed signal whose point is ``point`` (``point:number``)."""
    global _armed
    if _armed is None:
        text = os.environ.get(ENV, "")
        _armed = _parse(text) if text else []
    if not _armed:
        return
    name = point if number is None else f"{point}:{number}"
    due = [sig for sig, where in _armed if where == name]
    _armed = [(sig, where) for sig, where in _armed if where != name]
    for sig in due:  # one at a time: Python runs the handler between two iterations
        os.kill(os.getpid(), sig)


__all__ = ["ENV", "arm", "fault_point"]
