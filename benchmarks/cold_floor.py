"""What any first run of ``batchfit profile`` pays before its first probe, and what a symbolic trace costs.

Issue 45 asks a first run of the main job for 0.25 × the time of 3ad1b1f. This script times, in
fresh subprocesses (nothing imported or cached before), the parts of a first run that no design
of the probe removes, and one traced step at concrete and at symbolic sizes:

- ``import torch``; ``import transformers``' model classes; torch's ``FakeTensorMode()`` (its first
  construction imports ``torch._dynamo``);
- one forward and backward of the default model's first shallow copy (qwen2.5-7b's shape at 5
  layers, 3 × 8,192 tokens, activation checkpointing, bf16) under ``FakeTensorMode`` with no
  tracker, FSDP or optimizer: the least a probe that runs the step can cost;
- the same under a ``ShapeEnv`` with the batch and sequence dims symbolic
  (``torch.fx.experimental.symbolic_shapes``): what one trace of a graph walk would cost.

    python benchmarks/cold_floor.py              # 3 runs of each, medians
    python benchmarks/cold_floor.py --repeat 5

It prints each median in seconds (wall), and the ratio symbolic / concrete.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap

PARTS: dict[str, str] = {
    "import torch": "import torch",
    "import torch + transformers' Qwen2": "import torch\nfrom transformers import Qwen2Config, Qwen2ForCausalLM",
    "+ FakeTensorMode() (imports torch._dynamo)": (
        "import torch\nfrom transformers import Qwen2ForCausalLM\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\nFakeTensorMode()"
    ),
}

STEP = textwrap.dedent(
    """
    import sys, time, torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    from transformers import Qwen2Config, Qwen2ForCausalLM

    symbolic = sys.argv[1] == "symbolic"
    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=5, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064)
    config._attn_implementation = "sdpa"
    mode = FakeTensorMode(shape_env=ShapeEnv() if symbolic else None, allow_non_fake_inputs=True)
    torch.set_default_dtype(torch.bfloat16)
    with mode:
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.zeros(3, 8192, dtype=torch.long)
    dims = [DimDynamic.DYNAMIC] * 2
    ids = mode.from_tensor(ids, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims)) if symbolic else mode.from_tensor(ids)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        with mode:
            model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1).mean().backward()
        times.append(time.perf_counter() - start)
    print(times[0], times[1])
    """
)


def _seconds(code: str, *args: str) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-c", f"import time; _t = time.perf_counter()\n{code}\nprint(time.perf_counter() - _t)", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return [float(x) for x in out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each part (medians are printed)")
    args = parser.parse_args(argv)
    for name, code in PARTS.items():
        runs = [_seconds(code)[-1] for _ in range(args.repeat)]
        print(f"{name:50s} {statistics.median(runs):6.2f} s")
    concrete: list[list[float]] = []
    symbolic: list[list[float]] = []
    for _ in range(args.repeat):
        concrete.append(_seconds(STEP, "concrete")[:2])
        symbolic.append(_seconds(STEP, "symbolic")[:2])
    for name, runs in (("concrete", concrete), ("symbolic", symbolic)):
        first, second = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"{'fwd+bwd, 5 layers, 3 x 8,192, ' + name + ' sizes (1st / 2nd)':50s} {first:6.2f} s / {second:.2f} s")
    ratio = statistics.median(s[1] for s in symbolic) / statistics.median(c[1] for c in concrete)
    print(f"{'symbolic / concrete (2nd pass)':50s} {ratio:6.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
