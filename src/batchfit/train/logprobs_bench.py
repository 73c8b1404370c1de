"""The measurements behind ``batchfit bench logprobs``: time and peak memory of three log-prob paths.

Every method starts from the same place a training step does, the last hidden states
``[batch, seq, hidden]`` and the ``lm_head`` weight ``[vocab, hidden]`` (or, with
``start="logits"``, from a logits leaf ``[batch, seq, vocab]``), and runs forward and backward of
``loss = logp.sum() + entropy.sum()``:

- ``naive``: full logits, ``log_softmax`` of their fp32 upcast, gather, entropy (verl/TRL style).
- ``chunked``: full logits, then :func:`batchfit.logprobs.logprobs_from_logits`.
- ``fused``: :func:`batchfit.logprobs.logprobs_from_hidden` (``start="hidden"`` only).

Memory is measured by a :mod:`batchfit.memory` backend, which also decides what running out of
memory is: ``cpu`` (real run, live-storage tracker), ``estimate`` (the same tracker under
``FakeTensorMode``: no allocation, no timing) or ``cuda`` (``torch.cuda`` peak statistics). The
tracked backends count exact bytes here (``round_to=1``), so ``estimate`` predicts the ``cpu``
numbers to the byte. *Extra* memory is the peak minus the inputs and their gradients (which any
method must hold), i.e. what the log-prob computation itself costs.

This module measures through :mod:`batchfit.memory` (and synchronises a cuda device), so it sits
in :mod:`batchfit.train`, above the memory layer, beside the heads that use what it measures; the
pure core :mod:`batchfit.logprobs` holds no device code. Nothing here prints;
:mod:`batchfit.cli.bench` renders the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from batchfit.dtypes import DTYPES
from batchfit.errors import InvalidArgument
from batchfit.logprobs import logprobs_from_hidden, logprobs_from_logits
from batchfit.logprobs.chunks import check_temperature
from batchfit.memory import Backend, EstimateBackend, backend_class, backend_name, get_backend
from batchfit.memory.cpu import host_available_bytes
from batchfit.memory.sizes import MAX_BYTES
from batchfit.validation import check_choice, check_int, check_positive_int

METHODS = ("naive", "chunked", "fused")
STARTS = ("hidden", "logits")


@dataclass(frozen=True)
class BenchRow:
    """One measured (method, vocab, seq, chunk) case.

    ``time_ms`` is the best of ``repeats`` forward+backward wall times (``None`` under the estimate
    backend); ``peak_bytes`` the peak including inputs and gradients; ``extra_bytes`` the peak minus
    inputs and their gradients; ``speedup_vs_nochunk`` = time of the same method with
    ``chunk_size=None`` / this time (> 1 is faster); ``memory_saved_vs_naive`` = naive extra /
    this extra (> 1 uses less). ``oom`` is True when the case does not fit: it ran out of memory on
    cuda, or on the cpu it would need more than the host's available memory (the estimate says so
    before anything is allocated); its numbers are then ``None``.
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
    """The settings of a benchmark run and its rows (naive first, then chunked, fused per shape).

    ``limit_bytes`` is the memory a case may use before its row is marked OOM: the host's
    available memory on cpu, the device's usable memory on cuda, ``None`` (unlimited) for estimate.
    """

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
    limit_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
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


@dataclass(frozen=True)
class _Setup:
    """What every case of a run shares."""

    batch: int
    hidden: int
    dtype: torch.dtype
    start: str
    entropy: bool
    temperature: float
    seed: int


