"""Mixtures of experts: what a config says about its experts, how transformers runs them, fixed routing.

NOTE [ Experts as transformers runs them ]
transformers 5 stores each MoE layer's experts as 3-D parameters (``gate_up_proj`` of
``[experts, 2·I, H]``, ``down_proj``) in a class decorated by ``use_experts_implementation``
(``transformers/integrations/moe.py``), whose forward ``(hidden_states, top_k_index,
top_k_weights)`` is chosen by ``config._experts_implementation``:

- ``grouped_mm`` (transformers 5's default, ``PreTrainedModel.get_correct_experts_implementation``):
  the token-expert pairs are sorted by expert and multiplied by ``torch.nn.functional.grouped_mm``
  with per-expert offsets; every tensor has ``tokens × top-k`` rows whatever the routing, so its
  memory does not depend on the routing (balanced, random and skewed routing give the same
  peak: ``tests/test_moe.py``). The CPU kernel takes bf16 only.
- ``batched_mm``: each token repeated ``top-k`` times and the expert weights *gathered per pair*
  (``gate_up_proj[expert_ids]``: ``tokens × top-k`` copies of an expert's matrices); routing-
  independent shapes too, and far more memory.
- ``eager``: the per-expert loop (what transformers 4.x ran, and the class's own ``forward``):
  ``nonzero`` of the routing picks the experts hit, then each expert runs on its own tokens. Its
  shapes follow the routing, which the router decides from float data; the estimate cannot run it
  on the router's choice (fake tensors have no values) and would not want to: the budget must hold
  for whatever routing training produces.

NOTE [ The worst case of a routing-dependent loop ]
For a routing-dependent implementation the probe replaces the router's choice by a fixed index
tensor built from integers (``torch.arange``), so on the estimate its values are known (NOTE
[ Integer tensors keep their values ] in :mod:`batchfit.memory.shadow_values`) and ``nonzero``
runs; the weights of the choice stay the router's (its gradient flows as in training). The
routing fixed is the worst case the router can produce: every token of the micro-batch routed
to the same ``top-k`` experts (``"skewed"``): each of them runs on all the tokens at once, the
largest per-expert tensors there can be (the total over experts, ``tokens × top-k`` rows, is the
same for any routing). The loop also costs something per expert hit (its backward accumulates a
gradient of the whole 3-D parameter for each): measured on qwen3-30b-a3b (8k × 16, fused head,
73,728 tokens), balanced routing, every expert hit, peaked 1.6 GiB above all tokens on 8
experts. So the fixed routing is both: the first ``ceil(experts / top-k)`` tokens hit every
expert once, every other token goes to experts ``0 … top-k-1``. ``"balanced"`` (token ``t``'s slot ``j`` to expert ``(t·k + j) mod E``) is
offered to compare (``compare_routing``; slow on the estimate: the loop then runs every expert). The hook is a forward pre-hook on each experts module (no process-wide
change); the router itself, its logits, the auxiliary load-balancing loss
(``output_router_logits``) and their memory stay as the model's own code allocates them.

NOTE [ Expert parallelism under FSDP2 ]
Expert parallelism (each rank of an EP group holds ``experts / EP`` of a layer's experts and
tokens travel to them by all-to-all, as torchtitan and Megatron-based frameworks run MoE) is
:mod:`batchfit.parallel.expert_parallel` (NOTE [ Expert parallelism the torchtitan way ]):
transformers' grouped experts cut to the local experts, tokens dispatched and combined by
PyTorch's functional all-to-all, the dispatch buffers as they run; ``Sharding(expert_parallel=N)``
(``--expert-parallel N``, ``fsdp2`` only) builds it into the FSDP2 step. The dispatch follows
the routing whatever the implementation, so with EP the probe fixes the worst case
(:func:`probe_routing`) and runs as the rank that receives the most (:func:`received_rows`, NOTE
[ The rank that receives the most ]). Megatron's expert parallelism (``MoELayer``) is not built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.validation import check_choice

#: What ``--experts-implementation`` accepts: transformers' own names.
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "eager")
#: Implementations whose tensors' shapes follow the routing (NOTE [ The worst case of a routing-dependent loop ]).
ROUTING_DEPENDENT = frozenset({"eager"})
#: Fixed routings a probe can impose: the worst case, and the balanced one to compare with.
ROUTINGS = ("skewed", "balanced")

# Config fields naming the routed experts per MoE layer, by family (Qwen, DeepSeek/GLM, Mixtral/gpt-oss).
_EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def moe_fields(config: Any) -> tuple[int, int] | None:
    """``(experts per MoE layer, experts per token)`` read from a transformers config, or ``None`` for a dense model.

    Reads ``num_experts`` (Qwen), ``n_routed_experts`` (DeepSeek, GLM) or ``num_local_experts``
    (Mixtral, gpt-oss), and ``num_experts_per_tok``; a sub-config ``text_config`` is followed.
    """
    inner = getattr(config, "text_config", None) or config
    per_token = _positive(getattr(inner, "num_experts_per_tok", None))
    for name in _EXPERT_FIELDS:
        experts = _positive(getattr(inner, name, None))
        if experts is not None and per_token is not None:
            return experts, per_token
    return None


def shared_experts(config: Any) -> int:
    """Experts every token runs through beside its routed ones, per MoE layer (0 when none).

    Reads ``n_shared_experts`` (DeepSeek, GLM); Qwen2-MoE's one gated shared expert is told by
    ``shared_expert_intermediate_size > 0``. A sub-config ``text_config`` is followed.
    """
    inner = getattr(config, "text_config", None) or config
    counted = _positive(getattr(inner, "n_shared_experts", None))
    if counted is not None:
        return counted
    return 1 if _positive(getattr(inner, "shared_expert_intermediate_size", None)) else 0


def is_moe(config: Any) -> bool:
    """The config describes a mixture of experts (:func:`moe_fields` finds its experts)."""
    return moe_fields(config) is not None


def default_experts_implementation(config: Any = None) -> str:
    """The experts implementation the installed transformers runs when none is asked for.

    transformers 5 chooses ``grouped_mm`` (``PreTrainedModel.get_correct_experts_implementation``
    with no request) for every class decorated by ``use_experts_implementation``; older
    releases have no such choice and run the per-expert loop, ``eager``.
    """
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # transformers 4.x: the per-expert loop only
        return "eager"
    return "grouped_mm" if "grouped_mm" in ALL_EXPERTS_FUNCTIONS else "eager"


def check_experts_implementation(name: str, value: Any) -> str | None:
    """``value`` as an experts implementation (one of :data:`EXPERTS_IMPLEMENTATIONS`), or ``None`` (the default).

    Raises:
        InvalidArgument: any other value, naming ``name`` and the choices.
    """
    if value is None:
        return None
    return check_choice(name, value, EXPERTS_IMPLEMENTATIONS)


def check_expert_parallel(name: str, value: Any) -> None:
    """Check an expert-parallel size (NOTE [ Expert parallelism the torchtitan way ] in
    :mod:`batchfit.parallel.expert_parallel`): ``None`` or a positive integer pass; the strategy
    (``fsdp2``) and the divisions (world, experts) are checked where they are known.

    Raises:
        InvalidArgument: any other value.
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise InvalidArgument(
        f"{name} {value!r}: the expert-parallel size must be a positive integer (ranks each MoE layer's experts are spread over); "
        "use 1 for none, or a divisor of the world size and the experts, see docs/moe.md"
    )


