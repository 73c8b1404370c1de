"""SkyRL PR #1610's B200 table, estimated: the measured rows to the MiB, the OOM rows as "does not fit".

SkyRL's ``skyrl/benchmarks/bench_chunked_logprobs.py`` measured, on an NVIDIA B200
(183,359 MiB), the peak memory (``torch.cuda.max_memory_allocated``, the mean of 5 repetitions
after 2 warm-up calls) of the forward and backward of its Megatron log-prob kernels at
tensor-parallel size 1: the whole-vocabulary one (``chunk_size=None``) and the chunked one,
on bf16 logits ``[1, seq, vocab]``. This script runs the same algorithms, written here from
their description (fp32 upcast, a max-shifted log-softmax whose shifted copy lives inside it,
the softmax saved for backward; chunked: the bf16 logits saved, each chunk's softmax and a
one-hot recomputed in backward, the chunks' gradients concatenated), inside the same
repetition loop (a repetition's graph, and with it the previous leaf's bf16 gradient, lives
until the next forward returns), on the estimate backend: fake tensors, nothing allocated,
storages rounded to 512 B as the caching allocator does.

It prints the estimate beside each measured row, and the verdict of batchfit's margin for
every row: does the largest repetition's peak fit under ``safety_margin × (183,359 MiB −
reserve)``? The table's 131,072 × 128K rows ran out of memory on the B200 although their
tensors peak at 156–158 GiB of its 179 GiB: what the caching allocator and the CUDA stack hold
beyond the tensors is the difference (NOTE [ The margin's evidence ] in
:mod:`batchfit.memory.cuda_untracked`).

    python benchmarks/skyrl_b200.py            # about a minute
    python benchmarks/skyrl_b200.py --quick    # the 32K rows and the OOM rows of chunk 32 and 1024
"""

from __future__ import annotations

import argparse
import statistics

import torch

from batchfit.memory import MemoryTracker, get_backend, parse_memory
from batchfit.memory.cuda_untracked import DEFAULT_SAFETY_MARGIN, untracked_memory

MiB = 2**20
B200 = parse_memory("b200")
CHUNKS = (None, 32, 1024, 4096, 8192, 16384)
#: (vocab, seq) -> peak MiB per chunk size as the PR's table printed them; None: "OOM"
TABLE: dict[tuple[int, int], tuple[int | None, ...]] = {
    (32_000, 32_768): (15_601, 10_016, 10_501, 12_001, 14_001, 20_001),
    (32_000, 65_536): (31_202, 20_017, 20_501, 22_001, 24_001, 28_001),
    (32_000, 131_072): (62_404, 40_018, 40_503, 42_003, 44_003, 48_003),
    (64_000, 32_768): (31_201, 20_032, 21_001, 24_001, 28_001, 40_001),
    (64_000, 65_536): (62_402, 40_033, 41_001, 44_001, 48_001, 56_001),
    (64_000, 131_072): (124_804, 80_034, 81_003, 84_003, 88_003, 96_003),
    (128_000, 32_768): (62_401, 40_063, 42_001, 48_001, 56_001, 80_001),
    (128_000, 65_536): (124_802, 80_064, 82_001, 88_001, 96_001, 112_001),
    (128_000, 131_072): (None,) * 6,
}
WARMUP, BENCH = 2, 5


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    """A stable log-softmax over the last dimension; the max-shifted copy lives only in here."""
    shifted = x - torch.amax(x, dim=-1, keepdim=True)
    log_sum = shifted.exp().sum(-1, keepdim=True).float()
    return shifted - log_sum.log_().to(shifted.dtype)


