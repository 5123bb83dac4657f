"""The fake device backend: no tensors, a virtual clock, durations from a cost model.

It exists so that the real engine can be tested, measured and shown without a GPU: a task's
duration comes from per-layer costs (forward stages run forward, the fused stage forward plus
backward, a backward stage's recompute its forward and its backward the rest), transfers from bytes over a link bandwidth,
and optional seeded delays and jitter per task kind. The clock only moves when the engine asks
it to (`advance`), so 10^5 tasks simulate in about a second and nothing ever sleeps.

It must never import torch: simulations run where torch is not even installed.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from roundpipe.plan.kinds import SlotKind
from roundpipe.sched.backend import DoneCallback, IssuedCallback
from roundpipe.sched.task import (
    ACT_DOWN,
    ACT_UP,
    COMPUTE,
    G_COPY,
    GRAD_DOWN,
    GRAD_UP,
    P_COPY,
    PARAM_UP,
    RECOMPUTE,
    STEP,
    Task,
)

if TYPE_CHECKING:
    from roundpipe.plan.costs import LayerCosts

_H2D = (ACT_UP, PARAM_UP)  # lane names (a gradient upload runs on the act_up lane)
_D2H = (ACT_DOWN, GRAD_DOWN)
_TRANSFERS = frozenset((PARAM_UP, ACT_UP, GRAD_UP, ACT_DOWN, GRAD_DOWN))
_COMPUTE_KINDS = frozenset((COMPUTE, RECOMPUTE))


@dataclass
class FakeCostModel:
    """How long each task takes on the fake backend.

    ``costs``: per-layer forward/backward milliseconds per microbatch.
    ``link_gbps``: host<->device bandwidth in GB/s; None makes transfers take ``latency_ms``.
    ``optimizer_ms``: per-layer time of one optimizer step (scalar or per layer); G-copy and
    P-copy take ``copy_fraction`` of it.
    ``latency_ms``: fixed cost added to every task (launch, callback).
    """

    costs: LayerCosts
    link_gbps: float | None = None
    optimizer_ms: float | tuple[float, ...] = 0.0
    copy_fraction: float = 0.1
    latency_ms: float = 0.0
    # Stage times by (task kind, stage kind, layers): a simulation asks for the same few stages thousands of
    # times, and summing a stage's layers each time was the fake backend's largest cost.
    _stage_ms: dict[tuple[str, str, range], float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _stage_costs: LayerCosts | None = field(default=None, init=False, repr=False, compare=False)

    def duration(self, task: Task) -> float:
        kind = task.kind
        if kind in _COMPUTE_KINDS:
            if self._stage_costs is not self.costs:  # first use, or the costs were replaced
                self._stage_ms.clear()
                self._stage_costs = self.costs
            key = (kind, task.stage_kind, task.layers)
            ms = self._stage_ms.get(key)
            if ms is None:
                ms = self._stage_ms[key] = self._compute_ms(kind, task.stage_kind, task.layers)
        elif kind in _TRANSFERS:
            ms = 0.0 if self.link_gbps is None else task.nbytes / (self.link_gbps * 1e6)
        elif kind == STEP:
            ms = self._optimizer_ms(task)
        elif kind in (G_COPY, P_COPY):
            ms = self._optimizer_ms(task) * self.copy_fraction
        else:  # the grad-norm barrier, and kinds the model does not know
            ms = 0.0
        return ms + self.latency_ms

    def _compute_ms(self, kind: str, stage_kind: str, layers: range) -> float:
        """A backward stage's two tasks split `LayerCosts.bwd_stage_ms` (forward + backward per
        layer): the recompute is the stage's forward, the backward the rest."""
        if stage_kind == SlotKind.FWD or kind == RECOMPUTE:
            return self.costs.fwd_stage_ms(layers)
        if stage_kind == SlotKind.FUSED:
            return self.costs.fused_stage_ms(layers)
        self.costs.fwd_stage_ms(layers)  # checks the range
        return math.fsum(self.costs.bwd_ms[layers.start : layers.stop])

    def _optimizer_ms(self, task: Task) -> float:
        if isinstance(self.optimizer_ms, tuple):
            return sum(self.optimizer_ms[i] for i in task.layers)
        return self.optimizer_ms * max(len(task.layers), 1)


