"""Renderings of a :class:`~batchfit.budget.TokenBudget` for ``batchfit profile``: table, lines, plot."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from rich.table import Table

from batchfit.errors import InvalidArgument
from batchfit.memory import format_bytes

if TYPE_CHECKING:
    from batchfit.budget import MemoryModel, TokenBudget
    from batchfit.budget.confirm_report import ConfirmReport, RoleConfirmation
    from batchfit.budget.model_profile import ModelProfile


def memory_model_text(model: MemoryModel | None) -> str:
    """``peak ≈ 1.37 GiB + 18.04 KiB·b·s + 0.005 B·b·s²  (R² 0.99999, max residual 22.7 MiB, 13 probes)``."""
    if model is None:
        return "peak ≈ (no model)"
    quad = f"{model.quadratic:.4g} B" if model.quadratic < 1024 else format_bytes(round(model.quadratic))
    lin = f"{model.linear:.4g} B" if model.linear < 1024 else format_bytes(round(model.linear))
    base = format_bytes(round(model.base)) if model.base >= 0 else f"-{format_bytes(round(-model.base))}"
    return (
        f"peak ≈ {base} + {lin}·b·s + {quad}·b·s²  "
        f"(R² {model.r2:.5f}, max residual {format_bytes(round(model.max_residual))}, {model.n_points} probes)"
    )


def lora_text(profile: ModelProfile) -> str:
    """``LoRA rank 64, alpha 128, all-linear: 35,192,832 trainable parameters of 529,225,600 (6.65%); …``."""
    lora = profile.lora
    if lora is None:
        return "no LoRA: every parameter trained"
    return (
        f"{lora.describe()}; the base frozen in {profile.dtype} (no gradients, no optimizer state), "
        "the adapters in float32 with AdamW"
    )


def pass_title(role: str | None, detail: str = "") -> str:
    """A role and its pass, as ``--json`` names its budget: ``policy (update)``, ``policy_forward (old log-probs, 3×512)``."""
    from batchfit.budget.model_profile import PASS_NAMES

    words = [w for w in (PASS_NAMES.get(str(role), ""), detail) if w]
    return f"{role} ({', '.join(words)})" if words else str(role)


def budget_table(budget: TokenBudget, title: str | None = None) -> Table:
    """One row per probed length: max batch, tokens, peak, headroom to the limit, probes."""
    table = Table(title=title, title_justify="left")
    for name in ("seq len", "max batch", "tokens", "peak", "headroom", "probes"):
        table.add_column(name, justify="right")
    for p in budget.points:
        headroom = budget.limit_bytes - p.peak_bytes
        table.add_row(
            f"{p.seq_len:,}",
            ("" if p.largest else "≥ ") + f"{p.max_batch_size:,}" + (" (cap)" if p.capped else ""),
            ("" if p.largest else "≥ ") + f"{p.tokens:,}" + (" ◀" if p.largest and p.tokens == budget.tokens else ""),
            ("" if p.measured else "≤ ") + format_bytes(p.peak_bytes),
            format_bytes(headroom),
            str(p.probes),
        )
    return table


# Breakdown categories in the order a reader adds them up, with their labels.
_CATEGORY_LABELS = {
    "parameters": "parameters",
    "gathered_parameters": "parameters gathered by FSDP",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "optimizer_step": "optimizer step temporaries",
    "communication": "gradient communication buffers",
    "buffers": "buffers",
    "inputs": "inputs",
    "activations": "activations and temporaries",
    "logprob_head": "log-prob head (logits, log-softmax)",
}


# What the tracker's categories hold under Megatron (NOTE [ The Megatron step's optimizer ] in
# batchfit.train.megatron_step; its SP collectives are filed under FSDP's names, docs/megatron.md "Limits").
_MEGATRON_LABELS = {
    "gathered_parameters": "activations all-gathered by sequence parallelism",
    "communication": "sequence-parallel reduce-scatter buffers",
    "gradients": "gradients (fp32 main_grad buffer)",
    "optimizer_state": "optimizer state (fp32 main parameters, Adam moments)",
}


def _megatron_labels(sharding: Any) -> dict[str, str]:
    """:data:`_MEGATRON_LABELS` with the precision-aware optimizer's dtypes where it is on (bf16 main grads, moments)."""
    if not getattr(sharding, "precision_aware_optimizer", False):
        return _MEGATRON_LABELS
    grads, params = sharding.main_grads_dtype, sharding.main_params_dtype
    moments = sharding.exp_avg_dtype if sharding.exp_avg_dtype == sharding.exp_avg_sq_dtype else (
        f"{sharding.exp_avg_dtype}/{sharding.exp_avg_sq_dtype}"
    )
    return {
        **_MEGATRON_LABELS,
        "gradients": f"gradients ({grads} main_grad buffer)",
        "optimizer_state": f"optimizer state ({params} main parameters, {moments} Adam moments)",
    }


