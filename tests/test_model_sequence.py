"""Layer sequences of transformers models equal the models themselves: loss, gradients, two-stage runs."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from roundpipe.errors import ModelError
from roundpipe.model import LayerSequence, to_layer_sequence
from roundpipe.model.transformers_presets import _check_attention

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


VOCAB = 61
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _build(config: Any, seed: int = 0, attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    # Non-trivial norm weights so that every parameter's gradient is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def qwen3(attn: str = "sdpa", **over: Any) -> Any:
    return _build(
        transformers.Qwen3Config(**{**TINY, "head_dim": 8, "tie_word_embeddings": True, **over}), attn=attn
    )


def llama(attn: str = "sdpa") -> nn.Module:
    return _build(transformers.LlamaConfig(**TINY, tie_word_embeddings=False), attn=attn)


def qwen2() -> nn.Module:
    return _build(transformers.Qwen2Config(**TINY, tie_word_embeddings=False))


def mistral() -> nn.Module:
    return _build(transformers.MistralConfig(**TINY, sliding_window=4, tie_word_embeddings=False))


def _inputs(batch: int = 3, seq: int = 11, pad: bool = False, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    out = {"input_ids": ids, "labels": labels}
    if pad:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, -4:] = 0  # right padding
        mask[1, :3] = 0  # left padding
        labels[mask == 0] = -100
        out["attention_mask"] = mask
    return out


def _reference(
    model: nn.Module, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run_sequential(seq: LayerSequence, inputs: Any) -> torch.Tensor:
    out = inputs
    for layer in seq.layers:
        out = layer(out)
    return out


def _assert_grads_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "qwen3-tied-sdpa": qwen3,
    "qwen3-eager": lambda: qwen3("eager"),
    "qwen3-sliding": lambda: qwen3(use_sliding_window=True, max_window_layers=1, sliding_window=4),
    "llama-untied": llama,
    "llama-eager": lambda: llama("eager"),
    "qwen2": qwen2,
    "mistral-sliding": mistral,
}


@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_sequential_run_equals_model(make: Callable[[], nn.Module], pad: bool) -> None:
    model = make()
    inputs = _inputs(pad=pad)
    ref_loss, ref_grads = _reference(model, inputs)
    seq = to_layer_sequence(model, loss_chunk_tokens=7)  # 33 tokens: chunks do not divide evenly
    assert seq.computes_loss and seq.source is model
    loss = _run_sequential(seq, inputs)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    _assert_grads_equal(_grads(model), ref_grads)


def test_names_and_structure() -> None:
    model = qwen3()
    seq = to_layer_sequence(model)
    assert seq.names == ["embed", "block.0", "block.1", "block.2", "head"]
    assert len(seq) == 5
    # Every parameter of the model appears in some layer, none is copied.
    model_params = {id(p) for p in model.parameters()}
    layer_params = {id(p) for layer in seq.layers for p in layer.parameters()}
    assert layer_params == model_params


def test_tied_embedding_is_one_parameter_in_embed_and_head() -> None:
    model = qwen3()
    seq = to_layer_sequence(model)
    weight = model.get_input_embeddings().weight
    assert any(p is weight for p in seq.layers[0].parameters())
    assert any(p is weight for p in seq.layers[-1].parameters())
    untied = to_layer_sequence(llama())
    assert not {id(p) for p in untied.layers[0].parameters()} & {
        id(p) for p in untied.layers[-1].parameters()
    }


def test_activation_convention() -> None:
    seq = to_layer_sequence(qwen3("eager"))
    inputs = _inputs(pad=True)
    act = seq.layers[0](inputs)
    assert set(act) == {"hidden", "_cos", "_sin", "_mask", "_labels"}
    assert act["hidden"].requires_grad
    for key, value in act.items():
        assert isinstance(value, torch.Tensor)
        if key.startswith("_"):
            assert not value.requires_grad, key
    assert act["_labels"].dtype == torch.long
    torch.testing.assert_close(act["_labels"][:, :-1], inputs["labels"][:, 1:])
    assert (act["_labels"][:, -1] == -100).all()
    block_out = seq.layers[1](act)
    assert set(block_out) == set(act)
    for key in act:
        if key != "hidden":
            assert block_out[key] is act[key]


def test_sdpa_without_padding_carries_no_mask() -> None:
    act = to_layer_sequence(qwen3())
    out = act.layers[0]({"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    assert "_mask" not in out and "_labels" not in out


def _two_stage(seq: LayerSequence, inputs: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    """Run the layers as the pipeline does: forward [0,k) without grad, recompute both halves."""
    first, second = seq.layers[:k], seq.layers[k:]
    with torch.no_grad():
        x: Any = inputs
        for layer in first:
            x = layer(x)
    boundary = {
        key: (v.detach().requires_grad_(True) if not key.startswith("_") and v.is_floating_point() else v)
        for key, v in x.items()
    }
    assert [key for key, v in boundary.items() if v.requires_grad] == ["hidden"]
    out: Any = boundary
    for layer in second:
        out = layer(out)
    out.backward()
    grad = boundary["hidden"].grad
    assert grad is not None
    # Recompute the first stage with grad and push the boundary gradient through it.
    y: Any = inputs
    for layer in first:
        y = layer(y)
    for key, value in y.items():
        if key.startswith("_"):
            assert not value.requires_grad, f"constant {key} must not require grad"
    torch.autograd.backward([y["hidden"]], [grad])
    return out.detach()


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize(
    "make", [qwen3, llama, lambda: qwen3("eager")], ids=["qwen3", "llama", "qwen3-eager"]
)
def test_two_stage_recompute_matches(make: Callable[[], nn.Module], k: int) -> None:
    model = make()
    inputs = _inputs(pad=True)
    ref_loss, ref_grads = _reference(model, inputs)
    seq = to_layer_sequence(model, loss_chunk_tokens=8)
    loss = _two_stage(seq, inputs, k)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    _assert_grads_equal(_grads(model), ref_grads)


def test_deepcopy_of_layers_runs_the_same() -> None:
    model = qwen3()
    seq = to_layer_sequence(model)
    inputs = _inputs()
    want = _run_sequential(seq, inputs).detach()
    replicas = [copy.deepcopy(layer) for layer in seq.layers]
    for replica, layer in zip(replicas, seq.layers, strict=True):
        assert type(replica) is type(layer)
        for p, q in zip(replica.parameters(), layer.parameters(), strict=True):
            assert p is not q and torch.equal(p, q)
    out: Any = inputs
    for replica in replicas:
        out = replica(out)
    torch.testing.assert_close(out, want)


def test_missing_labels_raises() -> None:
    seq = to_layer_sequence(qwen3())
    with pytest.raises(ModelError, match="labels are required for training"):
        _run_sequential(seq, {"input_ids": torch.zeros(1, 4, dtype=torch.long)})


def test_bad_inputs_raise() -> None:
    embed = to_layer_sequence(qwen3()).layers[0]
    with pytest.raises(ModelError, match="unexpected input keys"):
        embed({"input_ids": torch.zeros(1, 4, dtype=torch.long), "token_type_ids": torch.zeros(1, 4)})
    with pytest.raises(ModelError, match="input_ids"):
        embed({"labels": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(ModelError, match="attention_mask"):
        embed({"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.ones(1, 5)})


def test_unsupported_attention_implementation() -> None:
    class Config:
        _attn_implementation = "flash_attention_2"

    with pytest.raises(ModelError, match="attn_implementation='sdpa'"):
        _check_attention(Config())


def test_peft_lora_sequence() -> None:
    peft = pytest.importorskip("peft")
    base = qwen3()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    # LoRA B starts at zero; make it non-zero so the adapters matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    inputs = _inputs(pad=True)
    model.zero_grad(set_to_none=True)
    ref = model(**inputs).loss
    ref.backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    seq = to_layer_sequence(model)
    assert seq.source is model and seq.computes_loss
    params = [p for layer in seq.layers for p in layer.parameters()]
    trainable = {id(p) for p in params if p.requires_grad}
    assert trainable == {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert all(not p.requires_grad for p in seq.layers[0].parameters())
    assert all(not p.requires_grad for p in seq.layers[-1].parameters())

    loss = _run_sequential(seq, inputs)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    loss.backward()
    got = _grads(model)
    assert got and all("lora_" in n for n in got)
    _assert_grads_equal(got, ref_grads)


def test_sequential_model() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    seq = to_layer_sequence(model)
    assert seq.names == ["0", "1", "2"] and not seq.computes_loss and seq.source is model
    assert all(a is b for a, b in zip(seq.layers, model, strict=True))
    x = torch.randn(3, 4)
    torch.testing.assert_close(_run_sequential(seq, x), model(x))
    named = nn.Sequential(__import__("collections").OrderedDict(embed=nn.Linear(2, 2), head=nn.Linear(2, 1)))
    assert to_layer_sequence(named).names == ["embed", "head"]
    assert to_layer_sequence(seq) is seq


def test_empty_sequential_raises() -> None:
    with pytest.raises(ModelError, match="empty"):
        to_layer_sequence(nn.Sequential())


def test_unsupported_model_raises() -> None:
    with pytest.raises(ModelError) as info:
        to_layer_sequence(nn.Linear(2, 2))
    message = str(info.value)
    assert "torch.nn.modules.linear.Linear" in message
    assert "nn.Sequential" in message and "Qwen3ForCausalLM" in message and "LlamaForCausalLM" in message
    with pytest.raises(ModelError):
        to_layer_sequence("not a model")  # type: ignore[arg-type]


def test_layer_sequence_validates() -> None:
    with pytest.raises(ModelError, match="one name per layer"):
        LayerSequence([nn.Linear(1, 1)], ["a", "b"], nn.Linear(1, 1), False)
    with pytest.raises(ModelError, match="unique"):
        LayerSequence([nn.Linear(1, 1), nn.Linear(1, 1)], ["a", "a"], nn.Linear(1, 1), False)
