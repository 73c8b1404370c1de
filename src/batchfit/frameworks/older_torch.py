"""What a run's budgets would miss on a torch older than the installed one: :func:`older_torch_notes`.

The budgets run the installed torch's FSDP2 (:mod:`batchfit.parallel.behaviour`). verl and
SkyRL get their torch through the inference engine they pin (vLLM, SGLang), often a release
before 2.8, where ``fully_shard(root)`` keeps the root's gathered parameters (embeddings,
final norm, head) from forward to backward whatever ``reshard_after_forward`` says: a trained
model's backward peak then holds them whole in the compute dtype on every rank. A run's
config does not name its torch, so ``batchfit profile --config`` states what that would add,
per trained model, measured on the model itself (built with fake tensors, its root's own
parameters counted), beside budgets that follow the installed torch.
"""

from __future__ import annotations

from typing import Any

from batchfit.frameworks.run_profile import RunProfile
from batchfit.memory.sizes import format_bytes
from batchfit.models import build_causal_lm
from batchfit.parallel.behaviour import CHANGED_IN, ROOT_RESHARD
from batchfit.parallel.shard import decoder_layers

#: the trained models of a run, and whether each is a critic (a value head instead of the LM head)
_TRAINED = {"policy": False, "critic": True}


def root_parameter_bytes(spec: Any, dtype: Any, *, value_head: bool = False) -> int:
    """Bytes of a model's root-owned parameters (everything outside its decoder layers), whole, in ``dtype``.

    Built on the estimate backend with one decoder layer (fake tensors, nothing allocated);
    tied weights count once.

    Raises:
        InvalidArgument: ``spec`` or ``dtype`` is not a model or dtype batchfit knows.
    """
    model = build_causal_lm(spec, backend="estimate", dtype=dtype, value_head=value_head, num_hidden_layers=1)
    in_layers = {id(p) for p in decoder_layers(model).parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_layers)


def older_torch_notes(result: RunProfile) -> list[str]:
    """One line per trained ``fsdp2`` model whose backward peak would grow on a torch before the root-reshard change.

    Empty when the installed torch keeps the root gathered already (its budgets include it),
    when the run does not reshard after forward, or when no trained model is sharded by ``fsdp2``.
    """
    notes = []
    for role, critic in _TRAINED.items():
        profile = result.profiles.get(role)
        if profile is None or profile.torch is None:
            continue
        sharding = profile.sharding
        if (
            not sharding.spec.torch_behaviours
            or not sharding.reshard_after_forward
            or not profile.torch[ROOT_RESHARD].value
        ):
            continue
        spec = result.run.models[role]
        extra = root_parameter_bytes(spec, profile.compute_dtype, value_head=critic)
        notes.append(
            f"{role} ({spec}): these budgets follow torch {profile.torch.torch_version}, which reshards FSDP2's root "
            f"after forward; on torch < {CHANGED_IN[ROOT_RESHARD]} (a framework's pin through vLLM or SGLang) the "
            f"root's parameters stay gathered until backward, +{format_bytes(extra)} per rank at the backward peak: "
            "profile under that torch, or lower the training budget by that much"
        )
    return notes


__all__ = ["older_torch_notes", "root_parameter_bytes"]
