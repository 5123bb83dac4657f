"""`RunConfig.distributed`: whether and how processes average their gradients (data parallel).

Why a module of its own: the knobs are few and plain data (a mode, the ranks of the group, a
timeout, how often weights are compared), so a `RunConfig` holding them can still be saved in a
checkpoint and compared; what they mean at run time lives in `roundpipe.optim.distributed`.
A process group object is not configuration: the group is named by its ranks, and a dedicated
gloo group is built from them so roundpipe's collectives never interleave with the user's.

This module must never import torch or touch a process group.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class DistributedConfig(BaseModel):
    """Data parallel across processes with torch.distributed; see docs/distributed.md."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["auto", "on", "off"] = Field(
        "auto",
        description='"auto": average gradients when torch.distributed is initialised with more than one '
        "process, or when torchrun's variables (WORLD_SIZE > 1, MASTER_ADDR) are set, initialising it "
        'with gloo then; "on": the same, but an error when neither holds; "off": never',
    )
    backend: Literal["gloo"] = Field(
        "gloo", description="backend of the reduction group: gloo (gradients live in host memory)"
    )
    ranks: tuple[int, ...] | None = Field(
        None, description="ranks of the group that averages; None: every process"
    )
    timeout_s: float = Field(
        300.0, gt=0, description="a collective that waits longer for another process fails with an error"
    )
    check_every: int = Field(
        100,
        ge=0,
        description="compare a checksum of the host weights across processes every N steps; 0: never",
    )

    @field_validator("ranks")
    @classmethod
    def _check_ranks(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None:
            if len(value) < 1 or len(set(value)) != len(value) or min(value) < 0:
                raise ValueError("ranks must name distinct ranks >= 0, e.g. (0, 1)")
            return tuple(sorted(value))
        return value
