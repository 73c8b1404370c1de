"""End to end: what batchfit buys a step-wise GRPO loop under FSDP2, measured on 2 gloo ranks (CPU).

The same training work (``examples/grpo_stepwise.py``: the same rollouts, optimizer steps and
gradients, FSDP2 over 2 spawned gloo ranks, the tiny preset) four ways:

    (a) fixed micro_train_batch_size_per_gpu=1, SkyRL's default (forward passes: 1 too);
    (b) the largest fixed micro size whose padded batch of maximum-length sequences fits
        (the padded budget // the maximum length, training and forward alike);
    (c) batchfit's token budget, padded micro-batches (cost = rows × longest);
    (d) batchfit's token budget, packed rows (cost = sum of lengths, varlen attention).

(a) and (b) run as SkyRL runs them: slices of the batch, every row prompt + response columns
wide. The budgets are profiled on the real ranks (cpu backend, per rank for this sharding). A
CPU does not get faster with bigger batches, so beside CPU tokens/s the table shows the costs
that carry over to a GPU cluster: micro-batches per optimizer step (per rank), tokens computed /
real tokens (padding), FSDP2 all-gather bytes per optimizer step (every micro-batch gathers the
parameters again; counted from the c10d collectives on rank 0), and the largest measured peak
of any micro-batch (cpu tracker) over its budget's limit.

Each way runs twice: measured (tracker and collective counter on; they cost about half the
throughput) and timed (both off); tokens/s skips the first training step (warm-up).

    python benchmarks/e2e.py               # about 5 minutes on 2 loaded CPU cores
    python benchmarks/e2e.py --steps 2 --json e2e.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from batchfit.cli.demo import load_example
from batchfit.memory import parse_memory

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = {
    "prompts": 16,
    "mini_batch": 8,
    "samples": 4,
    "max_prompt_len": 256,
    "max_response_len": 128,
    "memory": "64MiB",
    "sharding": "fsdp2",
    "quiet": True,
}
NAMES = {
    "a": "fixed micro size 1 (SkyRL default)",
    "b": "largest fixed size that fits",
    "c": "batchfit budget, padded",
    "d": "batchfit budget, packed",
}


def _example() -> Any:
    return load_example(ROOT / "examples" / "grpo_stepwise.py")


def _rank(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    try:
        ex = _example()
        base = ex.Settings(steps=steps, **WORKLOAD)
        sharding = ex.sharding_of(base)
        started = time.perf_counter()
        padded = ex.token_budgets(dataclasses.replace(base, layout="padded"), sharding)
        packed = ex.token_budgets(dataclasses.replace(base, layout="packed"), sharding)
        profile_seconds = time.perf_counter() - started
        width = base.max_prompt_len + base.max_response_len
        fits = (padded.training // width, padded.forward // width)
        variants = {
            "a": (
                dataclasses.replace(base, layout="padded", micro_batch_size=1, forward_micro_batch_size=1),
                padded,
            ),
            "b": (
                dataclasses.replace(
                    base, layout="padded", micro_batch_size=fits[0], forward_micro_batch_size=fits[1]
                ),
                padded,
            ),
            "c": (dataclasses.replace(base, layout="padded"), padded),
            "d": (dataclasses.replace(base, layout="packed"), packed),
        }
        rows = {}
        for key, (settings, budgets) in variants.items():
            measured = ex.train(settings, budgets)
            timed = ex.train(dataclasses.replace(settings, timing_only=True), budgets)
            rows[key] = {
                "settings": dataclasses.asdict(settings),
                "budgets": dataclasses.asdict(budgets),
                "steps": [dataclasses.asdict(s) for s in measured.steps],
                "forward": [dataclasses.asdict(f) for f in measured.forward],
                "timed_steps": [dataclasses.asdict(s) for s in timed.steps],
            }
        if rank == 0:
            result = {
                "workload": WORKLOAD,
                "steps": steps,
                "world": world,
                "profile_seconds": profile_seconds,
                "worst_peak": max(
                    log["peak_bytes"] for row in rows.values() for log in [*row["steps"], *row["forward"]]
                ),
            }
            Path(out).write_text(json.dumps({**result, "variants": rows}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize(data: dict) -> dict[str, dict[str, float]]:
    """Per way: means over optimizer steps, the worst peak / limit, tokens/s after the first training step."""
    out = {}
    for key, row in data["variants"].items():
        steps, forward, timed = row["steps"], row["forward"], row["timed_steps"]
        late = [s for s in timed if s["training_step"] > 0] or timed
        n = len(steps)
        out[key] = {
            "micro_batches": sum(s["micro_batches"] for s in steps) / n,
            "computed_over_real": sum(s["tokens_computed"] for s in steps)
            / sum(s["real_tokens"] for s in steps),
            "all_gather_mib": sum(s["all_gather_bytes"] for s in steps) / n / 2**20,
            "tokens_per_s": sum(s["real_tokens"] for s in late) / sum(s["seconds"] for s in late),
            "peak_over_limit": max(s["peak_bytes"] / s["limit_bytes"] for s in steps),
            "forward_micro_batches": sum(f["micro_batches"] for f in forward) / len(forward),
            "forward_peak_over_limit": max(f["peak_bytes"] / f["limit_bytes"] for f in forward),
        }
    return out


def table(data: dict, summary: dict[str, dict[str, float]]) -> str:
    """The summary as a markdown table, then the targets checked."""
    variants = data["variants"]
    lines = [
        "| way | micro-batches / optimizer step (per rank) | tokens computed / real | all-gather MiB / optimizer step | CPU tokens/s | peak / limit: training | peak / limit: forward |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for key, s in summary.items():
        settings, budgets = variants[key]["settings"], variants[key]["budgets"]
        how = (
            f"{settings['micro_batch_size']} / {settings['forward_micro_batch_size']} sequences"
            if settings["micro_batch_size"]
            else f"{budgets['training']:,} / {budgets['forward']:,} tokens"
        )
        lines.append(
            f"| ({key}) {NAMES[key]}: {how} | {s['micro_batches']:.1f} | {s['computed_over_real']:.2f} | "
            f"{s['all_gather_mib']:.1f} | {s['tokens_per_s']:,.0f} | {s['peak_over_limit']:.3f} | "
            f"{s['forward_peak_over_limit']:.3f} |"
        )
    a, b, c, d = (summary[k] for k in "abcd")
    memory = parse_memory(data["workload"]["memory"])
    worst_training = max(s["peak_over_limit"] for s in summary.values())
    worst_planned = max(max(s["peak_over_limit"], s["forward_peak_over_limit"]) for s in (c, d))
    worst = max(max(s["peak_over_limit"], s["forward_peak_over_limit"]) for s in summary.values())
    checks = [
        ("(c) ≥ 10× fewer micro-batches than (a)", a["micro_batches"] / c["micro_batches"], a["micro_batches"] >= 10 * c["micro_batches"]),
        ("(d) ≥ 10× fewer micro-batches than (a)", a["micro_batches"] / d["micro_batches"], a["micro_batches"] >= 10 * d["micro_batches"]),
        ("(c) ≥ 10× fewer all-gather bytes than (a)", a["all_gather_mib"] / c["all_gather_mib"], a["all_gather_mib"] >= 10 * c["all_gather_mib"]),
        ("(d) ≥ 10× fewer all-gather bytes than (a)", a["all_gather_mib"] / d["all_gather_mib"], a["all_gather_mib"] >= 10 * d["all_gather_mib"]),
        ("(d) tokens computed / real ≤ 1.05", d["computed_over_real"], d["computed_over_real"] <= 1.05),
        ("(d) fewer micro-batches than (b)", b["micro_batches"] / d["micro_batches"], d["micro_batches"] < b["micro_batches"]),
        ("every training micro-batch's peak ≤ its budget's limit", worst_training, worst_training <= 1),
        ("every micro-batch batchfit planned ((c), (d)) ≤ its budget's limit", worst_planned, worst_planned <= 1),
        ("every micro-batch of every way ≤ its budget's limit", worst, worst <= 1),
        ("every micro-batch of every way ≤ the memory", data["worst_peak"] / memory, data["worst_peak"] <= memory),
    ]  # fmt: skip
    lines.append("")
    lines.extend(f"- {'met' if ok else 'MISSED'}: {what} ({value:.3g})" for what, value, ok in checks)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps per way (default 3)")
    parser.add_argument("--json", help="also write the raw logs and the summary here")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "e2e.json")
        mp.start_processes(_rank, args=(2, _free_port(), args.steps, out), nprocs=2, start_method="spawn")
        data = json.loads(Path(out).read_text())
    summary = summarize(data)
    w = data["workload"]
    print(
        f"step-wise GRPO, tiny preset, FSDP2 over {data['world']} gloo ranks, {w['memory']} per rank; "
        f"{w['prompts']} prompts × {w['samples']} samples, mini-batches of {w['mini_batch']} prompts, "
        f"prompt {w['max_prompt_len']} + response {w['max_response_len']} columns; "
        f"{data['steps']} training steps per way; budgets profiled in {data['profile_seconds']:.0f} s\n"
    )
    print(table(data, summary))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps({**data, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
