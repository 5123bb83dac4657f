"""A profile of one layer per kind gives every layer of the kind the measured layer's figures and
runs only the layers it measures; layers that differ (sliding against full attention, the
embedding, the head) are each measured."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import roundpipe
from roundpipe.backends import profile
from roundpipe.backends.profile import measure_layers
from roundpipe.backends.profile_kinds import cost_kind, structure
from roundpipe.model.sequence import to_layer_sequence
from tests.helpers import tiny_causal_lm
from tests.test_moe_parity import tiny_gpt_oss

CPU = torch.device("cpu")
MEASURE_LAYER = profile._measure_layer


def count_measured(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the indices of the layers the profile measures, in order."""
    ran: list[int] = []

    def counting(index: int, *args: Any, **kwargs: Any) -> Any:
        ran.append(index)
        return MEASURE_LAYER(index, *args, **kwargs)

    monkeypatch.setattr(profile, "_measure_layer", counting)
    return ran


def measured(model: Any, one_per_kind: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[int]]:
    """The measurements of ``model``'s layers and the indices of the layers that ran."""
    seq = to_layer_sequence(model)
    ran = count_measured(monkeypatch)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    ms = measure_layers(
        seq.layers, batch, CPU, computes_loss=True, names=seq.names, one_per_kind=one_per_kind
    )
    return ms, ran


def test_identical_decoder_layers_are_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_causal_lm("qwen3", attn="sdpa")
    every, ran_every = measured(model, False, monkeypatch)
    ones, ran_ones = measured(model, True, monkeypatch)
    assert ran_every == [0, 1, 2, 3] and ran_ones == [0, 1, 3]  # embed, first block, head
    assert [m.name for m in ones] == [m.name for m in every] and [m.index for m in ones] == [0, 1, 2, 3]
    first, second = ones[1], ones[2]
    assert {k: v for k, v in vars(second).items() if k not in ("index", "name")} == {
        k: v for k, v in vars(first).items() if k not in ("index", "name")
    }
    # What the skipped layer takes is what measuring it gives, up to timing.
    for field in ("param_bytes", "grad_bytes", "saved_bytes", "boundary_bytes", "carried_bytes"):
        assert getattr(second, field) == getattr(every[2], field), field


def test_sliding_and_full_attention_layers_are_two_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_gpt_oss(layers=4)
    _, ran = measured(model, True, monkeypatch)
    assert ran == [0, 1, 2, 5]  # embed, a sliding and a full block, head; blocks 3 and 4 repeat them
    seq = to_layer_sequence(model)
    x = {"hidden": torch.zeros(2, 16, 8)}
    assert cost_kind(seq.layers[1], x, False) != cost_kind(seq.layers[2], x, False)
    assert cost_kind(seq.layers[1], x, False) == cost_kind(seq.layers[3], x, False)


def test_sliding_and_full_attention_layers_are_each_warmed_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled layer traces one graph per attention variant, so the first full-attention block
    after a sliding one must not be timed while it compiles: each variant gets its own warm-up,
    and repeats of a variant get none."""
    warmed: list[int] = []
    real = profile._warm_up
    monkeypatch.setattr(
        profile, "_warm_up", lambda call, x, i, *rest: (warmed.append(i), real(call, x, i, *rest))
    )
    measured(tiny_gpt_oss(layers=4), False, monkeypatch)
    assert warmed == [0, 1, 2, 5]  # embed, a sliding and a full block, head


def test_structure_sees_shapes_dtypes_and_nesting() -> None:
    a = {"hidden": torch.zeros(2, 3), "n": 1}
    assert structure(a) == structure({"hidden": torch.ones(2, 3), "n": 5})
    assert structure(a) != structure({"hidden": torch.zeros(2, 4), "n": 1})
    assert structure(a) != structure({"hidden": torch.zeros(2, 3, dtype=torch.bfloat16), "n": 1})
    assert structure(a) != structure({"hidden": torch.zeros(2, 3)})


def test_run_config_profile_choices() -> None:
    assert roundpipe.RunConfig().profile == "every_layer"
    assert roundpipe.RunConfig(profile="one_per_kind").profile == "one_per_kind"
    with pytest.raises(roundpipe.ConfigError):
        roundpipe.RunConfig(profile="some")  # type: ignore[arg-type]


def test_a_run_profiles_one_layer_per_kind_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a memory budget a CPU run profiles before it plans (as every CUDA run does): with
    ``profile="one_per_kind"`` only the embedding, one block and the head run in it."""
    ran = count_measured(monkeypatch)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = {}
    for choice in ("every_layer", "one_per_kind"):
        ran.clear()
        config = roundpipe.RunConfig(
            devices="cpu:1", num_microbatches=2, memory_budget="1GiB", profile=choice, async_optimizer=False
        )
        model = tiny_causal_lm("qwen3", attn="sdpa")
        with roundpipe.RoundPipe(
            model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), config=config
        ) as pipe:
            losses[choice] = pipe.forward_backward({"input_ids": ids, "labels": ids})
            pipe.step()
            pipe.synchronize()
        assert ran == ([0, 1, 2, 3] if choice == "every_layer" else [0, 1, 3])
    assert losses["one_per_kind"] == losses["every_layer"]  # the plan changes no number


def test_train_takes_the_profile_choice() -> None:
    from roundpipe.cli import build_parser
    from roundpipe.cli.train_command import options
    from roundpipe.train.config import make_config

    parsed = build_parser().parse_args(["train", "--profile", "one_per_kind"])
    assert make_config(options(parsed)).run_config().profile == "one_per_kind"
    assert make_config({}).run_config().profile == "every_layer"
