"""Link time: when moving a layer's weights to the device takes longer than computing with them.

Why: the planner's layer costs are compute times, and its evaluations run with free transfers.
That is right while a layer's upload hides behind the compute of the stage before it (one stage
is prefetched), and wrong for a layer that computes little with many bytes: a mixture of experts
moves every expert each pass but computes with 8 of 128 per token. Qwen3-30B-A3B's experts are
1.21 GB a layer in bf16, 22 ms at 55 GB/s, against a few ms of compute for 4 x 4096 tokens. Such
a run is *link-bound*: its iteration is the time its uploads take, and what shortens it is fewer
uploads (longer rounds, a longer fused stage, which uploads once where a forward and a backward
slot upload twice) or more tokens per upload, not a better balance of compute.

The model: a slot uploads its stage's weights once per round and runs the round's M_R
microbatches with them, the upload overlapping the stage before; so per layer and microbatch a
forward slot takes ``max(f, u / M_R)`` and a backward or fused slot ``max(f + b, u / M_R)``, with
``u`` the layer's upload time. `link_costs` writes exactly that into `LayerCosts` (forward
``max(f, u/M_R)``, backward the rest of ``max(f + b, u/M_R)``), so the planner and its free-transfer
evaluations see link-bound layers at their real time, and a fused layer at one upload instead of
two. Summing per-layer maxima over a stage is exact for equal layers and an upper bound otherwise.
`link_report` says, for a plan, how many bytes an iteration uploads, how long the link and the
compute take per device, and whether the run is link-bound: the figure a benchmark prints.

Pure: plain numbers, no torch, no devices, no scheduler. It must never measure anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from roundpipe.errors import PlanError
from roundpipe.plan.costs import LayerCosts
from roundpipe.plan.partition import Plan


def upload_ms(nbytes: int, link_gbps: float) -> float:
    """Milliseconds to move ``nbytes`` at ``link_gbps`` GB/s (1 GB = 1e9 bytes)."""
    return nbytes / (link_gbps * 1e6)


def _check(costs: LayerCosts, param_bytes: Sequence[int], link_gbps: float, per_upload: int) -> None:
    if len(param_bytes) != costs.num_layers:
        raise PlanError(
            f"param_bytes has {len(param_bytes)} entries for {costs.num_layers} layers; give one per layer"
        )
    if isinstance(link_gbps, bool) or not isinstance(link_gbps, int | float) or not link_gbps > 0:
        raise PlanError(f"link_gbps must be a positive number of GB/s, got {link_gbps!r}")
    if isinstance(per_upload, bool) or not isinstance(per_upload, int) or per_upload < 1:
        raise PlanError(f"microbatches per upload must be an integer >= 1, got {per_upload!r}")


def link_costs(
    costs: LayerCosts, param_bytes: Sequence[int], link_gbps: float, microbatches_per_upload: int
) -> LayerCosts:
    """``costs`` with each layer's times raised to what its upload takes per microbatch (the
    module docstring): unchanged for a layer whose compute hides its upload."""
    _check(costs, param_bytes, link_gbps, microbatches_per_upload)
    fwd: list[float] = []
    bwd: list[float] = []
    for f, b, nbytes in zip(costs.fwd_ms, costs.bwd_ms, param_bytes, strict=True):
        u = upload_ms(nbytes, link_gbps) / microbatches_per_upload
        forward = max(f, u)
        fwd.append(forward)
        bwd.append(max(f + b, u) - forward)
    return LayerCosts(tuple(fwd), tuple(bwd), costs.mem_bytes, costs.names)


@dataclass(frozen=True)
class LinkReport:
    """What one iteration of a plan asks of the host link, per device (each device has a link
    of its own; uploads and computes spread over the devices)."""

    link_gbps: float
    upload_bytes: int  # weight bytes uploaded per iteration, all devices together
    link_ms: float  # per device: those uploads at link_gbps
    compute_ms: float  # per device: the compute, transfers free
    microbatches_per_upload: (
        int  # the shortest round's microbatches: tokens per upload / tokens per microbatch
    )
    link_bound_layers: tuple[int, ...]  # layers whose backward slot computes for less than it uploads
    hiding_microbatches: int  # the fewest microbatches per round whose compute outlasts a round's uploads

    @property
    def link_bound(self) -> bool:
        """Whether the link, not the compute, sets the iteration's length."""
        return self.link_ms > self.compute_ms

    def describe(self) -> str:
        """One line for a log or a benchmark."""
        what = "link-bound" if self.link_bound else "compute-bound"
        line = (
            f"{what}: {self.upload_bytes / 1e9:.2f} GB of weights uploaded per iteration, "
            f"{self.link_ms:.1f} ms per device at {self.link_gbps:g} GB/s against {self.compute_ms:.1f} ms "
            f"of compute; {self.microbatches_per_upload} microbatch(es) per upload"
        )
        if self.link_bound:
            line += (
                f"; the uploads hide from {self.hiding_microbatches} microbatches per round "
                "(RunConfig.num_microbatches, round_size) or with more tokens per microbatch"
            )
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "link_gbps": self.link_gbps,
            "upload_bytes": self.upload_bytes,
            "link_ms": self.link_ms,
            "compute_ms": self.compute_ms,
            "link_bound": self.link_bound,
            "microbatches_per_upload": self.microbatches_per_upload,
            "link_bound_layers": list(self.link_bound_layers),
            "hiding_microbatches": self.hiding_microbatches,
        }


def upload_bytes(plan: Plan, param_bytes: Sequence[int], rounds: Sequence[int]) -> int:
    """Weight bytes a plan uploads per iteration: every round, each layer once per slot that runs
    it (a forward and a backward slot, or the fused one)."""
    fused = set(plan.fused)
    per_round = sum(nbytes * (1 if i in fused else 2) for i, nbytes in enumerate(param_bytes))
    return per_round * len(rounds)


def link_report(
    plan: Plan,
    costs: LayerCosts,
    param_bytes: Sequence[int],
    link_gbps: float,
    rounds: Sequence[int],
) -> LinkReport:
    """The link's share of an iteration of ``plan`` (``rounds``: microbatches per round,
    `round_sizes`); ``costs`` are compute times (before `link_costs`)."""
    per_upload = min(rounds) if rounds else 1
    _check(costs, param_bytes, link_gbps, per_upload)
    if plan.num_layers != costs.num_layers:
        raise PlanError(f"the plan has {plan.num_layers} layers and the costs {costs.num_layers}")
    n, m = plan.num_devices, sum(rounds)
    fused = set(plan.fused)
    per_microbatch = math.fsum(
        f + b if i in fused else 2 * f + b
        for i, (f, b) in enumerate(zip(costs.fwd_ms, costs.bwd_ms, strict=True))
    )
    total = upload_bytes(plan, param_bytes, rounds)
    uploads = [upload_ms(nbytes, link_gbps) for nbytes in param_bytes]
    work = [f + b for f, b in zip(costs.fwd_ms, costs.bwd_ms, strict=True)]
    bound = tuple(i for i, (u, w) in enumerate(zip(uploads, work, strict=True)) if u > w * per_upload)
    per_round_ms = upload_ms(upload_bytes(plan, param_bytes, (1,)), link_gbps)
    hiding = math.ceil(per_round_ms / per_microbatch) if per_microbatch > 0 else 1
    return LinkReport(
        link_gbps=float(link_gbps),
        upload_bytes=total,
        link_ms=upload_ms(total, link_gbps) / n,
        compute_ms=per_microbatch * m / n,
        microbatches_per_upload=per_upload,
        link_bound_layers=bound,
        hiding_microbatches=max(1, hiding),
    )
