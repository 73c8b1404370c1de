"""The day a GPU is present: estimate vs the real device, per category, in one command.

    python benchmarks/gpu_check.py                 # every GPU this machine shows
    python benchmarks/gpu_check.py --json out.json

It first checks batchfit's rules for CUDA's attention kernel (NOTE [ The estimate runs CUDA's
attention kernel ], ``batchfit.memory.cuda_attention``) against this torch's own choice
(``torch._fused_sdp_choice``) over a grid of dtypes, head counts, masks and head sizes, and
prints every case where they differ (cuDNN where batchfit says flash counts as agreeing: both
keep O(S) per head). Then qwen2.5-0.5b is confirmed once more with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, to show what the allocator reserves
beyond what tensors hold without its default segments.

For the tiny preset and qwen2.5-0.5b on one GPU, and qwen2.5-0.5b sharded with FSDP2 over every
visible GPU under ``torchrun`` when there are several, it runs ``batchfit profile --confirm
--backend cuda``: the budget is estimated (fake tensors), then the real step runs once at each
binding point on the device, and it prints, per category, the estimate, the measurement and
their ratio, the allocator's reserved − allocated, and the confirm's error. The numbers are the
user's calibration too (``--calibration``). Without a GPU it says so and exits 0: there is
nothing to check against.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# (name, profile flags) run on one GPU
SINGLE = (
    ("tiny", ["--model", "tiny", "--sharding", "none", "--max-seq-len", "2048", "--dtype", "fp32"]),
    ("qwen2.5-0.5b", ["--model", "qwen2.5-0.5b", "--sharding", "none", "--max-seq-len", "4096"]),
)
SHARDED = ["--model", "qwen2.5-0.5b", "--sharding", "fsdp2", "--max-seq-len", "4096"]


def _profile(flags: list[str], launcher: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``batchfit profile --confirm --backend cuda --json`` with ``flags``; its JSON (rank 0's)."""
    with tempfile.TemporaryDirectory() as tmp:
        calibration = Path(tmp) / "calibration.json"
        command = [*launcher, "profile", "--confirm", "--backend", "cuda", "--json", "--no-progress",
                   "--calibration", str(calibration), *flags]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})})
        if done.returncode not in (0, 1):  # 1: a confirm run did not fit, reported in the JSON
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr.strip()}")
        data = json.loads(done.stdout)
        if calibration.exists():
            data["calibration"] = json.loads(calibration.read_text())
        return data


_SDP_NAMES = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def attention_kernels() -> dict[str, Any]:
    """This torch's SDPA choice against :func:`batchfit.memory.cuda_attention.cuda_attention_kernel`, over a grid."""
    from batchfit.memory.cuda_attention import cuda_attention_kernel

    cases, differ = [], []
    for dtype, (hq, hkv), gqa, mask, dim, causal in itertools.product(
        (torch.float32, torch.bfloat16, torch.float16), ((4, 4), (4, 2), (4, 1)), (False, True),
        (None, "bool", "float"), (6, 16, 20, 64, 128, 192, 256, 512), (True, False),
    ):  # fmt: skip
        if (hq != hkv and not gqa) or (mask is not None and causal):
            continue
        q = torch.empty(2, hq, 128, dim, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.empty(2, hkv, 128, dim, device="cuda", dtype=dtype)
        m = None if mask is None else torch.ones(2, 1, 128, 128, device="cuda", dtype=torch.bool)
        if mask == "float":
            m = torch.zeros(2, 1, 128, 128, device="cuda", dtype=dtype)
        chosen = _SDP_NAMES[int(torch._fused_sdp_choice(q, k, k, m, 0.0, causal, scale=None, enable_gqa=gqa))]
        ours = cuda_attention_kernel(q, k, k, m, is_causal=causal, enable_gqa=gqa)
        case = {"dtype": str(dtype).removeprefix("torch."), "heads": f"{hq}/{hkv}", "enable_gqa": gqa, "mask": mask,
                "head_dim": dim, "causal": causal, "torch": chosen, "batchfit": ours}  # fmt: skip
        cases.append(case)
        if ours != chosen and not (ours == "flash" and chosen == "cudnn"):
            differ.append(case)
    return {"cases": len(cases), "differ": differ}


def _rows(name: str, data: dict[str, Any]) -> list[str]:
    lines = [f"\n{name}"]
    for role, entry in data.get("confirm", {}).get("roles", {}).items():
        error = entry.get("peak", {}).get("relative_error")
        shown = "—" if error is None else f"{error:+.2%}"
        lines.append(f"  {role} at {entry.get('shape', '?')}: peak error {shown}, "
                     f"reserved − allocated {entry.get('allocator_overhead_bytes')} B, fits {entry.get('fits')}")  # fmt: skip
        for category, c in entry.get("categories", {}).items():
            estimated, measured = c.get("estimated_bytes"), c.get("measured_bytes")
            ratio = f"{measured / estimated:.4f}" if estimated else "—"
            lines.append(f"    {category:20s} estimate {estimated:>16,}  measured {measured:>16,}  ratio {ratio}")
    if "error" in data:
        lines.append(f"  error: {data['error']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write every run's JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU on this machine (torch.cuda.is_available() is False): nothing to check; exit 0")
        return 0
    gpus = torch.cuda.device_count()
    one = [sys.executable, "-m", "batchfit"]
    kernels = attention_kernels()
    print(f"attention kernels: {kernels['cases']} cases, {len(kernels['differ'])} where batchfit's rule differs from torch's choice")
    for case in kernels["differ"]:
        print(f"  {case}")
    results: dict[str, Any] = {"attention_kernels": kernels}
    results.update({name: _profile(flags, one) for name, flags in SINGLE})
    name, flags = SINGLE[1]
    results[f"{name} expandable segments"] = _profile(flags, one, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    if gpus > 1:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "-m", "batchfit"]
        results[f"qwen2.5-0.5b fsdp2 × {gpus}"] = _profile([*SHARDED, "--world-size", str(gpus)], torchrun)
    print(f"{torch.cuda.get_device_name(0)} × {gpus}, torch {torch.__version__}")
    for name, data in results.items():
        if name != "attention_kernels":
            print("\n".join(_rows(name, data)))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
