"""``plan`` and ``profile --config`` on SkyRL and verl configs and OpenRLHF and slime launch commands; ``--emit`` round trips into ``plan``."""

from __future__ import annotations

import json

import pytest
import yaml

from batchfit.cli import main
from batchfit.frameworks import read_run_config
from batchfit.frameworks.emit import Key, render_overrides, render_yaml
from batchfit.frameworks.older_torch import older_torch_notes, root_parameter_bytes
from batchfit.memory import format_bytes
from batchfit.models import preset_info
from batchfit.parallel.behaviour import ROOT_RESHARD, Behaviour, TorchBehaviours
from batchfit.parallel.sharding import Sharding
from script_helpers import flag_words

FAST = ["--backend", "estimate", "--memory", "64MiB", "--reserve", "0", "--engine-reserve", "0", "--no-progress"]


@pytest.fixture
def model_dir(tmp_path):
    directory = tmp_path / "tiny-model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(dict(preset_info("tiny")["config"])))
    return directory


def _verl_config(tmp_path, model_dir, **critic):
    config = {
        "data": {"train_batch_size": 16, "max_prompt_length": 64, "max_response_length": 192},
        "actor_rollout_ref": {
            "model": {"path": str(model_dir), "enable_gradient_checkpointing": True},
            "actor": {"strategy": "fsdp2", "ppo_mini_batch_size": 8, "use_kl_loss": True},
            "rollout": {"n": 2},
        },
        "algorithm": {"adv_estimator": "gae" if critic else "grpo"},
        "critic": {"model": {"path": str(model_dir)}, **critic},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
    }
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.mark.slow
def test_profile_config_emits_verl_keys_equal_to_the_budgets_and_the_merge_plans(tmp_path, model_dir, capsys):
    path, config = _verl_config(tmp_path, model_dir, ppo_mini_batch_size=8)
    # verl's defaults set no micro size: the config itself does not plan yet
    assert main(["plan", str(path)]) == 2
    capsys.readouterr()
    assert main(["profile", "--config", str(path), *FAST, "--json", "--emit", "verl"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["vocabulary"] == "verl" and data["max_seq_len"] == 256
    assert data["budget_provenance"] == data["budget"] == "estimated"  # the estimate backend's budgets (and its alias)
    assert data["schema_version"] == 2 and data["profiles"]["policy"]["device_memory_bytes"] is not None
    # NOTE [ One name per figure ]: each pass's budget once, in its model's profile
    tokens = {role: b["tokens"] for p in data["profiles"].values() for role, b in p["budgets"].items()}
    assert set(tokens) == {"policy", "policy_forward", "reference", "critic", "critic_forward"}
    assert "tokens" not in data and data["profiles"]["policy"]["budgets"]["policy_forward"]["pass"] == "old log-probs"
    assert data["colocated"] == ["policy", "reference", "critic"] and data["resident_bytes"]["policy"] > 0
    # verl's old-log-prob pass computes the full entropy its update does not: its budget is its own
    assert data["profiles"]["policy"]["logprobs"]["forward_entropy"] == "full"
    assert data["emit"]["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == tokens["policy"]
    # torch 2.13 reshards the root after forward; the trained models say what an older torch adds
    root = format_bytes(root_parameter_bytes(model_dir, "bfloat16"))
    assert [note.split(" ")[0] for note in data["older_torch"]] == ["policy", "critic"]
    assert f"+{root} per rank" in data["older_torch"][0] and "torch < 2.8" in data["older_torch"][0]

    out = render_yaml([Key(path, value) for path, value in data["emit"].items()], [])
    emitted = yaml.safe_load(out)
    actor = emitted["actor_rollout_ref"]["actor"]
    assert actor["use_dynamic_bsz"] is True and actor["ppo_max_token_len_per_gpu"] == tokens["policy"]
    # and what the budgets assume (tests/test_emit.py): FSDP2, no offload, fp32 parameters with bf16 compute
    assert actor["strategy"] == "fsdp2" and actor["fsdp_config"]["offload_policy"] is False
    assert actor["fsdp_config"]["mixed_precision"] == {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    assert emitted["actor_rollout_ref"]["model"]["use_remove_padding"] is True  # verl counts valid tokens
    assert emitted["critic"]["model"]["use_remove_padding"] is True
    assert (
        emitted["actor_rollout_ref"]["rollout"]["log_prob_max_token_len_per_gpu"] == tokens["policy_forward"]
    )
    assert emitted["actor_rollout_ref"]["ref"]["log_prob_max_token_len_per_gpu"] == tokens["reference"]
    assert emitted["critic"]["ppo_max_token_len_per_gpu"] == tokens["critic"]
    # verl's V1 trainer runs both critic passes under ppo_infer_max_token_len_per_gpu: the smaller budget
    assert emitted["critic"]["ppo_infer_max_token_len_per_gpu"] == min(tokens["critic"], tokens["critic_forward"])
    merged = tmp_path / "merged.yaml"
    merged.write_text(yaml.safe_dump(_merge(config, emitted)))
    assert main(["plan", str(merged)]) == 0
    assert "verl vocabulary" in capsys.readouterr().out
    overrides = render_overrides([Key(path, value) for path, value in data["emit"].items()]).splitlines()
    assert "actor_rollout_ref.actor.use_dynamic_bsz=true" in overrides
    assert f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={tokens['policy']}" in overrides


@pytest.mark.slow
def test_profile_config_emits_skyrl_keys_that_pass_plan_and_flags_override(tmp_path, model_dir, capsys):
    config = {
        "trainer": {
            "train_batch_size": 8,
            "policy_mini_batch_size": 4,
            "micro_train_batch_size_per_gpu": 1,
            "placement": {"colocate_all": False, "policy_num_gpus_per_node": 2},
            "policy": {"model": {"path": str(model_dir)}},
            "algorithm": {"use_kl_loss": False},
        },
        "generator": {
            "n_samples_per_prompt": 4,
            "max_input_length": 64,
            "sampling_params": {"max_generate_length": 192},
        },
    }
    path = tmp_path / "skyrl.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["profile", "--config", str(path), *FAST, "--max-seq-len", "128", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["max_seq_len"] == 256 and data["profiles"]["policy"]["budgets"]["policy"]["max_seq_len"] == 128
    assert list(data["profiles"]) == ["policy"]  # no critic, no KL: no reference
    assert list(data["profiles"]["policy"]["budgets"]) == ["policy", "policy_forward"]
    assert main(["profile", "--config", str(path), *FAST, "--emit", "skyrl"]) == 0
    out = capsys.readouterr().out
    emitted = yaml.safe_load(out)["trainer"]
    assert emitted["max_tokens_per_microbatch"] > 0
    assert "the smallest budget, set by policy: estimated budget" in out and "measured" not in out
    assert "SkyRL treats it as a soft cap" in out  # NOTE [ SkyRL's soft cap ] (issue 44)
    assert "sequences up to max_seq_len=256" in out
    assert (4 * 4 // 2) % emitted["micro_train_batch_size_per_gpu"] == 0  # SkyRL validates it
    merged = tmp_path / "merged.yaml"
    merged.write_text(yaml.safe_dump(_merge(config, {"trainer": emitted})))
    run = read_run_config(merged)
    assert run.batch.max_tokens_per_micro_batch == emitted["max_tokens_per_microbatch"]
    assert run.plan().micro_batching == "tokens"


def test_plan_strict_makes_warnings_faults_and_json_lists_them(tmp_path, capsys):
    path = tmp_path / "skyrl.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "train_batch_size": 6,
                    "policy_mini_batch_size": 3,
                    "placement": {"policy_num_gpus_per_node": 2},
                },
                "generator": {"n_samples_per_prompt": 1},
            }
        )
    )
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "SkyRL vocabulary" in out and "warning: each policy mini-batch of 3 samples is padded to 4" in out
    assert main(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"][0].startswith("each policy mini-batch")
    assert main(["plan", str(path), "--strict"]) == 2
    assert "--strict makes it a fault" in capsys.readouterr().err


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "malformed.yaml").write_text("trainer: [1, 2\n")
    (tmp_path / "unresolved.yaml").write_text("data:\n  train_batch_size: ${data.nope}\n")
    (tmp_path / "mixed.yaml").write_text(
        "trainer:\n  policy_mini_batch_size: 4\nactor_rollout_ref:\n  actor: {}\n"
    )
    (tmp_path / "nomodel.yaml").write_text(
        "data: {train_batch_size: 8}\nactor_rollout_ref:\n  model: {path: /no/such/dir}\n"
    )
    (tmp_path / "megatron.yaml").write_text(
        "actor_rollout_ref:\n  model: {path: tiny}\n  actor: {strategy: megatron}\n"
    )
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "{d}/malformed.yaml"], "could not be parsed"),
        (["profile", "--config", "{d}/malformed.yaml"], "could not be parsed"),
        (["plan", "{d}/unresolved.yaml"], "cannot resolve the interpolation at 'data.train_batch_size'"),
        (["profile", "--config", "{d}/mixed.yaml"], "mixes vocabularies"),
        (
            ["profile", "--config", "{d}/nomodel.yaml"],
            "(read from actor_rollout_ref.model.path; --model overrides it)",
        ),
        (["profile", "--config", "{d}/megatron.yaml"], "trains a critic beside the Megatron actor"),
        (["profile", "--emit", "verl"], "--emit needs --config"),
        (["profile", "--config", "{d}/megatron.yaml", "--emit", "trl"], "--emit must be one of"),
        (
            ["profile", "--config", "{d}/megatron.yaml", "--roles", "policy"],
            "--roles cannot be combined with --config",
        ),
    ],
    ids=[
        "malformed",
        "malformed-profile",
        "unresolved",
        "mixed",
        "no-model",
        "megatron",
        "emit",
        "emit-target",
        "roles",
    ],
)
def test_bad_framework_input_is_one_line_and_exit_2(bad_files, capsys, argv, message):
    assert main([a.format(d=bad_files) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message in err


@pytest.mark.parametrize(
    ("root_resharded", "sharding", "noted"),
    [
        pytest.param(True, Sharding("fsdp2", world_size=2), True, id="resharded-root"),
        pytest.param(False, Sharding("fsdp2", world_size=2), False, id="older-torch-installed"),
        pytest.param(
            True, Sharding("fsdp2", world_size=2, reshard_after_forward=False), False, id="no-reshard"
        ),
        pytest.param(True, Sharding("ddp", world_size=2), False, id="ddp"),
    ],
)
def test_older_torch_notes_only_where_the_installed_torch_reshards_the_root(root_resharded, sharding, noted):
    import types

    behaviour = Behaviour(ROOT_RESHARD, root_resharded, "", "probe", "2.8")
    torch_info = TorchBehaviours("2.13.0", (behaviour,)) if sharding.strategy == "fsdp2" else None
    profile = types.SimpleNamespace(torch=torch_info, sharding=sharding, compute_dtype="bfloat16")
    result = types.SimpleNamespace(
        profiles={"policy": profile, "reference": profile},
        run=types.SimpleNamespace(models={"policy": "tiny"}),
    )
    notes = older_torch_notes(result)
    # tiny: embedding and head 2 × 1,024 × 64 and the final norm 64, in bf16: 262,272 B
    assert notes == (
        [
            f"policy (tiny): these budgets follow torch 2.13.0, which reshards FSDP2's root after forward; on torch < 2.8 (a framework's pin through vLLM or SGLang) the root's parameters stay gathered until backward, +{format_bytes(262_272)} per rank at the backward peak: profile under that torch, or lower the training budget by that much"
        ]
        if noted
        else []
    )


def _openrlhf_command(tmp_path, model_dir, *extra):
    path = tmp_path / "train_grpo.sh"
    path.write_text(
        "#!/bin/bash\n"
        f"MODEL={model_dir}\n"
        "python3 -m openrlhf.cli.train_ppo_ray \\\n"
        "   --actor.num_gpus_per_node 2 --ref.num_gpus_per_node 2 --vllm.num_engines 2 \\\n"
        "   --actor.model_name_or_path $MODEL --reward.remote_url http://localhost:5000/get_reward \\\n"
        "   --rollout.batch_size 8 --rollout.n_samples_per_prompt 4 --rollout.micro_batch_size 4 \\\n"
        "   --train.batch_size 16 --train.micro_batch_size 2 --data.max_len 256 --ds.zero_stage 3 \\\n"
        "   --algo.advantage.estimator group_norm --actor.gradient_checkpointing_enable --train.colocate_actor_ref "
        + " ".join(extra)
        + "\n"
    )
    return path


@pytest.mark.slow
def test_profile_emits_openrlhf_flags_that_its_parser_takes_and_the_command_plans(
    tmp_path, model_dir, capsys
):
    from batchfit.frameworks.flags import flag_spec

    path = _openrlhf_command(tmp_path, model_dir)
    assert main(["plan", str(path)]) == 0
    assert "OpenRLHF (launch command) vocabulary" in capsys.readouterr().out
    assert main(["profile", "--config", str(path), *FAST, "--max-seq-len", "128", "--emit", "openrlhf"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# batchfit profile --config {path} --emit openrlhf\n")
    assert "budgets estimated (estimate backend)" in out
    assert "# colocated models' state taken off each budget: policy" in out  # --train.colocate_actor_ref
    assert "# note: DeepSpeed ZeRO-3 (--ds.zero_stage 3) is profiled as FSDP2" in out
    assert "# the budgets count packed rows, as OpenRLHF runs them" in out  # dynamic batches pack samples
    flags = flag_words(out)
    args = flag_spec("openrlhf").parser().parse_args(flags)  # OpenRLHF 0.11.2's parser, from the shipped data
    train, rollout = getattr(args, "train.max_tokens_per_gpu"), getattr(args, "rollout.max_tokens_per_gpu")
    assert getattr(args, "train.dynamic_batch_enable") and 0 < train < rollout  # a no_grad pass fits more
    # one flag for the training passes, one for the experience passes (the smaller forward budget)
    assert (
        f"# --train.max_tokens_per_gpu: actor update, set by policy: estimated budget {train:,} tokens" in out
    )
    assert (
        "(policy_forward, reference; no_grad), set by " in out
        and f"estimated budget {rollout:,} tokens" in out
    )
    merged = tmp_path / "merged.sh"
    merged.write_text(path.read_text().rstrip("\n") + " " + " ".join(flags) + "\n")
    assert main(["plan", str(merged), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["vocabulary"] == "openrlhf" and plan["micro_batching"] == "tokens"
    assert plan["config"]["max_tokens_per_micro_batch"] == train


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_profile_emits_slime_flags_for_its_megatron_layout(tmp_path, model_dir, capsys):
    path = tmp_path / "run.sh"
    path.write_text(
        "ARGS=(\n"
        f"   --hf-checkpoint {model_dir}\n"
        "   --rollout-batch-size 8 --n-samples-per-prompt 4 --global-batch-size 16\n"
        "   --rollout-max-prompt-len 64 --rollout-max-response-len 192\n"
        ")\n"
        "python3 train.py --actor-num-nodes 1 --actor-num-gpus-per-node 2 ${ARGS[@]} --recompute-granularity full\n"
    )
    assert main(["profile", "--config", str(path), *FAST, "--max-seq-len", "128", "--emit", "slime", "--sharding", "fsdp2"]) == 2
    assert "--emit slime cannot carry --sharding fsdp2" in capsys.readouterr().err
    assert main(["profile", "--config", str(path), *FAST, "--max-seq-len", "128", "--emit", "slime"]) == 0
    out = capsys.readouterr().out
    assert "megatron over 2 ranks (tensor 1 × pipeline 1 × data 2, distributed optimizer)" in out
    words = flag_words(out)
    assert words[:2] == ["--use-dynamic-batch-size", "--max-tokens-per-gpu"] and int(words[2]) > 0
    assert (
        "# --max-tokens-per-gpu: every pass (slime runs log-probs and values over the training micro-batches)"
        in out
    )
    merged = tmp_path / "merged.sh"
    merged.write_text(path.read_text().rstrip("\n") + " " + " ".join(words) + "\n")
    assert read_run_config(merged).plan().config.max_tokens_per_micro_batch == int(words[2])


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_budgets_from_a_real_run_read_measured(tmp_path, model_dir, capsys):
    # one GPU: the framework still wraps the model (FSDP or ZeRO over one rank, fp32 master weights, bf16
    # compute), and so does the profile: the cpu backend runs the tiny model's real steps over a one-rank
    # group, and the emitted keys keep the framework's mixed precision
    path = _openrlhf_command(tmp_path, model_dir, "--algo.kl.init_coef 0")
    path.write_text(path.read_text().replace("--actor.num_gpus_per_node 2", "--actor.num_gpus_per_node 1"))
    argv = ["profile", "--config", str(path), "--backend", "cpu", "--memory", "24MiB", "--engine-reserve", "0", "--max-seq-len", "64"]
    assert main([*argv, "--no-progress", "--emit", "openrlhf"]) == 0
    out = capsys.readouterr().out
    assert "fsdp2 over 1 rank" in out and "--ds.param_dtype bf16" in out
    path, _ = _verl_config(tmp_path, model_dir)
    config = yaml.safe_load(path.read_text())
    config["trainer"]["n_gpus_per_node"] = 1
    config["actor_rollout_ref"]["actor"]["use_kl_loss"] = False  # no reference: one model
    path.write_text(yaml.safe_dump(config))
    argv[2] = str(path)
    assert main([*argv, "--no-progress", "--emit", "verl"]) == 0
    out = capsys.readouterr().out
    assert "budgets measured (cpu backend)" in out and "actor update: measured budget" in out
    assert "estimated" not in out
    engine = yaml.safe_load(out)["actor_rollout_ref"]["actor"]["fsdp_config"]
    assert engine["model_dtype"] == "fp32" and engine["mixed_precision"]["param_dtype"] == "bf16"


@pytest.mark.parametrize(
    ("backend", "word"), [("estimate", "estimated"), ("cpu", "measured"), ("cuda", "measured")]
)
def test_the_reports_budget_line_says_how_the_budget_was_found(backend, word):
    import types

    from batchfit.cli.render_budget import budget_lines

    budget = types.SimpleNamespace(
        tokens=4096, cost="padded", max_seq_len=1024, backend=backend, limit_bytes=2**30, safety_margin=0.85,
        usable_bytes=2**31, probes=5, memory_model=None, model_check="ok", response_tokens=None,
    )  # fmt: skip
    assert budget_lines(budget)[0].startswith(f"token budget C = 4,096 tokens (padded), {word}: b sequences")
