"""Staleness remedies (async warm-up, weight prediction, lr ramp): the pipe equals their plain loop.

Each remedy is defined by `tests.remedy_reference`, a naive loop over the weights after every
step; the pipe must match it after every step on 1, 2 and 3 CPU workers, keep the five rules in
its trace, and resume from a saved state exactly, whether saved during the warm-up, at its end
or later.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.errors import ConfigError, ScheduleError
from roundpipe.plan import LayerCosts, Plan
from tests.helpers import assert_weights_equal, batches, mlp, train_steps
from tests.remedy_reference import remedy_reference

mse = nn.functional.mse_loss
Prediction = float | tuple[float, ...]
# (async_warmup_steps, weight_prediction)
REMEDIES: list[tuple[int, Prediction]] = [
    (3, 0.0),
    (0, 2.0),
    (2, 1.5),
    (0, (2.0, -1.0)),
    (2, (1.5, -1.25, 0.25)),
]
# (async_warmup_steps, weight_prediction, (async_lr_ramp_steps, async_lr_ramp_start))
RAMPS = [(0, 0.0, (3, 0.3)), (2, 2.0, (2, 0.5)), (1, 0.0, (10, 0.25)), (2, (2.0, -1.0), (3, 0.4))]


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def remedy_config(
    devices: str,
    warmup: int,
    prediction: Prediction,
    precision: str = "fp32",
    ramp: tuple[int, float] = (0, 0.4),
) -> roundpipe.RunConfig:
    return roundpipe.RunConfig(
        devices=devices,
        num_microbatches=4,
        async_warmup_steps=warmup,
        weight_prediction=prediction,
        async_lr_ramp_steps=ramp[0],
        async_lr_ramp_start=ramp[1],
        precision=precision,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("warmup", "prediction"), REMEDIES)
def test_pipe_matches_the_remedy_loop_on_one_two_and_three_workers(
    warmup: int, prediction: Prediction
) -> None:
    data = batches(6)
    _, ref_weights = remedy_reference(mlp(), adamw, data, mse, warmup_steps=warmup, prediction=prediction)
    configs = [remedy_config(devices, warmup, prediction) for devices in ("cpu:1", "cpu:2", "cpu:3")]
    assert_pipe_matches(ref_weights, data, configs)


def assert_pipe_matches(
    ref_weights: list[dict[str, torch.Tensor]],
    data: list[tuple[torch.Tensor, torch.Tensor]],
    configs: list[roundpipe.RunConfig],
) -> None:
    """Under each config the pipe's weights after every step are the reference's, and its
    trace keeps the five rules."""
    for config in configs:
        with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=config) as pipe:
            weights = train_steps(pipe, data, mse)
            trace = pipe.trace()
        trace.check_rules()
        for got, want in zip(weights, ref_weights, strict=True):
            assert_weights_equal(got, want)


@pytest.mark.parametrize(("warmup", "prediction", "ramp"), RAMPS)
def test_pipe_matches_the_lr_ramp_loop_on_one_and_two_workers(
    warmup: int, prediction: Prediction, ramp: tuple[int, float]
) -> None:
    data = batches(6)
    _, ref_weights = remedy_reference(
        mlp(), adamw, data, mse, warmup_steps=warmup, prediction=prediction, lr_ramp=ramp
    )
    configs = [remedy_config(devices, warmup, prediction, ramp=ramp) for devices in ("cpu:1", "cpu:2")]
    assert_pipe_matches(ref_weights, data, configs)


def test_the_lr_ramp_leaves_the_scheduled_lr_alone() -> None:
    """A scheduler keeps its own values: the ramp scales one step at a time and puts them back."""

    def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    cfg = remedy_config("cpu:1", 0, 0.0, ramp=(2, 0.5))
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=cfg, lr_scheduler=scheduler) as pipe:
        train_steps(pipe, batches(3), mse)
        lrs = {group["lr"] for opt in pipe.host.optimizers.values() for group in opt.param_groups}
    assert lrs == {1e-2 / 4}


def test_the_lr_ramp_adds_no_task_and_no_dependency() -> None:
    """The ramp is part of the step task: the schedule (what runs on which lane, after what) is
    the one of the same run without it, so it cannot put the optimizer lane on the critical path."""
    graphs = []
    for ramp in [(0, 0.4), (4, 0.3)]:
        with roundpipe.RoundPipe(
            mlp(), optimizer=adamw, config=remedy_config("cpu:2", 1, 2.0, ramp=ramp)
        ) as pipe:
            train_steps(pipe, batches(4), mse)
            graphs.append(sorted((str(t.key), t.lane, tuple(sorted(map(str, t.deps)))) for t in pipe.trace()))
    assert graphs[0] == graphs[1]


def test_without_remedies_the_reference_is_plain_staleness_one() -> None:
    from tests.helpers import async_reference

    data = batches(4)
    want = async_reference(mlp(), adamw, data, mse)[1]
    got = remedy_reference(mlp(), adamw, data, mse)[1]
    for a, b in zip(got, want, strict=True):
        assert_weights_equal(a, b, rtol=0, atol=0)


def test_warmup_steps_are_synchronous_in_the_trace() -> None:
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=remedy_config("cpu:2", 2, 0.0)) as pipe:
        train_steps(pipe, batches(4), mse)
        trace = pipe.trace()
    # Iterations of warm-up steps read the version their own step starts from; later ones lag one.
    read = {t.iteration: t.step for t in trace if t.kind == "param_up"}
    assert read == {0: 0, 1: 1, 2: 1, 3: 2}
    assert trace.meta["sync_steps"] == 2


@pytest.mark.parametrize(
    ("warmup", "prediction", "stop", "precision"),
    [
        (3, 0.0, 2, "fp32"),
        (3, 0.0, 3, "fp32"),
        (0, 2.0, 3, "fp32"),
        (2, 1.5, 2, "fp32"),
        (1, 2.0, 3, "bf16"),
        # saved before any update was remembered, with one of the two the factors read, and both
        (2, (2.0, -1.0), 1, "fp32"),
        (1, (2.0, -1.0), 1, "fp32"),
        (2, (2.0, -1.0), 4, "fp32"),
        (1, (2.0, -1.0), 2, "bf16"),
        (0, (1.5, -1.25, 0.25), 4, "bf16"),
    ],
)
@pytest.mark.parametrize("ramp", [(0, 0.4), (4, 0.3)])
def test_resume_is_bit_exact(
    warmup: int, prediction: Prediction, stop: int, precision: str, ramp: tuple[int, float]
) -> None:
    assert_resume_is_bit_exact(remedy_config("cpu:2", warmup, prediction, precision, ramp), stop)


def assert_resume_is_bit_exact(cfg: roundpipe.RunConfig, stop: int) -> None:
    """Saved after ``stop`` of 6 steps (through torch.save) and loaded into a pipe around other
    weights, the run continues bit for bit as the one that never stopped."""
    data = batches(6)
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=cfg) as pipe:
        full = train_steps(pipe, data, mse)
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=cfg) as pipe:
        train_steps(pipe, data[:stop], mse)
        state = pipe.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    with roundpipe.RoundPipe(mlp(seed=99), optimizer=adamw, config=cfg) as pipe:
        pipe.load_state_dict(state)
        resumed = train_steps(pipe, data[stop:], mse)
    for got, want in zip(resumed, full[stop:], strict=True):
        assert_weights_equal(got, want, rtol=0, atol=0)


def test_prediction_state_is_saved_with_the_optimizer() -> None:
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=remedy_config("cpu:1", 0, 1.0)) as pipe:
        train_steps(pipe, batches(2), mse)
        state = pipe.state_dict()
    assert set(state["host"]["previous_weights"]) == {n for n, _ in mlp().named_parameters()}
    assert "earlier_weights" not in state["host"]


def test_each_further_factor_saves_the_weights_before_one_more_step() -> None:
    config = remedy_config("cpu:1", 0, (2.0, -1.0, 0.5))
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=config) as pipe:
        train_steps(pipe, batches(1), mse)
        after_one = pipe.state_dict()["host"]["earlier_weights"]
        train_steps(pipe, batches(3), mse)
        after_four = pipe.state_dict()["host"]["earlier_weights"]
    names = {n for n, _ in mlp().named_parameters()}
    assert [set(d) for d in after_one] == [set(), set()]  # one step: only the newest weights
    assert [set(d) for d in after_four] == [names, names]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"async_optimizer": False, "weight_prediction": 1.0}, "only applies with async_optimizer=True"),
        ({"async_optimizer": False, "async_warmup_steps": 5}, "only applies with async_optimizer=True"),
        ({"weight_prediction": -1.0}, "weight_prediction"),
        ({"weight_prediction": 9.0}, "weight_prediction"),
        ({"weight_prediction": (0.0, 1.0)}, "the factor of the last update must be in"),
        ({"weight_prediction": (2.0, -1.0, 0.5, 0.1)}, "at most 3 factors"),
        ({"weight_prediction": (2.0, 5.0)}, "earlier updates must be in"),
        ({"weight_prediction": "2;-1"}, "newest first"),
        (
            {"async_optimizer": False, "weight_prediction": (2.0, -1.0)},
            "only applies with async_optimizer=True",
        ),
        ({"async_warmup_steps": -2}, "async_warmup_steps"),
        ({"async_optimizer": False, "async_lr_ramp_steps": 5}, "only applies with async_optimizer=True"),
        ({"async_lr_ramp_start": 0.0}, "async_lr_ramp_start"),
        ({"async_lr_ramp_start": 1.5}, "async_lr_ramp_start"),
    ],
)
def test_bad_remedy_settings_are_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        roundpipe.RunConfig(**values)


def test_train_options_drop_remedies_in_sync_mode() -> None:
    from roundpipe.train.config import make_config

    sync = make_config({"async_optimizer": False, "weight_prediction": 1.0}).run_config()
    assert not sync.async_optimizer and sync.weight_prediction == 0 and sync.async_warmup_steps == 0
    assert sync.async_lr_ramp_steps == 0
    assert make_config({"async_optimizer": False, "fresh_layers": 3}).run_config().fresh_layers == 0
    assert make_config({"fresh_layers": 3}).run_config().fresh_layers == 3
    run = make_config(
        {"async_warmup_steps": 7, "weight_prediction": 0.5, "async_lr_ramp_steps": 9}
    ).run_config()
    assert run.async_warmup_steps == 7 and run.weight_prediction == 0.5 and run.async_lr_ramp_steps == 9


def test_a_state_resumed_inside_a_longer_warmup_reads_the_newest_weights() -> None:
    """Saved by a plain async run at step 2 (the compute copy one step behind), loaded by a pipe
    whose warm-up runs to step 5: its next iteration is synchronous and must read the weights
    after step 2, not the saved in-flight ones."""
    data = batches(3)
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=remedy_config("cpu:2", 0, 0.0)) as pipe:
        train_steps(pipe, data[:2], mse)
        state = pipe.state_dict()
    model = mlp(seed=99)
    with roundpipe.RoundPipe(model, optimizer=adamw, config=remedy_config("cpu:2", 5, 0.0)) as pipe:
        pipe.load_state_dict(state)
        x, y = data[2]
        with torch.no_grad():
            want = mse(model(x), y).item()  # the module holds the weights after step 2
        assert pipe.forward_backward(x, y, mse) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize(
    ("given", "stored"),
    [(2, 2.0), ("1.5", 1.5), ((2.0,), 2.0), ([2, -1], (2.0, -1.0)), ("2,-1", (2.0, -1.0)), ((0, 0), 0.0)],
)
def test_weight_prediction_has_one_form(given: object, stored: object) -> None:
    """One factor is a float however it is given, several a tuple, none 0.0: configs that mean
    the same compare (and save) the same."""
    assert roundpipe.RunConfig(weight_prediction=given).weight_prediction == stored  # type: ignore[arg-type]


@pytest.mark.parametrize("factors", [(2.0,), (2.0, -1.0), (1.5, -1.25, 0.25)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prediction_is_the_sum_of_the_remembered_updates(
    factors: tuple[float, ...], dtype: torch.dtype
) -> None:
    """Against the definition, on every step from the first remembered one on (fewer updates
    than factors: the missing terms are left out), and the low-precision path, which forms the
    sum in the oldest buffer, predicts the next steps as if it had not."""
    from roundpipe.optim.prediction import WeightPredictor

    gen = torch.Generator().manual_seed(0)
    versions = [torch.randn(5, 3, generator=gen)]
    predictor = WeightPredictor(factors)
    master = versions[0].clone()
    compute = torch.empty(5, 3, dtype=dtype)
    predictor.predict_into(0, compute, master)
    assert torch.equal(compute, master.to(dtype))  # nothing remembered: a plain copy
    for _ in range(5):
        predictor.remember(0, master)
        master += torch.randn(5, 3, generator=gen) * 0.1  # the step
        versions.append(master.clone())
        predictor.predict_into(0, compute, master)
        want = versions[-1].clone()
        for j, factor in enumerate(factors, start=1):
            if len(versions) - j - 1 < 0:
                break
            want += factor * (versions[-j] - versions[-j - 1])
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(compute.float(), want, rtol=tolerance, atol=tolerance)


def test_a_skipped_step_predicts_no_movement_with_any_number_of_factors() -> None:
    """An fp16 overflow skips the step: the next P-copy hands out the weights as they are, not
    an extrapolation of the updates before the skip (which would move them backwards)."""
    from roundpipe.optim.prediction import WeightPredictor

    predictor = WeightPredictor((2.0, -1.0))
    master = torch.zeros(3)
    for update in (1.0, 2.0):
        predictor.remember(0, master)
        master += update
    compute = torch.empty(3)
    predictor.predict_into(0, compute, master)
    assert torch.equal(compute, torch.full((3,), 3.0 + 2 * 2.0 - 1.0))  # W + 2 dW1 - dW2
    predictor.remember(0, master, skipped=True)  # the step that follows changes nothing
    predictor.predict_into(0, compute, master)
    assert torch.equal(compute, master)
    predictor.remember(0, master)
    master += 4.0
    predictor.predict_into(0, compute, master)  # one update known again: W + 2 dW1
    assert torch.equal(compute, torch.full((3,), 7.0 + 2 * 4.0))


def test_an_fp16_overflow_makes_the_pipe_forget_the_updates_it_would_extrapolate() -> None:
    config = roundpipe.RunConfig(
        devices="cpu:2", num_microbatches=2, precision="fp16", weight_prediction=(2.0, -1.0)
    )
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=config) as pipe:
        data = batches(4)
        train_steps(pipe, data[:3], mse)
        kept = pipe.host.predictor.previous
        assert kept and all(len(weights) == 2 for weights in kept.values())
        x, y = data[3]
        pipe.forward_backward(x * 1e6, y, mse)  # overflows in fp16: the step is skipped
        pipe.step()
        pipe.synchronize()
        assert pipe._scaler.skipped_steps == 1
        for key, weights in kept.items():
            assert len(weights) == 1 and torch.equal(weights[0], pipe.host.master[key])


# ------------------------------------------------------------------ fresh layers

# (fresh_layers, async_warmup_steps, weight_prediction, parameter names that read W_t). The mlp's
# layers are Linear, Tanh, Linear, Tanh, Linear, Tanh, Linear: layer i holds the parameters "i.*".
FRESH: list[tuple[int, int, Prediction, tuple[str, ...]]] = [
    (3, 0, 0.0, ("4.", "6.")),
    (1, 2, (2.0, -1.0), ("6.",)),
    (2, 1, 2.0, ("6.",)),  # layer 5 (a Tanh) has no weights to read fresh
    (7, 0, 2.0, ("0.", "2.", "4.", "6.")),  # every layer fresh: the sync loop
]


def fresh_config(devices: str, fresh: int, warmup: int, prediction: Prediction) -> roundpipe.RunConfig:
    return remedy_config(devices, warmup, prediction).model_copy(update={"fresh_layers": fresh})


@pytest.mark.parametrize(("fresh", "warmup", "prediction", "names"), FRESH)
def test_pipe_matches_the_fresh_layers_loop_on_one_two_and_three_workers(
    fresh: int, warmup: int, prediction: Prediction, names: tuple[str, ...]
) -> None:
    data = batches(6)
    _, ref_weights = remedy_reference(
        mlp(), adamw, data, mse, warmup_steps=warmup, prediction=prediction, fresh=names
    )
    configs = [fresh_config(devices, fresh, warmup, prediction) for devices in ("cpu:1", "cpu:2", "cpu:3")]
    assert_pipe_matches(ref_weights, data, configs)


def test_every_layer_fresh_is_the_synchronous_loop() -> None:
    """The reference with every parameter fresh is sync mode itself, so the fresh rules are the
    sync ones, not a third kind of schedule."""
    data = batches(5)
    sync = roundpipe.RunConfig(devices="cpu:2", num_microbatches=4, async_optimizer=False)
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=sync) as pipe:
        want = train_steps(pipe, data, mse)
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=fresh_config("cpu:2", 7, 0, 0.0)) as pipe:
        got = train_steps(pipe, data, mse)
    for a, b in zip(got, want, strict=True):
        assert_weights_equal(a, b, rtol=0, atol=0)


def test_fresh_layers_read_their_own_step_in_the_trace() -> None:
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=fresh_config("cpu:2", 3, 0, 2.0)) as pipe:
        train_steps(pipe, batches(4), mse)
        trace = pipe.trace()
    read = {(t.iteration, t.layers.start): t.step for t in trace if t.kind == "param_up"}
    assert {layer for _, layer in read} == {0, 2, 4, 6}
    for (iteration, layer), version in read.items():
        assert version == (iteration if layer >= 4 else max(0, iteration - 1)), (iteration, layer)
    assert trace.meta["fresh_units"] == [4, 6]
    # A fresh unit's P-copy follows its own step; a stale unit's waits for the next step.
    p_copies = [t for t in trace if t.kind == "p_copy"]
    assert {t.layers.start for t in p_copies if t.step == 3} == {4, 6}


@pytest.mark.parametrize(("fresh", "warmup", "prediction", "stop"), [(3, 0, 2.0, 3), (1, 2, (2.0, -1.0), 1)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_with_fresh_layers_is_bit_exact(
    fresh: int, warmup: int, prediction: Prediction, stop: int, precision: str
) -> None:
    cfg = fresh_config("cpu:2", fresh, warmup, prediction).model_copy(update={"precision": precision})
    assert_resume_is_bit_exact(cfg, stop)


def test_a_state_saved_without_fresh_layers_resumes_with_them() -> None:
    """The saved in-flight weights are the older ones; a unit the loading pipe reads fresh must
    compute on the newest instead: the next loss is the module's (which holds them)."""
    data = batches(3)
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=remedy_config("cpu:2", 0, 0.0)) as pipe:
        train_steps(pipe, data[:2], mse)
        state = pipe.state_dict()
    model = mlp(seed=99)
    with roundpipe.RoundPipe(model, optimizer=adamw, config=fresh_config("cpu:2", 7, 0, 0.0)) as pipe:
        pipe.load_state_dict(state)
        x, y = data[2]
        with torch.no_grad():
            want = mse(model(x), y).item()
        assert pipe.forward_backward(x, y, mse) == pytest.approx(want, rel=1e-6)


