"""Gemma 3 (text) and Phi-3 / Phi-4 causal LMs through RoundPipe equal the plain transformers loop.

Gemma 3 keeps one rotary table per layer type (local sliding layers and global full layers have
different bases), a scaled embedding and q/k norms; Phi-3 slides every layer when
``sliding_window`` is set and rotates only part of each head (``partial_rotary_factor``, as
Phi-4-mini does). fp32, sync, SGD on ``cpu:2``: losses and weights agree to 1e-5.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe.errors import ModelError
from roundpipe.model.transformers_presets import causal_lm_layers
from tests.test_transformers_parity import VOCAB, assert_same_weights, pipe_loop, reference_loop, token_data

SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_gemma3(seed: int = 0, attn: str = "eager", **overrides: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **SMALL,
        num_hidden_layers=3,
        head_dim=8,
        sliding_window=4,
        query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        **overrides,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def tiny_phi3(seed: int = 0, attn: str = "sdpa") -> nn.Module:
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(**SMALL, num_hidden_layers=2, sliding_window=4, partial_rotary_factor=0.5)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


@pytest.mark.parametrize(
    ("make", "attn"),
    [(tiny_gemma3, "eager"), (tiny_gemma3, "sdpa"), (tiny_phi3, "sdpa"), (tiny_phi3, "eager")],
    ids=["gemma3-eager", "gemma3-sdpa", "phi3-sdpa", "phi3-eager"],
)
def test_training_matches_transformers_loop(make: Any, attn: str) -> None:
    model: Any = make(attn=attn)
    reference = copy.deepcopy(model)
    initial = copy.deepcopy(model.state_dict())
    data = token_data(3)
    expected = reference_loop(reference, data)
    assert pipe_loop(model, data) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert_same_weights(model, reference)
    assert all(not torch.equal(t, initial[n]) for n, t in model.state_dict().items())


def test_gemma3_layers_read_the_rotary_table_of_their_type() -> None:
    model: Any = tiny_gemma3()
    layers, _ = causal_lm_layers(model)
    assert [layer.rotary_keys for layer in layers[1:-1]] == [
        ("_cos_sliding", "_sin_sliding"),
        ("_cos", "_sin"),
        ("_cos_sliding", "_sin_sliding"),
    ]
    batch = token_data(1)[0]
    with torch.no_grad():
        x = layers[0](batch)
        assert not torch.equal(x["_cos"], x["_cos_sliding"])  # different bases per layer type
        swapped = dict(x, _cos=x["_cos_sliding"], _sin=x["_sin_sliding"])
        loss, wrong = x, swapped
        for layer in layers[1:]:
            loss, wrong = layer(loss), layer(wrong)
        assert float(loss) == pytest.approx(float(model(**batch).loss), abs=1e-6)
        assert abs(float(wrong) - float(loss)) > 1e-5


def test_gemma3_logit_softcapping_is_refused() -> None:
    with pytest.raises(ModelError, match=r"final_logit_softcapping=30.0: roundpipe's chunked loss does not"):
        roundpipe.RoundPipe(
            tiny_gemma3(final_logit_softcapping=30.0), config=roundpipe.RunConfig(devices="cpu:1")
        )
