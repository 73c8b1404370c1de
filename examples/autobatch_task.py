"""An example task for ``batchfit autobatch`` — copy it and put your own model in.

Run it with:

    batchfit autobatch --task examples/autobatch_task.py:make_task --backend cpu --memory 64MiB

(or ``--task mypackage.mymodule:make_task`` once it is importable). The function is called
with no arguments inside the memory backend's context (fake tensors on the ``estimate``
backend), so build the model right here and do not call ``.to(device)``: batchfit moves the
model and every batch to the backend's device. The task needs:

- ``model``: the ``nn.Module``;
- ``make_batch(batch_size, mode)``: a batch for ``"train"`` or ``"val"`` (tensors, or a
  dict/list/tuple of tensors);
- ``loss(model, batch)``: the scalar loss;
- ``make_optimizer(parameters)`` (optional): the optimizer; default AdamW, ``None`` = no step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class TextClassifierTask:
    """A small Transformer encoder classifying token sequences of a fixed length."""

    model: nn.Module
    seq_len: int = 64
    vocab_size: int = 1000
    num_classes: int = 4

    def make_batch(self, batch_size: int, mode: str) -> dict[str, torch.Tensor]:
        # Real tasks would draw from the dataset; for memory only the shapes and dtypes matter.
        return {
            "tokens": torch.randint(0, self.vocab_size, (batch_size, self.seq_len)),
            "labels": torch.randint(0, self.num_classes, (batch_size,)),
        }

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch["tokens"]), batch["labels"])

    def make_optimizer(self, parameters) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)  # one state tensor per parameter


class Encoder(nn.Module):
    def __init__(self, vocab_size: int, num_classes: int, width: int = 64, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def make_task() -> TextClassifierTask:
    """The factory ``batchfit autobatch --task examples/autobatch_task.py:make_task`` calls."""
    return TextClassifierTask(model=Encoder(vocab_size=1000, num_classes=4))