def test_a_tied_head_stays_stale_with_its_embedding() -> None:
    from roundpipe.sched.spec import fresh_units_of

    # embedding (unit 0), two layers, a head reading the embedding's weights and its own norm.
    owners = ((0,), (1,), (2,), (0, 3))
    assert fresh_units_of(owners, 1) == frozenset()
    assert fresh_units_of(owners, 2) == {2}
    assert fresh_units_of(owners, 4) == {0, 1, 2, 3}
    assert fresh_units_of(((0,), (), (2,)), 2) == {2}  # a layer without weights changes nothing


def test_fresh_and_stale_owners_of_one_layer_are_refused() -> None:
    from roundpipe.sched.graph import GraphBuilder, ModelSpec, ScheduleOptions

    spec = ModelSpec(param_bytes=(1, 1, 1), owners=((0,), (1,), (0, 2)))
    with pytest.raises(ScheduleError, match="owned by fresh and stale units"):
        GraphBuilder(fused_plan(3), spec, 1, ScheduleOptions(fresh_units=frozenset({2})))


def fused_plan(num_layers: int, num_devices: int = 1, num_microbatches: int = 1) -> Plan:
    return Plan(
        fwd_stages=(),
        fused=range(num_layers),
        bwd_stages=(),
        t_max=3.0 * num_layers,
        num_devices=num_devices,
        num_microbatches=num_microbatches,
        slot_ms=(3.0 * num_layers,),
    )


