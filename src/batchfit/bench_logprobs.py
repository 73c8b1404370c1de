"""The computation behind ``batchfit bench logprobs``: time and peak memory of three log-prob paths.

Every method starts from the same place a training step does, the last hidden states
``[batch, seq, hidden]`` and the ``lm_head`` weight ``[vocab, hidden]`` (or, with
``start="logits"``, from a logits leaf ``[batch, seq, vocab]``), and runs forward and backward of
``loss = logp.sum() + entropy.sum()``:

- ``naive``: full logits, ``log_softmax`` of their fp32 upcast, gather, entropy (verl/TRL style).
- ``chunked``: full logits, then :func:`batchfit.logprobs.logprobs_from_logits`.
- ``fused``: :func:`batchfit.logprobs.logprobs_from_hidden` (``start="hidden"`` only).

Memory is the live-byte peak: the :class:`~batchfit.memory.tracker.MemoryTracker` on the CPU
(``backend="cpu"``, real execution), the same tracker under ``FakeTensorMode`` (``"estimate"``,
no allocation, no timing) or ``torch.cuda`` peak statistics (``"cuda"``). *Extra* memory is the
peak minus the inputs and their gradients (which any method must hold), i.e. what the log-prob
computation itself costs. Nothing here prints; :mod:`batchfit.cli.bench` renders the result.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from batchfit.logprobs import logprobs_from_hidden, logprobs_from_logits
from batchfit.logprobs._common import check_temperature
from batchfit.validation import check_choice, check_int, check_positive_int

METHODS = ("naive", "chunked", "fused")
BACKENDS = ("cpu", "estimate", "cuda")
STARTS = ("hidden", "logits")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BenchRow:
    """One measured (method, vocab, seq, chunk) case.

    ``time_ms`` is the best of ``repeats`` forward+backward wall times (``None`` under the estimate
    backend); ``peak_bytes`` the live-byte peak including inputs and gradients; ``extra_bytes`` the
    peak minus inputs and their gradients; ``speedup_vs_nochunk`` = time of the same method with
    ``chunk_size=None`` / this time (> 1 is faster); ``memory_saved_vs_naive`` = naive extra /
    this extra (> 1 uses less). ``oom`` is True when a cuda run ran out of memory (numbers ``None``).
    """

    method: str
    vocab: int
    seq: int
    chunk_size: int | None
    time_ms: float | None
    peak_bytes: int | None
    extra_bytes: int | None
    speedup_vs_nochunk: float | None = None
    memory_saved_vs_naive: float | None = None
    oom: bool = False


@dataclass(frozen=True)
class LogprobsBench:
    """The settings of a benchmark run and its rows (naive first, then chunked, fused per shape)."""

    backend: str
    device: str
    dtype: str
    start: str
    batch: int
    hidden: int
    entropy: bool
    temperature: float
    repeats: int
    rows: tuple[BenchRow, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        """A JSON-ready dict (rows as a list of dicts)."""
        out = asdict(self)
        out["rows"] = [asdict(r) for r in self.rows]
        return out


@dataclass(frozen=True)
class _Case:
    method: str
    vocab: int
    seq: int
    chunk_size: int | None


def _loss(method: str, leaves: dict, labels: torch.Tensor, case: _Case, entropy: bool, temperature: float):
    """Forward of one method to a scalar loss."""
    if method == "fused":
        out = logprobs_from_hidden(
            leaves["hidden"],
            leaves["weight"],
            labels,
            chunk_size=case.chunk_size,
            temperature=temperature,
            return_entropy=entropy,
        )
    else:
        logits = leaves["logits"] if "logits" in leaves else leaves["hidden"] @ leaves["weight"].t()
        if method == "naive":
            z = logits.float()
            if temperature != 1.0:
                z = z / temperature
            lsm = torch.log_softmax(z, dim=-1)
            logp = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            out = (logp, -(lsm.exp() * lsm).sum(-1)) if entropy else logp
        else:
            out = logprobs_from_logits(
                logits, labels, chunk_size=case.chunk_size, temperature=temperature, return_entropy=entropy
            )
    return out[0].sum() + out[1].sum() if entropy else out.sum()


def _make_inputs(
    case: _Case, batch: int, hidden: int, dtype: torch.dtype, device: str, start: str, seed: int
):
    """Leaf tensors (requiring grad) and labels for one case, seeded without touching global RNG."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = {"dtype": dtype, "device": device, "generator": gen}
    labels = torch.randint(0, case.vocab, (batch, case.seq), device=device, generator=gen)
    if start == "logits":
        return {"logits": torch.randn(batch, case.seq, case.vocab, **kw).requires_grad_()}, labels
    leaves = {
        "hidden": torch.randn(batch, case.seq, hidden, **kw).requires_grad_(),
        "weight": (torch.randn(case.vocab, hidden, **kw) * hidden**-0.5).requires_grad_(),
    }
    return leaves, labels


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _measure_tracker(case, batch, hidden, dtype, start, entropy, temperature, seed, fake: bool):
    """(peak, extra) bytes with the live-storage tracker, real on the CPU or under FakeTensorMode."""
    from batchfit.memory.tracker import MemoryTracker

    mode = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    with mode:
        leaves, labels = _make_inputs(case, batch, hidden, dtype, "cpu", start, seed)
        with MemoryTracker() as tracker:
            tracker.register(*leaves.values(), labels, category="inputs")
            fixed = sum(_nbytes(t) for t in leaves.values()) * 2 + _nbytes(labels)  # inputs + their grads
            _loss(case.method, leaves, labels, case, entropy, temperature).backward()
        peak = tracker.peak_bytes
    return peak, peak - fixed