def _loss(case: _Case, leaves: dict[str, torch.Tensor], labels: torch.Tensor, setup: _Setup) -> torch.Tensor:
    """Forward of one method to a scalar loss."""
    entropy, temperature = setup.entropy, setup.temperature
    if case.method == "fused":
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
        if case.method == "naive":
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
    case: _Case, setup: _Setup, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Leaf tensors (requiring grad) and labels for one case, seeded without touching global RNG."""
    gen = torch.Generator(device=device).manual_seed(setup.seed)
    kw: dict[str, Any] = {"dtype": setup.dtype, "device": device, "generator": gen}
    labels = torch.randint(0, case.vocab, (setup.batch, case.seq), device=device, generator=gen)
    if setup.start == "logits":
        return {"logits": torch.randn(setup.batch, case.seq, case.vocab, **kw).requires_grad_()}, labels
    leaves = {
        "hidden": torch.randn(setup.batch, case.seq, setup.hidden, **kw).requires_grad_(),
        "weight": torch.randn(case.vocab, setup.hidden, **kw).mul_(setup.hidden**-0.5).requires_grad_(),
    }
    return leaves, labels


def _fixed_bytes(case: _Case, setup: _Setup) -> int:
    """Bytes of the inputs, their gradients and the labels: what every method holds."""
    size = setup.dtype.itemsize
    if setup.start == "logits":
        leaves = setup.batch * case.seq * case.vocab
    else:
        leaves = setup.batch * case.seq * setup.hidden + case.vocab * setup.hidden
    return 2 * leaves * size + setup.batch * case.seq * 8  # + int64 labels


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_times(
    cases: Sequence[_Case], setup: _Setup, device: torch.device, repeats: int, warmup: int
) -> list[float]:
    """Best-of-``repeats`` ms per case; the cases (of one shape) share inputs and run interleaved.

    Interleaving (round r runs every case once) spreads the load of a shared machine evenly over
    the cases, so their ratios are fairer than back-to-back series.
    """
    leaves, labels = _make_inputs(cases[0], setup, device)
    times: list[list[float]] = [[] for _ in cases]
    for i in range(warmup + repeats):
        for k, case in enumerate(cases):
            for t in leaves.values():
                t.grad = None
            _sync(device)
            t0 = time.perf_counter()
            _loss(case, leaves, labels, setup).backward()
            _sync(device)
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return [min(ts) * 1e3 for ts in times]


def _check_sizes(vocabs: Sequence[int], seqs: Sequence[int], batch: int, hidden: int) -> None:
    """Refuse shapes whose tensors no device could hold (their byte counts overflow int64)."""
    vocab, seq = max(vocabs), max(seqs)
    for what, elements in (
        ("batch × seq × vocab (the logits)", batch * seq * vocab),
        ("vocab × hidden (the weight)", vocab * hidden),
        ("batch × seq × hidden (the hidden states)", batch * seq * hidden),
    ):
        if elements * 4 > MAX_BYTES:
            raise InvalidArgument(
                f"{what} = {elements:,} elements is more than any device holds in fp32 (8 EiB), with vocab={vocab}, seq={seq}, batch={batch}, hidden={hidden}; lower vocab or seq"
            )


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
    on_progress: Callable[[str], None] | None = None,
) -> LogprobsBench:
    """Measure every method on the grid ``vocabs × seqs × chunk_sizes`` (naive once per shape).

    Args:
        vocabs, seqs: vocabulary sizes and sequence lengths (positive ints).
        chunk_sizes: chunk sizes for ``chunked`` and ``fused``; ``None`` means no chunking.
        methods: a subset of ``("naive", "chunked", "fused")``; ``fused`` is skipped when
            ``start="logits"``.
        backend: ``"cpu"`` (real run: time and tracker peak; a case the estimate puts above the
            host's available memory is an OOM row and never allocated), ``"estimate"``
            (FakeTensorMode: peak only, any size), ``"cuda"`` (torch.cuda stats, time; an
            out-of-memory case is an OOM row) or ``"auto"`` (cuda if available, else estimate).
        batch, hidden: batch size and hidden size of the inputs.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` for hidden/weight/logits.
        start: ``"hidden"`` (every method projects ``hidden @ weight.T``) or ``"logits"``.
        entropy: compute the entropy too (``loss = logp.sum() + entropy.sum()``).
        temperature: softmax temperature.
        repeats, warmup: timed and untimed runs per case; the time is the best timed run.
        seed: input seed.
        on_row: called with each :class:`BenchRow` as it is measured (before the ratios are
            filled in).
        on_progress: called with a short line saying what is measured next (e.g. to drive a
            progress display: a run can take minutes).

    Returns:
        :class:`LogprobsBench` whose rows carry the ratios ``speedup_vs_nochunk`` and
        ``memory_saved_vs_naive`` where their reference was measured.

    Raises:
        InvalidArgument: a bad size, name or count (names the argument and the choices), shapes
            no device could hold, or ``backend="cuda"`` without a CUDA device.

    Example:
        >>> r = run_logprobs_bench([512], [64], [None, 16], methods=["naive", "fused"], backend="estimate", hidden=16)
        >>> [(row.method, row.chunk_size) for row in r.rows]
        [('naive', None), ('fused', None), ('fused', 16)]
    """
    vocabs = [check_positive_int("vocab", v) for v in vocabs]
    seqs = [check_positive_int("seq", s) for s in seqs]
    chunk_sizes = [None if c is None else check_positive_int("chunk_size", c) for c in chunk_sizes]
    methods = [check_choice("method", m, METHODS) for m in methods]
    name = backend_name(backend)
    dtype_name = check_choice("dtype", dtype, tuple(DTYPES))
    setup = _Setup(
        batch=check_positive_int("batch", batch),
        hidden=check_positive_int("hidden", hidden),
        dtype=DTYPES[dtype_name],
        start=check_choice("start", start, STARTS),
        entropy=bool(entropy),
        temperature=check_temperature(temperature),
        seed=check_int("seed", seed),
    )
    repeats = check_positive_int("repeats", repeats)
    warmup = check_int("warmup", warmup, minimum=0)
    _check_sizes(vocabs, seqs, setup.batch, setup.hidden)
    if setup.start == "logits":
        methods = [m for m in methods if m != "fused"]
    say = on_progress or (lambda line: None)

    # Exact bytes on the tracked backends (round_to=1, no reserve): estimate == cpu to the byte.
    gate: Backend | None = None
    kind = backend_class(name)
    if kind.host_memory:
        host = host_available_bytes()
        be = get_backend(name, memory_limit=host)
        if host is not None:  # a real run above it meets swap or the OOM killer, not an error
            gate = EstimateBackend(memory_limit=host, reserve_bytes=0, round_to=1)
    elif kind.simulated:
        be = get_backend(name, reserve_bytes=0, round_to=1)
    else:
        be = get_backend(name)

    rows: list[BenchRow] = []
    for vocab in vocabs:
        for seq in seqs:
            cases = []
            if "naive" in methods:
                cases.append(_Case("naive", vocab, seq, None))
            for m in ("chunked", "fused"):
                if m in methods:
                    cases.extend(_Case(m, vocab, seq, c) for c in chunk_sizes)
            rows.extend(_measure_shape(cases, setup, be, gate, repeats, warmup, say, on_row))

    return LogprobsBench(
        be.name,
        str(be.device),
        dtype_name,
        setup.start,
        setup.batch,
        setup.hidden,
        setup.entropy,
        setup.temperature,
        repeats,
        tuple(_with_ratios(r, rows) for r in rows),
        be.limit_bytes,
    )


def _measure_shape(
    cases: list[_Case],
    setup: _Setup,
    be: Backend,
    gate: Backend | None,
    repeats: int,
    warmup: int,
    say: Callable[[str], None],
    on_row: Callable[[BenchRow], None] | None,
) -> list[BenchRow]:
    """The rows of the cases of one (vocab, seq) shape: memory per case, then time on the cpu."""
    peaks: dict[_Case, int | None] = {}
    times: dict[_Case, float] = {}
    for case in cases:
        chunk = "none" if case.chunk_size is None else f"{case.chunk_size:,}"
        say(f"V={case.vocab:,} S={case.seq:,} {case.method} chunk={chunk}: peak memory on {be.name}")

        def step(case: _Case = case) -> None:
            if be.reads_device:  # timed inside the measured call: running out of memory is a row too
                times[case] = _best_times([case], setup, be.device, repeats, warmup)[0]
                return
            leaves, labels = _make_inputs(case, setup, be.device)
            _loss(case, leaves, labels, setup).backward()

        fits = gate is None or gate.measure(step).fits  # nothing is allocated for a case that cannot fit
        measured = be.measure(step) if fits else None
        peaks[case] = measured.peak_bytes if measured is not None and measured.fits else None
    fitting = [c for c in cases if peaks[c] is not None]
    if be.host_memory and fitting:
        say(f"V={cases[0].vocab:,} S={cases[0].seq:,}: timing {len(fitting)} cases × {warmup + repeats} runs")
        times.update(zip(fitting, _best_times(fitting, setup, be.device, repeats, warmup)))
    rows = []
    for case in cases:
        peak = peaks[case]
        row = BenchRow(
            case.method,
            case.vocab,
            case.seq,
            case.chunk_size,
            times.get(case) if peak is not None else None,
            peak,
            None if peak is None else peak - _fixed_bytes(case, setup),
            oom=peak is None,
        )
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


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