def test_fresh_layers_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="only applies with async_optimizer=True"):
        roundpipe.RunConfig(async_optimizer=False, fresh_layers=2)
    with pytest.raises(ConfigError, match="fresh_layers"):
        roundpipe.RunConfig(fresh_layers=-1)
    with pytest.raises(ConfigError, match=r"fresh_layers=9 but the model has 7 layers"):
        roundpipe.RoundPipe(mlp(), optimizer=adamw, config=fresh_config("cpu:1", 9, 0, 0.0))


def test_simulate_shows_what_fresh_layers_cost_the_next_forward() -> None:
    """On a fused-only plan every layer's last gradient arrives when the iteration ends, so a
    fresh layer makes the next iteration wait; on a split plan the deep stages' gradients arrive
    while the shallow ones still drain, and their steps land before the next forward needs them."""
    from roundpipe.plan.choose import choose_plan
    from roundpipe.planning.simulate import simulate

    costs = LayerCosts((1.0,) * 4, (2.0,) * 4, (1,) * 4)
    plan = fused_plan(4, 2, 4)
    stale = simulate(plan, costs, 2, 4, 4, True, optimizer_ms=0.5)
    fresh = simulate(plan, costs, 2, 4, 4, True, optimizer_ms=0.5, fresh_layers=2)
    assert fresh.makespan_ms > stale.makespan_ms
    assert fresh.trace.meta["fresh_units"] == [2, 3]
    fresh.trace.check_rules()

    costs = LayerCosts((1.0,) * 32, (2.0,) * 32, (1,) * 32)
    plan = choose_plan(costs, 2, 4, async_optimizer=True)
    assert plan.bwd_stages
    stale = simulate(plan, costs, 2, 4, 4, True, optimizer_ms=0.2)
    fresh = simulate(plan, costs, 2, 4, 4, True, optimizer_ms=0.2, fresh_layers=8)
    assert fresh.makespan_ms == stale.makespan_ms
    assert fresh.trace.meta["fresh_units"] == list(range(24, 32))
    fresh.trace.check_rules()