def breakdown_rows(profile: ModelProfile) -> list[tuple[str, list[int | None]]]:
    """``(label, bytes per role)`` rows of one rank's memory at each role's budget peak.

    Categories come from the probe that set each role's budget (its largest fitting
    batch at the binding length); then the peak, the reserve no tracker sees, the limit
    and, under CPU offload, the host bytes.
    """
    partitioned = profile.sharding.partitioned
    budgets = list(profile.budgets.values())
    points = [b.binding_point for b in budgets]
    cats = [c for c in _CATEGORY_LABELS if any(p is not None and p.breakdown.get(c) for p in points)]
    cats += sorted({c for p in points if p is not None for c in p.breakdown} - set(cats))
    rows: list[tuple[str, list[int | None]]] = []
    labels = {**_CATEGORY_LABELS, **(_megatron_labels(profile.sharding) if profile.megatron is not None else {})}
    for cat in cats:
        label = labels.get(cat, cat.replace("_", " "))
        if cat in partitioned:
            label += f" (1/{profile.sharding.world_size} shard)"
        elif cat == "optimizer_state" and profile.sharding.distributed_optimizer:
            label += _distributed_optimizer_shard(profile.sharding)
        rows.append((label, [None if p is None else p.breakdown.get(cat, 0) for p in points]))
    rows.append(("peak at C", [None if p is None else p.peak_bytes for p in points]))
    rows.append(("reserve (CUDA context, NCCL, workspaces)", [profile.reserve_bytes] * len(points)))
    rows.append(("limit (safety margin × usable)", [b.limit_bytes for b in budgets]))
    if any(p is not None and p.host_bytes for p in points):
        what = "CPU offload" if not profile.activation_offload else (
            "CPU offload, offloaded activations" if profile.sharding.offload == "cpu" else "offloaded activations"
        )
        rows.append((f"in host memory ({what})", [None if p is None else p.host_bytes for p in points]))
    return rows


def breakdown_table(profile: ModelProfile) -> Table:
    """One rank's memory at each role's budget peak, by category (columns: roles)."""
    table = Table(title="per-rank memory at the budget's peak", title_justify="left")
    table.add_column("")
    for role, budget in profile.budgets.items():
        point = budget.binding_point
        if point is None:
            at = ""
        elif point.max_tokens is not None:  # packed: whole sequences and a remainder
            at = f"{point.tokens:,} tokens ≤ {point.seq_len:,} each"
        else:
            at = f"{point.max_batch_size}×{point.seq_len:,}"
        table.add_column(pass_title(role, at), justify="right")
    for label, values in breakdown_rows(profile):
        table.add_row(label, *("—" if v is None else format_bytes(v) for v in values))
    return table


def budget_lines(budget: TokenBudget, *, sequence_parallel: int = 1) -> list[str]:
    """The budget, its guarantee, the limit, the memory model and the model check, as lines.

    Under sequence parallelism (``sequence_parallel > 1``) a line says what the budget means per
    group and per GPU (NOTE [ A group's budget ] in :mod:`batchfit.budget.model_profile`).
    """
    if budget.cost == "padded":
        meaning = (
            f"b sequences padded to s ≤ {budget.max_seq_len:,} fit when b·s ≤ {budget.tokens:,} "
            "(packed micro-batches: --cost packed, counted to the token)"
        )
    else:
        meaning = (
            f"packed micro-batches of sequences ≤ {budget.max_seq_len:,} tokens fit when the sum of "
            f"lengths ≤ {budget.tokens:,}"
        )
    from batchfit.frameworks.emit import provenance

    lines = [f"token budget C = {budget.tokens:,} tokens ({budget.cost}), {provenance(budget.backend)}: {meaning}"]
    if sequence_parallel > 1:
        sp = sequence_parallel
        lines.append(
            f"per group of {sp} GPUs (Ulysses sequence parallelism): a micro-batch of ≤ {budget.tokens:,} tokens is "
            f"split over them, ≤ {budget.tokens // sp:,} tokens per GPU (verl's *_max_token_len_per_gpu, which verl "
            f"multiplies by {sp}; SkyRL's max_tokens_per_microbatch is C)"
        )
    if budget.response_tokens is not None:
        share = (
            "every token but each sequence's first"
            if budget.response_fraction is None
            else f"response share {budget.response_fraction:.3g}"
        )
        lines.append(
            f"response cap R = {budget.response_tokens:,} response tokens per micro-batch (response-only head, "
            f"probed at {share}): a micro-batch fits when it holds ≤ C tokens and ≤ R response tokens; "
            "plan with plan_micro_batches(..., response_lengths=loss_mask.sum(-1), response_budget=R)"
        )
    return [
        *lines,
        f"limit {format_bytes(budget.limit_bytes)} = safety margin {budget.safety_margin:g} × "
        f"{format_bytes(budget.usable_bytes)} usable; {budget.probes} probes",
        f"memory model: {memory_model_text(budget.memory_model)}",
        f"model check: {budget.model_check}",
    ]


