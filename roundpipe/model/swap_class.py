"""A module computes differently on roundpipe's copies of a layer by taking a subclass of its class.

Why a subclass and not a wrapper: the swapped module keeps its parameters, their names and its
state dict, so replicas, profile copies and checkpoints see the module they expect; only methods
change (experts as grouped matrix products, a long sequence a slice at a time). Why made once per
base class: every copy of a layer then has the same class, so the compiled graphs that guard on it
are shared, and swapping another copy costs a lookup.

It must never be applied to the user's model, only to roundpipe's copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def subclass_of(
    made: dict[type, type], base: type, prefix: str, methods: Callable[[type], dict[str, Any]]
) -> type:
    """The subclass ``prefix + base.__name__`` of ``base`` holding ``methods(base)``, made on the
    first call for ``base`` and kept in ``made`` (one table per kind of swap)."""
    subclass = made.get(base)
    if subclass is None:
        subclass = made[base] = type(f"{prefix}{base.__name__}", (base,), methods(base))
    return subclass
