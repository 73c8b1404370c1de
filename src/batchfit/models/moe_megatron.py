"""Megatron-core's mixture of experts (``MoELayer``, its router and all-to-all dispatcher) on CPU ranks, its routing fixed.

- :data:`MOE_CPU_SETTINGS`: the ``TransformerConfig`` fields a CPU run of Megatron's MoE needs over mbridge's.
- :func:`moe_cpu_patches`: what megatron-core 0.16.1's dispatcher needs changed on CPU ranks and under the fake
  process group (entered by :func:`batchfit.models.megatron.megatron_cpu_patches`).
- :func:`fix_megatron_routing`: every router of a model routes by :func:`batchfit.models.moe.fixed_routing`.

NOTE [ Megatron's mixture of experts on CPU ranks ]
mbridge 0.15.1 maps a Hugging Face MoE config to Megatron's (``Qwen3MoEBridge._build_config``:
``num_moe_experts`` = ``num_experts``, ``moe_router_topk`` = ``num_experts_per_tok``,
``moe_ffn_hidden_size`` = ``moe_intermediate_size``, softmax scores after the top-k
(``moe_router_pre_softmax=False``), ``moe_router_load_balancing_type="none"`` ("default None for
RL": no auxiliary loss), ``moe_token_dispatcher_type="alltoall"`` in its base config; Qwen2-MoE's
bridge adds ``moe_shared_expert_intermediate_size``, Mixtral's and DeepSeek-V3's theirs), and
``expert_model_parallel_size`` / ``expert_tensor_parallel_size`` from its parallel states. That
config is used as mbridge builds it, with three changes: ``persist_layer_norm`` off (Apex's persistent
kernel of the same norm, which torch's norm refuses); ``bias_dropout_fusion`` and ``bias_activation_fusion``
off, as mbridge's dense bridges and Megatron's defaults have them (the fused functions are
``torch.compile``'d, and an inductor kernel called with the estimate's fake tensors ended the process
with a segmentation fault; the unfused functions compute the same sums and SwiGLU in eager ops, as the
dense Megatron path runs them); and ``moe_grouped_gemm=False``. mbridge turns the
grouped GEMM on, which is Transformer Engine's (``TEGroupedMLP``) or the ``grouped_gemm`` package's
CUDA kernels, neither of which runs on a CPU; megatron-core's local layer spec with experts
(``get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=False)``) builds ``SequentialMLP``: each
local expert an ``MLP`` run on its slice of the permuted tokens, one after another. It holds the same
parameters; its activations are each expert's ``fc1``/``fc2`` inputs and the SwiGLU's, per expert
slice, where the grouped GEMM keeps the same tensors for all local experts at once (the same bytes
summed, up to the grouped kernel's own workspace, which is not modelled).

A router with an expert bias (DeepSeek-V3's) counts its tokens per expert in ``_apply_expert_bias``, which
megatron-core ``torch.compile``s at import (``jit_fuser``): it runs under ``torch.compiler.set_stance("force_eager")``,
the same sum in eager ops (the compiled kernel, called with the estimate's fake tensors, ended the process).
The router runs after one change: without Transformer Engine its gating linear
(``RouterGatingLinearFunction``) meets an undefined ``te_general_gemm`` (:class:`_GemmNamedWithoutTransformerEngine`);
defined as ``None``, it runs torch's ``mm`` in the router's dtype, as megatron-core means it to
(:class:`_UnsetNameDefined`).
The dispatcher (``MoEAlltoAllTokenDispatcher``) runs on gloo ranks after two changes:
- it makes a side stream for its device-to-host copies at construction (``torch.cuda.Stream()``) and
  copies the split sizes on it (``_maybe_dtoh_and_synchronize``: ``torch.cuda.current_stream()``,
  ``torch.cuda.stream``, an event it synchronises on). Here every tensor is on the host and every op
  synchronous: no stream is made (a placeholder stands in the class attribute), and at the copy point the split sizes become the host integers a
  GPU run turns them into (``maybe_move_tensor_to_cpu(..., as_numpy=True)``: numpy arrays), the other
  counts stay tensors;
- under the fake process group (the estimate) the count exchange (``gather_from_sequence_parallel_region``
  of each rank's tokens per expert over the TP × EP group) returns no values. With the routing fixed
  every rank routes its micro-batch as this one does (NOTE [ The rank that receives the most ] in
  :mod:`batchfit.parallel.expert_parallel`), so the gathered counts are this rank's repeated, a tensor
  of the gather's shape: the estimate makes that. Real ranks run the gather.

The router's choice is fixed through Megatron's own hook for it: ``topk_routing_with_score_function``
asks ``router.router_replay.get_replay_topk`` for the top-k when the router has a replay object
(``moe_utils.py``, megatron-core 0.16.1; ``RouterReplay`` replays recorded indices, gathering the
scores at them). :func:`fix_megatron_routing` gives every ``TopKRouter`` an object whose indices are
:func:`batchfit.models.moe.fixed_routing` of the tokens it routes (``"skewed"``: the worst case,
EP rank 0 receiving every rank's pairs for experts ``0 … top-k − 1``), the scores gathered at them as
the replay does, so the router's gradient flows. Megatron then builds the ``[tokens, experts]``
routing map by scattering ones into ``zeros_like(logits).int()``, a tensor made from float data whose
values the estimate does not keep (NOTE [ Integer tensors keep their values ] in
:mod:`batchfit.memory.shadow_values`); the map is rebuilt from the integer indices
(``torch.zeros(..., bool).scatter``), one ``[tokens, experts]`` bool more for a moment on both backends
(tokens × experts bytes: 1 MiB at 8,192 tokens and 128 experts). The probe runs as global rank 0, which is EP rank 0
of its expert group in Megatron's expert order (``tp-ep-dp-pp``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from batchfit.patching import AttributePatch, SharedChange

#: What a CPU run changes in mbridge's MoE config (NOTE [ Megatron's mixture of experts on CPU ranks ]).
MOE_CPU_SETTINGS: dict[str, Any] = {
    "moe_grouped_gemm": False,  # Transformer Engine's grouped GEMM (CUDA only): SequentialMLP instead
    "moe_token_dispatcher_type": "alltoall",  # mbridge's, as verl runs
    "moe_permute_fusion": False,  # Transformer Engine's fused permutation (megatron-core's default)
    "moe_router_fusion": False,  # Transformer Engine's fused top-k (megatron-core's default)
    "persist_layer_norm": False,  # Apex's persistent LayerNorm kernel (the same norm): torch's norm refuses the flag
    # torch.compile'd fusions (megatron.core.jit's jit_fuser): inductor kernels called with fake tensors crash the
    # process (a segfault, seen under the estimate); off, as in mbridge's dense bridges and Megatron's defaults
    "bias_dropout_fusion": False,
    "bias_activation_fusion": False,
}


def _dispatcher() -> Any:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return MoEAlltoAllTokenDispatcher


def _dispatcher_module() -> Any:
    from megatron.core.transformer.moe import token_dispatcher

    return token_dispatcher


def _router_module() -> Any:
    from megatron.core.transformer.moe import router

    return router


def _router_class() -> Any:
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter


_ROUTING_MAP_OF_THE_INDICES = AttributePatch(_router_module, "topk_routing_with_score_function", lazy=True)
_EXPERT_BIAS_IN_EAGER_OPS = AttributePatch(_router_class, "_apply_expert_bias", lazy=True)
_SPLITS_ON_THE_HOST = AttributePatch(_dispatcher, "_maybe_dtoh_and_synchronize", lazy=True)
_SYMMETRIC_COUNTS = AttributePatch(_dispatcher_module, "gather_from_sequence_parallel_region", lazy=True)


class _UnsetNameDefined(SharedChange):
    """``owner.name`` set to ``value`` while active where it is missing or ``None``; put back on exit.

    Two of megatron-core 0.16.1's names need it (NOTE [ Megatron's mixture of experts on CPU ranks ]):
    ``moe_utils.te_general_gemm``, which ``RouterGatingLinearFunction`` tests against ``None`` to choose
    torch's ``mm`` but which is never defined without Transformer Engine (``moe_utils.py`` imports it in
    a ``try`` whose ``except ImportError`` sets only ``HAVE_TE``: the router's forward raises
    ``NameError``), set to ``None``; and ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream``, the side stream
    its constructor makes with ``torch.cuda.Stream()`` when it is ``None``, set to a placeholder that no
    code uses here (:func:`_splits_on_the_host` copies nothing). A value already there is left alone.
    """

    def __init__(self, owner: Any, name: str, value: Any):
        super().__init__()
        self._owner, self.name, self.value = owner, name, value
        self._saved: tuple[bool, Any] | None = None

    def _install(self) -> None:
        owner = self._owner()
        missing = not hasattr(owner, self.name)
        current = getattr(owner, self.name, None)
        if missing or current is None:
            self._saved = (missing, current)
            setattr(owner, self.name, self.value)

    def _uninstall(self) -> None:
        saved, self._saved = self._saved, None
        if saved is None:
            return
        owner = self._owner()
        if getattr(owner, self.name, None) is not self.value:
            return  # replaced since: not ours to undo
        if saved[0]:
            delattr(owner, self.name)
        else:
            setattr(owner, self.name, saved[1])


def _moe_utils() -> Any:
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


#: stands for the dispatcher's device-to-host stream, which nothing uses on CPU ranks
HOST_STREAM = "no side stream: every tensor is on the host"
_ROUTER_GEMM_NAMED = _UnsetNameDefined(_moe_utils, "te_general_gemm", None)
_NO_SIDE_STREAM = _UnsetNameDefined(_dispatcher, "cuda_dtoh_stream", HOST_STREAM)


@_ROUTING_MAP_OF_THE_INDICES.bind
def _routing_map_of_the_indices(logits: torch.Tensor, topk: int, *args: Any, router_replay: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``topk_routing_with_score_function``; under :class:`FixedTopK` its routing map is rebuilt from the
    fixed indices (NOTE [ Megatron's mixture of experts on CPU ranks ]: a map the estimate knows the values of)."""
    probs, routing_map = _ROUTING_MAP_OF_THE_INDICES.call_below(logits, topk, *args, router_replay=router_replay, **kwargs)
    if isinstance(router_replay, FixedTopK) and router_replay.index is not None:
        index, router_replay.index = router_replay.index, None
        known = torch.zeros(routing_map.shape, dtype=torch.bool, device=routing_map.device)
        routing_map = known.scatter(1, index, True)
    return probs, routing_map


