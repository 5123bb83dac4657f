"""Random schedule scenarios for the property tests (tests/test_schedule_properties.py).

Hypothesis draws layer costs, plans (from `partition` or hand-made with `Plan.from_stages`),
1-8 devices, 1-32 microbatches, 1-3 iterations, sync/async, with and without link bandwidth,
parameter/activation bytes, upload chunking, a shared link, round sizes and a random
`Perturbation`; a `Scenario` runs itself on the fake backend.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from roundpipe.backends.fake import FakeBackend, Perturbation
from roundpipe.plan import LayerCosts, Plan, partition
from roundpipe.planning.simulate import SimulationResult, simulate
from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions
from roundpipe.sched.task import ACT_DOWN, ACT_UP, COMPUTE, G_COPY, GRAD_DOWN, P_COPY, PARAM_UP, STEP

KINDS = (PARAM_UP, ACT_UP, COMPUTE, ACT_DOWN, GRAD_DOWN, G_COPY, STEP, P_COPY)
PROPERTY_SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    costs: LayerCosts
    plan: Plan
    num_devices: int
    num_microbatches: int
    iterations: int
    async_optimizer: bool
    link_gbps: float | None
    param_bytes: tuple[int, ...] | None
    act_bytes: int
    chunk_bytes: int | None
    optimizer_ms: float
    latency_ms: float
    round_size: int | None
    shared_link: bool
    perturbation: Perturbation | None

    def run(self) -> SimulationResult:
        return simulate(
            self.plan,
            self.costs,
            self.num_devices,
            self.num_microbatches,
            self.iterations,
            self.async_optimizer,
            self.link_gbps,
            param_bytes=self.param_bytes,
            act_bytes=self.act_bytes,
            chunk_bytes=self.chunk_bytes,
            optimizer_ms=self.optimizer_ms,
            latency_ms=self.latency_ms,
            round_size=self.round_size,
            shared_link=self.shared_link,
            perturbation=self.perturbation,
        )

    def builder(self) -> GraphBuilder:
        """A twin of the builder `simulate` uses (same spec and options)."""
        spec = ModelSpec(
            param_bytes=tuple(self.param_bytes if self.param_bytes is not None else self.costs.mem_bytes),
            owners=tuple((layer,) for layer in range(self.costs.num_layers)),
            act_bytes=self.act_bytes,
        )
        options = ScheduleOptions(
            async_optimizer=self.async_optimizer, round_size=self.round_size, chunk_bytes=self.chunk_bytes
        )
        return GraphBuilder(self.plan, spec, self.num_devices, options)

    def resource(self, lane: str) -> str:
        return FakeBackend(durations={}, shared_link=self.shared_link).resource(lane)


_ms = st.one_of(
    st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 3.0]),  # ties and zero-length tasks stress the engine
    st.floats(min_value=0.01, max_value=8.0, allow_nan=False, allow_infinity=False),
)


def _composition(draw: st.DrawFn, start: int, stop: int) -> list[range]:
    """A random split of [start, stop) into non-empty consecutive ranges, shallow first."""
    if stop <= start:
        return []
    cuts = sorted(
        draw(st.sets(st.integers(start + 1, stop - 1), max_size=stop - start - 1)) if stop - start > 1 else []
    )
    bounds = [start, *cuts, stop]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _plan(draw: st.DrawFn, costs: LayerCosts, n: int, m: int, async_optimizer: bool) -> Plan:
    """A partitioned plan, or a hand-made one with random stage boundaries."""
    if draw(st.booleans()):
        return partition(costs, n, m, async_optimizer=async_optimizer)
    num_layers = costs.num_layers
    fused_start = draw(st.integers(0, num_layers - 1))
    fwd = _composition(draw, 0, fused_start)
    bwd = list(reversed(_composition(draw, 0, fused_start)))
    return Plan.from_stages(fwd, range(fused_start, num_layers), bwd, costs, n, m)


def _perturbation(draw: st.DrawFn) -> Perturbation | None:
    if not draw(st.booleans()):
        return None
    kinds = st.sampled_from(KINDS)
    return Perturbation(
        delay_ms=draw(st.dictionaries(kinds, st.floats(0.0, 3.0), max_size=4)),
        jitter=draw(st.dictionaries(kinds, st.floats(0.0, 0.9), max_size=4)),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    num_layers = draw(st.integers(1, 8))
    costs = LayerCosts(
        tuple(draw(st.lists(_ms, min_size=num_layers, max_size=num_layers))),
        tuple(draw(st.lists(_ms, min_size=num_layers, max_size=num_layers))),
        tuple(draw(st.lists(st.integers(0, 4 << 20), min_size=num_layers, max_size=num_layers))),
    )
    n = draw(st.integers(1, 8))
    m = draw(st.integers(1, 32))
    async_optimizer = draw(st.booleans())
    plan = _plan(draw, costs, n, m, async_optimizer)
    # Keep a run under ~8k tasks so a hundred examples stay fast.
    iterations = draw(st.integers(1, 3))
    while iterations > 1 and iterations * m * plan.num_slots > 2500:
        iterations -= 1
    if m * plan.num_slots > 2500:
        m = max(1, 2500 // plan.num_slots)
    link_gbps = draw(st.one_of(st.none(), st.floats(0.5, 64.0)))
    param_bytes = draw(
        st.one_of(
            st.none(),
            st.lists(st.integers(0, 8 << 20), min_size=num_layers, max_size=num_layers).map(tuple),
        )
    )
    act_bytes = draw(st.sampled_from([0, 1 << 10, 1 << 20, 3 << 20]))
    chunk_bytes = draw(st.one_of(st.none(), st.sampled_from([1 << 18, 1 << 20, 3 << 20])))
    optimizer_ms = draw(st.sampled_from([0.0, 0.05, 0.5, 2.0]))
    latency_ms = draw(st.sampled_from([0.0, 0.0, 0.01]))
    round_size = draw(st.one_of(st.none(), st.integers(n, max(n, m))))
    shared_link = draw(st.booleans())
    perturbation = _perturbation(draw)
    return Scenario(
        costs,
        plan,
        n,
        m,
        iterations,
        async_optimizer,
        link_gbps,
        param_bytes,
        act_bytes,
        chunk_bytes,
        optimizer_ms,
        latency_ms,
        round_size,
        shared_link,
        perturbation,
    )
