"""Mixture-of-experts budgets without a GPU: qwen3-30b-a3b on 8 and 16 × H100, FSDP2, grouped_mm vs the eager loop.

Every figure is the estimate backend running PyTorch's own FSDP2 (``fully_shard`` per layer and
root, bf16 compute, fp32 master weights, AdamW) on a simulated process group: one rank's peak, with
activation checkpointing and full log-probs (what ``batchfit profile`` runs by default), the
budget searched at ``max_seq_len`` only (``seq_lens=[max_seq_len]``).

1. The grid: 8k and 32k × 8 and 16 ranks × no offload and CPU offload × grouped_mm (any routing)
   and eager (worst-case routing: every token to the same 8 experts). A cell that does not fit one
   sequence prints the error's first words and its remedies.
2. The per-rank breakdown of 8k × 16 without offload next to hand arithmetic of the sharded
   state: 30,532,122,624 parameters / N ranks × 4 B (fp32 master weights), the same for the
   gradients, twice that for AdamW's two moments, and one decoder layer gathered whole by FSDP2
   in bf16 (all of its 128 experts) when the peak falls inside the layers.
3. The eager loop: balanced routing beside the worst case, at one cell.
4. A fused log-prob head (no ``[tokens, vocab]`` logits) at 8k × 16: the peak falls inside the
   layers, where FSDP2 holds gathered layers, all of their experts (``gathered_parameters``).

    python benchmarks/moe.py            # everything (parts 1-3 took 21 min 33 s on 2 shared CPU cores; 4 adds minutes)
    python benchmarks/moe.py --quick    # 8k × 8 with offload (both implementations), 8k × 16: 2 and 4's grouped_mm
"""

from __future__ import annotations

import argparse
import time

from batchfit.budget import profile_model
from batchfit.errors import DoesNotFitError
from batchfit.memory import format_bytes
from batchfit.parallel.sharding import Sharding

MODEL = "qwen3-30b-a3b"
PARAMETERS = 30_532_122_624  # every parameter of the preset (batchfit.models.moe.moe_summary)


def profile(
    seq_len: int, world: int, offload: bool, implementation: str, routing: str | None = None, logprobs: str = "full"
) -> tuple[object, float]:
    t0 = time.perf_counter()
    try:
        result = profile_model(
            MODEL,
            max_seq_len=seq_len,
            backend="estimate",
            memory_limit="h100-80gb",
            sharding=Sharding("fsdp2", world_size=world, offload="cpu" if offload else "none"),
            gradient_checkpointing=True,
            seq_lens=[seq_len],
            experts_implementation=implementation,
            routing=routing,
            suggest_world_size=False,
            logprobs=logprobs,
        )
    except DoesNotFitError as exc:
        result = exc
    return result, time.perf_counter() - t0


def cell(
    seq_len: int, world: int, offload: bool, implementation: str, routing: str | None = None, logprobs: str = "full"
) -> object:
    result, seconds = profile(seq_len, world, offload, implementation, routing, logprobs)
    where = f"{seq_len // 1024}k × {world}, {'offload' if offload else 'no offload'}, {implementation}"
    if logprobs != "full":
        where += f", {logprobs} log-probs"
    if routing:
        where += f" ({routing} routing)"
    if isinstance(result, DoesNotFitError):
        print(f"  {where}: does not fit one sequence ({seconds:.0f} s): {str(result)[:220]}…")
    else:
        c = result.combined
        print(f"  {where}: C = {c.tokens:,} tokens per rank, peak {format_bytes(c.binding_point.peak_bytes)} ({seconds:.0f} s)")
    return result


def layer_parameters() -> int:
    """Parameters of one decoder layer of the preset (attention, router, all 128 experts), counted on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from batchfit.models import load_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(MODEL, num_hidden_layers=1), dtype=torch.bfloat16)
    return sum(p.numel() for p in model.model.layers[0].parameters())


def hand_arithmetic(result: object, world: int, what: str) -> None:
    breakdown = (result.breakdown or {}) if isinstance(result, DoesNotFitError) else result.combined.breakdown
    shard = PARAMETERS * 4 / world  # fp32 master weights, FSDP2's even split
    layer = layer_parameters()
    print(f"\n{what}: per-rank breakdown (estimate) and hand arithmetic")
    rows = (
        ("parameters", shard, f"{PARAMETERS:,} × 4 B / {world}"),
        ("gradients", shard, f"{PARAMETERS:,} × 4 B / {world}"),
        ("optimizer_state", 2 * shard, f"2 × {PARAMETERS:,} × 4 B / {world}: AdamW's two moments"),
        ("gathered_parameters", 2 * layer, f"one layer gathered whole in bf16, all 128 experts: {layer:,} × 2 B"),
    )
    for name, hand, how in rows:
        measured = breakdown.get(name, 0)
        print(f"  {name:<22} {format_bytes(measured):>12}   hand {format_bytes(int(hand)):>12}  ({how}; {measured / hand - 1:+.2%})")
    for name, value in breakdown.items():
        if name not in {r[0] for r in rows}:
            print(f"  {name:<22} {format_bytes(value):>12}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(f"1. {MODEL}, fsdp2, checkpointing, full log-probs, h100-80gb (estimate backend)")
    if args.quick:
        grid = [(8192, 8, True)]
    else:
        grid = [(s, w, o) for s in (8192, 32768) for w in (8, 16) for o in (False, True)]
    cells = {}
    for seq_len, world, offload in grid:
        cells[seq_len, world, offload] = cell(seq_len, world, offload, "grouped_mm")
        cell(seq_len, world, offload, "eager", "skewed")
    if args.quick:
        cells[8192, 16, False] = cell(8192, 16, False, "grouped_mm")
    hand_arithmetic(cells[8192, 16, False], 16, "2. 8k × 16, no offload, grouped_mm, full log-probs")
    if not args.quick:
        print("\n3. the eager loop, 8k × 16 without offload: balanced routing beside the worst case")
        cell(8192, 16, False, "eager", "balanced")
    print("\n4. 8k × 16 without offload, fused log-probs: the peak inside the layers, FSDP2's gathered layers in it")
    fused = cell(8192, 16, False, "grouped_mm", logprobs="fused")
    if not args.quick:
        cell(8192, 16, False, "eager", "skewed", logprobs="fused")
        cell(8192, 16, False, "eager", "balanced", logprobs="fused")
    hand_arithmetic(fused, 16, "4. 8k × 16, no offload, grouped_mm, fused log-probs")


if __name__ == "__main__":
    main()
