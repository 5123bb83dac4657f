"""How a training run stops when asked: Ctrl-C (SIGINT) and a scheduler's SIGTERM.

Why this way: a cluster scheduler that wants its node back sends SIGTERM and, after a grace
period, SIGKILL; a person presses Ctrl-C, often twice. Either must end in the same place: the
current step finishes, the metrics line of every finished step is on disk, a checkpoint is saved
at the step boundary, and the process exits 128 + the signal's number (130 for SIGINT, 143 for
SIGTERM). So a signal only records the request; the loop checks it between steps. A second
signal must not tear that down halfway (an exception raised at an arbitrary point could cut a
metrics line or leave the engine's tasks pending), so it is acknowledged and otherwise ignored:
the step and the save take seconds, and SIGKILL remains for stopping without saving.

This must never install handlers off the main thread (Python forbids it; a run started from
another thread then stops only on its own) and must restore the previous handlers on exit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from roundpipe.train.result import Reporter

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """The first stop signal received (None until one arrives); safe to read from any thread."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal: signal.Signals | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, sig: signal.Signals) -> None:
        if not self._event.is_set():
            self.signal = sig
            self._event.set()


def _describe(sig: signal.Signals) -> str:
    return "Ctrl-C" if sig == signal.SIGINT else sig.name


@contextmanager
def stop_on_signals(stop: StopRequest, reporter: Reporter) -> Iterator[None]:
    """While inside: SIGINT and SIGTERM ask the run to stop after the current step and save."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        sig = signal.Signals(signum)
        if stop.is_set():
            reporter.note(
                f"{_describe(sig)} again: already stopping; finishing the step and saving the checkpoint "
                "(SIGKILL stops without saving)"
            )
            return
        stop.set(sig)
        reporter.note(f"{_describe(sig)}: stopping after this step and saving a checkpoint")

    previous = {sig: signal.signal(sig, handler) for sig in HANDLED}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


__all__ = ["StopRequest", "stop_on_signals"]
