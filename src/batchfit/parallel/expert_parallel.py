"""Expert parallelism around transformers' grouped experts: experts sharded over an EP group, tokens sent by all-to-all.

NOTE [ Expert parallelism the torchtitan way ]
Each rank of an expert-parallel group of ``ep`` ranks keeps ``experts / ep`` consecutive experts
of every MoE layer (EP rank ``r`` the experts ``r·L … r·L + L - 1``, ``L = experts / ep``): the
3-D parameters of transformers' experts module (``gate_up_proj``, ``down_proj`` and their biases,
NOTE [ Experts as transformers runs them ] in :mod:`batchfit.models.moe`) are cut along their
first dimension, as torchtitan's ``ExpertParallel._partition_fn`` does with ``Shard(0)``
(``torchtitan/distributed/expert_parallel.py``, pytorch/torchtitan@03a13843). The rest of the
model is left to its own strategy. One forward of an experts module runs, on every rank:

1. **permute**: the ``tokens × top-k`` token-expert pairs sorted by expert, the tokens gathered in
   that order (``S × H``, ``S = tokens · top-k``);
2. the pairs per expert counted (``[experts]`` int64) and exchanged with ``all_to_all_single``
   (``[ep · L]``: what every source rank sends to each local expert); the send and receive splits
   are their sums per EP rank (a host sync, as torchtitan's);
3. **dispatch**: the permuted tokens sent by all-to-all (:class:`_AllToAll`: PyTorch's functional
   collective ``_c10d_functional.all_to_all_single`` waited at once, its backward the reverse
   all-to-all, as ``all_to_all_single_autograd`` runs it; waited at once, an eager rank's buffers are
   the estimate's to the byte, where ``all_to_all_single_autograd``'s eager ``AsyncCollectiveTensor``
   held ``S + R`` rows more at the peak than its traced path, measured on 2 gloo ranks): each rank
   receives ``R × H``, ``R`` the pairs routed to its experts from every rank;
4. the received rows re-ordered by local expert (they arrive source-major) and run through
   ``torch.nn.functional.grouped_mm`` with the local experts' offsets (transformers' own
   ``_grouped_linear`` and gate), then put back in arrival order;
5. **combine**: sent back by the reverse all-to-all (``S × H``), weighted by the router's weights
   and summed over each token's ``top-k`` pairs in the token's order.

Backward runs the two all-to-alls in reverse (their autograd). Written for batchfit from that
pattern; no code is taken from torchtitan.

NOTE [ The rank that receives the most ]
Under drop-less routing (no capacity factor: every pair runs) how many rows ``R`` an EP rank
receives is decided by the routers of all ``ep`` ranks: from ``0`` up to ``ep · tokens · min(top-k, L)``
(a token's ``top-k`` experts are distinct, so at most ``L`` of its pairs reach one rank). A budget
must hold for the rank that receives the most. With the probe's worst-case routing
(``"skewed"``: every expert hit once, every other token on experts ``0 … top-k-1``, NOTE [ The
worst case of a routing-dependent loop ]) fixed on every rank, EP rank 0 holds those experts and
receives from each of the ``ep`` ranks all the pairs it routes to them; the probe runs as rank 0.
With fixed routing every rank routes the same micro-batch shape the same way, so the counts rank
0 receives are known without asking the others (``symmetric=True``: the count exchange of step 2
is replaced by ``ep`` copies of its own counts for its experts); a fake process group (the
estimate) has no peers to ask. The balanced routing gives every rank ``tokens · top-k`` rows.
A capacity factor ``c`` (Megatron's ``moe_expert_capacity_factor``, tokens dropped past it)
would cap each expert at ``c · tokens · ep · top-k / experts`` rows, so a rank at ``c · tokens · top-k``
(:func:`batchfit.models.moe.received_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.validation import check_positive_int

#: The experts modules' 3-D parameters (and their biases) cut along the experts (NOTE [ Expert parallelism the torchtitan way ]).
_EXPERT_PARAMETERS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class ExpertGroup:
    """One experts module's place in its expert-parallel group.

    Attributes:
        num_experts: the layer's routed experts (all ranks together).
        ep_size: ranks of the EP group; divides ``num_experts``.
        ep_rank: this rank's place in it (``0 … ep_size - 1``).
        group: the EP process group (``None``: the default group).
        symmetric: every rank routes the same way (fixed routing): the counts received are known
            without exchanging them (NOTE [ The rank that receives the most ]).
    """

    num_experts: int
    ep_size: int
    ep_rank: int
    group: Any = None
    symmetric: bool = False

    @property
    def local_experts(self) -> int:
        """Experts per rank: ``num_experts // ep_size``."""
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        """The first global expert this rank holds."""
        return self.ep_rank * self.local_experts


