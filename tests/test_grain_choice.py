"""``recompute_grain="auto"`` takes "layer_input" only where every decoder layer ends in a frozen
dense product, on a device kind that chooses, where a plan fits with it and the host has room;
"stage" otherwise. A pipe that chose trains exactly as one told the grain it chose."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.errors import PlanError
from roundpipe.model.frozen_tail import dense_tail_width
from roundpipe.model.sequence import to_layer_sequence
from roundpipe.planning import grain as grain_choice
from roundpipe.planning.grain import choose_grain, host_room, initial_grain
from tests.helpers import tiny_causal_lm
from tests.test_frozen_tail import four_block_lora, trained_on_one_worker
from tests.test_transformers_parity import VOCAB, lora, tiny_qwen3_moe


def layers_of(model: nn.Module) -> list[nn.Module]:
    return list(to_layer_sequence(model).layers)


@pytest.fixture
def narrow_models_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test models are 32 wide: let "auto" choose for them as for a 4,096-wide one."""
    monkeypatch.setattr(grain_choice, "MIN_WIDTH", 1)


def test_the_tail_width_is_the_hidden_size_for_lora_and_0_for_full_training_or_experts() -> None:
    assert dense_tail_width(layers_of(four_block_lora())) == 32
    down_too = lora(tiny_causal_lm("llama", vocab=VOCAB, attn="sdpa"), ("q_proj", "down_proj"))
    assert dense_tail_width(layers_of(down_too)) == 32  # peft's LoRA keeps the frozen base product
    assert dense_tail_width(layers_of(tiny_causal_lm("qwen3", vocab=VOCAB, attn="sdpa"))) == 0  # trains it
    assert dense_tail_width(layers_of(lora(tiny_qwen3_moe(), ("q_proj", "v_proj")))) == 0
    assert dense_tail_width([nn.Linear(4, 4)]) == 0  # no decoder layer at all


def test_one_trained_down_proj_is_enough_to_keep_stage() -> None:
    model = four_block_lora()
    model.get_submodule("base_model.model.model.layers.2.mlp.down_proj").weight.requires_grad_(True)
    assert dense_tail_width(layers_of(model)) == 0


class Planned:
    """What a plan stands for here: its grain, the bytes it saves on the host, and whether those
    include the residuals."""

    def __init__(self, grain: str, saved: int, residuals: bool = False) -> None:
        self.grain, self.saved, self.residuals = grain, saved, residuals


def choose(
    config_grain: str = "auto",
    kind: str = "cuda",
    available: int | None = 1000,
    saved: int = 400,
    fits: bool = True,
    model: nn.Module | None = None,
    residuals: int | None = None,
    save_residuals: bool = True,
) -> tuple[str, list[str], str]:
    """The grain chosen, the grains planned on the way (in order; "+r" where with residuals) and
    the reason given. ``residuals``: the bytes the layers' residuals add (None: they keep none)."""
    asked: list[str] = []

    def plan_at(grain: str, with_residuals: bool) -> Planned:
        keeps = with_residuals and grain == "layer_input" and residuals is not None
        asked.append(grain + ("+r" if keeps else ""))
        if grain == "layer_input" and not fits:
            raise PlanError("does not fit")
        inputs = saved if grain == "layer_input" else 0
        return Planned(grain, inputs + (residuals or 0 if keeps else 0), keeps)

    config = roundpipe.RunConfig(recompute_grain=config_grain, save_residuals=save_residuals)
    layers = layers_of(model if model is not None else four_block_lora())
    room = host_room(available, environ={})
    chosen, why = choose_grain(config, layers, kind, plan_at, lambda p: p.saved, room)
    return chosen.grain + ("+r" if chosen.residuals else ""), asked, why


@pytest.mark.usefixtures("narrow_models_choose")
def test_auto_saves_the_residuals_where_they_fit_the_host_room_beside_the_inputs() -> None:
    assert choose(residuals=100) == (
        "layer_input+r",
        ["layer_input+r"],
        "auto: one round's layer inputs and residuals (500 B) fit the host room (500 B)",
    )
    # Inputs and residuals too many, the inputs alone fit: those.
    assert choose(residuals=101) == (
        "layer_input",
        ["layer_input+r", "layer_input"],
        "auto: one round's layer inputs (400 B) fit the host room (500 B)",
    )
    assert choose(saved=501, residuals=1) == (
        "stage",
        ["layer_input+r", "layer_input", "stage"],
        "auto: one round's layer inputs (501 B) exceed the host room (500 B)",
    )
    assert choose(residuals=100, save_residuals=False)[:2] == ("layer_input", ["layer_input"])
    assert choose("layer_input", residuals=100, available=None)[0] == "layer_input+r"


def test_a_model_narrower_than_the_floor_keeps_stage() -> None:
    assert grain_choice.MIN_WIDTH == 4096
    assert choose() == ("stage", ["stage"], "auto: 32 wide, under 4096")


@pytest.mark.usefixtures("narrow_models_choose")
def test_auto_takes_layer_input_on_cuda_for_a_lora_model_with_host_room() -> None:
    grain, asked, why = choose()
    assert (grain, asked) == ("layer_input", ["layer_input"])
    assert why == "auto: one round's layer inputs (400 B) fit the host room (500 B)"
    assert choose(saved=500)[:2] == ("layer_input", ["layer_input"])  # exactly half the host


