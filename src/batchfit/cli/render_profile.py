"""``batchfit profile``'s text output: the settings a profile ran with, its budget tables and breakdown."""

from __future__ import annotations

from typing import Any

from batchfit.frameworks.profile_request import ProfileRequest


def render_profile(console: Any, profile: Any, request: ProfileRequest) -> None:
    """The settings ``profile`` ran with, each pass's budget table and lines, the breakdown (and the combined budget)."""
    from batchfit.cli.render_budget import breakdown_table, budget_lines, budget_table, pass_title
    from batchfit.memory import format_bytes

    target = request.memory if request.memory is not None else "the device"
    if isinstance(target, int):  # the calibrated device's bytes
        target = format_bytes(target)
    if request.memory_defaulted:
        target = f"{target} (default target without a GPU; set --memory)"
    limit = f"{format_bytes(profile.memory_limit)}" if profile.memory_limit else "device total"
    depth = f"{profile.depth} layers"
    if profile.measured_depths:
        depth += f", extrapolated from {profile.measured_depths[0]} and {profile.measured_depths[1]}"
    precision = (
        f"{profile.dtype} params, {profile.compute_dtype} compute"
        if profile.compute_dtype != profile.dtype
        else profile.dtype
    )
    console.print(
        f"batchfit profile: model {profile.model} ({depth}; {precision}"
        f"{', gradient checkpointing' if profile.gradient_checkpointing else ''}"
        f"{', activation offload' if profile.activation_offload else ''}, {_optimizer_words(profile)}, "
        f"{profile.logprobs} log-probs), max_seq_len {request.options.max_seq_len:,}, cost {request.options.cost}",
        highlight=False,
    )
    if profile.lora is not None:
        from batchfit.cli.render_budget import lora_text

        console.print(lora_text(profile), highlight=False)
    if profile.attention is not None and profile.attention.note:
        console.print(profile.attention.note, highlight=False)
    if profile.moe is not None:
        console.print(profile.moe.describe(), highlight=False)
        floor = profile.moe.expert_shard_note(profile.sharding.world_size) if profile.sharding.spec.shards_rows else None
        if floor:  # NOTE [ One expert per rank at least ] in batchfit.models.moe
            console.print(f"note: {floor}", highlight=False)
        line = worst_case_line(profile)
        if line:
            console.print(line, highlight=False)
    console.print(f"sharding: {profile.sharding.describe()}", highlight=False)
    if profile.megatron is not None:
        console.print(f"megatron: {profile.megatron.describe()}", highlight=False)
    if profile.torch is not None:
        for b in profile.torch.behaviours:
            console.print(
                f"torch {profile.torch.torch_version} ({b.detected_by}): {b.meaning}", highlight=False
            )
    terms = "" if profile.untracked is None else f" ({profile.untracked.describe()})"
    console.print(
        f"backend {profile.backend} → {target} per rank: {limit}, reserve {format_bytes(profile.reserve_bytes)}{terms}, "
        f"safety margin {profile.safety_margin:g}",
        highlight=False,
    )
    from batchfit.memory import backend_class

    cls = backend_class(profile.backend)
    if cls.simulated or cls.reads_device:  # a CUDA device, estimated or measured
        for line in device_lines(profile):
            console.print(line, highlight=False)
    if request.calibration is not None:
        console.print(
            f"calibration {request.calibration_path}: {request.calibration.describe()}", highlight=False
        )
    if request.confirm:
        console.print(
            f"--confirm: the budgets estimated against the {request.backend} device's memory and reserve; "
            "its real runs follow",
            highlight=False,
        )
    for role, budget in profile.budgets.items():
        console.print()
        console.print(budget_table(budget, title=pass_title(role)))
        for line in budget_lines(budget, sequence_parallel=profile.sharding.sequence_parallel):
            console.print(line, highlight=False)
    console.print()
    console.print(breakdown_table(profile))
    if len(profile.budgets) > 1:
        combined = profile.combined
        console.print()
        console.print(
            f"combined budget (every role fits): C = {combined.tokens:,} tokens per rank, set by "
            f"{pass_title(combined.binding_role)}",
            highlight=False,
        )
    if request.plot:
        console.print(f"plot written to {request.plot}", highlight=False)


def device_lines(profile: Any) -> list[str]:
    """What the limit assumes beyond the reserve: the allocator setting, and the rollout engine's share when there is one."""
    from batchfit.memory import format_bytes
    from batchfit.memory.cuda_untracked import ALLOCATOR_CONF

    if profile.allocator == "expandable_segments":
        setting = f"PYTORCH_CUDA_ALLOC_CONF={ALLOCATOR_CONF[profile.allocator]} in the training processes; without it, --allocator caching"
    else:
        setting = "the default segments, which fragment over a run; with expandable segments, --allocator expandable_segments"
    lines = [f"allocator: {profile.allocator} ({setting}): safety margin {profile.safety_margin:g}"]
    engine = profile.engine
    if engine is not None and (engine.bytes or engine.given_bytes is not None):
        lines.append(f"rollout engine: {engine.describe()} = {format_bytes(engine.bytes)} per GPU, taken off the usable memory")
    return lines


#: A balanced-routing budget this much larger than the worst case's is called out.
WORST_CASE_GAP = 1.1


def worst_case_line(profile: Any) -> str | None:
    """The worst-case routing's budget beside the balanced one's, when the gap is large (``None`` otherwise)."""
    moe = profile.moe
    if moe is None or moe.routing != "skewed" or moe.balanced_tokens is None:
        return None
    worst = profile.combined.tokens
    if moe.balanced_tokens < WORST_CASE_GAP * worst:
        return f"routing: the worst case (every expert hit, the other tokens on the same experts) costs little here: C = {worst:,} tokens, {moe.balanced_tokens:,} with balanced routing"
    if getattr(moe, "expert_parallel", 1) > 1:  # the dispatch follows the routing whatever the implementation
        return (
            f"routing: the worst case (every rank's tokens on one EP rank's experts) sets C = {worst:,} tokens per rank; balanced routing "
            f"would allow {moe.balanced_tokens:,} ({moe.balanced_tokens / worst:.2g}×), but drop-less routing can send every rank's tokens "
            "to one EP rank: a capacity factor (tokens dropped past it) bounds what it receives"
        )
    return (
        f"routing: the worst case (every expert hit, the other tokens on the same experts) sets C = {worst:,} tokens per rank; balanced routing "
        f"would allow {moe.balanced_tokens:,} ({moe.balanced_tokens / worst:.2g}×), but the {moe.implementation} experts' memory "
        "follows the routing and the router can produce the worst case: use --experts-implementation grouped_mm for a budget that does not depend on it"
    )


def _optimizer_words(profile: Any) -> str:
    """``AdamW``, or under Megatron its own optimizer (``Megatron's distributed optimizer (Adam)``)."""
    if profile.megatron is None:
        return "AdamW"
    return "Megatron's distributed optimizer (Adam)" if profile.sharding.distributed_optimizer else "Megatron's optimizer (Adam)"