def _time_cpu(cases, batch, hidden, dtype, start, entropy, temperature, seed, repeats, warmup) -> list[float]:
    """Best-of-``repeats`` ms per case; cases of one shape share inputs and run interleaved.

    Interleaving (round r runs every case once) spreads the load of a shared machine evenly over
    the cases, so their ratios are fairer than back-to-back series.
    """
    leaves, labels = _make_inputs(cases[0], batch, hidden, dtype, "cpu", start, seed)
    times: list[list[float]] = [[] for _ in cases]
    for i in range(warmup + repeats):
        for k, case in enumerate(cases):
            for t in leaves.values():
                t.grad = None
            t0 = time.perf_counter()
            _loss(case.method, leaves, labels, case, entropy, temperature).backward()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return [min(ts) * 1e3 for ts in times]


def _measure_cuda(case, batch, hidden, dtype, start, entropy, temperature, seed, repeats, warmup):
    """(time_ms, peak, extra) with torch.cuda statistics; ``None``s after an out-of-memory error."""
    device = "cuda"
    try:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        leaves, labels = _make_inputs(case, batch, hidden, dtype, device, start, seed)
        fixed = sum(_nbytes(t) for t in leaves.values()) * 2 + _nbytes(labels)
        times, peak = [], 0
        for i in range(warmup + repeats):
            for t in leaves.values():
                t.grad = None
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            _loss(case.method, leaves, labels, case, entropy, temperature).backward()
            torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                peak = max(peak, torch.cuda.max_memory_allocated(device) - before)
        return min(times) * 1e3, peak, peak - fixed
    except torch.cuda.OutOfMemoryError:  # the one place a cuda OOM is decided: "does not fit"
        return None, None, None
    finally:
        torch.cuda.empty_cache()