def _error_text(error: float | None) -> str:
    return "—" if error is None else f"{error:+.2%}"


def confirm_table(confirmation: RoleConfirmation, backend: str) -> Table:
    """One role's confirm run: per category (its literal name), the estimate, the measurement and the error.

    Then the peak; on cuda also the caching allocator's ``reserved − allocated``, which no
    estimate sees. The error is ``(estimate − measured) / measured``.
    """
    c = confirmation
    title = f"{c.role} on {backend}: {c.shape} ({c.cost})"
    table = Table(title=title, title_justify="left")
    table.add_column("category")
    for name in ("estimate", "measured", "error"):
        table.add_column(name, justify="right")
    for cat in c.categories:
        table.add_row(
            cat.category,
            format_bytes(cat.estimated_bytes),
            format_bytes(cat.measured_bytes),
            _error_text(cat.relative_error),
        )
    table.add_row(
        "peak",
        format_bytes(c.estimated_peak_bytes),
        format_bytes(c.measured_peak_bytes) + (" (stopped)" if c.exceeded else ""),
        _error_text(c.relative_error),
        end_section=True,
    )
    if c.reserved_bytes is not None:
        table.add_row("reserved − allocated", "—", format_bytes(c.allocator_overhead_bytes or 0), "not estimated")
    return table


def confirm_lines(report: ConfirmReport, role: str | None = None) -> list[str]:
    """The confirm's header (``role=None``: the device, what differs, the largest error) or one role's verdict."""
    if role is None:
        about = [report.device] if report.device != report.backend else []
        about += [f"{report.world_size} ranks"] if report.world_size > 1 else []
        where = f"{report.backend} ({', '.join(about)})" if about else report.backend
        runs = list(report.roles.values())
        peak = max(runs, key=lambda r: abs(r.relative_error or 0.0))
        cats = [(abs(c.relative_error), c.category) for r in runs for c in r.categories if c.relative_error is not None]
        worst = max(cats, default=(0.0, ""))
        lines = [
            f"confirm on {where}: the real step, full depth, once at each role's budget; largest error: peak "
            f"{_error_text(peak.relative_error)}, category {worst[0]:.2%}{f' ({worst[1]})' if worst[0] else ''} "
            f"(the estimate took {report.estimate_seconds:.1f} s)",
            *(f"what differs: {d}" for d in report.differences),
        ]
        if report.untracked_bytes is not None:
            lines.append(
                f"outside torch's allocator (CUDA context, NCCL, other processes): {format_bytes(report.untracked_bytes)}"
            )
        return lines
    c = report.roles[role]
    used = format_bytes(c.footprint_bytes) + (" reserved" if c.reserved_bytes is not None else "")
    device = f"the {format_bytes(c.limit_bytes)} the device allows (memory − reserve)"
    if not c.fits:
        verdict = f"DOES NOT FIT: {'more than ' if c.exceeded else ''}{used}, above {device}"
    else:
        margin = "holds" if c.within_budget_limit else "was exceeded (the safety margin absorbed it)"
        verdict = (
            f"fits: {used} of {device}; the budget's limit {format_bytes(c.budget_limit_bytes)} "
            f"(safety margin {c.safety_margin:g}) {margin}"
        )
    return [
        verdict,
        f"the budget search's own peak here ({report.profiled_round_to} B rounding): "
        f"{format_bytes(c.profiled_peak_bytes)}; the run took {c.seconds:.2f} s",
    ]


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def require_matplotlib(path: str) -> None:
    """Raise a one-line :class:`InvalidArgument` for a ``--plot`` file that cannot be written, before any work.

    The file must end in one of :data:`PLOT_SUFFIXES`, its folder must exist, and matplotlib
    must be installed.
    """
    from pathlib import Path

    target = Path(path)
    if target.suffix.lower() not in PLOT_SUFFIXES:
        raise InvalidArgument(
            f"--plot must name a {', '.join(PLOT_SUFFIXES)} file, but got --plot {str(path)!r}; e.g. --plot budget.png"
        )
    if not target.parent.is_dir():
        raise InvalidArgument(
            f"--plot {str(path)!r}: the folder {str(target.parent)!r} does not exist; create it or write elsewhere"
        )
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidArgument(
            f"--plot {str(path)!r} needs matplotlib, which is not installed; "
            "install it with pip install 'batchfit[plot]' (or pip install matplotlib)"
        )


