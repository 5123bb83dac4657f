"""What torch.compile compiled, and when: each frame dynamo starts tracing and each recompile's
first guard failure, with the second it happened.

Why: a benchmark's measured steps must not pay for compiling, and `gpu_throughput.py` reports
``compile_s_measured`` (torch.compile's own timers), which says how long but not what. On an H100 a
GPT-OSS-20B run (`gpu_big.sh D2`) compiled 4.6 s inside its measured steps with its plan settled
(its first forward stage's compute took 5.3 s there); no CPU run of the same shapes compiled after
its first iteration. The events name the frame and the guard that failed, so a run's line says which.

It reads the loggers torch writes to anyway: ``torch._dynamo.symbolic_convert`` (``torchdynamo start
tracing <frame> <file>:<line>``, at INFO) and dynamo's ``recompiles`` artifact, which it switches
on (`torch._logging.set_logs`: the reasons then also reach stderr, where `gpu_big.sh` keeps them in
the run's log). Both log from whichever thread compiles (roundpipe's lanes, autograd's threads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

TRACING_LOGGER = "torch._dynamo.symbolic_convert"
RECOMPILES_LOGGER = "torch._dynamo.guards.__recompiles"
MAX_EVENTS = 200  # a run compiles some tens of frames; of a runaway recompile loop the latest are kept
MAX_CHARS = 240


class CompileEvents(logging.Handler):
    """The events recorded so far, each ``(perf_counter seconds, text)``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        # The latest events: a measured window comes after the warm-up's compiles.
        self.events: deque[tuple[float, str]] = deque(maxlen=MAX_EVENTS)
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        text = summarize(record.getMessage())
        if text is None:
            return
        with self._guard:
            self.events.append((time.perf_counter(), text))

    def since(self, start: float) -> list[dict[str, Any]]:
        """The events from ``start`` (a `time.perf_counter` reading) on, with their second from it."""
        with self._guard:
            return [{"s": round(t - start, 3), "what": what} for t, what in self.events if t >= start]


def summarize(message: str) -> str | None:
    """One line of a dynamo log message: the frame a trace starts, or a recompile's frame and its
    first guard failure; None for the other messages of those loggers."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return None
    if "start tracing" in lines[0]:
        return lines[0][:MAX_CHARS]
    if lines[0].startswith("Recompiling function"):
        failure = next((line.lstrip("- ") for line in lines[1:] if line.startswith("- ")), "")
        return f"{lines[0]}: {failure}"[:MAX_CHARS]
    return None


@contextmanager
def compile_events() -> Iterator[CompileEvents]:
    """Record compile events while the block runs (module docstring); the loggers are set back after."""
    import torch

    handler = CompileEvents()
    tracing = logging.getLogger(TRACING_LOGGER)
    recompiles = logging.getLogger(RECOMPILES_LOGGER)
    level = tracing.level
    torch._logging.set_logs(recompiles=True)
    tracing.setLevel(logging.INFO)
    tracing.addHandler(handler)
    recompiles.addHandler(handler)
    try:
        yield handler
    finally:
        tracing.removeHandler(handler)
        recompiles.removeHandler(handler)
        tracing.setLevel(level)
        torch._logging.set_logs()
