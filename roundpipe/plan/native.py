"""The compiled inner loops of plan evaluation (`_kernels.c`), where the extension was built.

Why: choosing a plan at 94 layers builds the engine's task graph and runs event loops over
its thousands of tasks, tens to hundreds of times (the ranking models' list schedule
`_event_loop.event_loop` and the engine replay `roundpipe.planning.replay.replay_starts`); in Python they
are most of its time. `_kernels.c` runs the same loops on packed arrays, step for step, and
builds the same graph: `tests/test_native_kernels.py` compares each loop with its Python loop,
`tests/test_plan_replay.py` the graph with the engine's.

The Python loops stay: they are the reference and the fallback. `pip install` builds the
extension when a C compiler is there and goes on without it when not (``optional`` in
setup.py); then every caller runs the Python loop and plans the same, only more slowly.
``ROUNDPIPE_PURE_PYTHON=1`` (or `pure_python()`, for tests) turns the compiled loops off.

What it must never do: decide anything itself. It only packs lists into arrays.
"""

from __future__ import annotations

import importlib
import os
import warnings
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate, chain
from types import ModuleType

try:  # a compiled leaf that imports nothing (by name: ``from roundpipe.plan import`` would read
    # to the layering check as an import of the package, a cycle)
    _compiled: ModuleType | None = importlib.import_module("roundpipe.plan._kernels")
except ImportError:  # no compiler when it was installed: the Python loops run
    _compiled = None

FUNCTIONS = (
    "balanced_split",
    "build",
    "busiest_share",
    "first_starts",
    "invert",
    "list_schedule",
    "replay",
    "sharers",
    "span",
    "split_layout",
    "split_schedule",
    "steady_bound_ticks",
    "steady_period_of",
    "stream_base",
    "stream_extras",
)
"""What the callers use. An extension built from an older `_kernels.c` (an editable install not
rebuilt since) lacks some: it is set aside, with a warning, rather than fail mid-plan."""

INTERFACE = 4
"""The arguments the callers pass (`_kernels.c`'s ``INTERFACE``, raised with every change to
them). An extension without it, or of another, is set aside as one lacking functions is."""

if _compiled is not None and (
    _missing := [f for f in FUNCTIONS if not hasattr(_compiled, f)]
    + ([] if getattr(_compiled, "INTERFACE", 1) == INTERFACE else [f"interface {INTERFACE}"])
):
    warnings.warn(
        f"roundpipe.plan._kernels was built from an older source (no {', '.join(_missing)}): "
        "planning runs the Python loops, slower; rebuild it with `pip install -e .` "
        "or `python setup.py build_ext --inplace`",
        RuntimeWarning,
        stacklevel=1,
    )
    _compiled = None

_enabled = os.environ.get("ROUNDPIPE_PURE_PYTHON", "") in ("", "0")


def kernels() -> ModuleType | None:
    """The compiled module, or None: not built, or turned off."""
    return _compiled if _enabled else None


def built() -> bool:
    """Whether the extension was built and loads (whatever `pure_python` says)."""
    return _compiled is not None


@contextmanager
def pure_python() -> Iterator[None]:
    """Within it, every caller runs the Python loops (tests compare the two)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def ints(values: Sequence[int] | Iterator[int]) -> array:
    return array("q", values)


def floats(values: Sequence[float]) -> array:
    return array("d", values)


def csr(lists: Sequence[Sequence[int]]) -> tuple[array, array]:
    """``lists`` (per task, its dependents) as offsets and one flat array: task t's dependents
    are ``flat[offsets[t]:offsets[t + 1]]``."""
    return array("q", accumulate(map(len, lists), initial=0)), array("q", chain.from_iterable(lists))
