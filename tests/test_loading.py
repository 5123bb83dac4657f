"""Loading a safetensors model directory shard by shard (`roundpipe.model.loading`): the same
weights as ``from_pretrained``, frozen ones as views of the mapped files, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from roundpipe.errors import ModelError
from roundpipe.model.loading import LoadProgress, load_pretrained
from tests.helpers import tiny_causal_lm_config

SHARD = "10KB"  # a two-layer tiny model of ~50 KB in bf16: seven shards


def save_tiny(
    path: Path, kind: str = "llama", dtype: torch.dtype = torch.bfloat16, shard: str | None = SHARD
) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_causal_lm_config(kind, vocab=96), dtype=dtype)
    if shard is None:
        model.save_pretrained(str(path))
    else:
        model.save_pretrained(str(path), max_shard_size=shard)
    return path


def reference(path: Path, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def mappings(path: Path) -> list[tuple[int, int]]:
    """The address ranges this process maps from files under ``path``."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(path)):
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


def mapped(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    ptr = tensor.untyped_storage().data_ptr()
    return any(low <= ptr < high for low, high in ranges)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # untied, tied (lm_head absent from the files)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shard", [SHARD, None])
def test_same_weights_as_from_pretrained(
    tmp_path: Path, kind: str, dtype: torch.dtype, shard: str | None
) -> None:
    path = save_tiny(tmp_path / "m", kind, shard=shard)
    assert (path / "model.safetensors.index.json").is_file() == (shard is not None)
    ref = reference(path, dtype)
    got, report = load_pretrained(path, dtype=dtype, frozen=True)
    assert type(got) is type(ref) and got.training == ref.training
    expected, actual = ref.state_dict(), got.state_dict()
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name
    assert dict(got.named_buffers()).keys() == dict(ref.named_buffers()).keys()
    for name, buf in ref.named_buffers():
        assert torch.equal(dict(got.named_buffers())[name], buf), name
    tied = ref.config.tie_word_embeddings
    assert (got.lm_head.weight is got.get_input_embeddings().weight) == tied
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(got(ids).logits, ref(ids).logits)
    # bf16 files: frozen bf16 weights are viewed, fp32 ones converted (a copy).
    assert report.file_bytes == sum(p.stat().st_size for p in path.glob("*.safetensors")) - report_headers(
        path
    )
    assert (report.mapped_bytes == report.file_bytes) == (dtype == torch.bfloat16)


def report_headers(path: Path) -> int:
    return sum(8 + int.from_bytes(p.read_bytes()[:8], "little") for p in path.glob("*.safetensors"))


def test_frozen_tensors_view_the_mapped_files_and_trainable_ones_are_copies(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m")
    model, report = load_pretrained(
        path, dtype=torch.float32, frozen_dtype=torch.bfloat16, frozen=lambda n: "mlp" in n
    )
    ranges = mappings(path)
    assert ranges, "the shards are mapped while frozen views live"
    for name, param in model.named_parameters():
        if "mlp" in name:
            assert not param.requires_grad and param.dtype == torch.bfloat16 and mapped(param, ranges), name
        else:
            assert param.requires_grad and param.dtype == torch.float32 and not mapped(param, ranges), name
    assert report.mapped_bytes > 0 and report.copied_bytes > 0
    # A write to a view lands in a private page, never in the file.
    before = (path / "model-00002-of-00007.safetensors").read_bytes()
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    assert (path / "model-00002-of-00007.safetensors").read_bytes() == before
    del model, param
    import gc

    gc.collect()
    assert not mappings(path), "the mappings go with the last view"


def test_progress_reaches_every_byte(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m")
    seen: list[LoadProgress] = []
    _, report = load_pretrained(path, frozen=True, dtype=torch.bfloat16, progress=seen.append)
    assert len(seen) == report.tensors and seen[-1].bytes_done == seen[-1].bytes_total
    assert [s.bytes_done for s in seen] == sorted(s.bytes_done for s in seen)
    assert {s.file_index for s in seen} == set(range(report.files)) and report.files > 2


def index_of(path: Path) -> dict[str, Any]:
    return json.loads((path / "model.safetensors.index.json").read_text())


def write_index(path: Path, index: dict[str, Any]) -> None:
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_errors_name_the_file_and_tensor(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m")
    good = index_of(path)
    shard = path / "model-00003-of-00007.safetensors"
    cases: list[tuple[Any, str]] = []

    def missing_shard() -> None:
        shard.rename(tmp_path / "aside")

    def restore_shard() -> None:
        (tmp_path / "aside").rename(shard)

    missing_shard()
    with pytest.raises(ModelError, match=r"missing from .*model-00003-of-00007.safetensors"):
        load_pretrained(path)
    restore_shard()
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelError, match="is not valid JSON"):
        load_pretrained(path)
    write_index(path, {"metadata": {}})
    with pytest.raises(ModelError, match="no 'weight_map'"):
        load_pretrained(path)
    # The index names a tensor in a shard that lacks it.
    index = json.loads(json.dumps(good))
    name = next(n for n, f in index["weight_map"].items() if f != shard.name)
    index["weight_map"][name] = shard.name
    write_index(path, index)
    with pytest.raises(ModelError, match=f"model-00003-of-00007.safetensors lacks 1 tensor.*{name}"):
        load_pretrained(path)
    # A parameter no file provides, and a tensor the model has no place for.
    index = json.loads(json.dumps(good))
    del index["weight_map"]["model.norm.weight"]
    write_index(path, index)
    with pytest.raises(ModelError, match=r"1 missing \(model.norm.weight\)"):
        load_pretrained(path)
    save_file({"model.extra.weight": torch.zeros(2)}, str(path / "extra.safetensors"))
    index = json.loads(json.dumps(good))
    index["weight_map"]["model.extra.weight"] = "extra.safetensors"
    write_index(path, index)
    with pytest.raises(ModelError, match=r"1 unexpected \(model.extra.weight\)"):
        load_pretrained(path)
    write_index(path, good)
    assert not cases
    load_pretrained(path)  # intact again


def test_shape_mismatch_and_truncated_shard(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m", shard=None)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(
        ModelError, match=r"in model.safetensors has shape \[96, 32\] but .* expects \[100, 32\]"
    ):
        load_pretrained(path)
    (path / "config.json").write_text(json.dumps(config))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelError, match="truncated or damaged"):
        load_pretrained(path)


@pytest.mark.parametrize("same", [True, False])
def test_tied_copy_in_the_files(tmp_path: Path, same: bool) -> None:
    """A checkpoint that also stores the tied LM head loads as transformers loads it: one tensor
    when both names hold the same values, two (untied) when they differ."""
    path = save_tiny(tmp_path / "m", "qwen3", shard=None)
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.clone() if same else torch.zeros_like(embed)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    got, report = load_pretrained(path, frozen=True, dtype=torch.bfloat16)
    ref = reference(path, torch.bfloat16)
    assert (ref.lm_head.weight is ref.model.embed_tokens.weight) == same
    assert (got.lm_head.weight is got.model.embed_tokens.weight) == same
    assert (report.skipped if same else report.untied) == ["model.embed_tokens.weight"]
    for name, tensor in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], tensor), name


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_nf4_load_equals_quantizing_from_pretrained(tmp_path: Path, kind: str) -> None:
    from roundpipe.model.quant import NF4Linear, quantize_frozen_

    path = save_tiny(tmp_path / "m", kind)
    ref = reference(path, torch.bfloat16)
    for param in ref.parameters():
        param.requires_grad_(False)
    quantize_frozen_(ref)
    got, report = load_pretrained(path, dtype=torch.bfloat16, frozen=True, base_format="nf4")
    kinds = {n: type(m) for n, m in got.named_modules()}
    assert kinds == {n: type(m) for n, m in ref.named_modules()}
    assert sum(k is NF4Linear for k in kinds.values()) == 14  # 7 linears a block; the head is kept
    expected, actual = ref.state_dict(), got.state_dict()
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name
    assert report.quantized_bytes > 0 and report.nf4_bytes < report.quantized_bytes / 3
    assert report.mapped_bytes + report.quantized_bytes == report.file_bytes
    ranges = mappings(path)
    assert all(mapped(p, ranges) for n, p in got.named_parameters() if "norm" in n)


def test_nf4_in_pieces_is_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from roundpipe.model import nf4
    from roundpipe.model.quant import NF4Linear

    linear = nn.Linear(96, 40, bias=True).to(torch.bfloat16)
    whole = NF4Linear.from_linear(linear, 64)
    monkeypatch.setattr(nf4, "QUANT_CHUNK", 640)  # six pieces
    pieces = NF4Linear.from_linear(linear, 64)
    for name, tensor in whole.state_dict().items():
        assert torch.equal(pieces.state_dict()[name], tensor), name