class _Whole(torch.autograd.Function):
    """The whole vocabulary at once: fp32 upcast, log-softmax, the softmax saved for backward."""

    @staticmethod
    def forward(ctx, logits, target):  # type: ignore[override]
        ignored = target < 0
        index = target.clone()
        index[ignored] = 0
        upcast = logits.to(torch.float32)
        log_probs = _log_softmax(upcast)
        softmax = log_probs.exp()
        picked = log_probs.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        picked[ignored] = 0.0
        ctx.save_for_backward(softmax, ignored, index)
        return picked

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        softmax, ignored, index = ctx.saved_tensors
        grad_input = softmax.neg()
        grad_input.mul_(grad.unsqueeze(-1))
        grad_input.scatter_add_(-1, index.unsqueeze(-1), grad.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad_input, None


class _Chunked(torch.autograd.Function):
    """Chunks along the sequence: the bf16 logits saved; backward recomputes each chunk's softmax."""

    @staticmethod
    def forward(ctx, logits, target, chunk):  # type: ignore[override]
        ignored = target < 0
        index = target.clone()
        index[ignored] = 0
        pieces = []
        for start in range(0, logits.shape[1], chunk):
            end = min(start + chunk, logits.shape[1])
            upcast = logits[:, start:end].to(torch.float32)  # kept until the next chunk's replaces it
            log_probs = _log_softmax(upcast)
            picked = log_probs.gather(-1, index[:, start:end].unsqueeze(-1)).squeeze(-1)
            picked[ignored[:, start:end]] = 0.0
            pieces.append(picked)
        ctx.save_for_backward(logits, ignored, index)
        ctx.chunk = chunk
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        logits, ignored, index = ctx.saved_tensors
        vocab = logits.shape[-1]
        pieces = []
        for start in range(0, logits.shape[1], ctx.chunk):
            end = min(start + ctx.chunk, logits.shape[1])
            upcast = logits[:, start:end].to(torch.float32)  # the last chunk's lives until the return
            softmax = _log_softmax(upcast).exp()
            chosen = (~ignored[:, start:end]).unsqueeze(-1) * torch.nn.functional.one_hot(
                index[:, start:end], num_classes=vocab
            )
            piece = chosen.float().sub_(softmax)
            piece.mul_(grad[:, start:end].unsqueeze(-1))
            pieces.append(piece)
        return torch.cat(pieces, dim=1), None, None


def _run(logits: torch.Tensor, target: torch.Tensor, chunk: int | None) -> torch.Tensor:
    if chunk is None:
        return _Whole.apply(logits, target)
    return _Chunked.apply(logits, target, chunk)


def _repetitions(
    tracker: MemoryTracker, logits: torch.Tensor, target: torch.Tensor, chunk: int | None, reps: int
) -> list[int]:
    """The benchmark's ``measure(..., reps)``: each repetition's peak (the previous graph alive until ``out`` is replaced)."""
    peaks = []
    for _ in range(reps):
        leaf = logits.detach().requires_grad_(True)
        tracker.reset_peak()
        out = _run(leaf, target, chunk)
        loss = out.sum()
        loss.backward()
        peaks.append(tracker.peak_bytes)
    return peaks


def estimate_row(
    vocab: int, seq: int, chunk: int | None, *, warmup: int = WARMUP, bench: int = BENCH
) -> tuple[float, int]:
    """``(mean peak MiB of the timed repetitions, largest peak in bytes of all)`` for one row, on fake tensors.

    The warm-up calls return before the next starts (nothing of theirs survives), so they do
    not change the figures: ``warmup=0`` gives the same in less time. Within the timed loop
    the first repetition peaks lower than the rest (no previous graph alive), which the
    table's mean includes; the largest peak is any later one's (``bench=2`` finds it).
    """
    backend = get_backend("estimate", round_to=512)
    with backend.context(), MemoryTracker(round_to=512) as tracker:
        logits = torch.randn(1, seq, vocab, dtype=torch.bfloat16)
        target = torch.randint(0, vocab, (1, seq))
        warm = [p for _ in range(warmup) for p in _repetitions(tracker, logits, target, chunk, 1)]
        timed = _repetitions(tracker, logits, target, chunk, bench)
    return statistics.fmean(timed) / MiB, max(warm + timed)


def limit_bytes() -> int:
    """What batchfit's default margin lets a B200's tensors peak at: ``margin × (memory − reserve)``."""
    return int(DEFAULT_SAFETY_MARGIN * (B200 - untracked_memory("b200", world_size=1).reserve_bytes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the 32K rows and the OOM rows of chunk 32 and 1024"
    )
    args = parser.parse_args(argv)
    untracked = untracked_memory("b200", world_size=1)
    limit = limit_bytes()
    keys = [(v, s, c) for (v, s) in TABLE for c in CHUNKS]
    if args.quick:
        keys = [k for k in keys if k[0] == 32_000 or (k[:2] == (128_000, 131_072) and k[2] in (32, 1024))]
    print(f"B200 {B200 / MiB:,.0f} MiB; {untracked.describe()}; limit = {DEFAULT_SAFETY_MARGIN} × "
          f"(memory − reserve) = {limit / MiB:,.0f} MiB")  # fmt: skip
    print(
        f"{'vocab':>8} {'seq':>8} {'chunk':>6} {'table MiB':>10} {'estimate MiB':>13} {'diff':>6} {'largest rep MiB':>16}  verdict"
    )
    worst, wrong = 0.0, 0
    for vocab, seq, chunk in keys:
        mean, largest = estimate_row(vocab, seq, chunk)
        measured = TABLE[(vocab, seq)][CHUNKS.index(chunk)]
        fits = largest <= limit
        ran = measured is not None
        wrong += fits != ran
        diff = "" if measured is None else f"{mean - measured:+.1f}"
        worst = worst if measured is None else max(worst, abs(mean - measured))
        shown = "OOM" if measured is None else f"{measured:,}"
        verdict = ("fits" if fits else "does not fit") + (
            "" if fits == ran else "  ← disagrees with the B200"
        )
        print(
            f"{vocab:>8,} {seq:>8,} {chunk!s:>6} {shown:>10} {mean:>13,.1f} {diff:>6} {largest / MiB:>16,.0f}  {verdict}"
        )
    print(f"\nlargest difference from a measured row: {worst:.1f} MiB (the table prints whole MiB); verdicts that "
          f"disagree with the B200: {wrong}")  # fmt: skip
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