# (fresh_at, fresh_layers, async_warmup_steps, weight_prediction, parameter names that read W_t)
FRESH_AT: list[tuple[tuple[int, ...], int, int, Prediction, tuple[str, ...]]] = [
    ((0,), 0, 0, (2.0, -1.0), ("0.",)),  # the shallowest layer: its next forward comes first
    ((2,), 1, 2, 2.0, ("2.", "6.")),  # with the deepest layer
    ((0, 1, 4), 0, 1, 0.0, ("0.", "4.")),  # a Tanh listed: nothing to read
]


@pytest.mark.parametrize(("at", "deepest", "warmup", "prediction", "names"), FRESH_AT)
def test_pipe_matches_the_fresh_at_loop_on_one_two_and_three_workers(
    at: tuple[int, ...], deepest: int, warmup: int, prediction: Prediction, names: tuple[str, ...]
) -> None:
    data = batches(6)
    _, ref_weights = remedy_reference(
        mlp(), adamw, data, mse, warmup_steps=warmup, prediction=prediction, fresh=names
    )
    configs = [
        fresh_config(devices, deepest, warmup, prediction).model_copy(update={"fresh_at": at})
        for devices in ("cpu:1", "cpu:2", "cpu:3")
    ]
    assert_pipe_matches(ref_weights, data, configs)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_with_fresh_at_is_bit_exact(precision: str) -> None:
    cfg = fresh_config("cpu:2", 0, 1, (2.0, -1.0)).model_copy(
        update={"fresh_at": (0,), "precision": precision}
    )
    assert_resume_is_bit_exact(cfg, 3)