@pytest.mark.parametrize(
    "case,reason",
    [
        (dict(kind="cpu"), "cpu devices recompute each backward stage from its input"),
        (dict(kind="fake"), "fake devices recompute each backward stage from its input"),
        (dict(available=None), "the host's available memory is unknown"),
        (dict(saved=501), "one round's layer inputs (501 B) exceed the host room (500 B)"),
        (dict(fits=False), "no plan fits the memory budget at layer_input"),
        (
            dict(model=tiny_causal_lm("qwen3", vocab=VOCAB, attn="sdpa")),  # every weight trains
            "not every decoder layer ends in a frozen dense down_proj",
        ),
    ],
    ids=["cpu", "fake", "host-unknown", "host-short", "budget", "full-training"],
)
@pytest.mark.usefixtures("narrow_models_choose")
def test_auto_keeps_stage_where_a_condition_fails(case: dict[str, Any], reason: str) -> None:
    grain, asked, why = choose(**case)
    assert grain == "stage" and asked[-1] == "stage"
    assert why == "auto: " + reason


def test_processes_on_one_host_share_its_room() -> None:
    assert host_room(1000, environ={}) == 500
    assert host_room(1000, environ={"LOCAL_WORLD_SIZE": "4"}) == 125  # each sees the whole host
    assert host_room(None, environ={"LOCAL_WORLD_SIZE": "4"}) is None


@pytest.mark.parametrize("named", ["stage", "layer", "layer_input"])
def test_a_named_grain_is_planned_as_named(named: str) -> None:
    assert choose(named, kind="cpu", available=None) == (named, [named], "named in RunConfig.recompute_grain")
    assert initial_grain(roundpipe.RunConfig(recompute_grain=named)) == named


def test_auto_runs_at_stage_until_a_device_plan_chooses() -> None:
    assert roundpipe.RunConfig().recompute_grain == "auto"
    assert initial_grain(roundpipe.RunConfig()) == "stage"
    config = roundpipe.RunConfig(devices="cpu:1", async_optimizer=False)
    with roundpipe.RoundPipe(four_block_lora(), config=config) as pipe:  # no budget: no device plan
        assert pipe.trace().meta["recompute_grain"] == pipe.runtime.recompute_grain == "stage"


def run(grain: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    return trained_on_one_worker(four_block_lora(), grain, True, microbatches=4, budget="256KiB")


@pytest.mark.usefixtures("narrow_models_choose")
def test_a_pipe_that_chose_layer_input_trains_exactly_as_one_told_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grain_choice, "CHOOSES_ON", frozenset({"cpu"}))  # the CUDA rule, on a CPU worker
    losses, adapters, meta = run("auto")
    assert meta["recompute_grain"] == "layer_input"
    assert meta["recompute_grain_why"].startswith("auto: one round's layer inputs")
    told_losses, told, told_meta = run("layer_input")
    stages = [k for k in meta["plan"] if k.endswith("stages") or k == "fused"]
    assert "bwd_stages" in stages
    assert told_meta["recompute_grain"] == "layer_input"
    assert [meta["plan"][k] for k in stages] == [told_meta["plan"][k] for k in stages]
    assert losses == told_losses
    for name in told:
        assert torch.equal(adapters[name], told[name]), name


@pytest.mark.usefixtures("narrow_models_choose")
def test_a_pipe_short_of_host_room_keeps_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grain_choice, "CHOOSES_ON", frozenset({"cpu"}))
    monkeypatch.setattr(grain_choice, "HOST_SHARE", 1e-12)
    losses, adapters, meta = run("auto")
    assert meta["recompute_grain"] == "stage" and "exceed the host room" in meta["recompute_grain_why"]
    stage_losses, stage, _ = run("stage")
    assert losses == stage_losses
    for name in stage:
        assert torch.equal(adapters[name], stage[name]), name


def test_the_train_command_passes_the_grain_through() -> None:
    import argparse

    from roundpipe.cli.train_command import add_parser, options
    from roundpipe.train.config import TrainConfig, make_config

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--recompute-grain", "layer_input"])
    assert make_config(options(args)).run_config().recompute_grain == "layer_input"
    assert TrainConfig().run_config().recompute_grain == "auto"
    with pytest.raises(
        roundpipe.ConfigError, match=r"--recompute-grain: .* or .layer_input. \(got .layers.\)"
    ):
        make_config({"recompute_grain": "layers"})


def test_the_profile_keeps_residuals_only_for_a_run_that_may_save_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As its forward stages will call the layers (one compiled variant, not two): at a named
    layer_input, or where "auto" may take it before a plan is made (CUDA, a frozen dense tail at
    least `MIN_WIDTH` wide)."""
    from roundpipe.planning.device_plan import may_save_residuals

    layers = layers_of(four_block_lora())  # 32 wide

    def may(kind: str = "cuda", **fields: Any) -> bool:
        return may_save_residuals(roundpipe.RunConfig(**fields), kind, layers)

    assert may(recompute_grain="layer_input", kind="cpu")
    assert not may(recompute_grain="layer_input", save_residuals=False)
    assert not may(recompute_grain="layer_input", skip_unread_tail=False)
    assert not may(recompute_grain="stage") and not may()  # "auto": 32 wide, under the floor
    monkeypatch.setattr(grain_choice, "MIN_WIDTH", 32)
    assert may() and not may(kind="cpu")
