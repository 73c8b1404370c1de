"""The tiny model as a data-parallel strategy wraps it on gloo ranks (spawned by :func:`multirank.run_ranks`).

- :func:`fully_shard_layers`: FSDP2 as batchfit, verl and SkyRL apply it: ``fully_shard`` on each
  decoder layer, then on the root, over a CPU mesh of every rank.
- :func:`data_parallel`: ``"ddp"`` (``DistributedDataParallel``) or ``"fsdp2"`` (the above).
- :func:`user_llama_config`: a user's own small Llama (issue 28's real-rank searches).
- :func:`full_gradients`: each parameter's whole gradient (FSDP2's shards gathered, a collective),
  named as in the unwrapped model.

Call them inside a rank, after the process group exists.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def fully_shard_layers(model: torch.nn.Module, mesh: Any = None, **options: Any) -> torch.nn.Module:
    """``model`` (a causal LM with ``model.model.layers``) under FSDP2: each decoder layer, then the root.

    ``mesh`` defaults to a CPU mesh of every rank; ``options`` go to each ``fully_shard`` (e.g. ``mp_policy``).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def data_parallel(model: torch.nn.Module, strategy: str) -> torch.nn.Module:
    """``model`` wrapped by ``strategy``: ``"ddp"`` or ``"fsdp2"`` (:func:`fully_shard_layers`)."""
    if strategy == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if strategy == "fsdp2":
        return fully_shard_layers(model)
    raise ValueError(f"strategy must be 'ddp' or 'fsdp2', but got strategy={strategy!r}")


def full_gradients(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """``{name: gradient}`` of every parameter, whole (FSDP2: gathered) and named without DDP's ``module.``."""
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.removeprefix("module.")] = grad.numpy().copy()
    return grads


USER_LLAMA = dict(
    num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
    vocab_size=4096, max_position_embeddings=256,
)


def user_llama_config() -> Any:
    """The config of :data:`USER_LLAMA` as a user builds it (``LlamaForCausalLM``)."""
    from transformers import LlamaConfig

    return LlamaConfig(**USER_LLAMA, architectures=["LlamaForCausalLM"])