def check_expert_group(num_experts: int, ep_size: Any, ep_rank: Any) -> None:
    """Refuse an EP size that does not divide ``num_experts`` or a rank outside the group.

    Raises:
        InvalidArgument: naming ``expert_parallel`` or ``ep_rank``, the value and the fix.
    """
    check_positive_int("expert_parallel", ep_size)
    if num_experts % ep_size:
        raise InvalidArgument(
            f"expert_parallel={ep_size} must divide the {num_experts} experts of each MoE layer (each EP rank holds "
            f"experts / expert_parallel of them); use a divisor of {num_experts}"
        )
    if not isinstance(ep_rank, int) or isinstance(ep_rank, bool) or not 0 <= ep_rank < ep_size:
        raise InvalidArgument(f"ep_rank must be in 0 … {ep_size - 1}, but got ep_rank={ep_rank!r}")


def shard_experts(model: torch.nn.Module, ep_size: int, ep_rank: int, group: Any = None, *, symmetric: bool = False) -> int:
    """Keep on this rank only its ``experts / ep_size`` experts of every MoE layer and dispatch tokens by all-to-all.

    Each experts module of ``model`` (:func:`experts_modules`) gets its 3-D
    parameters cut to the local experts (new parameters: copies of the slices) and its forward
    replaced by :func:`expert_parallel_forward` (NOTE [ Expert parallelism the torchtitan way ]);
    forward hooks (fixed routing) still run. Returns the experts modules changed. ``ep_size == 1``
    changes nothing.

    Raises:
        InvalidArgument: ``ep_size`` does not divide a layer's experts, or ``ep_rank`` is outside the group.
    """
    check_positive_int("expert_parallel", ep_size)
    if ep_size == 1:
        return 0
    modules = experts_modules(model)
    for m in modules:
        check_expert_group(m.num_experts, ep_size, ep_rank)
        place = ExpertGroup(m.num_experts, ep_size, ep_rank, group, symmetric)
        for name in _EXPERT_PARAMETERS:
            p = getattr(m, name, None)
            if isinstance(p, torch.nn.Parameter):
                local = p.detach()[place.first : place.first + place.local_experts].clone()
                setattr(m, name, torch.nn.Parameter(local, requires_grad=p.requires_grad))
        m._batchfit_expert_group = place
        m.forward = _bound_forward(m)
    return len(modules)


def fully_shard_experts(model: torch.nn.Module, ep_size: int, device_type: str, options: dict[str, Any]) -> int:
    """Spread ``model``'s experts over EP groups of ``ep_size`` ranks and ``fully_shard`` each experts module over the rest.

    NOTE [ Experts under FSDP2 with expert parallelism ]
    As torchtitan's ``parallelize``: the world is a ``(world / ep, ep)`` mesh (EP fastest), each
    rank's EP group its row, so EP rank ``r`` holds experts ``r·L …`` (:func:`shard_experts`);
    each experts module is then ``fully_shard``-ed over its column (the ``world / ep`` ranks holding
    the same experts) with the same options, before the decoder layers and the root are sharded
    over every rank (FSDP2 leaves a nested module's parameters to it). The mesh is built on the
    default group. Not done here: torchtitan's gradient divide factor for the experts (their
    reduction averages over ``world / ep`` ranks); memory does not depend on it.

    Returns the experts modules sharded.
    """
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    check_positive_int("expert_parallel", ep_size)
    if world % ep_size:
        raise InvalidArgument(f"expert_parallel={ep_size} must divide the world of {world} ranks; use a divisor of {world}")
    with unset_fake_temporarily():  # the mesh holds real rank ids, even when estimating
        mesh = init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("expert_shard", "ep"))
    ep_mesh, shard_mesh = mesh["ep"], mesh["expert_shard"]
    if not experts_modules(model):
        raise InvalidArgument(
            f"expert_parallel={ep_size} needs a mixture of experts (transformers' experts modules), but the model has none; "
            "use expert_parallel=1"
        )
    if any(type(m).__module__.startswith("peft.") for m in model.modules()):
        raise InvalidArgument(
            f"expert_parallel={ep_size} with LoRA adapters is not modelled (PEFT's adapters of the experts span every "
            "expert, not a rank's share); use expert_parallel=1 or lora_rank=0"
        )
    count = shard_experts(model, ep_size, ep_mesh.get_local_rank(), ep_mesh.get_group())
    for m in experts_modules(model):
        fully_shard(m, **{**options, "mesh": shard_mesh})
    return count


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' experts modules in ``model`` (classes decorated by ``use_experts_implementation``: ``_is_expert_parallel`` and ``num_experts``).

    The same test as :func:`batchfit.models.moe.experts_modules` (this layer cannot import ``models``).
    """
    return [
        m for m in model.modules()
        if hasattr(m, "_is_expert_parallel") and isinstance(getattr(m, "num_experts", None), int) and m.num_experts > 0
    ]


def _bound_forward(module: torch.nn.Module) -> Any:
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return expert_parallel_forward(module, hidden_states, top_k_index, top_k_weights)

    return forward


def _received_counts(place: ExpertGroup, counts: torch.Tensor) -> torch.Tensor:
    """``[ep · L]``: the pairs each source rank sends to each local expert (NOTE [ Expert parallelism the torchtitan way ], step 2)."""
    if place.symmetric:  # NOTE [ The rank that receives the most ]: every rank routes as this one (fixed routing)
        return counts[place.first : place.first + place.local_experts].repeat(place.ep_size)
    from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

    with torch.no_grad():
        return wait_tensor(all_to_all_single(counts, None, None, group=_group(place)))


def _group(place: ExpertGroup) -> Any:
    import torch.distributed as dist

    return place.group if place.group is not None else dist.group.WORLD


def _all_to_all(tensor: torch.Tensor, receive: list[int], send: list[int], group: Any) -> torch.Tensor:
    """``tensor``'s rows sent by all-to-all (``send`` rows to each rank, ``receive`` from each), waited: a plain tensor."""
    from torch.distributed._functional_collectives import _resolve_group_name

    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_to_all_single(tensor.contiguous(), receive, send, _resolve_group_name(group)))


