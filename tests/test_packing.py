"""Packing: examples laid in one row train exactly as the same examples one by one."""

from __future__ import annotations

import pytest
import torch

from roundpipe.data.batching import collate, pack
from roundpipe.data.examples import IGNORE_INDEX, Example
from roundpipe.model.transformers_presets import causal_lm_layers, packed_sequence_ids
from tests.helpers import tiny_causal_lm


def examples(lengths: tuple[int, ...], vocab: int = 64) -> list[Example]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX, *ids[1:]]
        labels[1] = IGNORE_INDEX  # a masked prompt token, as prompt/completion data has
        out.append(Example(ids, labels))
    return out


def layer_loss(layers: list[torch.nn.Module], batch: dict[str, torch.Tensor]) -> tuple[float, int]:
    """The loss of the roundpipe layer sequence on ``batch`` and the tokens it counts."""
    x = batch
    for layer in layers:
        x = layer(x)
    labels = batch["labels"][:, 1:]
    return float(x), int((labels != IGNORE_INDEX).sum())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_examples_one_by_one(attn: str) -> None:
    model = tiny_causal_lm("qwen3", attn=attn)
    layers, _ = causal_lm_layers(model)
    data = examples((5, 9, 3, 7, 4))
    seq_len = 16
    rows = pack(data, seq_len)
    assert len(rows) < len(data)  # some rows really hold several examples
    with torch.no_grad():
        packed, n_packed = layer_loss(layers, collate(rows, seq_len, 0, packed=True))
        padded, n_padded = layer_loss(layers, collate([[e] for e in data], seq_len, 0, packed=False))
        total, count = 0.0, 0
        for example in data:  # each alone, unpadded, through the model's own forward
            ids = torch.tensor([example.ids])
            loss = model(input_ids=ids, labels=torch.tensor([example.labels])).loss
            n = sum(1 for label in example.labels[1:] if label != IGNORE_INDEX)
            total, count = total + float(loss) * n, count + n
    assert n_packed == n_padded == count
    assert packed == pytest.approx(total / count, abs=1e-5)
    assert padded == pytest.approx(total / count, abs=1e-5)


def test_packed_sequence_ids() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    ids = packed_sequence_ids(positions)
    assert ids is not None and ids.tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 1, 1]]
    assert packed_sequence_ids(torch.arange(6)[None]) is None
