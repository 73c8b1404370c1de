"""Figures of the response-only head (issue 22, item 4): the head's peak and time, and the budget C it leaves.

Two tables, then the issue's bar check:

1. **cpu backend, a small model** (default: 2 layers, hidden 256, vocabulary 32,768, fp32): for
   each total token count and prompt:response ratio, one packed micro-batch of ``--seqs``
   sequences runs the budget's own probe step (:func:`batchfit.budget.causal_lm_probe.causal_lm_step`,
   no optimizer: :func:`batchfit.train.micro_batch_loss`, i.e. ``model_logprobs`` and the
   clipped policy loss, then ``backward()``) with the head ``full`` / ``chunked`` / ``fused``,
   with and without ``only_loss_tokens``. Memory is the cpu backend's live-storage
   measurement (exact bytes): the step's peak, the ``logprob_head`` category at that peak (the
   bytes the head created, NOTE [ Phases and regions ]) and the largest peak while the step
   is at the head (``forward:head`` / ``backward:head`` phase peaks). Time is the best of
   ``--repeats`` untracked runs of the same step (``time.perf_counter``), printed with the load.
2. **estimate backend, qwen2.5-7b over 8 ranks** (fsdp2, gradient checkpointing, H100 80 GB,
   packed cost): :func:`batchfit.budget.profile_model` for each ``max_seq_len`` × head, once
   without the response-only head (every token but each sequence's first is a loss token, so
   the ratio does not change the probe) and once per ratio with ``response_only=True,
   response_fraction=r/(p+r)``. Printed: C (total tokens), the response cap, the binding
   length, the head's bytes (``logprob_head``) and the peak at the binding point.

Without response-only the cpu rows are measured once per total and head as well, on the same
kind of probe batch (every token but the first a loss token).

Usage:
    python benchmarks/response_head.py --quick         # smoke run, ~20 s (tiny sizes; 'tiny' preset, 64 MiB; 19.5 s at load 1.6, 2026-11-24)
    python benchmarks/response_head.py --part cpu      # the cpu table, ~5 min
    python benchmarks/response_head.py --part estimate # the estimate table, 36 profiles, ~18 min
    python benchmarks/response_head.py                 # both

Measured 2026-11-24 on this 2-core machine with other jobs running: the full estimate table
(3 lengths × 3 heads × (1 + 3 ratios) = 36 profiles) took 18 minutes at load 2.8-5.2 (14-54 s
per profile); the cpu table 5 minutes at load 1.4-2.9. Output and reading: docs/logprobs.md,
"Response-only head: figures".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchfit.errors import BatchfitError

HEADS = ("full", "chunked", "fused")
RATIOS = ("1:1", "4:1", "16:1")
MIB = 2**20
GIB = 2**30


def parse_ratio(text: str) -> tuple[int, int]:
    """``"4:1"`` → ``(4, 1)`` (prompt, response); both positive integers."""
    try:
        prompt, response = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"ratio must be prompt:response such as 4:1, but got {text!r}") from None
    if prompt < 0 or response <= 0:
        raise argparse.ArgumentTypeError(f"ratio needs prompt >= 0 and response >= 1, but got {text!r}")
    return prompt, response


def response_fraction(ratio: str) -> float:
    """The response share of a ``prompt:response`` ratio: ``r / (p + r)`` (4:1 → 0.2)."""
    prompt, response = parse_ratio(ratio)
    return response / (prompt + response)


def load() -> str:
    """The 1-minute load average, for the timing lines."""
    return f"{os.getloadavg()[0]:.2f}"


# ---------------------------------------------------------------------------------------------
# 1. cpu backend, small model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuRow:
    """One measured micro-batch on the cpu backend.

    ``ratio`` is ``None`` for the head over every token (no ``only_loss_tokens``).
    """

    total: int
    head: str
    ratio: str | None
    loss_tokens: int
    peak_bytes: int
    head_bytes: int
    head_phase_peak: int
    seconds: float
    load: str


def split_tokens(total: int, seqs: int) -> list[int]:
    """``total`` tokens as ``seqs`` sequences as equal as possible (the packed micro-batch's lengths)."""
    base, extra = divmod(total, seqs)
    return [base + (i < extra) for i in range(seqs) if base + (i < extra) > 0]


def measure_cpu(
    totals: Sequence[int],
    ratios: Sequence[str],
    heads: Sequence[str],
    *,
    vocab: int,
    hidden: int,
    layers: int,
    seqs: int,
    repeats: int,
    on_row: Callable[[CpuRow], None] = lambda row: None,
) -> list[CpuRow]:
    """Measure the probe step of a small model for every total × head × (every token, each ratio)."""
    from batchfit.budget.causal_lm_probe import causal_lm_step
    from batchfit.memory import get_backend
    from batchfit.models import build_causal_lm

    backend = get_backend("cpu")
    heads_n = max(1, hidden // 64)
    model = build_causal_lm(
        "tiny",
        backend=backend,
        seed=0,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=heads_n,
        num_key_value_heads=max(1, heads_n // 2),
        head_dim=hidden // heads_n,
        max_position_embeddings=max(32768, *totals),
    )
    rows = []
    for total in totals:
        lengths = split_tokens(total, seqs)
        for head in heads:
            for ratio in (None, *ratios):
                fraction = None if ratio is None else response_fraction(ratio)
                step = causal_lm_step(
                    model,
                    backend=backend,
                    optimizer=None,
                    logprobs=head,
                    cost="packed",
                    only_loss_tokens=ratio is not None,
                    response_fraction=fraction,
                )
                m = step.measure(lengths)
                mb = step.micro_batch(lengths)
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    step.run(mb)
                    best = min(best, time.perf_counter() - start)
                at_head = [v for k, v in m.phase_peaks.items() if k.endswith(":head")]
                row = CpuRow(
                    total=sum(lengths),
                    head=head,
                    ratio=ratio,
                    loss_tokens=int(mb.batch["loss_mask"].sum()),
                    peak_bytes=m.peak_bytes,
                    head_bytes=m.breakdown.get("logprob_head", 0),
                    head_phase_peak=max(at_head, default=0),
                    seconds=best,
                    load=load(),
                )
                rows.append(row)
                on_row(row)
    return rows


# ---------------------------------------------------------------------------------------------
# 2. estimate backend, qwen2.5-7b over 8 ranks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EstimateRow:
    """One profile's combined budget; ``ratio`` ``None`` is the head over every token.

    ``tokens`` is ``None`` when nothing fits (``error`` says why).
    """

    max_seq_len: int
    head: str
    ratio: str | None
    tokens: int | None
    response_tokens: int | None
    binding_seq_len: int | None
    head_bytes: int | None
    peak_bytes: int | None
    limit_bytes: int | None
    seconds: float
    error: str = ""
    activation_bytes: int | None = None


def profile_estimate(
    model: str,
    lengths: Sequence[int],
    ratios: Sequence[str],
    heads: Sequence[str],
    *,
    memory_limit: str,
    world_size: int,
    reserve_bytes: int | None = None,
    on_row: Callable[[EstimateRow], None] = lambda row: None,
) -> list[EstimateRow]:
    """Profile ``model`` on the estimate backend for every length × head × (every token, each ratio)."""
    from batchfit.budget import profile_model
    from batchfit.parallel import Sharding

    rows = []
    for length in lengths:
        for head in heads:
            for ratio in (None, *ratios):
                start = time.perf_counter()
                try:
                    profile = profile_model(
                        model,
                        max_seq_len=length,
                        backend="estimate",
                        memory_limit=memory_limit,
                        reserve_bytes=reserve_bytes,
                        sharding=Sharding("fsdp2", world_size=world_size),
                        gradient_checkpointing=True,
                        logprobs=head,
                        cost="packed",
                        response_only=ratio is not None,
                        response_fraction=None if ratio is None else response_fraction(ratio),
                    )
                except BatchfitError as err:  # nothing fits: a row saying so
                    row = EstimateRow(length, head, ratio, None, None, None, None, None, None,
                                      time.perf_counter() - start, str(err).splitlines()[0])
                else:
                    budget = profile.combined
                    point = budget.binding_point
                    row = EstimateRow(
                        max_seq_len=length,
                        head=head,
                        ratio=ratio,
                        tokens=budget.tokens,
                        response_tokens=budget.response_tokens,
                        binding_seq_len=None if point is None else point.seq_len,
                        head_bytes=None if point is None else point.breakdown.get("logprob_head", 0),
                        peak_bytes=None if point is None else point.peak_bytes,
                        limit_bytes=budget.limit_bytes,
                        seconds=time.perf_counter() - start,
                        activation_bytes=None if point is None else point.breakdown.get("activations", 0),
                    )
                rows.append(row)
                on_row(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Rendering (plain text)
# ---------------------------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def render_cpu(rows: Sequence[CpuRow]) -> str:
    """The cpu table; ``vs all`` compares with the same total and head over every token."""
    base = {(r.total, r.head): r for r in rows if r.ratio is None}
    out = []
    for r in rows:
        ref = base.get((r.total, r.head))
        out.append([
            f"{r.total:,}",
            r.head,
            "all tokens" if r.ratio is None else f"resp-only {r.ratio}",
            f"{r.loss_tokens:,}",
            f"{r.peak_bytes / MIB:,.1f}",
            f"{r.head_bytes / MIB:,.1f}",
            f"{r.head_phase_peak / MIB:,.1f}",
            f"{r.seconds * 1e3:,.0f}",
            "" if ref is None or r is ref else f"{r.peak_bytes / ref.peak_bytes:.2f}x / {r.seconds / ref.seconds:.2f}x",
            r.load,
        ])
    header = ["tokens", "head", "head runs on", "loss tok", "peak MiB", "head MiB@peak",
              "peak@head MiB", "time ms", "peak/time vs all", "load"]
    return table(header, out)


def render_estimate(rows: Sequence[EstimateRow]) -> str:
    """The estimate table; ``C vs all`` compares with the same length and head over every token.

    ``head GiB`` is the ``logprob_head`` category at the binding point's peak, ``trunk GiB`` the
    ``activations`` one (the layers' activations and temporaries); the rest of the peak is the
    rank's parameters, gradients, optimizer state, buffers and inputs.
    """
    base = {(r.max_seq_len, r.head): r for r in rows if r.ratio is None}
    out = []
    for r in rows:
        ref = base.get((r.max_seq_len, r.head))
        ratio = "" if ref is None or r is ref or not (r.tokens and ref.tokens) else f"{r.tokens / ref.tokens:.2f}x"
        out.append([
            f"{r.max_seq_len:,}",
            r.head,
            "all tokens" if r.ratio is None else f"resp-only {r.ratio}",
            "does not fit" if r.tokens is None else f"{r.tokens:,}",
            "-" if r.response_tokens is None else f"{r.response_tokens:,}",
            "-" if r.binding_seq_len is None else f"{r.binding_seq_len:,}",
            "-" if r.head_bytes is None else f"{r.head_bytes / GIB:.1f}",
            "-" if r.activation_bytes is None else f"{r.activation_bytes / GIB:.1f}",
            "-" if r.peak_bytes is None else f"{r.peak_bytes / GIB:.1f}",
            ratio,
            f"{r.seconds:.0f}",
        ])
    header = ["max_seq_len", "head", "head runs on", "C tokens", "resp cap", "binding len",
              "head GiB", "trunk GiB", "peak GiB", "C vs all", "s"]
    return table(header, out)


def bar_check(rows: Sequence[EstimateRow], ratio: str = "4:1", length: int = 8192) -> list[str]:
    """The issue's bar: at ``ratio`` and ``length``, response-only C over the all-token heads' C."""
    lengths = sorted({r.max_seq_len for r in rows})
    if not lengths:
        return ["bar check: no estimate rows"]
    if length not in lengths:
        length = lengths[0]
    c = {(r.head, r.ratio): r.tokens for r in rows if r.max_seq_len == length}
    lines = [f"bar check (estimate, prompt:response {ratio}, max_seq_len {length}):"]
    pairs = [
        (("fused", ratio), ("fused", None), "response-only fused C / fused C"),
        (("full", ratio), ("fused", None), "response-only full C / fused C"),
        (("full", ratio), ("full", None), "response-only full C / full C"),
        (("chunked", ratio), ("chunked", None), "response-only chunked C / chunked C"),
    ]
    for top, bottom, name in pairs:
        a, b = c.get(top), c.get(bottom)
        if a and b:
            mark = "  (issue bar: >= 1.5)" if bottom == ("fused", None) else ""
            lines.append(f"  {name} = {a:,} / {b:,} = {a / b:.2f}{mark}")
    return lines


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("cpu", "estimate", "both"), default="both", help="which table (default both)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny cpu sizes and the 'tiny' preset on the estimate backend, one ratio")
    p.add_argument("--ratios", nargs="+", default=list(RATIOS), help="prompt:response ratios (default 1:1 4:1 16:1)")
    p.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS), help="log-prob heads (default all)")
    est = p.add_argument_group("estimate table")
    est.add_argument("--model", default="qwen2.5-7b", help="preset profiled on the estimate backend")
    est.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768], help="max_seq_len values")
    est.add_argument("--world-size", type=int, default=8, help="fsdp2 ranks (default 8)")
    est.add_argument("--memory", default="h100-80gb", help="device memory (default h100-80gb)")
    cpu = p.add_argument_group("cpu table")
    cpu.add_argument("--totals", nargs="+", type=int, default=[2048, 4096, 8192], help="tokens per micro-batch")
    cpu.add_argument("--seqs", type=int, default=4, help="sequences per packed micro-batch (default 4)")
    cpu.add_argument("--vocab", type=int, default=32768)
    cpu.add_argument("--hidden", type=int, default=256)
    cpu.add_argument("--layers", type=int, default=2)
    cpu.add_argument("--repeats", type=int, default=3, help="timed runs per case; the best is shown")
    args = p.parse_args(argv)
    for ratio in args.ratios:
        try:
            parse_ratio(ratio)
        except argparse.ArgumentTypeError as err:
            p.error(str(err))
    for name in ("lengths", "totals"):
        if any(v <= 0 for v in getattr(args, name)):
            p.error(f"--{name} must be positive integers, but got {getattr(args, name)}")
    for name in ("world_size", "seqs", "vocab", "hidden", "layers", "repeats"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, but got {getattr(args, name)}")
    if args.quick:
        args.ratios, args.heads = ["4:1"], [h for h in args.heads if h != "chunked"] or args.heads
        args.model, args.lengths, args.memory, args.world_size = "tiny", [1024], "64MiB", 8
        args.totals, args.vocab, args.hidden, args.repeats = [1024], 4096, 64, 1
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {load()}, {os.cpu_count()} cores", flush=True)
    if args.part in ("cpu", "both"):
        print(f"\n## cpu backend: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab:,}, fp32, "
              f"{args.seqs} packed sequences per micro-batch, forward + backward (no optimizer), "
              f"best of {args.repeats}", flush=True)
        rows = measure_cpu(
            args.totals, args.ratios, args.heads, vocab=args.vocab, hidden=args.hidden, layers=args.layers,
            seqs=args.seqs, repeats=args.repeats,
            on_row=lambda r: print(f"  measured {r.total} {r.head} {r.ratio or 'all'}", file=sys.stderr, flush=True),
        )
        print(render_cpu(rows), flush=True)
    if args.part in ("estimate", "both"):
        reserve = 0 if args.quick else None  # the tiny preset's 64 MiB device has no room for an H100's reserve
        print(f"\n## estimate backend: {args.model}, fsdp2 x {args.world_size}, {args.memory}, gradient "
              f"checkpointing, packed", flush=True)
        rows_e = profile_estimate(
            args.model, args.lengths, args.ratios, args.heads, memory_limit=args.memory,
            world_size=args.world_size, reserve_bytes=reserve,
            on_row=lambda r: print(f"  profiled {r.max_seq_len} {r.head} {r.ratio or 'all'}: {r.tokens} "
                                   f"in {r.seconds:.0f} s (load {load()})", file=sys.stderr, flush=True),
        )
        print(render_estimate(rows_e), flush=True)
        print("\n" + "\n".join(bar_check(rows_e)), flush=True)
    print(f"\n# done {time.strftime('%H:%M UTC', time.gmtime())}, load {load()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
