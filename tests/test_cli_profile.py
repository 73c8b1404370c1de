"""``batchfit profile``: default run, --json schema, roles, --plot, one-line errors with exit 2."""

from __future__ import annotations

import json

import pytest

from batchfit.cli import main

# A fast configuration: the tiny preset estimated against 2 GiB (the estimate backend keeps a 1 GiB reserve).
FAST = [
    "--model",
    "tiny",
    "--max-seq-len",
    "512",
    "--backend",
    "estimate",
    "--memory",
    "2GiB",
    "--no-progress",
]


def test_default_run_prints_table_budget_and_model(capsys):
    assert main(["profile"]) == 0
    out = capsys.readouterr().out
    assert "backend estimate → h100-80gb (default target without a GPU; set --memory)" in out
    assert "seq len" in out and "headroom" in out
    assert "token budget C = " in out
    assert "memory model: peak ≈ " in out
    assert "model check: the model agrees at every length 1..4096" in out


def test_json_schema(capsys):
    assert main(["profile", *FAST, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {
        "model",
        "dtype",
        "backend",
        "memory_limit",
        "reserve_bytes",
        "tokens",
        "binding_role",
        "roles",
    } <= set(data)
    assert data["backend"] == "estimate" and data["memory_limit"] == 2 * 1024**3
    policy = data["roles"]["policy"]
    assert policy["tokens"] == data["tokens"]
    # C = min over probed lengths of max_batch_size × seq_len
    assert policy["tokens"] == min(p["max_batch_size"] * p["seq_len"] for p in policy["points"])
    assert [p["seq_len"] for p in policy["points"]] == [512, 256, 128, 64]
    assert set(policy["memory_model"]) == {"base", "linear", "quadratic", "r2", "max_residual", "n_points"}
    assert policy["probes"] == len(policy["trials"]) <= 8 * 4
    assert policy["limit_bytes"] == int(0.9 * (2 * 1024**3 - 1024**3))  # margin × (memory - 1 GiB reserve)


def test_reference_role_is_forward_only_and_fits_more_tokens(capsys):
    assert main(["profile", *FAST, "--roles", "policy,reference", "--logprobs", "fused", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["logprobs"] == "fused"
    # no gradients, no optimizer state, nothing saved for backward: a larger budget than training
    assert data["roles"]["reference"]["tokens"] > data["roles"]["policy"]["tokens"]
    assert data["binding_role"] == "policy" and data["tokens"] == data["roles"]["policy"]["tokens"]


def test_policy_and_critic_are_combined_by_the_smaller(capsys, tmp_path):
    plot = tmp_path / "budget.png"
    assert main(["profile", *FAST, "--roles", "policy,critic", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "combined budget (every role fits)" in out
    assert plot.stat().st_size > 1000


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(["--memory", "80Gx"], "--memory is not a memory size or device preset", id="bad-memory"),
        pytest.param(["--model", "nope"], "spec must be a preset", id="bad-model"),
        pytest.param(["--backend", "gpu"], "--backend must be one of", id="bad-backend"),
        pytest.param(["--roles", "policy,actor"], "--roles must be one of", id="bad-role"),
        pytest.param(["--logprobs", "fast"], "--logprobs must be one of 'full', 'chunked', 'fused'", id="bad-logprobs"),
        pytest.param(
            ["--backend", "cpu"], "--memory is required with --backend cpu", id="cpu-without-memory"
        ),
        pytest.param(["--max-seq-len", "0"], "--max-seq-len must be an integer >= 1", id="zero-length"),
        pytest.param(["--cost", "pad"], "did you mean 'padded'", id="bad-cost"),
        pytest.param(["--dtype", "int8"], "dtype must be", id="bad-dtype"),
    ],
)
def test_bad_values_give_one_line_errors_and_exit_2(capsys, argv, message):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("batchfit profile: error: ") and message in err


def test_one_sequence_that_does_not_fit_exits_1_naming_what_to_reduce(capsys):
    argv = ["profile", "--model", "tiny", "--max-seq-len", "512", "--backend", "cpu", "--memory", "100KB"]
    assert main([*argv, "--no-progress"]) == 1
    assert "reduce max_seq_len" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_one_line_error_before_profiling(capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    assert main(["profile", *FAST, "--plot", "budget.png"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs matplotlib" in err and "batchfit[plot]" in err