#: One colour family per pass (matplotlib colormaps): a pass's lengths are shades of its colour.
_ROLE_COLORMAPS = ("Blues", "Oranges", "Greens", "Purples", "Reds", "Greys", "YlOrBr", "PuRd")


def budget_figure(budgets: dict[str, TokenBudget]) -> Any:
    """The ``--plot`` figure: peak vs. tokens per probed length, each pass's limit and ``C``, no colour twice.

    Each pass (role) gets one colour family, its lengths shades of it (darkest: the longest);
    each pass's own limit (``safety_margin × usable``: passes differ, e.g. a forward pass beside
    resident state) is a dashed line in its colour, and its ``C`` a dotted one, so no pass's
    points are read against another's limit. One limit shared by every pass is one red line.
    A pass beyond the colormaps reuses them with another marker. Returns the matplotlib figure
    (needs matplotlib: :func:`require_matplotlib` checks it first).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    several = len(budgets) > 1
    shared = len({b.limit_bytes for b in budgets.values()}) == 1
    for index, (role, budget) in enumerate(budgets.items()):
        cmap = matplotlib.colormaps[_ROLE_COLORMAPS[index % len(_ROLE_COLORMAPS)]]
        marker = "os^D"[(index // len(_ROLE_COLORMAPS)) % 4]
        by_len: dict[int, list[tuple[int, int, bool]]] = {}
        for t in budget.trials:
            by_len.setdefault(t.seq_len, []).append((t.total_tokens, t.peak_bytes, t.exceeded))
        lengths = sorted(by_len, reverse=True)
        for k, seq_len in enumerate(lengths):
            rows = sorted(by_len[seq_len])
            shade = cmap(0.9 - 0.5 * k / (len(lengths) - 1)) if len(lengths) > 1 else cmap(0.8)
            label = f"{role}: s={seq_len}" if several else f"s={seq_len}"
            ax.plot([r[0] for r in rows], [r[1] / 2**30 for r in rows], f"{marker}-", color=shade, label=label)
            aborted = [r for r in rows if r[2]]
            if aborted:
                ax.plot([r[0] for r in aborted], [r[1] / 2**30 for r in aborted], "x", color=shade)
        base = cmap(0.8)
        ax.axvline(budget.tokens, linestyle=":", color=base if several else "grey")
        if not shared:
            label = f"{role} limit {format_bytes(budget.limit_bytes)}"
            ax.axhline(budget.limit_bytes / 2**30, color=base, linestyle="--", label=label)
    if shared and budgets:
        limit = next(iter(budgets.values())).limit_bytes
        ax.axhline(limit / 2**30, color="red", linestyle="--", label=f"limit {format_bytes(limit)}")
    ax.set_xlabel("tokens in the micro-batch")
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title("batchfit profile: probes (x = aborted at the limit), dotted = budget C")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_budget(budgets: dict[str, TokenBudget], path: str) -> None:
    """Write :func:`budget_figure` to ``path``, once (its suffix names the format).

    matplotlib (Agg) is imported here only, so the CLI needs it only with ``--plot``.
    """
    require_matplotlib(path)
    import matplotlib.pyplot as plt

    fig = budget_figure(budgets)
    from pathlib import Path

    from batchfit.fileio import replacing

    suffix = Path(path).suffix.lstrip(".").lower() or None
    try:  # NOTE [ Writes replace, never truncate ]
        with replacing(path) as tmp:
            fig.savefig(tmp, dpi=120, format=suffix)
    finally:
        plt.close(fig)


def _distributed_optimizer_shard(s: Any) -> str:
    """What Megatron's distributed optimizer leaves on a rank: the dense state over data × context ranks, an expert's
    over the expert-data-parallel ranks, world / (EP × expert TP × pp), expert TP Megatron's default (= TP) unless set."""
    dense = s.data_parallel_size * s.context_parallel
    if s.expert_parallel > 1:
        etp = s.tensor_parallel if s.expert_tensor_parallel is None else s.expert_tensor_parallel
        experts = s.world_size // (s.expert_parallel * etp * s.pipeline_parallel)
        return f" (dense 1/{dense}, experts 1/{experts} shard)"
    return f" (1/{dense} shard)" if dense > 1 else ""