def test_fresh_at_picks_the_listed_layers_units() -> None:
    from roundpipe.sched.spec import fresh_units_at

    owners = ((0,), (1,), (2,), (0, 3))  # embedding, two blocks, a head tied to the embedding
    assert fresh_units_at(owners, [1]) == {1}
    assert fresh_units_at(owners, [0]) == frozenset()  # the head reads the embedding's weights
    assert fresh_units_at(owners, [0, 3]) == {0, 3}
    assert fresh_units_at(owners, range(2, 4)) == {2}  # what fresh_layers=2 reads


def test_fresh_at_settings_are_checked() -> None:
    from roundpipe.config import layer_indices

    assert roundpipe.RunConfig(fresh_at="2,1").fresh_at == (1, 2)
    assert roundpipe.RunConfig(fresh_at=3).fresh_at == (3,)
    assert roundpipe.RunConfig(fresh_at="none").fresh_at == ()
    assert layer_indices([]) == ()
    for bad, message in [("1,x", "no layer index"), ((-1,), "count from 0"), ((1, 1), "each layer once")]:
        with pytest.raises(ConfigError, match=message):
            roundpipe.RunConfig(fresh_at=bad)
    with pytest.raises(ConfigError, match="only applies with async_optimizer=True"):
        roundpipe.RunConfig(async_optimizer=False, fresh_at=(1,))
    with pytest.raises(ConfigError, match=r"fresh_at=\[7\] but the model has 7 layers, 0 to 6"):
        roundpipe.RoundPipe(
            mlp(),
            optimizer=adamw,
            config=fresh_config("cpu:1", 0, 0, 0.0).model_copy(update={"fresh_at": (7,)}),
        )


