"""``batchfit profile``: default run, --json schema, roles, sharding, torchrun, --plot, one-line errors with exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types

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


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
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


@pytest.mark.slow
def test_the_default_jobs_packed_budget_counts_tokens_and_exceeds_the_padded_one(capsys):
    # NOTE [ Packed budgets count tokens ]: 3 whole sequences of 8192 and 3,132 tokens more fit,
    # where rounding down to whole sequences gave the padded 24,576
    assert main(["profile", "--no-progress", "--cost", "packed", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    longest = data["budgets"]["policy"]["points"][0]
    assert (longest["seq_len"], longest["max_batch_size"], longest["tokens"]) == (8192, 3, 27_708)
    assert data["budgets"]["policy"]["tokens"] == 27_708 > 24_576


def test_json_schema(capsys):
    assert main(["profile", *FAST, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {
        "model",
        "dtype",
        "backend",
        "memory_limit",
        "reserve_bytes",
        "budgets",
        "combined",
    } <= set(data)
    # NOTE [ One name per figure ]: each budget once, under its role, with its pass in words
    assert not {"tokens", "binding_role", "roles", "per_rank"} & set(data)
    assert data["backend"] == "estimate" and data["memory_limit"] == 1024**3
    # NOTE [ The --json schema ]: a version, the device told apart from the limit, one type per key
    assert next(iter(data)) == "schema_version" and data["schema_version"] == 2
    assert data["device_memory_bytes"] == 1024**3 and data["budget_provenance"] == "estimated"
    assert data["logprobs"] == {"head": "full"}
    assert data["deprecated_keys"] == {"memory_limit": "device_memory_bytes", "budget": "budget_provenance"}
    policy = data["budgets"]["policy"]
    assert policy["pass"] == "update"
    assert data["combined"] == {"tokens": policy["tokens"], "response_tokens": None, "binding_role": "policy"}
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
    binding = next(p for p in policy["points"] if p["tokens"] == policy["tokens"])
    assert policy["breakdown"] == binding["breakdown"] and policy["peak_bytes"] == binding["peak_bytes"]
    assert policy["host_bytes"] == 0


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
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
    assert data["budgets"]["policy"]["host_bytes"] > 0


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_ddp_and_one_device_are_strategies_too(capsys):
    assert main(["profile", *FAST, "--sharding", "none", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["profile", *FAST, "--sharding", "ddp", "--json"]) == 0
    ddp = json.loads(capsys.readouterr().out)
    assert ddp["budgets"]["policy"]["breakdown"]["communication"] > 0  # DDP's gradient buckets
    assert ddp["budgets"]["policy"]["tokens"] <= one["budgets"]["policy"]["tokens"]


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_under_torchrun_every_rank_measures_and_rank_0_prints_one_json_document():
    # --standalone: torchrun's own rendezvous on a port the OS picks when it binds (no port chosen beforehand)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "batchfit", "profile", "--backend", "cpu"]
    command += ["--model", "tiny", "--memory", "24MiB", "--max-seq-len", "64", "--json", "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)  # exactly one document: rank 1 printed nothing
    assert data["backend"] == "cpu" and data["sharding"]["world_size"] == 2
    assert data["sharding"]["strategy"] == "fsdp2" and data["budgets"]["policy"]["tokens"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("cost", "head"), [("packed", "fused"), ("padded", "full")])
def test_torchrun_on_real_ranks_finds_the_budgets_the_estimate_finds_in_one_process(tmp_path, capsys, cost, head):
    # issue 28: the same command gave 1,023 / 1,024 tokens on 2 real gloo ranks and 2,857 / 8,768 estimated;
    # a user's small Llama (tests/test_guard.py's), state most of one sequence's peak
    from sharded_helpers import user_llama_config

    model = tmp_path / "llama"
    user_llama_config().save_pretrained(model)
    flags = ["--model", str(model), "--reserve", "0", "--memory", "40MiB", "--mixed-precision", "none", "--dtype", "fp32"]
    flags += ["--max-seq-len", "128", "--cost", cost, "--logprobs", head, "--roles", "policy,policy_forward"]
    flags += ["--json", "--no-progress"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run([*command, "-m", "batchfit", "profile", "--backend", "cpu", *flags], capture_output=True,
                          text=True, timeout=scaled(600))
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = json.loads(done.stdout)["budgets"]
    assert main(["profile", "--backend", "estimate", "--world-size", "2", *flags]) == 0
    alone = json.loads(capsys.readouterr().out)["budgets"]
    for role in ("policy", "policy_forward"):
        # padded budgets count rows of 128: equal; packed ones tokens, and the estimate rounds each storage to
        # 512 B where the cpu backend counts exact bytes (a few tokens' worth)
        tolerance = 0 if cost == "padded" else 8
        assert abs(ranks[role]["tokens"] - alone[role]["tokens"]) <= tolerance, (role, ranks[role], alone[role])


@pytest.mark.slow
def test_reference_role_is_forward_only_and_fits_more_tokens(capsys):
    assert main(["profile", *FAST, "--roles", "policy,reference", "--logprobs", "fused", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["logprobs"] == {"head": "fused"}
    # no gradients, no optimizer state, nothing saved for backward: a larger budget than training
    budgets = data["budgets"]
    assert budgets["reference"]["tokens"] > budgets["policy"]["tokens"]
    assert data["combined"]["binding_role"] == "policy" and data["combined"]["tokens"] == budgets["policy"]["tokens"]


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
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
        pytest.param(["--sharding", "fsdp"], "--sharding must be one of 'none', 'ddp', 'fsdp1', 'fsdp2', 'zero1', 'zero2', 'megatron', but got --sharding='fsdp'; did you mean 'fsdp2'?", id="unknown-strategy"),
        pytest.param(["--sharding", "ddp", "--offload", "cpu"], "--offload cpu needs --sharding fsdp1 or fsdp2", id="offload-without-fsdp2"),
        pytest.param(["--mixed-precision", "fp8"], "--mixed-precision must be one of 'bf16', 'none', but got --mixed-precision fp8", id="bad-precision"),
        pytest.param(
            ["--backend", "cpu", "--memory", "1GiB", "--world-size", "2"],
            "--world-size must equal the number of launched ranks with --backend cpu (WORLD_SIZE=1), but got --world-size 2",
            id="world-size-not-torchrun",
        ),
        pytest.param(["--plot", "out.txt"], "--plot must name a .png, .pdf, .svg, .jpg, .jpeg file", id="plot-suffix"),
        pytest.param(["--plot", "no/such/dir/b.png"], "the folder 'no/such/dir' does not exist", id="plot-folder"),
        pytest.param(["--memory", "300MiB"], "--memory 300MiB (300.00 MiB) leaves nothing once the default reserve of 593.75 MiB is taken off", id="memory-below-reserve"),
        pytest.param(["--reserve", "lots"], "--reserve is not a memory size", id="bad-reserve"),
    ],
)
def test_bad_values_give_one_line_errors_and_exit_2(capsys, argv, message):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("batchfit profile: error: ") and message in err


def test_one_rank_of_fsdp2_runs_on_the_cpu_without_torchrun(capsys):
    # FSDP2 over one rank never communicates: a one-GPU framework run (still FSDP, bf16 compute) profiles in
    # this process, with the framework's mixed precision
    argv = ["profile", "--backend", "cpu", "--model", "tiny", "--memory", "24MiB", "--max-seq-len", "64"]
    assert main([*argv, "--sharding", "fsdp2", "--json", "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["sharding"]["strategy"] == "fsdp2" and data["sharding"]["world_size"] == 1
    assert data["sharding"]["mixed_precision"] == "bf16" and data["budgets"]["policy"]["tokens"] > 0


# the first tier's time (issue 41): --reserve 0 under the whole memory stays in the first tier
# (test_a_two_role_json_names_each_budget_once_beside_its_breakdown: 0.85 x 64 MiB)
@pytest.mark.slow
def test_reserve_zero_gives_the_whole_memory(capsys):
    argv = ["profile", *FAST[:6], "--memory", "1GiB", "--reserve", "0", "--sharding", "none", "--json"]
    assert main([*argv, "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["reserve_bytes"] == 0 and data["budgets"]["policy"]["usable_bytes"] == 1024**3


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


# one sequence of 2048 on the cpu backend needs about 27 MiB (24 MiB of it the full log-prob head) and
# runs to the end under 64 MiB, over the limit 0.3 × 64 MiB = 20,132,659 bytes (int(20,132,659.2))
TOO_LONG = ["profile", "--model", "tiny", "--max-seq-len", "2048", "--backend", "cpu", "--memory", "64MiB"]
TOO_LONG += ["--safety-margin", "0.3", "--roles", "policy,policy_forward"]


def test_one_sequence_that_does_not_fit_exits_1_with_its_breakdown_and_the_flags_to_change(capsys):
    assert main([*TOO_LONG, "--no-progress"]) == 1  # a verdict, not bad input: exit 1 (cli/__init__)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("batchfit profile: error: policy: one sequence of --max-seq-len 2048 does not fit")
    assert "(logprob head " in err and ", activations " in err and ", optimizer state " in err  # the largest first
    assert "the limit is 19.20 MiB = --safety-margin 0.3 × 64.00 MiB usable (memory 64.00 MiB − reserve 0 B)" in err
    for flag in ("reduce --max-seq-len", "(--logprobs fused)", "(--response-only)", "(--memory, --safety-margin)"):
        assert flag in err
    for keyword in ("max_seq_len", "logprobs=", "memory_limit", "safety_margin", "response_only"):
        assert keyword not in err  # NOTE [ Messages in the caller's vocabulary ]: flags only


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_a_json_does_not_fit_error_carries_the_breakdown_limit_reserve_and_flags(capsys):
    assert main([*TOO_LONG, "--json"]) == 1
    out, err = capsys.readouterr()
    error = json.loads(out)["error"]
    assert error["type"] == "DoesNotFitError" and error["faults"] == [err.removeprefix("batchfit profile: error: ").strip()]
    assert error["limit_bytes"] == 20_132_659 and error["usable_bytes"] == 64 * 1024**2 and error["reserve_bytes"] == 0
    breakdown = error["breakdown"]
    assert sum(breakdown.values()) == error["needed_bytes"] > error["limit_bytes"]  # it ran to the end: whole
    assert max(breakdown, key=breakdown.get) == "logprob_head" and breakdown["gradients"] > 0
    changes = [change for remedy in error["remedies"] for change in remedy["change"]]
    assert changes == ["--max-seq-len", "--logprobs fused", "--response-only", "--sharding fsdp2 --world-size N", "--memory", "--safety-margin"]
    assert error["remedies"][1]["text"] == "compute log-probs fused from the hidden states (--logprobs fused)"
    assert error["world_size_hint"] is None  # the cpu backend looks for none


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_a_two_role_json_names_each_budget_once_beside_its_breakdown(capsys):
    # tiny at 64 tokens, one unsharded 64 MiB device, no reserve: the update and the old-log-prob pass
    argv = ["profile", "--model", "tiny", "--max-seq-len", "64", "--backend", "estimate", "--memory", "64MiB"]
    argv += ["--reserve", "0", "--sharding", "none", "--roles", "policy,policy_forward", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    budgets = data["budgets"]
    assert list(budgets) == ["policy", "policy_forward"]
    assert not {"tokens", "binding_role", "roles", "per_rank"} & set(data)  # NOTE [ One name per figure ]
    update, old = budgets["policy"], budgets["policy_forward"]
    assert (update["pass"], old["pass"]) == ("update", "old log-probs")
    # the update's budget: 65 sequences of 64 = 4,160 tokens; the old log-probs' (no gradients, no saved
    # activations): 84 × 64 = 5,376; both under 0.85 × 64 MiB = 57,042,534 bytes (int(57,042,534.4))
    assert (update["tokens"], old["tokens"]) == (4_160, 5_376)
    assert update["limit_bytes"] == old["limit_bytes"] == 57_042_534
    assert data["combined"] == {"tokens": 4_160, "response_tokens": None, "binding_role": "policy"}
    for budget in (update, old):
        binding = next(p for p in budget["points"] if p["tokens"] == budget["tokens"])
        assert budget["breakdown"] == binding["breakdown"] and budget["peak_bytes"] == binding["peak_bytes"]
        assert sum(budget["breakdown"].values()) == budget["peak_bytes"] <= budget["limit_bytes"]
    assert "gradients" in update["breakdown"] and "gradients" not in old["breakdown"]  # each its own pass's


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_the_table_names_each_budget_as_the_json_does(capsys):
    argv = ["profile", "--model", "tiny", "--max-seq-len", "64", "--backend", "estimate", "--memory", "64MiB"]
    argv += ["--reserve", "0", "--sharding", "none", "--roles", "policy,policy_forward", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "policy (update)\n" in out and "policy_forward (old log-probs)\n" in out
    assert "policy (update, 65×64)" in out  # the breakdown's column, 4,160 tokens
    assert "combined budget (every role fits): C = 4,160 tokens per rank, set by policy (update)" in out


def test_packed_progress_lines_say_tokens_so_one_shape_never_reads_twice(capsys):
    from batchfit.budget import Probe
    from batchfit.cli.probe_progress import ProbeProgress

    def event(probe, n, **done):
        return types.SimpleNamespace(role="policy", probe=probe, probes=n, **done)

    # issue 28: three packed probes of 2 sequences of 32,768 and a remainder were all printed "b=3"
    probes = [
        Probe(3, 32_768, 90, fits=False, tokens=2 * 32_768 + 20_000),
        Probe(3, 32_768, 70, fits=True, tokens=2 * 32_768 + 1_234),
        Probe(3, 32_768, 80, fits=False, tokens=2 * 32_768 + 1_235),
    ]
    with ProbeProgress(types.SimpleNamespace(is_terminal=False), True) as callback:
        for n, probe in enumerate(probes, start=3):
            callback(event(probe, n))
        callback(event(None, 5, length_index=0, n_lengths=2, seq_len=32_768, max_batch_size=2))
    lines = [line.removeprefix("batchfit profile: policy: ") for line in capsys.readouterr().err.splitlines()]
    assert lines[:3] == [
        "probe 3: 2×32,768 + 20,000 = 85,536 tokens does not fit",  # 65,536 + 20,000
        "probe 4: 2×32,768 + 1,234 = 66,770 tokens fits",
        "probe 5: 2×32,768 + 1,235 = 66,771 tokens does not fit",
    ]
    assert lines[3].startswith("length 1/2 done (s=32,768, largest fitting 2×32,768 + 1,234 = 66,770 tokens); ")


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_a_packed_search_never_prints_one_shape_with_two_verdicts(capsys):
    argv = ["profile", "--model", "tiny", "--max-seq-len", "64", "--backend", "estimate", "--memory", "64MiB"]
    assert main([*argv, "--reserve", "0", "--sharding", "none", "--cost", "packed"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if ": probe " in line]
    shape = re.compile(r"probe \d+: (?:([\d,]+)×([\d,]+))?(?: \+ ([\d,]+))? = ([\d,]+) tokens (fits|does not fit)$")
    verdicts: dict[str, str] = {}
    remainders = 0
    for line in lines:
        found = shape.search(line)
        assert found, line
        rows, length, rest, total, verdict = (g.replace(",", "") if g and g[0].isdigit() else g for g in found.groups())
        assert int(rows or 0) * int(length or 0) + int(rest or 0) == int(total)  # the sequences add up
        said = line[line.index(": probe ") :].split(": ", 2)[2].rsplit(" tokens ", 1)[0]
        assert verdicts.setdefault(said, verdict) == verdict, line  # one shape, one verdict
        remainders += rest is not None
    assert remainders >= 2  # the search did probe remainders (NOTE [ Packed budgets count tokens ])


def test_plot_without_matplotlib_is_a_one_line_error_before_profiling(capsys, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    assert main(["profile", *FAST, "--plot", "budget.png"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs matplotlib" in err and "batchfit[plot]" in err


# the first tier's time (issue 41): the world-size search stays in the first tier (tests/test_profile.py's
# test_activations_that_never_fit_say_no_world_size_helps), and the flags of a sequence that does not fit
# (test_one_sequence_that_does_not_fit_exits_1_with_its_breakdown_and_the_flags_to_change)
@pytest.mark.slow
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
