"""DeepSpeed ZeRO-1 and ZeRO-2 reproduced on PyTorch's own collectives: parameters replicated, the rest partitioned.

:class:`ZeroState` is what ``deepspeed.initialize`` leaves on one rank for a bf16 model under
``zero_optimization.stage`` 1 or 2 (``DeepSpeedZeroOptimizer``, deepspeed 0.19.8
``runtime/zero/stage_1_and_2.py``), with DeepSpeed's sizes (NOTE [ DeepSpeed's flat
partitions ] in :mod:`batchfit.parallel.zero_layout`):

- parameters: every trainable parameter is a view into one flat 16-bit buffer, padded to a
  multiple of ``2 × world_size`` elements, replicated on every rank;
- optimizer state: an fp32 copy of this rank's partition of that buffer (the master weights),
  and AdamW's two fp32 moments of it (a ``torch.optim.AdamW`` over the master partition);
- gradients: ZeRO-1 keeps each parameter's whole 16-bit gradient (``.grad``) until the step
  (which drops those outside the rank's partition first, and the rest after it);
  ZeRO-2 all-reduces each gradient as autograd finishes it, keeps the parameters of its own
  partition in one 16-bit buffer (DeepSpeed's ``grads_in_partition``) and drops the rest;
- communication: the ``reduce_bucket_size``-element 16-bit bucket (two with ``overlap_comm``):
  ZeRO-2 holds it during each backward, ZeRO-1 all along (NOTE [ ZeRO's reduce bucket ]).

The step builds the partition's flat gradient, converts it to fp32, steps AdamW on the master
partition, copies it back into the flat buffer and all-gathers the partitions, as
``DeepSpeedZeroOptimizer.step`` does. On real ranks (gloo, NCCL) the collectives run; in a
simulated world (PyTorch's fake process group, fake tensors) they return at once, so the
estimate runs the same code. What differs from DeepSpeed's own timeline is in
``docs/memory.md`` ("DeepSpeed ZeRO-1 and ZeRO-2"), measured against DeepSpeed itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from batchfit.parallel.distributed import is_simulated
from batchfit.parallel.sharding import Sharding
from batchfit.parallel.zero_layout import ZeroLayout, zero_layout

__all__ = ["ZeroOptimizer", "ZeroState"]


# NOTE [ ZeRO's reduce bucket ]
# DeepSpeed fills a ``reduce_bucket_size``-element 16-bit bucket (500M = 1 GB by default, two with
# ``overlap_comm``), allocated at the first gradient of a backward (``setup_buckets``). Measured
# with batchfit's cpu tracker on 2 gloo ranks (tests/test_zero_referee.py): ZeRO-2 frees it when
# the backward ends (``independent_gradient_partition_epilogue`` → ``_release_ipg_buffers``), so
# batchfit allocates it at the first gradient hook of each backward and frees it from a callback
# queued on the autograd engine for the end of that backward; ZeRO-1 still holds it between
# micro-batches (its ``ipg_buckets``), so batchfit counts it there as registered state of that size
# (a meta tensor, like DDP's buckets).


class ZeroState:
    """One rank's ZeRO-1/2 state for ``model``: the flat parameter buffer, the master partition, the gradient buffer.

    ``shard_model`` builds it; read it back with
    :func:`~batchfit.parallel.shard_state.zero_state`. The model's trainable parameters
    become views into :attr:`flat`; ZeRO-2 registers a post-accumulate-grad hook on each.

    Attributes:
        stage: 1 or 2.
        layout: the :class:`~batchfit.parallel.zero_layout.ZeroLayout` of the trainable parameters.
        rank: this rank's partition index (simulated: NOTE [ The simulated ZeRO rank ]).
        flat: the flat 16-bit buffer every trainable parameter is a view into.
        master: the fp32 copy of this rank's partition (what AdamW steps).
        gradients: ZeRO-2's ``grads_in_partition`` (16-bit), ``None`` under ZeRO-1.
        bucket_bytes: bytes of the reduce bucket(s) (NOTE [ ZeRO's reduce bucket ]).
        registered_bucket_bytes: the bucket's bytes held between steps (ZeRO-1), else 0.
    """

    def __init__(self, model: torch.nn.Module, sharding: Sharding, group: Any = None):
        self.stage = sharding.spec.zero_stage
        self.group = group
        self.params: list[torch.nn.Parameter] = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        if not self.params:
            from batchfit.errors import InvalidArgument

            raise InvalidArgument(
                f"sharding={sharding.strategy!r} partitions the trainable parameters, but the model has none; "
                "unfreeze the model, or give it LoRA adapters"
            )
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            from batchfit.errors import InvalidArgument

            raise InvalidArgument(
                f"sharding={sharding.strategy!r} flattens the trainable parameters into one buffer of one dtype (as "
                f"DeepSpeed does), but got dtypes={sorted(str(d) for d in dtypes)}; build the model in one dtype "
                "(e.g. dtype='bf16'), LoRA adapters included"
            )
        self.layout: ZeroLayout = zero_layout([p.numel() for p in self.params], sharding.world_size)
        self.world_size = sharding.world_size
        self.rank = _simulated_rank(self.layout, self.stage) if is_simulated() else (
            dist.get_rank(group) if dist.is_initialized() else 0
        )
        dtype = self.params[0].dtype
        self.bucket_bytes = sharding.reduce_bucket_size * torch.empty((), dtype=dtype).element_size()
        self.bucket_bytes *= 2 if sharding.overlap_comm else 1
        self.registered_bucket_bytes = self.bucket_bytes if self.stage == 1 else 0
        self._offsets: list[int] = []
        offset = 0
        for p in self.params:
            self._offsets.append(offset)
            offset += p.numel()
        with torch.no_grad():
            # DeepSpeed: flatten_dense_tensors_aligned, then _update_model_bit16_weights
            pad = self.layout.aligned_numel - self.layout.numel
            pieces = [p.detach().reshape(-1) for p in self.params]
            if pad:
                pieces.append(torch.zeros(pad, dtype=dtype, device=self.params[0].device))
            self.flat = torch.cat(pieces)
            del pieces
            for p, start in zip(self.params, self._offsets):
                p.data = self.flat.narrow(0, start, p.numel()).view_as(p)
            self.master = self._own(self.flat).detach().clone().float()
        self.master.requires_grad_(True)  # as DeepSpeed sets it: the optimizer steps it
        self.gradients: torch.Tensor | None = None
        self._bucket: torch.Tensor | None = None
        #: A context manager factory the bucket is allocated inside (a probe sets its tracker's category).
        self.bucket_region: Any = contextlib.nullcontext
        self._slots: dict[int, int] = {}
        if self.stage == 2:
            kept = self.layout.params_in_partition(self.rank)
            at = 0
            for i in kept:
                self._slots[i] = at
                at += self.layout.numels[i]
            self.gradients = torch.zeros(at, dtype=dtype, device=self.flat.device)
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(self._hook(i))

    def state_buffers(self) -> tuple[tuple[torch.Tensor, str], ...]:
        """``(tensor, category)`` of the state to register beside the model and the optimizer."""
        out: list[tuple[torch.Tensor, str]] = [(self.master, "optimizer_state")]
        if self.gradients is not None:
            out.append((self.gradients, "gradients"))
        return tuple(out)

    def _own(self, flat: torch.Tensor) -> torch.Tensor:
        size = self.layout.partition_size
        return flat.narrow(0, self.rank * size, size)

    def _average(self, grad: torch.Tensor) -> None:
        # DeepSpeed's gradient_reduction_w_predivide: all-reduce, then scale by 1 / dp
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(grad, group=self.group)
        grad.mul_(1.0 / self.world_size)

    def _open_bucket(self) -> None:
        """ZeRO-2: the reduce bucket, from the first gradient of a backward to its end (NOTE [ ZeRO's reduce bucket ])."""
        if self._bucket is not None:
            return
        with self.bucket_region():  # a tracker's category for it, set from above (parallel sits below memory)
            self._bucket = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.flat.device)
        torch.autograd.Variable._execution_engine.queue_callback(self._close_bucket)

    def _close_bucket(self) -> None:
        self._bucket = None

    def _hook(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:  # ZeRO-2: reduce as autograd finishes the gradient
            grad = param.grad
            if grad is None:
                return
            self._open_bucket()
            with torch.no_grad():
                self._average(grad)
                slot = self._slots.get(index)
                if slot is not None and self.gradients is not None:
                    self.gradients.narrow(0, slot, grad.numel()).add_(grad.reshape(-1))
            param.grad = None

        return hook

    def _gradient(self, index: int) -> torch.Tensor | None:
        """Parameter ``index``'s flat gradient as this rank holds it (ZeRO-2: its slot, when kept)."""
        if self.stage == 1:
            grad = self.params[index].grad
            return None if grad is None else grad.reshape(-1)  # a kept parameter's (step drops the rest)
        slot = self._slots.get(index)
        if slot is None or self.gradients is None:
            return None
        return self.gradients.narrow(0, slot, self.layout.numels[index])

    def flat_gradient(self) -> torch.Tensor:
        """This rank's partition of the flat gradient (16-bit, ``partition_size``): DeepSpeed's ``get_flat_partition``."""
        size = self.layout.partition_size
        start, end = self.rank * size, (self.rank + 1) * size
        pieces: list[torch.Tensor] = []
        filled = start
        for i, offset in enumerate(self._offsets):
            n = self.layout.numels[i]
            lo, hi = max(start, offset), min(end, offset + n)
            if lo >= hi:
                continue
            grad = self._gradient(i)
            if grad is None:
                grad = torch.zeros(n, dtype=self.flat.dtype, device=self.flat.device)
            pieces.append(grad.narrow(0, lo - offset, hi - lo))
            filled = hi
        if filled < end:
            pieces.append(torch.zeros(end - filled, dtype=self.flat.dtype, device=self.flat.device))
        return torch.cat(pieces)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step as ``DeepSpeedZeroOptimizer.step`` takes it (ZeRO-1 reduces the gradients first)."""
        if self.stage == 1:
            # reduce_gradients: every gradient averaged over the ranks; the gradients of the
            # parameters outside this rank's partition dropped (clear_grad_attribute), the others
            # moved into grads_in_partition (the same bytes: kept here as they are) until the
            # partition's fp32 gradient is built
            kept = set(self.layout.params_in_partition(self.rank))
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    self._average(p.grad)
                    if i not in kept:
                        p.grad = None
        flat = self.flat_gradient()
        self.master.grad = flat.to(torch.float32)
        del flat
        if self.stage == 1:  # free_grad_in_param_list(params_in_partition): the fp32 copy is all that is kept
            for p in self.params:
                p.grad = None
        optimizer.step()
        self.master.grad = None
        if self.stage == 1:
            # the next micro-batch's backward allocates the gradients again and holds them to the
            # next step: they are given back here, zeroed (NOTE [ Gradients are resident between
            # micro-batches ] in batchfit.train.optim)
            for p in self.params:
                p.grad = torch.zeros_like(p)
        own = self._own(self.flat)
        own.copy_(self.master)
        if self.world_size > 1 and dist.is_initialized():  # all_gather_into_tensor_dp_groups
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
            gather(self.flat, own, group=self.group)
        if self.gradients is not None:
            self.gradients.zero_()


class ZeroOptimizer(torch.optim.Optimizer):
    """An optimizer over a :class:`ZeroState`: ``step()`` runs ZeRO's step around ``inner`` (AdamW over the master partition).

    ``param_groups`` and ``state`` are ``inner``'s, so registering this optimizer counts
    AdamW's moments; the master partition itself is in :meth:`ZeroState.state_buffers`.
    """

    def __init__(self, zero: ZeroState, inner: torch.optim.Optimizer):
        super().__init__([zero.master], dict(inner.defaults))
        self.zero = zero
        self.inner = inner
        self.param_groups = inner.param_groups
        self.state = inner.state

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """ZeRO's step (:meth:`ZeroState.step`); ``closure`` is not supported (DeepSpeed's neither)."""
        self.zero.step(self.inner)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the model's gradients; ZeRO-2's partition is zeroed after each step."""
        for p in self.zero.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


def _simulated_rank(layout: ZeroLayout, stage: int) -> int:
    """The rank a simulated world stands for: the one holding the most (NOTE [ The simulated ZeRO rank ]).

    NOTE [ The simulated ZeRO rank ]
    Every rank holds the same parameters and partitions of equal size, but ZeRO-2's gradient
    buffer holds whole parameters: those starting in the rank's partition and the one
    straddling its start, so it differs between ranks by up to a parameter's size (an
    embedding: a gigabyte for a 7B model). The estimate simulates the rank whose buffer is
    largest (the first such), so its peak is the largest rank's; real ranks each measure
    themselves. For the same reason a ZeRO-2 model is not extrapolated from shallow copies:
    which parameter straddles a boundary changes with the depth.
    """
    if stage == 1:
        return 0
    sizes = [layout.gradient_partition_numel(r) for r in range(layout.world_size)]
    return sizes.index(max(sizes))

