"""``batchfit profile``: default run, --json schema, roles, sharding, torchrun, --plot, one-line errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from batchfit.cli import main
from batchfit.memory import untracked_memory
from multirank import scaled

# A fast configuration: the tiny preset estimated against 1 GiB (less the estimate backend's reserve):
# small budgets make the estimate's probes cheap
FAST = [
    "--model",
    "tiny",
    "--max-seq-len",
    "512",
    "--backend",
    "estimate",
    "--memory",
    "1GiB",
    "--no-progress",
]


def test_default_run_answers_a_7b_fsdp2_node(capsys):
    # the main job: qwen2.5-7b at 8192 on 8 simulated h100-80gb ranks, fsdp2, checkpointing
    assert main(["profile", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "model qwen2.5-7b (28 layers, extrapolated from 5 and 6; float32 params, bfloat16 compute" in out
    assert "sharding: fsdp2 over 8 ranks (fp32 params, bf16 compute, fp32 reduce)" in out
    assert "backend estimate → h100-80gb (default target without a GPU; set --memory) per rank" in out
    assert "seq len" in out and "headroom" in out
    assert "token budget C = 24,576 tokens (padded)" in out  # 3 sequences of 8192
    assert "model check: the model agrees at every length 1..8192" in out
    assert "per-rank memory at the budget's peak" in out
    assert "parameters (1/8 shard)" in out and "optimizer state (1/8 shard)" in out
    assert "reserve (CUDA context, NCCL, workspaces)" in out


def test_the_default_jobs_packed_budget_counts_tokens_and_exceeds_the_padded_one(capsys):
    # NOTE [ Packed budgets count tokens ]: 3 whole sequences of 8192 and 3,132 tokens more fit,
    # where rounding down to whole sequences gave the padded 24,576
    assert main(["profile", "--no-progress", "--cost", "packed", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    longest = data["roles"]["policy"]["points"][0]
    assert (longest["seq_len"], longest["max_batch_size"], longest["tokens"]) == (8192, 3, 27_708)
    assert data["tokens"] == 27_708 > 24_576


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
    assert data["backend"] == "estimate" and data["memory_limit"] == 1024**3
    policy = data["roles"]["policy"]
    assert policy["tokens"] == data["tokens"]
    # C = min over probed lengths of max_batch_size × seq_len
    assert policy["tokens"] == min(p["max_batch_size"] * p["seq_len"] for p in policy["points"])
    assert [p["seq_len"] for p in policy["points"]] == [512, 256, 128, 64]
    assert set(policy["memory_model"]) == {"base", "linear", "quadratic", "r2", "max_residual", "n_points"}
    assert policy["probes"] == len(policy["trials"]) <= 8 * 4
    # estimating defaults to fsdp2 over 8 simulated ranks: the reserve holds NCCL's buffers too
    assert data["sharding"]["strategy"] == "fsdp2" and data["sharding"]["world_size"] == 8
    untracked = untracked_memory(world_size=8)
    assert data["untracked"] == untracked.to_dict() and data["reserve_bytes"] == untracked.reserve_bytes
    assert policy["limit_bytes"] == int(0.85 * (1024**3 - untracked.reserve_bytes))  # margin × (memory - reserve)
    assert set(data["per_rank"]) == {"breakdown", "reserve_bytes", "host_bytes"}
    assert data["per_rank"]["breakdown"] == policy["breakdown"]


def test_sharding_flags_reach_the_profile(capsys):
    argv = ["profile", *FAST, "--world-size", "4", "--no-reshard-after-forward", "--mixed-precision", "none"]
    assert main([*argv, "--offload", "cpu", "--dtype", "bf16", "--no-gradient-checkpointing", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["sharding"] == {
        "strategy": "fsdp2",
        "world_size": 4,
        "reshard_after_forward": False,
        "mixed_precision": "none",
        "offload": "cpu",
    }
    assert data["dtype"] == data["compute_dtype"] == "bfloat16" and not data["gradient_checkpointing"]
    assert data["per_rank"]["host_bytes"] > 0


def test_ddp_and_one_device_are_strategies_too(capsys):
    assert main(["profile", *FAST, "--sharding", "none", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["profile", *FAST, "--sharding", "ddp", "--json"]) == 0
    ddp = json.loads(capsys.readouterr().out)
    assert ddp["per_rank"]["breakdown"]["communication"] > 0  # DDP's gradient buckets
    assert ddp["tokens"] <= one["tokens"]


def test_under_torchrun_every_rank_measures_and_rank_0_prints_one_json_document():
    # --standalone: torchrun's own rendezvous on a port the OS picks when it binds (no port chosen beforehand)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "batchfit", "profile", "--backend", "cpu"]
    command += ["--model", "tiny", "--memory", "24MiB", "--max-seq-len", "64", "--json", "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)  # exactly one document: rank 1 printed nothing
    assert data["backend"] == "cpu" and data["sharding"]["world_size"] == 2
    assert data["sharding"]["strategy"] == "fsdp2" and data["tokens"] > 0


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
        pytest.param(["--world-size", "0"], "--world-size must be an integer >= 1, but got --world-size=0", id="zero-world"),
        pytest.param(["--sharding", "fsdp"], "--sharding must be one of 'none', 'ddp', 'fsdp1', 'fsdp2', but got --sharding='fsdp'; did you mean 'fsdp2'?", id="unknown-strategy"),
        pytest.param(["--sharding", "ddp", "--offload", "cpu"], "offload='cpu' needs strategy='fsdp1' or 'fsdp2'", id="offload-without-fsdp2"),
        pytest.param(["--mixed-precision", "fp8"], "mixed_precision must be one of 'bf16', 'none'", id="bad-precision"),
        pytest.param(
            ["--backend", "cpu", "--memory", "1GiB", "--world-size", "2"],
            "--world-size must equal the number of launched ranks with --backend cpu (WORLD_SIZE=1), but got --world-size 2",
            id="world-size-not-torchrun",
        ),
        pytest.param(["--plot", "out.txt"], "--plot must name a .png, .pdf, .svg, .jpg, .jpeg file", id="plot-suffix"),
        pytest.param(["--plot", "no/such/dir/b.png"], "the folder 'no/such/dir' does not exist", id="plot-folder"),
        pytest.param(["--memory", "300MiB"], "--memory 300MiB (300.00 MiB) leaves nothing once the default reserve of 593.75 MiB is taken off", id="memory-below-reserve"),
        pytest.param(["--reserve", "lots"], "--reserve is not a memory size", id="bad-reserve"),
        pytest.param(
            ["--backend", "cpu", "--memory", "1GiB", "--sharding", "fsdp2"],
            "--sharding fsdp2 with --backend cpu runs on real ranks: launch with torchrun",
            id="cpu-fsdp2-without-torchrun",
        ),
    ],
)
def test_bad_values_give_one_line_errors_and_exit_2(capsys, argv, message):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("batchfit profile: error: ") and message in err


def test_reserve_zero_gives_the_whole_memory(capsys):
    argv = ["profile", *FAST[:6], "--memory", "1GiB", "--reserve", "0", "--sharding", "none", "--json"]
    assert main([*argv, "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["reserve_bytes"] == 0 and data["roles"]["policy"]["usable_bytes"] == 1024**3


@pytest.mark.parametrize("argv", [[], ["bench"]], ids=["batchfit", "batchfit-bench"])
def test_a_missing_command_prints_usage_on_stderr_and_exits_2(capsys, argv):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: batchfit") and "error: name a" in err


def test_world_size_unlike_torchrun_s_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["profile", *FAST[:4], "--backend", "cpu", "--memory", "1GiB", "--world-size", "2"]) == 2
    assert "(WORLD_SIZE=4), but got --world-size 2" in capsys.readouterr().err
    assert main(["profile", *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "one of WORLD_SIZE=4 torchrun ranks; run it without torchrun" in err


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


def test_a_sequence_too_long_for_one_device_names_the_flags_that_fit(capsys, tmp_path):
    from batchfit.models import preset_info

    config = dict(preset_info("tiny")["config"])
    config.update(vocab_size=16384, hidden_size=128, intermediate_size=352, head_dim=32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["profile", "--model", str(tmp_path), "--max-seq-len", "32", "--memory", str(1024**3 + 33 * 1024**2), "--reserve", "1GiB"]
    argv += ["--safety-margin", "0.9"]
    assert main([*argv, "--sharding", "none", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "it fits with --sharding fsdp2 --world-size 16 --gradient-checkpointing" in err
