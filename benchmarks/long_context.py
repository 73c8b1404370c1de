"""Long-context budgets: 32k, 64k and 128k tokens on 8 × H100, with and without activation offload.

For each model and sequence length (one sequence of ``max_seq_len`` = prompt + response
tokens, packed rows as verl's ``use_remove_padding`` runs them, FSDP2 over 8 ranks with fp32
master weights and bf16 compute, gradient checkpointing, the policy's update step, the estimate
backend with an H100's 80 GB), it prints:

- the token budget C of one micro-batch (split over the sp ranks of a group) and its per-GPU share
  C / sp (what ``ppo_max_token_len_per_gpu`` may be: verl multiplies it by sp), or "does not fit";
- verl's rule of thumb (docs/perf/perf_tuning.rst: ``ppo_max_token_len_per_gpu`` at least
  2 × (max_prompt_length + max_response_length)) and whether the budget meets it;
- the peak's breakdown at the budget (one rank's device bytes by category) and the host bytes
  activation offload moves there; for a length that does not fit, the bytes reached when the
  step went over the limit (a lower bound of its peak, ``≥``) and their breakdown;
- once per model and offload setting, the longest single sequence that fits.

    python benchmarks/long_context.py                          # qwen2.5-7b and qwen3-8b, verl's head
    python benchmarks/long_context.py --logprobs fused         # the fused head (no logits kept)
    python benchmarks/long_context.py --models qwen2.5-7b --lengths 32768

    python benchmarks/long_context.py --models qwen2.5-7b --lengths 131072 --sequence-parallel 1,2,4,8

With ``--sequence-parallel``, each size splits every packed micro-batch over a group of that many
ranks with Ulysses attention (docs/sequence_parallel.md); C is then the tokens of a micro-batch
the group holds, and the per-GPU share is C / sp. Ring attention (cp) is refused by batchfit on
this torch (docs/sequence_parallel.md says why), so it has no rows.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from batchfit.budget import ProfileOptions, profile_model
from batchfit.errors import DoesNotFitError
from batchfit.memory import format_bytes
from batchfit.parallel import Sharding

MODELS = ("qwen2.5-7b", "qwen3-8b")
LENGTHS = (32_768, 65_536, 131_072)
WORLD_SIZE = 8
TARGET = "h100-80gb"

SEQUENCE_PARALLEL: tuple[int, ...] = (1,)
"""The sequence-parallel sizes by default (``--sequence-parallel 1,2,4,8`` adds more)."""


def sharding_for(sp: int) -> Sharding:
    """FSDP2 over :data:`WORLD_SIZE` ranks, each packed micro-batch split over ``sp`` of them (Ulysses)."""
    return Sharding("fsdp2", world_size=WORLD_SIZE, sequence_parallel=sp)


@dataclass
class Row:
    model: str
    seq_len: int
    offload: bool
    sp: int
    tokens: int | None = None
    peak: int | None = None
    host: int = 0
    breakdown: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def options(seq_len: int, offload: bool, sp: int, logprobs: str) -> ProfileOptions:
    return ProfileOptions(
        max_seq_len=seq_len,
        seq_lens=[seq_len],
        backend="estimate",
        memory_limit=TARGET,
        sharding=sharding_for(sp),
        gradient_checkpointing=True,
        cost="packed",
        logprobs=logprobs,
        activation_offload=offload,
        suggest_world_size=False,
    )


def measure(model: str, seq_len: int, offload: bool, sp: int, logprobs: str) -> Row:
    """One policy profile at ``seq_len``: its budget and binding peak, or ``tokens=None`` when one sequence does not fit."""
    row = Row(model, seq_len, offload, sp)
    start = time.perf_counter()
    try:
        profile = profile_model(model, options(seq_len, offload, sp, logprobs))
    except DoesNotFitError as exc:
        row.peak = exc.needed
        row.breakdown = dict(getattr(exc, "breakdown", None) or {})
    else:
        budget = profile.budgets["policy"]
        point = budget.binding_point
        row.tokens = budget.tokens
        if point is not None:
            row.peak, row.host, row.breakdown = point.peak_bytes, point.host_bytes, dict(point.breakdown)
    row.seconds = time.perf_counter() - start
    return row


def longest_sequence(model: str, offload: bool, sp: int, logprobs: str, start: int) -> int | None:
    """The longest single sequence (a multiple of 1,024 tokens) whose packed micro-batch fits, from ``start`` down.

    With packed rows and varlen attention a micro-batch's peak grows with its tokens, however they
    are cut into sequences, so the budget at ``s`` is close to the longest ``s``: step to ``C(s)``
    until ``C(s) >= s`` (two or three profiles).
    """
    s = start // 1024 * 1024
    for _ in range(6):
        if s < 1024:
            return None
        row = measure(model, s, offload, sp, logprobs)
        if row.tokens is not None and row.tokens >= s:
            return s
        s = (row.tokens if row.tokens is not None else s // 2) // 1024 * 1024
    return None


def _gib(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def render(rows: Iterable[Row]) -> str:
    lines = [
        f"{'model':12} {'sp':>2} {'offload':>7} {'seq len':>8} {'budget C':>10} {'per GPU':>9} {'verl 2×len':>10} {'meets':>5} "
        f"{'peak':>10} {'host':>10} {'s':>6}  breakdown at the peak"
    ]
    for r in rows:
        rule = 2 * r.seq_len
        per_gpu = None if r.tokens is None else r.tokens // r.sp  # verl's ppo_max_token_len_per_gpu (× sp inside verl)
        meets = "-" if per_gpu is None else ("yes" if per_gpu >= rule else "no")
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(r.breakdown.items(), key=lambda kv: -kv[1]) if v)
        lines.append(
            f"{r.model:12} {r.sp:>2} {'on' if r.offload else 'off':>7} {r.seq_len:>8,} "
            f"{('no fit' if r.tokens is None else f'{r.tokens:,}'):>10} {('-' if per_gpu is None else f'{per_gpu:,}'):>9} "
            f"{rule:>10,} {meets:>5} "
            f"{(_gib(r.peak) if r.tokens is not None else '≥ ' + _gib(r.peak)):>10} "
            f"{(_gib(r.host) if r.host else '-'):>10} {r.seconds:>6.1f}  {parts}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated max_seq_len values")
    parser.add_argument("--logprobs", default="verl", help="the policy's head (verl, full, chunked, fused)")
    parser.add_argument("--no-longest", action="store_true", help="skip the longest-sequence search")
    parser.add_argument(
        "--sequence-parallel", default=",".join(map(str, SEQUENCE_PARALLEL)), help="comma-separated Ulysses sizes"
    )
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    lengths = [int(n) for n in args.lengths.split(",") if n]
    print(
        f"policy update, {WORLD_SIZE} × {TARGET}, fsdp2 (fp32 params, bf16 compute), gradient checkpointing, packed rows, "
        f"{args.logprobs} log-probs, estimate backend; C = tokens per GPU (ppo_max_token_len_per_gpu)"
    )
    start = time.perf_counter()
    rows: list[Row] = []
    longest: list[str] = []
    for model in models:
        for sp in [int(x) for x in args.sequence_parallel.split(",")]:
            for offload in (False, True):
                these = [measure(model, n, offload, sp, args.logprobs) for n in lengths]
                rows += these
                print(render(these).split("\n", 1)[1], flush=True)
                if not args.no_longest:
                    fitted = [r.tokens for r in these if r.tokens is not None]
                    s = longest_sequence(model, offload, sp, args.logprobs, max(fitted) if fitted else min(lengths) // 2)
                    longest.append(
                        f"{model:12} sp {sp} offload {'on ' if offload else 'off'}: longest single sequence that fits "
                        f"{'none' if s is None else f'{s:,} tokens'}"
                    )
                    print(longest[-1], flush=True)
    print()
    print(render(rows))
    print()
    print("\n".join(longest))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
