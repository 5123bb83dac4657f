"""A process-wide setting that roundpipe changes only while at least one pipe holds it.

Why: a few settings that make a CUDA pipe fast belong to the process, not to a pipe: inductor's
C++ launch wrapper (`compiling.CPP_WRAPPER`), dynamo's recompile limit
(`compiling.RECOMPILE_LIMIT`) and the interpreter's GIL switch interval (`cuda.GIL_SWITCH`). Each
open pipe holds such a setting once; the first holder sets it, and the last one to let go gives
back what the first found, so the user's process is as they left it before the first pipe
opened and after the last one closed. A value the user set while a pipe
was open is theirs and is left as it is (one equal to roundpipe's cannot be told apart from it).
Where the setting already had the value roundpipe wants, nothing is written or given back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class HeldSetting(Generic[T]):
    """``read``/``write`` the setting; ``value(found)`` is what to set it to, given what it was."""

    def __init__(self, read: Callable[[], T], write: Callable[[T], None], value: Callable[[T], T]) -> None:
        self._read = read
        self._write = write
        self._value = value
        self._lock = threading.Lock()
        self._holders = 0
        self._found: T | None = None
        self._set: T | None = None

    @property
    def holders(self) -> int:
        return self._holders

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._found = self._read()
                self._set = self._value(self._found)
                if self._set != self._found:  # writing what is there could still change it (a float rounded)
                    self._write(self._set)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                return
            self._holders -= 1
            wrote = self._set != self._found
            if self._holders == 0 and wrote and self._read() == self._set:
                self._write(self._found)  # type: ignore[arg-type]  # set by acquire