@_EXPERT_BIAS_IN_EAGER_OPS.bind
def _expert_bias_in_eager_ops(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``TopKRouter._apply_expert_bias`` (``torch.compile``'d by megatron-core's ``jit_fuser``) run eagerly
    (NOTE [ Megatron's mixture of experts on CPU ranks ]: an inductor kernel called with fake tensors ends the process)."""
    with torch.compiler.set_stance("force_eager"):
        return _EXPERT_BIAS_IN_EAGER_OPS.call_below(self, *args, **kwargs)


@_SPLITS_ON_THE_HOST.bind
def _splits_on_the_host(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` with every tensor on the host: the split sizes
    become host integers at the copy point, as a GPU run's (NOTE [ Megatron's mixture of experts on CPU ranks ])."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                import numpy

                setattr(self, name, numpy.array(value.tolist()))  # as_numpy=True, as a GPU run's copy gives them
    return tokens_per_expert


@_SYMMETRIC_COUNTS.bind
def _symmetric_counts(input_: torch.Tensor, tensor_parallel_output_grad: bool = True, group: Any = None, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The dispatcher's count gather; under the fake process group every rank's counts are this rank's
    (fixed routing: NOTE [ Megatron's mixture of experts on CPU ranks ])."""
    from batchfit.parallel.distributed import is_simulated

    if group is None or not is_simulated(group) or input_.dtype.is_floating_point:
        return _SYMMETRIC_COUNTS.call_below(input_, tensor_parallel_output_grad, group, *args, **kwargs)
    return input_.repeat(group.size(), *([1] * (input_.dim() - 1)))


@contextlib.contextmanager
def moe_cpu_patches() -> Iterator[None]:
    """Megatron-core's MoE dispatcher runs on CPU tensors inside (NOTE [ Megatron's mixture of experts on CPU ranks ])."""
    with (
        _NO_SIDE_STREAM.active(),
        _SPLITS_ON_THE_HOST.active(),
        _SYMMETRIC_COUNTS.active(),
        _ROUTER_GEMM_NAMED.active(),
        _ROUTING_MAP_OF_THE_INDICES.active(),
        _EXPERT_BIAS_IN_EAGER_OPS.active(),
    ):
        yield


class FixedTopK:
    """A router's top-k as :func:`batchfit.models.moe.fixed_routing` of its tokens, through Megatron's replay hook.

    Stands where ``TopKRouter.router_replay`` (a ``RouterReplay``) stands; ``get_replay_topk``
    returns the scores gathered at the fixed indices and the indices, as the replay does
    (NOTE [ Megatron's mixture of experts on CPU ranks ]).
    """

    def __init__(self, routing: str, num_experts: int):
        self.routing = routing
        self.num_experts = int(num_experts)
        self.index: torch.Tensor | None = None  # the last indices given, for the routing map

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Any = None, group_topk: Any = None, default_compute_topk: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        from batchfit.models.moe import fixed_routing

        index = fixed_routing(scores.shape[0], int(topk), self.num_experts, self.routing, scores.device)
        self.index = index
        return scores.gather(1, index), index


def fix_megatron_routing(model: torch.nn.Module, routing: str | None) -> int:
    """Every ``TopKRouter`` in ``model`` routes by :func:`~batchfit.models.moe.fixed_routing` (``routing``); ``None`` changes nothing.

    Returns the routers fixed (0 for a dense model).

    Raises:
        InvalidArgument: ``routing`` is not one of :data:`batchfit.models.moe.ROUTINGS`.
    """
    if routing is None:
        return 0
    from megatron.core.transformer.moe.router import TopKRouter

    from batchfit.models.moe import ROUTINGS
    from batchfit.validation import check_choice

    check_choice("routing", routing, ROUTINGS)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.router_replay = FixedTopK(routing, router.config.num_moe_experts)
    return len(routers)


__all__ = ["MOE_CPU_SETTINGS", "FixedTopK", "fix_megatron_routing", "moe_cpu_patches"]