class _AllToAll(torch.autograd.Function):
    """A differentiable all-to-all whose forward and backward are waited at once (NOTE [ Expert parallelism the torchtitan way ], step 3)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, receive: list[int], send: list[int], group: Any) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.group = receive, send, group
        return _all_to_all(tensor, receive, send, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _all_to_all(grad, ctx.send, ctx.receive, ctx.group), None, None, None


def expert_parallel_forward(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts module's output ``[tokens, hidden]`` with its experts spread over the EP group (NOTE [ Expert parallelism the torchtitan way ]).

    ``module`` is an experts module prepared by :func:`shard_experts`; the arguments are
    transformers' (``hidden_states [tokens, hidden]``, ``top_k_index`` and ``top_k_weights``
    ``[tokens, top-k]``, global expert ids). Every rank of the group must call it together.
    """
    from transformers.integrations.moe import _grouped_linear

    place: ExpertGroup = module._batchfit_expert_group
    if getattr(module, "_batchfit_routing_fixed", False) and not place.symmetric:  # set by models.moe's fixing hook
        place = ExpertGroup(place.num_experts, place.ep_size, place.ep_rank, place.group, True)
    ep, local = place.ep_size, place.local_experts
    num_tokens, top_k = top_k_index.shape
    hidden = hidden_states.size(-1)
    expert_ids = top_k_index.reshape(-1)
    # 1. permute: pairs sorted by expert (so by destination rank), tokens gathered in that order
    _, perm = torch.sort(expert_ids, stable=True)
    routed = hidden_states[perm // top_k]
    # 2. counts and splits (host integers, as torchtitan's)
    counts = torch.bincount(expert_ids, minlength=place.num_experts)
    received = _received_counts(place, counts)
    send_splits = counts.view(ep, local).sum(1).tolist()
    receive_splits = received.view(ep, local).sum(1).tolist()
    # 3. dispatch
    arrived = _AllToAll.apply(routed, receive_splits, send_splits, _group(place))
    # 4. arrival order (source-major) to local-expert order, grouped_mm, back to arrival order
    rows = sum(receive_splits)
    local_ids = torch.repeat_interleave(torch.arange(local, device=received.device).repeat(ep), received, output_size=rows)
    local_ids_sorted, order = torch.sort(local_ids, stable=True)
    grouped = arrived[order]
    offsets = torch.cumsum(received.view(ep, local).sum(0), dim=0, dtype=torch.int32)
    weight = module.gate_up_proj if module.has_gate else module.up_proj
    bias = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias)[local_ids_sorted] if module.has_bias else None
    out = _grouped_linear(grouped, weight, offsets, bias=bias, is_transposed=module.is_transposed)
    out = module._apply_gate(out) if module.has_gate else module.act_fn(out)
    bias = module.down_proj_bias[local_ids_sorted] if module.has_bias else None
    out = _grouped_linear(out, module.down_proj, offsets, bias=bias, is_transposed=module.is_transposed)
    if module.has_post_expert_norm:
        out = module.post_expert_norm(out)
    out = out[torch.argsort(order)]
    # 5. combine: back to the senders, weighted, in the tokens' order, summed over top-k
    back = _AllToAll.apply(out, send_splits, receive_splits, _group(place))
    weighted = back * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    weighted = weighted[torch.argsort(perm)]
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
