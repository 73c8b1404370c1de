"""DeepSpeed itself as the referee of batchfit's ZeRO-1/2 (:mod:`batchfit.parallel.zero`), on gloo ranks.

:func:`compare_on_rank` runs, on one rank of a gloo group, the same training step (the tiny
model in bf16, batchfit's loss on the same micro-batch, forward, backward, optimizer step)
twice: once under ``deepspeed.initialize`` (``DeepSpeedZeroOptimizer``, OpenRLHF's settings:
bf16, gradient clipping 1.0, ``contiguous_gradients``, no ``overlap_comm``; a torch AdamW
with ``foreach=True`` as the client optimizer, batchfit's own) and once as batchfit models
it (``Sharding("zero1"/"zero2")``), each measured with batchfit's cpu tracker, DeepSpeed's
state registered from its own attributes. Call inside a rank (``multirank.run_ranks``).
"""

from __future__ import annotations

from typing import Any

import torch

BATCH, SEQ = 2, 48
#: Micro-batches per optimizer step. batchfit's probe measures a micro-batch with the gradients of the
#: step's earlier micro-batches held (NOTE [ Gradients are resident between micro-batches ]); DeepSpeed
#: holds them from the second micro-batch of an accumulation on, so its last (the step) is measured.
ACCUMULATION = 2


def _deepspeed_run(stage: int, bucket: int, lengths: list[int]) -> dict[str, Any]:
    import deepspeed

    from batchfit.budget.causal_lm_probe import CLIP_RATIO, VALUE_CLIP, causal_lm_step, on_device
    from batchfit.memory import get_backend, labels
    from batchfit.models import build_causal_lm
    from batchfit.train.micro_batch_step import micro_batch_loss

    backend = get_backend("cpu")
    model = build_causal_lm("tiny", backend=backend, dtype="bf16", seed=0)
    probe = causal_lm_step(model, backend=backend, optimizer=None)  # only for its micro-batch and loss options
    mb = probe.micro_batch(lengths)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, foreach=True)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, zero_opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    options = probe.loss_options

    def run() -> None:  # in the probe's phases (TrainingStep.run), so that each phase's peak compares
        with labels.phase(labels.FORWARD):
            inputs, _held = on_device(mb, backend)  # copied inside the measured call, as batchfit's probe does
            loss = micro_batch_loss(engine, inputs, clip_ratio=CLIP_RATIO, value_clip=VALUE_CLIP, **options)
        with labels.phase(labels.BACKWARD):
            engine.backward(loss)
        del loss
        with labels.phase(labels.OPTIMIZER):
            engine.step()

    for _ in range(2 * ACCUMULATION):  # AdamW's state exists from the first step on
        run()
    for _ in range(ACCUMULATION - 1):  # the gradients of the step's earlier micro-batches are held
        run()
    masters = list(zero_opt.single_partition_of_fp32_groups)
    state = [zero_opt.optimizer.state[p] for p in masters]
    held = _held_tensors(zero_opt)
    m = backend.measure(
        run,
        register=(engine.module, masters, state, list(held.values())),
        categories=(None, "optimizer_state", "optimizer_state", "gradients"),
    )
    return {
        "held": {name: sum(t.untyped_storage().nbytes() for t in ts) for name, ts in held.items()},
        "peak": m.peak_bytes,
        "phases": _coarse(m.phase_peaks),
        "breakdown": dict(m.breakdown),
        "flat_numel": [int(f.numel()) for f in zero_opt.bit16_groups_flat],
        "partition_size": [int(p.numel()) for p in masters],
    }


def _coarse(phase_peaks: dict[str, int]) -> dict[str, int]:
    """The peak of each phase (forward, backward, optimizer), positions within it merged."""
    out: dict[str, int] = {}
    for key, peak in phase_peaks.items():
        name = str(key).split("/")[0].split(":")[0]
        out[name] = max(out.get(name, 0), peak)
    return out


def _tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 3:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v, depth + 1)]
    return [t for v in getattr(value, "__dict__", {}).values() for t in _tensors(v, depth + 1)] if depth else []


def _held_tensors(zero_opt: Any) -> dict[str, list[torch.Tensor]]:
    """Every tensor ``DeepSpeedZeroOptimizer`` holds between micro-batches besides the parameters, masters and AdamW state.

    Registered under ``"gradients"``: between micro-batches they are the gradients of the
    accumulation so far (``grads_in_partition``, ``averaged_gradients``, ``all_grad_tensors``)
    and the reduce bucket while a backward runs; a storage already counted is not counted twice.
    """
    skip = {"optimizer", "bit16_groups", "round_robin_bit16_groups", "single_partition_of_fp32_groups",
            "bit16_groups_flat", "parallel_partitioned_bit16_groups", "param_dict", "round_robin_bit16_meta",
            "params_in_partition", "params_not_in_partition"}
    out = {}
    for name, value in vars(zero_opt).items():
        if name in skip or name.startswith("_param_slice"):
            continue
        found = [t for t in _tensors(value) if t.device.type != "meta" and t.untyped_storage().nbytes() > 0]
        if found:
            out[name] = found
    return out


def _batchfit_run(stage: int, bucket: int, world: int, lengths: list[int]) -> dict[str, Any]:
    from batchfit.budget.causal_lm_probe import causal_lm_step
    from batchfit.memory import get_backend
    from batchfit.models import build_causal_lm
    from batchfit.parallel.shard_state import zero_state
    from batchfit.parallel.sharding import Sharding

    backend = get_backend("cpu")
    sharding = Sharding(f"zero{stage}", world_size=world, reduce_bucket_size=bucket)
    model = build_causal_lm("tiny", backend=backend, dtype="bf16", sharding=sharding, seed=0)
    step = causal_lm_step(model, backend=backend)
    step.measure(lengths)
    m = step.measure(lengths)
    zero = zero_state(model)
    return {
        "peak": m.peak_bytes,
        "phases": _coarse(m.phase_peaks),
        "breakdown": dict(m.breakdown),
        "flat_numel": [int(zero.flat.numel())],
        "partition_size": [int(zero.master.numel())],
    }


def compare_on_rank(rank: int, stage: int, bucket: int) -> dict[str, dict[str, Any]]:
    """``{"deepspeed": ..., "batchfit": ...}``: each run's peak, breakdown, flat buffer and partition sizes."""
    import os

    import torch.distributed as dist

    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed reads it (torchrun sets it)
    torch.manual_seed(rank)
    lengths = [SEQ] * BATCH
    world = dist.get_world_size()
    return {
        "deepspeed": _deepspeed_run(stage, bucket, lengths),
        "batchfit": _batchfit_run(stage, bucket, world, lengths),
    }