def test_a_listed_layer_sharing_weights_with_a_stale_one_is_refused() -> None:
    """A tied LM head listed alone cannot read fresh weights (the embedding reads the same ones,
    stale): asked for by index, that is an error that names the other layer, not a silent no."""
    from roundpipe.assembly import fresh_units

    owners = ((0,), (1,), (2,), (0, 3))
    config = roundpipe.RunConfig(fresh_at=(3,))
    with pytest.raises(ConfigError, match=r"fresh_at lists layer 3, whose weights layer\(s\) \[0\] share"):
        fresh_units(config, owners)
    assert fresh_units(roundpipe.RunConfig(fresh_at=(0, 3)), owners) == {0, 3}
    assert fresh_units(roundpipe.RunConfig(fresh_at=(0,), fresh_layers=1), owners) == {0, 3}


def test_a_fresh_units_optimizer_work_runs_first_on_the_lane() -> None:
    """On a fused-only plan every gradient lands at the iteration's end and the next forward
    waits for the fresh unit's G-copy, step and P-copy: they run before the stale units' work,
    so the wait is one unit's chain wherever the unit lies (before, a deep fresh unit waited
    behind every shallower unit's G-copy and step)."""
    from roundpipe.planning.simulate import simulate

    n = 8
    costs = LayerCosts((1.0,) * n, (2.0,) * n, (1,) * n)
    waits = {}
    for at in [(), (1,), (6,)]:
        result = simulate(
            fused_plan(n, 1, 4), costs, 1, 4, iterations=4, optimizer_ms=2.0, fresh_at=at, after_loss=True
        )
        result.trace.check_rules()
        computes = [t for t in result.trace if t.kind == "compute"]
        ends = [max(t.end_t for t in computes if t.iteration == i) for i in range(3)]
        starts = [min(t.start_t for t in computes if t.iteration == i) for i in range(1, 4)]
        waits[at] = [round(b - a, 6) for a, b in zip(ends, starts, strict=True)][1:]
        if at:
            lane = sorted(
                (t for t in result.trace if t.lane == "host.optimizer" and t.step == 1),
                key=lambda t: t.start_t,
            )
            assert [(t.kind, t.layers.start) for t in lane[:3]] == [
                ("g_copy", at[0]),
                ("step", at[0]),
                ("p_copy", at[0]),
            ]
    assert waits[(1,)] == waits[(6,)] and all(w > s for w, s in zip(waits[(1,)], waits[()], strict=True))


