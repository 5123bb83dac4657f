"""Examples into fixed-shape batches: padded, or packed into full rows.

Every batch is ``[batch_size, seq_len]`` whatever the examples' lengths, so the pipe's plan, its
measured stage times and compiled kernels stay valid from step to step. Without packing each row
holds one example, right-padded; padding has label -100 and attention mask 0, so it carries no
loss and is never attended to. With packing, examples are laid one after another in a row until
the next does not fit: ``position_ids`` restart at 0 for each example, and the model's embed
layer (`roundpipe.model.transformers_presets.CausalLMEmbed`) turns restarting positions into a
block-diagonal causal mask, so no token sees another example and each example's loss is what it
would be alone. The unused tail of a packed row is padding, laid as an example of its own.

The order of the examples is a seeded permutation per epoch, and the batch of step ``s`` depends
only on (examples, sizes, seed, ``s``): a resumed run sees the batches an uninterrupted one would.
This module must never use the global RNG nor hold anything but the examples and their order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from roundpipe.data.examples import IGNORE_INDEX, Example

Row = list[Example]


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The order of ``count`` examples in ``epoch`` (a permutation seeded by seed and epoch)."""
    digest = hashlib.blake2b(f"roundpipe-examples:{seed}:{epoch}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return torch.randperm(count, generator=gen).tolist()


def pack(examples: Sequence[Example], seq_len: int) -> list[Row]:
    """Examples in their order, laid into rows of at most ``seq_len`` tokens (next fit)."""
    rows: list[Row] = []
    used = seq_len + 1
    for example in examples:
        if used + len(example.ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(example)
        used += len(example.ids)
    return rows


def collate(rows: Sequence[Row], seq_len: int, pad_id: int, packed: bool) -> dict[str, torch.Tensor]:
    """The batch tensors of ``rows``: input_ids and labels, and attention_mask (one example a row)
    or position_ids (packed rows)."""
    batch = len(rows)
    ids = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((batch, seq_len), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((batch, seq_len), dtype=torch.long)
    positions = torch.zeros((batch, seq_len), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for example in row:
            n = len(example.ids)
            ids[r, at : at + n] = torch.tensor(example.ids)
            labels[r, at : at + n] = torch.tensor(example.labels)
            mask[r, at : at + n] = 1
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(seq_len - at)  # the padding: a block of its own
    if packed:
        return {"input_ids": ids, "labels": labels, "position_ids": positions}
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class ExampleBatches:
    """The batch of each step over ``examples``, epoch after epoch."""

    def __init__(
        self,
        examples: Sequence[Example],
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        pad_id: int,
        packing: bool,
    ) -> None:
        if not examples:
            raise ValueError("no examples to batch")
        self.examples = list(examples)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.pad_id, self.packing = pad_id, packing
        self._epochs: list[list[Row]] = []

    def _rows(self, epoch: int) -> list[Row]:
        while len(self._epochs) <= epoch:
            order = epoch_order(len(self.examples), self.seed, len(self._epochs))
            ordered = [self.examples[i] for i in order]
            self._epochs.append(pack(ordered, self.seq_len) if self.packing else [[e] for e in ordered])
        return self._epochs[epoch]

    def rows_per_epoch(self) -> int:
        return len(self._rows(0))

    def rows_of_step(self, step: int) -> list[Row]:
        """Rows ``step * batch_size`` .. of the endless sequence of epochs."""
        first = step * self.batch_size
        epoch, rows = 0, list[Row]()
        while len(rows) < self.batch_size:
            epoch_rows = self._rows(epoch)
            if first >= len(epoch_rows):
                first -= len(epoch_rows)
            else:
                take = epoch_rows[first : first + self.batch_size - len(rows)]
                rows.extend(take)
                first = 0
            epoch += 1
        return rows

    def real_tokens(self, step: int) -> int:
        """Tokens of examples in the batch of ``step``: its slots less the padding."""
        return sum(len(example.ids) for row in self.rows_of_step(step) for example in row)

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        return collate(self.rows_of_step(step), self.seq_len, self.pad_id, self.packing)


def eval_batches(
    examples: Sequence[Example], *, seq_len: int, batch_size: int, pad_id: int, packing: bool
) -> list[dict[str, torch.Tensor]]:
    """Every example once, in order, in batches of at most ``batch_size`` rows."""
    rows = pack(examples, seq_len) if packing else [[e] for e in examples]
    return [
        collate(rows[i : i + batch_size], seq_len, pad_id, packing) for i in range(0, len(rows), batch_size)
    ]


__all__ = ["ExampleBatches", "collate", "epoch_order", "eval_batches", "pack"]
