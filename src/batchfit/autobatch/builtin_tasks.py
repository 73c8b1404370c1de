"""Built-in tasks for ``batchfit autobatch``: a tiny causal LM at a fixed length, a small conv-net.

Both are factories called with no arguments inside ``backend.context()`` (NOTE [ Tasks are
built inside the backend's context ] in :mod:`batchfit.autobatch.task`); their keyword
arguments let a user's own factory reuse them (``return causal_lm(seq_len=512)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchfit.validation import check_positive_int


@dataclass
class CausalLMTask:
    """A causal LM on random tokens of one fixed length; the loss is next-token cross-entropy."""

    model: nn.Module
    seq_len: int
    vocab_size: int

    def make_batch(self, batch_size: int, mode: str) -> dict[str, torch.Tensor]:
        """``input_ids`` of shape ``(batch_size, seq_len)``, used as labels too."""
        return {"input_ids": torch.randint(0, self.vocab_size, (batch_size, self.seq_len))}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``model(input_ids, labels=input_ids).loss``."""
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def causal_lm(
    *,
    model: str = "tiny",
    seq_len: int = 128,
    dtype: Any = torch.float32,
    gradient_checkpointing: bool = False,
    **config_overrides: Any,
) -> CausalLMTask:
    """The default task: a causal LM from :func:`batchfit.models.build_causal_lm` at ``seq_len`` tokens.

    ``model`` is a preset (default ``"tiny"``: a 2-layer Llama of about 0.2M parameters,
    vocabulary 1024), a local directory with ``config.json`` or a hub id (config only; the
    weights are random). Called inside ``backend.context()``, so presets of billions of
    parameters cost nothing on the ``estimate`` backend.

    Raises:
        InvalidArgument: bad ``seq_len``, spec, dtype or config override.
    """
    from batchfit.models import build_causal_lm

    seq_len = check_positive_int("seq_len", seq_len)
    lm = build_causal_lm(
        model, dtype=dtype, gradient_checkpointing=gradient_checkpointing, **config_overrides
    )
    return CausalLMTask(model=lm, seq_len=seq_len, vocab_size=int(lm.config.vocab_size))


@dataclass
class VisionTask:
    """Image classification on random images; the loss is cross-entropy over ``num_classes``."""

    model: nn.Module
    image_size: int
    channels: int
    num_classes: int

    def make_batch(self, batch_size: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images, labels)``: images ``(batch_size, channels, image_size, image_size)``."""
        images = torch.randn(batch_size, self.channels, self.image_size, self.image_size)
        labels = torch.randint(0, self.num_classes, (batch_size,))
        return images, labels

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy of ``model(images)`` against ``labels``."""
        images, labels = batch
        return nn.functional.cross_entropy(model(images), labels)


def vision_cnn(
    *, image_size: int = 32, channels: int = 3, width: int = 16, num_classes: int = 10
) -> VisionTask:
    """A small conv-net (three 3×3 conv layers, pooling, a linear head) on ``image_size`` images.

    Shows that autobatch is not LLM-specific: activations grow with ``batch × width × image_size²``.

    Raises:
        InvalidArgument: a size is not a positive integer.
    """
    image_size = check_positive_int("image_size", image_size)
    channels = check_positive_int("channels", channels)
    width = check_positive_int("width", width)
    num_classes = check_positive_int("num_classes", num_classes)
    model = nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )
    return VisionTask(model=model, image_size=image_size, channels=channels, num_classes=num_classes)


def describe(task: Any) -> str:
    """A one-line description of a task for reports (its type and parameter count)."""
    n = sum(p.numel() for p in task.model.parameters())
    return f"{type(task).__name__} ({n:,} parameters)"
