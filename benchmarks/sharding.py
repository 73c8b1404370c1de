"""Sharded budgets without a GPU: wall time of whole profiles, and depth extrapolation against full depth.

Every figure is the estimate backend running PyTorch's own FSDP2 (``fully_shard`` per layer
and root) on a simulated process group, fake tensors, one process.

1. The main job, ``batchfit profile`` with no arguments (qwen2.5-7b at 8192 on 8 × h100-80gb,
   fsdp2 with bf16 mixed precision, activation checkpointing), run as a newcomer runs it: a
   fresh process, imports included; with depth extrapolation (the default) and without.
   Target < 60 s.
2. llama-3.1-70b at 32768 on 64 ranks: with CPU offload and fused log-probs it fits; without
   offload one sequence does not fit and the error names the world size that would. Target
   < 90 s each.
3. Depth extrapolation (depths 5 and 6) against the full-depth estimate of the same probe,
   and the time of one probe each way. Target: within 0.5%.

    python benchmarks/sharding.py            # everything (about 5 minutes on 2 CPU cores)
    python benchmarks/sharding.py --quick    # 1 and the 7B extrapolation check only
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from batchfit.budget.causal_lm_probe import causal_lm_step
from batchfit.budget.depth import DEFAULT_DEPTHS, DepthExtrapolatedStep
from batchfit.memory import format_bytes, get_backend
from batchfit.models import build_causal_lm
from batchfit.parallel.distributed import simulated_world
from batchfit.parallel.sharding import Sharding


def timed_cli(args: list[str]) -> tuple[float, str, str]:
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "batchfit", "profile", "--no-progress", *args], capture_output=True, text=True
    )
    return time.perf_counter() - t0, done.stdout, done.stderr


def main_job() -> None:
    for flag in ("--depth-extrapolation", "--no-depth-extrapolation"):
        seconds, out, err = timed_cli([flag])
        budget = next((line for line in out.splitlines() if line.startswith("token budget C")), err.strip())
        print(f"\n1. batchfit profile {flag} (qwen2.5-7b, 8192, fsdp2 × 8 h100-80gb, checkpointing): {seconds:.1f} s")
        print(f"   {budget}")


def seventy_b() -> None:
    common = ["--model", "llama-3.1-70b", "--max-seq-len", "32768", "--world-size", "64", "--logprobs", "fused"]
    for extra, name in ((["--offload", "cpu"], "CPU offload"), ([], "no offload")):
        seconds, out, err = timed_cli([*common, *extra])
        lines = [line for line in out.splitlines() if line.startswith("token budget C")] or [err.strip()]
        print(f"\n2. llama-3.1-70b, 32768, fsdp2 × 64, fused log-probs, {name}: {seconds:.1f} s")
        print(f"   {lines[0][:400]}")


def extrapolation(spec: str, world: int, batch: int, seq_len: int) -> None:
    be = get_backend("estimate", memory_limit=None)
    sharding = Sharding("fsdp2", world_size=world)
    with simulated_world(world):

        def make(n_layers: int | None):
            overrides = {} if n_layers is None else {"num_hidden_layers": n_layers}
            model = build_causal_lm(spec, backend=be, sharding=sharding, gradient_checkpointing=True, **overrides)
            return causal_lm_step(model, backend=be)

        full = make(None)
        depth = int(full.model.config.num_hidden_layers)
        extrapolated = DepthExtrapolatedStep({k: make(k) for k in DEFAULT_DEPTHS}, depth)
        for step in (full, extrapolated):
            step.measure([64] * 1)  # FSDP2's lazy initialisation, paid once per model in any profile
        t0 = time.perf_counter()
        predicted = extrapolated.measure([seq_len] * batch)
        t1 = time.perf_counter()
        measured = full.measure([seq_len] * batch)
        t2 = time.perf_counter()
    error = (predicted.peak_bytes - measured.peak_bytes) / measured.peak_bytes
    print(
        f"\n3. {spec} ({depth} layers), fsdp2 × {world}, checkpointing, {batch} × {seq_len}: "
        f"extrapolated {format_bytes(predicted.peak_bytes)} ({predicted.peak_bytes:,} B, {t1 - t0:.1f} s), "
        f"full depth {format_bytes(measured.peak_bytes)} ({measured.peak_bytes:,} B, {t2 - t1:.1f} s): "
        f"error {error:+.4%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 7B cases only")
    args = parser.parse_args()
    main_job()
    extrapolation("qwen2.5-7b", 8, 2, 8192)
    if not args.quick:
        seventy_b()
        extrapolation("llama-3.1-70b", 64, 1, 32768)
        extrapolation("qwen2.5-0.5b", 8, 4, 4096)


if __name__ == "__main__":
    main()