def set_experts_implementation(config: Any, implementation: str | None) -> None:
    """Ask transformers to build ``config``'s experts with ``implementation`` (``None``: its default); dense configs are left as they are."""
    if implementation is None or not is_moe(config):
        return
    config._experts_implementation = implementation


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules of a transformers MoE (classes decorated by ``use_experts_implementation``)."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and _positive(getattr(m, "num_experts", None))]


def fixed_routing(num_tokens: int, top_k: int, num_experts: int, routing: str, device: Any) -> torch.Tensor:
    """A ``[num_tokens, top_k]`` int64 index tensor built from integers (NOTE [ The worst case of a routing-dependent loop ]).

    ``"skewed"``: the first ``ceil(num_experts / top_k)`` tokens hit every expert once, every
    other token goes to experts ``0 … top_k-1`` (NOTE [ The worst case of a routing-dependent
    loop ]); ``"balanced"``: token ``t``'s slot ``j``
    to expert ``(t·top_k + j) mod num_experts`` (each expert gets ``num_tokens·top_k/num_experts``
    pairs, a token's experts distinct when ``top_k <= num_experts``).
    """
    if routing == "skewed":
        # NOTE [ The worst case of a routing-dependent loop ]: every expert hit once, the rest concentrated
        spread = min(num_tokens, -(-num_experts // top_k))
        every = (torch.arange(spread * top_k, device=device) % num_experts).view(spread, top_k)
        same = torch.arange(top_k, device=device).repeat(num_tokens - spread, 1)
        return torch.cat([every, same])
    return (torch.arange(num_tokens * top_k, device=device) % num_experts).view(num_tokens, top_k)


def received_rows(tokens: int, top_k: int, num_experts: int, ep_size: int, routing: str = "skewed") -> int:
    """Token-expert rows the receiving EP rank gets in one forward of one MoE layer (NOTE [ The rank that receives the most ]).

    Every one of ``ep_size`` ranks routes ``tokens`` tokens by :func:`fixed_routing` (``routing``);
    the count is EP rank 0's, which holds experts ``0 … experts/ep_size - 1``: under ``"skewed"``
    (the worst case) the rank that receives the most, ``ep_size × (pairs it routes to those
    experts)``; under ``"balanced"`` every rank's, ``tokens × top_k`` when the pattern spreads
    evenly. Integers only: the exchanged-token buffer of that rank is this × hidden × bytes.

    Raises:
        InvalidArgument: ``ep_size`` does not divide ``num_experts``, or an unknown ``routing``.
    """
    from batchfit.parallel.expert_parallel import check_expert_group

    check_choice("routing", routing, ROUTINGS)
    check_expert_group(num_experts, ep_size, 0)
    index = fixed_routing(tokens, top_k, num_experts, routing, "cpu")
    return ep_size * int((index < num_experts // ep_size).sum())


@contextlib.contextmanager
def routing_fixed(model: torch.nn.Module, routing: str | None) -> Iterator[int]:
    """Inside, every experts module of ``model`` runs on :func:`fixed_routing` instead of its router's choice.

    Yields the number of experts modules hooked (0 for a dense model). ``routing=None`` changes
    nothing. The router's weights for its choice are kept (their gradient flows).

    Raises:
        InvalidArgument: ``routing`` is not one of :data:`ROUTINGS`.
    """
    if routing is None:
        yield 0
        return
    check_choice("routing", routing, ROUTINGS)
    handles = []
    for m in experts_modules(model):
        handles += [m.register_forward_pre_hook(_fixing_hook(routing)), m.register_forward_hook(_restore_limit, always_call=True)]
    try:
        yield len(handles) // 2
    finally:
        for handle in handles:
            handle.remove()


def fix_routing(model: torch.nn.Module, routing: str | None) -> int:
    """:func:`routing_fixed` for the model's lifetime (the hooks stay); returns the experts modules hooked."""
    if routing is None:
        return 0
    check_choice("routing", routing, ROUTINGS)
    modules = experts_modules(model)
    for m in modules:
        m.register_forward_pre_hook(_fixing_hook(routing))
        m.register_forward_hook(_restore_limit, always_call=True)
    return len(modules)


# NOTE [ The routing mask keeps its values ]
# The per-expert loop builds ``one_hot(top_k_index, experts + 1)``, an int64 tensor of
# ``tokens × top-k × (experts + 1)`` entries (67 MB for 8,192 tokens of Qwen3-30B-A3B), and takes
# its ``nonzero``: on the estimate its values must be kept, beyond the usual limit per tensor
# (NOTE [ Integer tensors keep their values ]). While an experts module with fixed routing runs
# forward (again under checkpointing's recomputation), the limit of the active fake mode is
# raised to that tensor's bytes, then restored. The estimate spends that much host memory.


def _raised_limit(module: torch.nn.Module, index: torch.Tensor) -> None:
    from torch._guards import active_fake_mode

    mode = active_fake_mode()
    if mode is None or not hasattr(mode, "shadow_limit_bytes"):
        return
    need = index.numel() * (module.num_experts + 1) * 8
    saved = module.__dict__.setdefault("_batchfit_saved_limits", [])
    saved.append((mode, mode.shadow_limit_bytes))
    mode.shadow_limit_bytes = max(mode.shadow_limit_bytes, need)


def _restore_limit(module: torch.nn.Module, args: tuple, output: Any) -> None:
    module._batchfit_routing_fixed = False
    saved = module.__dict__.get("_batchfit_saved_limits")
    if saved:
        mode, limit = saved.pop()
        mode.shadow_limit_bytes = limit


def _fixing_hook(routing: str) -> Any:
    def hook(module: torch.nn.Module, args: tuple) -> tuple | None:
        if len(args) < 3:  # called by keywords: not transformers' own call, leave it alone
            raise InvalidArgument(
                f"routing={routing!r}: the experts module {type(module).__name__} was called without its routing as positional arguments (hidden_states, top_k_index, top_k_weights); run it with routing=None"
            )
        hidden, index, weights, *rest = args
        fixed = fixed_routing(index.shape[0], index.shape[-1], module.num_experts, routing, index.device)
        _raised_limit(module, index)  # NOTE [ The routing mask keeps its values ]
        module._batchfit_routing_fixed = True  # NOTE [ The rank that receives the most ]: every rank routes alike
        return (hidden, fixed.view(index.shape).to(index.dtype), weights, *rest)

    return hook


@dataclass(frozen=True)
class MoeSummary:
    """What a report says about a mixture of experts.

    Attributes:
        total_parameters: every parameter of the model.
        active_parameters: those one token runs through: the dense ones and ``per_token /
            experts`` of each MoE layer's routed experts (embeddings and head included).
        experts: routed experts per MoE layer.
        experts_per_token: experts each token is routed to.
        moe_layers: decoder layers with routed experts.
        implementation: the experts implementation measured (NOTE [ Experts as transformers runs them ]).
        default_implementation: the one the installed transformers runs unasked.
        routing: ``"any"`` (the implementation's memory does not depend on it) or the routing
            fixed in the probe (``"skewed"``: the worst case).
        balanced_tokens: with the worst case probed and ``compare_routing`` asked, the binding
            role's budget with balanced routing at ``max_seq_len`` (beside the worst case's); else ``None``.
        shared_experts: experts per MoE layer every token runs through beside its routed ones
            (DeepSeek's ``n_shared_experts``; their parameters are all active).
        dense_layers: decoder layers without routed experts (DeepSeek's ``first_k_dense_replace``).
        expert_parallel: ranks each layer's experts are spread over (1: none); above 1 the probe runs
            as the rank that receives the most (NOTE [ The rank that receives the most ]).
        runs_in: whose experts modules are measured: ``"transformers"``, or ``"Megatron-core"``
            under ``--sharding megatron`` (its ``SequentialMLP``).
    """

    total_parameters: int
    active_parameters: int
    experts: int
    experts_per_token: int
    moe_layers: int
    implementation: str
    default_implementation: str
    routing: str
    balanced_tokens: int | None = None
    shared_experts: int = 0
    dense_layers: int = 0
    expert_parallel: int = 1
    runs_in: str = "transformers"

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready)."""
        return {
            "total_parameters": self.total_parameters,
            "active_parameters": self.active_parameters,
            "experts": self.experts,
            "experts_per_token": self.experts_per_token,
            "moe_layers": self.moe_layers,
            "experts_implementation": self.implementation,
            "default_experts_implementation": self.default_implementation,
            "routing": self.routing,
            "balanced_tokens": self.balanced_tokens,
            "shared_experts": self.shared_experts,
            "dense_layers": self.dense_layers,
            "expert_parallel": self.expert_parallel,
        }

    def _experts_words(self) -> str:
        shared = f" routed + {self.shared_experts} shared" if self.shared_experts else ""
        return f"{self.experts}{shared} experts"

    def short(self) -> str:
        """``mixture of experts (30.5B parameters, 3.35B active, 128 experts, 8 per token, experts grouped_mm)``.

        With shared experts: ``…, 64 routed + 2 shared experts, 6 per token, …``.
        """
        routing = ", worst-case routing" if self.routing == "skewed" else ", balanced routing" if self.routing == "balanced" else ""
        return (
            f"mixture of experts ({_billions(self.total_parameters)} parameters, {_billions(self.active_parameters)} active, "
            f"{self._experts_words()}, {self.experts_per_token} per token, experts {self.implementation}{routing})"
        )

    def describe(self) -> str:
        """One line: ``mixture of experts: 30.5B parameters, 3.35B active; 48 MoE layers of 128 experts, 8 per token; experts grouped_mm (transformers' default), any routing``.

        DeepSeek-V2-Lite's: ``…; 26 MoE layers (1 dense layer first) of 64 routed + 2 shared experts, 6 per token; …``.
        """
        default = (
            f" ({self.runs_in}'s default)" if self.implementation == self.default_implementation
            else f" ({self.runs_in}'s default: {self.default_implementation})"
        )
        routing = (
            "its memory does not depend on the routing"
            if self.routing == "any"
            else "routing fixed as the worst case (every expert hit, the other tokens all on the same experts)"
            if self.routing == "skewed"
            else "routing fixed as balanced (not the worst case)"
        )
        dense = "" if not self.dense_layers else f" ({self.dense_layers} dense layer{'s' if self.dense_layers > 1 else ''} first)"
        return (
            f"mixture of experts: {_billions(self.total_parameters)} parameters, {_billions(self.active_parameters)} active; "
            f"{self.moe_layers} MoE layers{dense} of {self._experts_words()}, {self.experts_per_token} per token; "
            f"experts {self.implementation}{default}, {routing}{self.receiving_rank()}"
        )

    def receiving_rank(self) -> str:
        """With expert parallelism, the receiving rank's worst case in words (NOTE [ The rank that receives the most ]); else ``""``.

        ``; expert parallel 8: 16 experts per rank; budgeted for the rank that receives the most, all 8 ranks'
        tokens routed to its experts (up to 8 × tokens × 8 rows per MoE layer, 8× a balanced rank's; …)``.
        """
        ep = self.expert_parallel
        if ep <= 1:
            return ""
        local = self.experts // ep
        per = min(self.experts_per_token, local)
        return (
            f"; expert parallel {ep}: {local} experts per rank; budgeted for the rank that receives the most, all {ep} ranks' "
            f"tokens routed to its experts (up to {ep} × tokens × {per} rows per MoE layer, "
            f"{ep * per / self.experts_per_token:.3g}× a balanced rank's; drop-less: a capacity factor c, tokens dropped past it, "
            "would cap it at c× a balanced rank's)"
        )


    def expert_shard_note(self, world_size: int) -> str | None:
        """What FSDP2's sharding of the experts leaves on each of ``world_size`` ranks, when it is not ``1/world_size``.

        NOTE [ One expert per rank at least ]: FSDP2 (``fully_shard``, ``Shard(0)``)
        shards a layer's 3-D expert parameter (``[experts, …]``) along its first dimension, each
        rank holding ``ceil(experts / world_size)`` rows, padded: with fewer experts than ranks
        (8 experts over 16 ranks) every rank still holds one whole expert's share (half of them
        padding), so the experts' sharded parameters, gradients and optimizer state per rank
        stop falling at ``world_size = experts`` (torch 2.13, a fake group of 16: an ``[8, 32, 16]``
        parameter leaves a ``[1, 32, 16]`` shard, 512 elements padded, on every rank; FSDP1's flat
        parameter splits elements evenly and has no such floor). The estimate runs FSDP2's own sharding, so its
        figures hold the padding; this says why. ``None`` when there are at least as many
        experts as ranks (uneven counts above pad less than one expert per rank).
        """
        ep = self.expert_parallel  # with EP, FSDP2 shards a rank's experts / ep over the world / ep ranks holding them
        experts, ranks = self.experts // ep, world_size // ep
        if experts >= ranks:
            return None
        where = "" if ep == 1 else f" (expert parallel {ep}: each EP rank's {experts} over the {ranks} ranks that hold them)"
        return (
            f"FSDP2 shards each layer's expert parameters along their {experts} experts{where}: over {ranks} ranks "
            f"each rank still holds one whole expert ({ranks - experts} of the {ranks} ranks hold padding "
            f"only), so the experts' sharded parameters, gradients and optimizer state per rank are 1/{experts} "
            f"of them, not 1/{ranks}: more ranks stop lowering them past {experts} (docs/moe.md)"
        )


def _billions(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e8 else f"{n / 1e6:.3g}M"


def probe_routing(implementation: str, expert_parallel: int = 1) -> str | None:
    """The routing a probe fixes for ``implementation``: the worst case where memory follows the routing, else none.

    With ``expert_parallel > 1`` the dispatch follows the routing whatever the implementation
    (NOTE [ The rank that receives the most ]): the worst case.
    """
    return "skewed" if implementation in ROUTING_DEPENDENT or expert_parallel > 1 else None


def moe_summary(config: Any, implementation: str | None = None, expert_parallel: int = 1) -> MoeSummary | None:
    """Parameters, experts and implementation of a MoE config (built on the meta device: nothing allocated), or ``None`` for a dense one.

    Args:
        config: a transformers config (:func:`batchfit.models.load_config`).
        implementation: the experts implementation asked for; ``None``: the default.
        expert_parallel: the EP size the experts are spread over (the routing is then the worst case).
    """
    fields = moe_fields(config)
    if fields is None:
        return None
    import copy

    from transformers import AutoModelForCausalLM

    experts, per_token = fields
    default = default_experts_implementation(config)
    chosen = implementation or default
    with torch.device("meta"):  # a copy: from_config writes the dtype and implementations into it
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    modules = experts_modules(model)
    routed = sum(p.numel() for m in modules for p in m.parameters(recurse=False))
    active = total - routed + sum(
        p.numel() * per_token // m.num_experts for m in modules for p in m.parameters(recurse=False)
    )
    return MoeSummary(
        total_parameters=total,
        active_parameters=active,
        experts=experts,
        experts_per_token=per_token,
        moe_layers=len(modules),
        implementation=chosen,
        default_implementation=default,
        routing=probe_routing(chosen, expert_parallel) or "any",
        shared_experts=shared_experts(config),
        dense_layers=max(0, _layers(config) - len(modules)),
        expert_parallel=expert_parallel,
    )


def _layers(config: Any) -> int:
    inner = getattr(config, "text_config", None) or config
    return _positive(getattr(inner, "num_hidden_layers", None)) or 0