@dataclass
class Perturbation:
    """Seeded extra time per task kind: a fixed ``delay_ms`` plus uniform relative ``jitter``
    (0.1 = up to +-10% of the task's duration)."""

    delay_ms: Mapping[str, float] = field(default_factory=dict)
    jitter: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0


class FakeBackend:
    """Completes tasks on a virtual clock. See the module docstring."""

    virtual = True
    issues_ahead = False

    def __init__(
        self,
        cost_model: FakeCostModel | None = None,
        *,
        durations: Mapping[tuple[object, ...], float] | Callable[[Task], float] | None = None,
        perturbation: Perturbation | None = None,
        shared_link: bool = False,
        fail: Callable[[Task], BaseException | None] | None = None,
        execute: Callable[[Task], None] | None = None,
    ) -> None:
        """``durations`` overrides the cost model (by task key, or a function), as replay does.
        ``shared_link``: a device's two upload lanes share one link (and so do its two download
        lanes), so priorities decide who goes first. ``fail(task)`` may return an exception to
        inject a failure (for tests). ``execute(task)``, when given, does the task's real work at
        its virtual completion time, on the loop thread (a `RoundPipe` on ``"fake:N"`` devices:
        real math, virtual time, one thread, fully deterministic)."""
        if cost_model is None and durations is None:
            raise ValueError("FakeBackend needs a cost_model or durations")
        self.cost_model = cost_model
        self._durations = durations
        self._perturbation = perturbation
        self._rng = random.Random(perturbation.seed if perturbation else 0)
        self._shared_link = shared_link
        self._fail = fail
        self._execute = execute
        self._clock = 0.0
        self._heap: list[tuple[float, int, Task]] = []
        self._counter = 0
        self._done: DoneCallback | None = None
        # Durations straight from the cost model: no overrides, no perturbation.
        self._plain = durations is None and perturbation is None

    def bind(
        self, done: DoneCallback, loop: asyncio.AbstractEventLoop | None, issued: IssuedCallback | None = None
    ) -> None:
        self._done = done

    def resource(self, lane: str) -> str:
        if self._shared_link:
            device, _, name = lane.partition(".")
            if name in _H2D:
                return f"{device}.h2d"
            if name in _D2H:
                return f"{device}.d2h"
        return lane

    def now(self) -> float:
        return self._clock

    def duration(self, task: Task) -> float:
        durations = self._durations
        if durations is None:
            assert self.cost_model is not None
            ms = self.cost_model.duration(task)
        elif callable(durations):
            ms = durations(task)
        else:
            ms = durations[task.key]
        pert = self._perturbation
        if pert is not None:
            ms += pert.delay_ms.get(task.kind, 0.0)
            jitter = pert.jitter.get(task.kind, 0.0)
            if jitter:
                ms *= 1.0 + self._rng.uniform(-jitter, jitter)
        return max(ms, 0.0)

    def start(self, task: Task) -> None:
        self._counter += 1
        if self._plain:  # the common case, without the indirections of `duration`
            ms = self.cost_model.duration(task)  # type: ignore[union-attr]
            if ms < 0.0:
                ms = 0.0
        else:
            ms = self.duration(task)
        heapq.heappush(self._heap, (self._clock + ms, self._counter, task))

    def advance(self) -> bool:
        if not self._heap:
            return False
        end, _, task = heapq.heappop(self._heap)
        self._clock = end
        error = self._fail(task) if self._fail is not None else None
        if error is None and self._execute is not None:
            try:
                self._execute(task)
            except Exception as exc:  # reported like any task failure
                error = exc
        assert self._done is not None
        self._done(task, error)
        return True

    def next_time(self) -> float | None:
        """When the earliest running task will finish (None when nothing runs)."""
        return self._heap[0][0] if self._heap else None

    def set_clock(self, now_ms: float) -> None:
        """Move the idle clock forward (replay submits batches at their recorded times)."""
        if self._heap and now_ms > self._heap[0][0]:
            raise ValueError("cannot move the clock past a running task's end")
        self._clock = max(self._clock, now_ms)

    def close(self) -> None:
        self._heap.clear()
