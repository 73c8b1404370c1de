"""Tests of batchfit.bench_logprobs and the ``batchfit bench logprobs`` command (tiny grids)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from batchfit.bench_logprobs import run_logprobs_bench
from batchfit.cli import main
from batchfit.cli.bench import render_logprobs
from batchfit.errors import InvalidArgument

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
        ({"backend": "gpu"}, r"backend must be one of 'cpu', 'estimate', 'cuda'"),
        ({"methods": ["fast"]}, r"method must be one of"),
        ({"dtype": "fp8"}, r"dtype must be one of"),
    ],
    ids=["vocab-zero", "chunk-zero", "backend-unknown", "method-unknown", "dtype-unknown"],
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
