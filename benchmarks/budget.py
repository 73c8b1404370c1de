"""Budget search: probes and wall time of the model-guided search vs. blind doubling + bisection.

The baseline is SkyRL #1060's profiler strategy, implemented from its description: double the
batch size until a step does not fit, then bisect. Both searches use the same probe (one
measured training step compared with the same limit) and must find the same budget C and the
same largest batch at the length that sets it (equal accuracy; checked): the blind search finds
the largest batch at every length, the guided one only where it can lower C (NOTE [ A length
that does not bind ]). Also times the estimate of a 0.5B preset at 8192.

    python benchmarks/budget.py            # all cases (a few minutes on 2 CPU cores)
    python benchmarks/budget.py --quick    # the tiny-model cases only
"""

from __future__ import annotations

import argparse
import time

from batchfit.budget import find_token_budget
from batchfit.budget.causal_lm_probe import causal_lm_step
from batchfit.memory import format_bytes, get_backend
from batchfit.models import build_causal_lm
from batchfit.plan.bracket import largest_fitting


def make_step(model: str, backend: str, memory: str, dtype: str):
    be = get_backend(backend, memory_limit=memory)
    return causal_lm_step(build_causal_lm(model, backend=be, dtype=dtype), backend=be)


def baseline(step, seq_lens: list[int], limit: int) -> tuple[dict[int, int], int, float]:
    """Doubling + bisection at each length with the same probe; (max batch per length, probes, seconds)."""
    probes = 0
    found: dict[int, int] = {}
    t0 = time.perf_counter()
    for s in seq_lens:

        def probe(b: int, s: int = s) -> bool:
            m = step.measure([s] * b)
            return bool(m.fits and not m.exceeded and m.peak_bytes <= limit)

        result = largest_fitting(probe)  # no guess: doubling from 1, then bisection
        found[s] = result.batch_size
        probes += len(result.trials)
    return found, probes, time.perf_counter() - t0


def compare(name: str, model: str, backend: str, memory: str, max_seq_len: int, dtype: str) -> None:
    step = make_step(model, backend, memory, dtype)
    step.measure([16])  # warm-up, so neither search pays it
    t0 = time.perf_counter()
    budget = find_token_budget(step, max_seq_len=max_seq_len, progress=False)
    guided_s = time.perf_counter() - t0
    lens = [p.seq_len for p in budget.points]
    found, base_probes, base_s = baseline(step, lens, budget.limit_bytes)
    # the guided search searches the binding length to the row; at the others it measures (or proves)
    # that C fits and stops there (NOTE [ A length that does not bind ]): compare C and the binding row
    binding = budget.binding_point
    blind_c = min(b * s for s, b in found.items())
    same = binding.max_batch_size == found[binding.seq_len] and blind_c == budget.tokens
    same_text = "yes" if same else f"NO: blind {found} (C = {blind_c:,})"
    print(
        f"\n{name}: {model} ({dtype}) on {backend}, memory {memory}, limit {format_bytes(budget.limit_bytes)}"
    )
    print(f"  max batch at the binding length {binding.seq_len}: {binding.max_batch_size}; per length, blind: {found}")
    print(f"  same budget from both searches: {same_text}")
    print(f"  budget C = {budget.tokens:,} tokens")
    per_len = ", ".join(f"s={p.seq_len}: {p.probes}" for p in budget.points)
    print(f"  model-guided : {budget.probes:3d} probes ({per_len}), {guided_s:7.1f} s")
    print(f"  doubling+bisect: {base_probes:3d} probes, {base_s:7.1f} s")
    print(f"  probes saved: {base_probes - budget.probes} ({1 - budget.probes / base_probes:.0%}), "
          f"time ratio {base_s / guided_s:.1f}x")  # fmt: skip


def estimate_time(model: str, seq_len: int) -> None:
    t0 = time.perf_counter()
    step = make_step(model, "estimate", "h100-80gb", "bf16")
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = step.measure([seq_len])
    probe_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    budget = find_token_budget(step, max_seq_len=seq_len, progress=False)
    search_s = time.perf_counter() - t0
    print(f"\nestimate of {model} (bf16, AdamW) for an h100-80gb at seq {seq_len}:")
    print(
        f"  build (fake tensors): {build_s:.1f} s; one probe (1 × {seq_len}): {probe_s:.1f} s, peak {format_bytes(m.peak_bytes)}"
    )
    print(f"  full budget search: {search_s:.1f} s, {budget.probes} probes, C = {budget.tokens:,} tokens "
          f"({[(p.seq_len, p.max_batch_size) for p in budget.points]})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny-model cases only")
    args = parser.parse_args()
    compare("real CPU run", "tiny", "cpu", "64MiB", 1024, "fp32")
    compare("estimate, large batches", "tiny", "estimate", "h100-80gb", 4096, "bf16")
    if not args.quick:
        compare("estimate, 0.5B", "qwen2.5-0.5b", "estimate", "h100-80gb", 8192, "bf16")
        estimate_time("qwen2.5-0.5b", 8192)


if __name__ == "__main__":
    main()