def test_the_quality_bench_reads_fresh_the_parameters_the_pipe_does() -> None:
    """bench/async_quality.py's plain loop picks its fresh parameters itself (it never builds a
    pipe); on the main job's model, tied head included, they are the fresh units' own."""
    import importlib.util
    import sys
    from pathlib import Path

    from roundpipe.train.config import TrainConfig
    from roundpipe.train.model import build_model

    path = Path(__file__).parent.parent / "bench" / "async_quality.py"
    spec = importlib.util.spec_from_file_location("async_quality", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["async_quality"] = bench  # its dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules["async_quality"]
    model = build_model(TrainConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    config = roundpipe.RunConfig(devices="cpu:1", fresh_layers=4)
    with roundpipe.RoundPipe(model, optimizer=adamw, config=config) as pipe:
        units = pipe._options.fresh_units
        want = {names[id(p)] for unit in units for p in pipe.host.unit_params[unit]}
    assert units == {4, 5, 6}  # blocks 3-5: the head (layer 7) shares the embedding's weights
    got = {names[key] for key in bench.fresh_parameters(model, 4)}
    assert got == want and all(".layers.3." in n or ".layers.4." in n or ".layers.5." in n for n in got)
    config = roundpipe.RunConfig(devices="cpu:1", fresh_at=(1,), fresh_layers=2)
    with roundpipe.RoundPipe(model, optimizer=adamw, config=config) as pipe:
        units = pipe._options.fresh_units
        want = {names[id(p)] for unit in units for p in pipe.host.unit_params[unit]}
    assert units == {1, 6}  # the first block and the last (the head stays stale)
    assert {names[key] for key in bench.fresh_parameters(model, 2, (1,))} == want
    # The bench's default mode is what `roundpipe train` runs on the main job (one fused stage).
    mode, train = bench.Mode.parse(bench.DEFAULT_MODE), TrainConfig()
    with roundpipe.RoundPipe(build_model(train), optimizer=adamw, config=train.run_config()) as pipe:
        assert pipe.fresh_units == set(mode.fresh_at) == {1}
    assert (mode.warmup, mode.prediction, mode.ramp_steps, mode.ramp_start) == (
        train.async_warmup_steps,
        train.weight_prediction,
        train.async_lr_ramp_steps,
        train.async_lr_ramp_start,
    )


def test_simulate_after_loss_runs_as_a_training_loop_does() -> None:
    """Submitted as `forward_backward` then `step` submit them, the next iteration starts only
    once the fused stage's losses are in: never sooner than the chained run, and the fresh
    layers' wait is measured against that loop. The trace replays exactly."""
    from roundpipe.plan.choose import choose_plan
    from roundpipe.planning.simulate import replay, simulate

    costs = LayerCosts((1.0,) * 24, (2.0,) * 24, (1,) * 24)
    plan = choose_plan(costs, 4, 8, async_optimizer=True)
    chained = simulate(plan, costs, 4, 8, 5, True, optimizer_ms=0.2)
    loop = simulate(plan, costs, 4, 8, 5, True, optimizer_ms=0.2, after_loss=True)
    fresh = simulate(plan, costs, 4, 8, 5, True, optimizer_ms=0.2, after_loss=True, fresh_layers=6)
    assert loop.makespan_ms >= chained.makespan_ms
    assert fresh.makespan_ms >= loop.makespan_ms
    for result in (loop, fresh):
        result.trace.check_rules()
        again = replay(result.trace)
        assert again.order() == result.trace.order()
    first_computes = {}
    for task in loop.trace:
        if task.kind == "compute":
            first_computes[task.iteration] = min(first_computes.get(task.iteration, 1e18), task.start_t)
    fused_done = {}
    for task in loop.trace:
        if task.kind == "compute" and task.stage_kind == "fused":
            fused_done[task.iteration] = max(fused_done.get(task.iteration, 0.0), task.end_t)
    for iteration in range(1, 5):
        assert first_computes[iteration] >= fused_done[iteration - 1]


def test_the_next_iterations_p_copies_run_before_the_steps() -> None:
    """The deferred P-copies gate the next iteration's uploads; the steps are first read two
    iterations later. On the lane every P-copy of step s-1 ends before any step of s starts, and
    the next iteration's first compute does not wait for the steps."""
    from roundpipe.planning.simulate import simulate

    costs = LayerCosts((1.0,) * 6, (2.0,) * 6, (1,) * 6)
    plan = fused_plan(6, 2, 4)
    result = simulate(plan, costs, 2, 4, 5, True, optimizer_ms=2.0, after_loss=True)
    result.trace.check_rules()
    tasks = list(result.trace)
    for step in range(2, 4):
        p_copies = [t for t in tasks if t.kind == "p_copy" and t.step == step - 1]
        steps = [t for t in tasks if t.kind == "step" and t.step == step]
        assert len(p_copies) == 6 and max(t.end_t for t in p_copies) <= min(t.start_t for t in steps)
        first = min(t.start_t for t in tasks if t.kind == "compute" and t.iteration == step + 1)
        assert first < max(t.end_t for t in steps)  # iteration s+1 started while step s ran


def test_an_async_pipe_on_four_workers_computes_each_iteration_on_all_of_them() -> None:
    """8 microbatches on 4 workers: the plan must not leave two of them idle per iteration (the
    chained evaluation chose a fused-only plan that ran its two rounds on two workers)."""
    config = roundpipe.RunConfig(devices="cpu:4", num_microbatches=8)
    with roundpipe.RoundPipe(mlp(depth=6, width=64), optimizer=adamw, config=config) as pipe:
        train_steps(pipe, batches(4, batch=16), mse)
        trace = pipe.trace()
    for iteration in range(1, 4):
        assert {t.device for t in trace if t.kind == "compute" and t.iteration == iteration} == {0, 1, 2, 3}


@pytest.mark.parametrize(("devices", "fresh"), [("cpu:1", ("2.",)), ("cpu:3", ())])
def test_fresh_at_if_fused_follows_the_plan_on_one_and_three_workers(
    devices: str, fresh: tuple[str, ...]
) -> None:
    """One worker plans this model as one fused stage, three split it: the listed layer is fresh
    on the first and stale on the second, each exactly as its plain loop."""
    data = batches(6)
    _, ref_weights = remedy_reference(
        mlp(), adamw, data, mse, warmup_steps=1, prediction=(2.0, -1.0), fresh=fresh
    )
    config = fresh_config(devices, 0, 1, (2.0, -1.0)).model_copy(update={"fresh_at_if_fused": (2,)})
    with roundpipe.RoundPipe(mlp(), optimizer=adamw, config=config) as pipe:
        assert pipe.fresh_units == ({2} if fresh else frozenset())
        assert bool(fresh) == (not pipe.plan.fwd_stages and not pipe.plan.bwd_stages)
    assert_pipe_matches(ref_weights, data, [config])


def test_resume_with_fresh_at_if_fused_is_bit_exact() -> None:
    cfg = fresh_config("cpu:2", 0, 1, (2.0, -1.0)).model_copy(update={"fresh_at_if_fused": (0,)})
    assert_resume_is_bit_exact(cfg, 3)


def test_fresh_at_if_fused_reads_fresh_on_one_fused_stage_and_stale_on_a_split_plan() -> None:
    """`roundpipe train`'s default: the first block fresh where the plan made at construction is
    one fused stage (its step then sits between iterations); on a split plan it would stall the
    first stages for the last, so the layers stay one step behind. Which plan it is comes from
    the estimated costs, so the run trains exactly as the plain loop of what it chose."""
    data = batches(6)
    base = fresh_config("cpu:2", 0, 1, (2.0, -1.0)).model_copy(update={"fresh_at_if_fused": (2,)})
    fused = roundpipe.RoundPipe(mlp(), optimizer=adamw, config=base)
    assert (fused.plan.fwd_stages, fused.plan.bwd_stages) == ((), ())
    assert fused.fresh_units == {2}
    with fused:
        weights = train_steps(fused, data, mse)
    _, ref_fresh = remedy_reference(
        mlp(), adamw, data, mse, warmup_steps=1, prediction=(2.0, -1.0), fresh=("2.",)
    )
    for got, want in zip(weights, ref_fresh, strict=True):
        assert_weights_equal(got, want)

    split = roundpipe.RoundPipe(
        mlp(), optimizer=adamw, config=base.model_copy(update={"mem_limit_bytes": 2400})
    )
    assert split.plan.fwd_stages or split.plan.bwd_stages
    assert split.fresh_units == frozenset()
    with split:
        weights = train_steps(split, data, mse)
    _, ref_stale = remedy_reference(mlp(), adamw, data, mse, warmup_steps=1, prediction=(2.0, -1.0))
    for got, want in zip(weights, ref_stale, strict=True):
        assert_weights_equal(got, want)
    sync = roundpipe.RoundPipe(mlp(), optimizer=adamw, config=roundpipe.RunConfig(async_optimizer=False))
    assert sync.fresh_units == frozenset()
    sync.close()
    with pytest.raises(ConfigError, match="only applies with async_optimizer=True"):
        roundpipe.RunConfig(async_optimizer=False, fresh_at_if_fused=(1,))
