"""The planner's fast schedule models give the engine's times, on random plans.

The planner ranks plans with specialised models of the engine's schedule (`_stream.stream_ms`,
`_split_stream.split_ms`) and times the best few with a replay of the engine's graph
(`roundpipe.planning.replay`, on the graph `roundpipe.planning.replay_graph` renders or the compiled kernels
build). None of them runs the engine, so each is checked here against it: the real `Engine` on the
fake backend (`engine_evaluator(..., engine=True)`), on plans hypothesis draws (1-4 devices, one
to three rounds, stages cut anywhere), compiled and in Python. What holds:

- the replay gives the engine's time to the last bit, sync and async, chained and as a training
  loop submits the iterations (reading each loss at once or one iteration late);
- `stream_ms`, whose unit is a whole microbatch of a stage, gives the engine's time to the last bit
  where that is what runs: on plans of the fused stage alone, sync and async, chained and as a
  loop submits them (with backward stages the engine recomputes ahead of the gradient, which
  `split_ms` models for sync plans and the async ranking leaves to the replay of its best few);
- `split_ms` (sync) gives the engine's time on one device and on plans of no more slots than
  devices (to rounding: it adds a backward microbatch's two parts where the engine has one sum), and within 2% on the others (where transfers on a shared link can reorder a
  device's work: measured exact on about 95% of them).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from roundpipe.plan import LayerCosts, Plan, native
from roundpipe.plan._ranking import _StageTimes
from roundpipe.plan._sharing import sharers_and_waits
from roundpipe.plan._split_stream import split_ms
from roundpipe.plan._stream import stream_ms
from roundpipe.plan.rounds import round_sizes
from roundpipe.planning.ranking import engine_evaluator

MODELS = settings(derandomize=True, database=None, deadline=None, max_examples=60)


@dataclass(frozen=True)
class Case:
    plan: Plan
    costs: LayerCosts
    n: int
    m: int
    compiled: bool

    @property
    def rounds(self) -> tuple[int, ...]:
        return round_sizes(self.m, self.n)

    def engine(self, **options: object) -> float:
        """The iteration time of the real engine on the fake backend (`engine_evaluator`'s options)."""
        evaluate = engine_evaluator(self.costs, self.n, self.m, engine=True, **options)  # type: ignore[arg-type]
        return evaluate(self.plan)


def _chain(draw: st.DrawFn, stop: int) -> list[range]:
    cuts = draw(st.sets(st.integers(1, stop - 1), max_size=stop - 1)) if stop > 1 else set()
    ends = [0, *sorted(cuts), stop]
    return [range(a, b) for a, b in itertools.pairwise(ends)]


@st.composite
def cases(draw: st.DrawFn, backward: bool, zero: bool = False) -> Case:
    """A plan of forward stages, the fused stage and backward stages over random layer times
    (``zero``: zero-time layers among them), on 1-4 devices and 1-3 rounds; without ``backward``
    the fused stage alone (a plan's backward stages cover every layer its forward stages do)."""
    layers = draw(st.integers(2, 9))
    times = [0.5, 1.0, 1.0, 2.0, *([0.0] if zero else [])]
    fwd = draw(st.lists(st.sampled_from(times), min_size=layers, max_size=layers))
    bwd = [x * draw(st.sampled_from([1.3, 2.0, 3.0])) for x in fwd]
    costs = LayerCosts(tuple(fwd), tuple(bwd), (0,) * layers)
    n = draw(st.integers(1, 4))
    m = n * draw(st.integers(1, 3)) + draw(st.sampled_from([0, 0, 1]))
    p = draw(st.integers(1, layers - 1)) if backward else 0
    fwd_stages = _chain(draw, p) if p else []
    bwd_stages = _chain(draw, p)[::-1] if p else []
    plan = Plan.from_stages(fwd_stages, range(p, layers), bwd_stages, costs, n, m)
    return Case(plan, costs, n, m, draw(st.booleans()))


def _modelled(case: Case, compute: object) -> float:
    if case.compiled:
        return compute()  # type: ignore[operator,no-any-return]
    with native.pure_python():
        return compute()  # type: ignore[operator,no-any-return]


@MODELS
@given(cases(backward=True, zero=True), st.sampled_from(["sync", "chained", "loop", "late"]))
def test_the_replay_gives_the_engines_times(case: Case, mode: str) -> None:
    options: dict[str, object] = {"async_optimizer": mode != "sync"}
    if mode != "sync":
        options |= {"window": (1, 3), "loop": mode != "chained", "loss_lag": int(mode == "late")}
    replay = engine_evaluator(case.costs, case.n, case.m, **options)  # type: ignore[arg-type]
    assert _modelled(case, lambda: replay(case.plan)) == case.engine(**options)


@MODELS
@given(cases(backward=False), st.sampled_from(["sync", "chained", "loop", "late"]))
def test_the_stream_model_gives_the_engines_times_on_fused_plans(case: Case, mode: str) -> None:
    plan = case.plan
    if mode == "sync":
        expected = case.engine(async_optimizer=False)
        model = lambda: stream_ms(plan.slot_ms, case.n, case.rounds)  # noqa: E731
    else:
        late = mode == "late"
        iterations, window = (10, (3, 9)) if late else (4, (1, 3))
        expected = case.engine(
            async_optimizer=True, window=window, loop=mode != "chained", loss_lag=int(late)
        )
        shares, waits = sharers_and_waits(plan.fwd_stages, plan.fused, plan.bwd_stages)
        gate = len(plan.fwd_stages) if mode != "chained" else None
        model = lambda: stream_ms(  # noqa: E731
            *(plan.slot_ms, case.n, case.rounds),
            iterations=iterations,
            window=window,
            weight_waits=waits,
            sharers=shares,
            gate=gate,
            gate_lag=int(late),
        )
    assert _modelled(case, model) == expected


@MODELS
@given(cases(backward=True))
def test_the_split_model_gives_the_engines_sync_times(case: Case) -> None:
    plan = case.plan
    split = _StageTimes(case.costs).split(plan.fwd_stages, plan.fused, plan.bwd_stages)
    modelled = _modelled(case, lambda: split_ms(plan.slot_ms, split, case.n, case.rounds))
    expected = case.engine(async_optimizer=False)
    if case.n == 1 or plan.num_slots <= case.n:  # exact, but for float sums in another order
        assert math.isclose(modelled, expected, rel_tol=1e-12)
    else:
        assert math.isclose(modelled, expected, rel_tol=0.02)
