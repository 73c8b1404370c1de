"""Tests of batchfit.train.logprobs_bench and the ``batchfit bench logprobs`` command (tiny grids)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from torch._subclasses.fake_tensor import FakeTensor

from batchfit.cli import main
from batchfit.cli.bench import render_logprobs
from batchfit.errors import InvalidArgument
from batchfit.train import logprobs_bench as bench
from batchfit.train.logprobs_bench import run_logprobs_bench

TINY = {"vocabs": [512], "seqs": [64], "chunk_sizes": [None, 16], "hidden": 16}


def test_grid_has_naive_once_and_every_chunk_for_the_other_methods():
    result = run_logprobs_bench(**TINY, repeats=1, warmup=0)
    keys = [(r.method, r.chunk_size) for r in result.rows]
    assert keys == [("naive", None), ("chunked", None), ("chunked", 16), ("fused", None), ("fused", 16)]
    assert all(r.time_ms is not None and r.time_ms > 0 for r in result.rows)
    by = {k: r for k, r in zip(keys, result.rows)}
    assert by[("naive", None)].memory_saved_vs_naive == 1.0
    assert by[("fused", None)].speedup_vs_nochunk == 1.0
    # fused at chunk 16 holds [16, 512] fp32 temporaries instead of [64, 512] ones: it uses less
    assert by[("fused", 16)].extra_bytes < by[("fused", None)].extra_bytes


def test_estimate_backend_predicts_the_cpu_peaks_exactly_without_timing():
    cpu = run_logprobs_bench(**TINY, repeats=1, warmup=0)
    est = run_logprobs_bench(**TINY, backend="estimate")
    assert [r.peak_bytes for r in est.rows] == [r.peak_bytes for r in cpu.rows]
    assert all(r.time_ms is None and r.speedup_vs_nochunk is None for r in est.rows)


def test_estimate_backend_runs_sizes_this_machine_cannot_hold():
    # vocab 128k x seq 131072: naive fp32 logits alone would be 131072 x 131072 x 4 B = 64 GiB
    est = run_logprobs_bench([131072], [131072], [1024], methods=["fused"], backend="estimate", hidden=64)
    (row,) = est.rows
    # fused extra: a few [1024, 131072] fp32 chunks (512 MiB each), far below 64 GiB
    assert row.extra_bytes < 4 * 1024 * 131072 * 4


def test_logits_start_skips_fused_and_on_row_sees_every_row():
    seen = []
    result = run_logprobs_bench(**TINY, start="logits", repeats=1, warmup=0, on_row=seen.append)
    assert [r.method for r in result.rows] == ["naive", "chunked", "chunked"]
    assert len(seen) == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocabs": [0]}, r"vocab=0"),
        ({"chunk_sizes": [0]}, r"chunk_size=0"),
        ({"backend": "gpu"}, r"backend must be one of 'auto', 'cpu', 'estimate', 'cuda'"),
        ({"methods": ["fast"]}, r"method must be one of"),
        ({"dtype": "fp8"}, r"dtype must be one of"),
        (
            {"vocabs": [10**12], "seqs": [10**8]},
            r"batch × seq × vocab \(the logits\) = .* more than any device",
        ),
    ],
    ids=[
        "vocab-zero",
        "chunk-zero",
        "backend-unknown",
        "method-unknown",
        "dtype-unknown",
        "beyond-int64-bytes",
    ],
)
def test_invalid_benchmark_arguments_raise(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        run_logprobs_bench(**{**TINY, **kwargs})


def test_cli_json_and_table(capsys):
    argv = ["bench", "logprobs", "--vocab", "256", "--seq", "32", "--chunk", "none", "8", "--hidden", "8"]
    assert main([*argv, "--repeats", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backend"] == "cpu" and len(data["rows"]) == 5
    result = run_logprobs_bench([256], [32], [None, 8], hidden=8, backend="estimate")
    buf = io.StringIO()
    render_logprobs(result, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "fused" in text and "saved vs naive" in text and "backend=estimate" in text


@pytest.mark.parametrize(
    "argv",
    [["--chunk", "0"], ["--chunk", "x"], ["--backend", "tpu"]],
    ids=["chunk-zero", "chunk-word", "backend"],
)
def test_cli_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "logprobs", *argv])
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cpu_cases_above_the_hosts_memory_are_oom_rows_and_never_run(monkeypatch):
    # estimate peaks of TINY (exact bytes): naive 692,744, chunked none 563,208, chunked 16 366,408,
    # fused none 337,992, fused 16 141,192; a host with 400,000 bytes available holds the last three
    monkeypatch.setattr(bench, "host_available_bytes", lambda: 400_000)
    real = []  # the methods of the cases run on real tensors
    real_loss = bench._loss

    def loss(case, leaves, labels, setup):
        if not isinstance(labels, FakeTensor):
            real.append(case.method)
        return real_loss(case, leaves, labels, setup)

    monkeypatch.setattr(bench, "_loss", loss)
    result = run_logprobs_bench(**TINY, repeats=1, warmup=0)
    oom = {(r.method, r.chunk_size): r.oom for r in result.rows}
    assert oom == {
        ("naive", None): True,
        ("chunked", None): True,
        ("chunked", 16): False,
        ("fused", None): False,
        ("fused", 16): False,
    }
    for r in result.rows:
        assert (
            (r.time_ms is None and r.peak_bytes is None)
            if r.oom
            else (r.time_ms > 0 and r.peak_bytes <= 400_000)
        )
    assert result.limit_bytes == 400_000
    # the OOM cases ran on fake tensors only (naive never ran for real; chunked at chunk 16 did)
    assert "naive" not in real and "chunked" in real


def test_cli_sizes_the_host_cannot_allocate_are_oom_rows_not_a_traceback(capsys):
    # vocab 10M x seq 1M: the logits alone are 10**13 fp32 = 40 TB; nothing is allocated for them
    argv = ["bench", "logprobs", "--vocab", "10000000", "--seq", "1000000", "--chunk", "none"]
    assert main([*argv, "--method", "naive", "chunked", "--json", "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["method"], r["oom"], r["peak_bytes"]) for r in rows] == [
        ("naive", True, None),
        ("chunked", True, None),
    ]


def test_cli_sizes_beyond_any_device_are_a_one_line_error(capsys):
    assert main(["bench", "logprobs", "--vocab", str(10**12), "--seq", str(10**8), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("batchfit bench: error: batch × seq × vocab")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cli_cuda_without_a_gpu_is_a_one_line_error(capsys):
    assert main(["bench", "logprobs", "--backend", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch.cuda.is_available() is False" in err[0]


def test_cli_progress_goes_to_stderr_line_by_line_when_not_a_terminal(capsys):
    argv = ["bench", "logprobs", "--vocab", "256", "--seq", "32", "--chunk", "none", "--hidden", "8"]
    assert main([*argv, "--method", "naive", "fused", "--repeats", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "bench logprobs: V=256 S=32 naive chunk=none: peak memory on cpu",
        "bench logprobs: V=256 S=32 fused chunk=none: peak memory on cpu",
        "bench logprobs: V=256 S=32: timing 2 cases × 2 runs",  # 1 warm-up + 1 timed
    ]
    assert json.loads(captured.out)["rows"]  # stdout holds the JSON alone
    assert main([*argv, "--method", "naive", "--repeats", "1", "--json", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_cli_table_is_as_wide_as_it_needs_when_piped(capsys):
    # estimate at vocab 10M x seq 1M: the widest numbers a table holds; stdout is not a terminal here
    argv = ["bench", "logprobs", "--backend", "estimate", "--vocab", "10000000", "--seq", "1000000"]
    assert main([*argv, "--chunk", "none", "--method", "naive", "--hidden", "8", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "vocab" in line and "saved vs naive" in line)
    row = next(line for line in lines if "naive" in line and "10,000,000" in line)
    assert "…" not in row and "1,000,000" in row
    assert len(header) > 80