def run_logprobs_bench(
    vocabs: Sequence[int],
    seqs: Sequence[int],
    chunk_sizes: Sequence[int | None],
    *,
    methods: Sequence[str] = METHODS,
    backend: str = "cpu",
    batch: int = 1,
    hidden: int = 256,
    dtype: str = "float32",
    start: str = "hidden",
    entropy: bool = True,
    temperature: float = 1.0,
    repeats: int = 3,
    warmup: int = 1,
    seed: int = 0,
    on_row: Callable[[BenchRow], None] | None = None,
) -> LogprobsBench:
    """Measure every method on the grid ``vocabs × seqs × chunk_sizes`` (naive once per shape).

    Args:
        vocabs, seqs: vocabulary sizes and sequence lengths (positive ints).
        chunk_sizes: chunk sizes for ``chunked`` and ``fused``; ``None`` means no chunking.
        methods: a subset of ``("naive", "chunked", "fused")``; ``fused`` is skipped when
            ``start="logits"``.
        backend: ``"cpu"`` (real run, time and tracker peak), ``"estimate"`` (FakeTensorMode, peak
            only, any size) or ``"cuda"`` (torch.cuda stats; untested on CPU-only machines).
        batch, hidden: batch size and hidden size of the inputs.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` for hidden/weight/logits.
        start: ``"hidden"`` (every method projects ``hidden @ weight.T``) or ``"logits"``.
        entropy: compute the entropy too (``loss = logp.sum() + entropy.sum()``).
        temperature: softmax temperature.
        repeats, warmup: timed and untimed runs per case; the time is the best timed run.
        seed: input seed.
        on_row: called with each :class:`BenchRow` as it is measured (before the ratios are
            filled in), e.g. to drive a progress bar.

    Returns:
        :class:`LogprobsBench` whose rows carry the ratios ``speedup_vs_nochunk`` and
        ``memory_saved_vs_naive`` where their reference was measured.

    Raises:
        InvalidArgument: a bad size, name or count (names the argument and the choices).
    """
    vocabs = [check_positive_int("vocab", v) for v in vocabs]
    seqs = [check_positive_int("seq", s) for s in seqs]
    chunk_sizes = [None if c is None else check_positive_int("chunk_size", c) for c in chunk_sizes]
    methods = [check_choice("method", m, METHODS) for m in methods]
    backend = check_choice("backend", backend, BACKENDS)
    dtype_name = check_choice("dtype", dtype, tuple(DTYPES))
    start = check_choice("start", start, STARTS)
    batch = check_positive_int("batch", batch)
    hidden = check_positive_int("hidden", hidden)
    temperature = check_temperature(temperature)
    repeats = check_positive_int("repeats", repeats)
    warmup = check_int("warmup", warmup, minimum=0)
    torch_dtype = DTYPES[dtype_name]
    if start == "logits":
        methods = [m for m in methods if m != "fused"]

    cases = []
    for v in vocabs:
        for s in seqs:
            if "naive" in methods:
                cases.append(_Case("naive", v, s, None))
            for m in ("chunked", "fused"):
                if m in methods:
                    cases.extend(_Case(m, v, s, c) for c in chunk_sizes)

    common = (batch, hidden, torch_dtype, start, bool(entropy), temperature, seed)
    timed: dict[_Case, float] = {}
    if backend == "cpu":
        for shape in dict.fromkeys((c.vocab, c.seq) for c in cases):
            group = [c for c in cases if (c.vocab, c.seq) == shape]
            timed.update(zip(group, _time_cpu(group, *common, repeats, warmup)))
    raw: list[BenchRow] = []
    for case in cases:
        oom = False
        if backend == "cuda":
            ms, peak, extra = _measure_cuda(case, *common, repeats, warmup)
            oom = peak is None
        else:
            ms = timed.get(case)
            peak, extra = _measure_tracker(case, *common, fake=backend == "estimate")
        row = BenchRow(case.method, case.vocab, case.seq, case.chunk_size, ms, peak, extra, oom=oom)
        raw.append(row)
        if on_row is not None:
            on_row(row)

    rows = tuple(_with_ratios(r, raw) for r in raw)
    device = "cuda" if backend == "cuda" else "cpu"
    return LogprobsBench(
        backend, device, dtype_name, start, batch, hidden, bool(entropy), temperature, repeats, rows
    )


def _with_ratios(row: BenchRow, rows: list[BenchRow]) -> BenchRow:
    def find(method: str, chunk: int | None) -> BenchRow | None:
        for r in rows:
            if (r.method, r.vocab, r.seq, r.chunk_size) == (method, row.vocab, row.seq, chunk):
                return r
        return None

    nochunk = find(row.method, None)
    speed = None
    if nochunk is not None and nochunk.time_ms and row.time_ms:
        speed = nochunk.time_ms / row.time_ms
    naive = find("naive", None)
    saved = None
    if naive is not None and naive.extra_bytes and row.extra_bytes:
        saved = naive.extra_bytes / row.extra_bytes
    return BenchRow(**{**asdict(row), "speedup_vs_nochunk": speed, "memory_saved_vs_naive": saved})
