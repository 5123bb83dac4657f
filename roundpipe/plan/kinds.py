"""Names shared by every layer: the three kinds of stage, the string enum they are made of, and the
grains a backward stage recomputes at.

Why here: `plan` is the bottom layer (the scheduler, the backends and the views all read plans),
so the one spelling of "fwd" / "fused" / "bwd" lives where a slot is defined. The enums are
`StrEnum`s so that a member *is* its string: it compares equal to it, hashes like it and is
written to JSON as it, which keeps traces and plan files readable and compatible. This module must
never import anything but the standard library.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Literal

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, Enum):
        """`enum.StrEnum` of Python 3.11: members are strings and print as their value."""

        __str__ = str.__str__
        __format__ = str.__format__


class SlotKind(StrEnum):
    """What a stage does: ``FWD`` forward only (saves boundary activations), ``FUSED`` forward,
    loss and backward in one go, ``BWD`` recompute and backward."""

    FWD = "fwd"
    FUSED = "fused"
    BWD = "bwd"


Grain = Literal["stage", "layer", "layer_input"]
"""What a backward stage recomputes from: its input, layer by layer from it, or each layer's own."""

__all__ = ["Grain", "SlotKind", "StrEnum"]
