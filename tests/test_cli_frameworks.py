"""``plan`` and ``profile --config`` on SkyRL and verl configs; ``--emit`` round trips into ``plan``."""

from __future__ import annotations

import json

import pytest
import yaml

from batchfit.cli import main
from batchfit.frameworks import read_run_config
from batchfit.frameworks.emit import Key, render_overrides
from batchfit.frameworks.older_torch import older_torch_notes, root_parameter_bytes
from batchfit.memory import format_bytes
from batchfit.models import preset_info
from batchfit.parallel.behaviour import ROOT_RESHARD, Behaviour, TorchBehaviours
from batchfit.parallel.sharding import Sharding

FAST = ["--backend", "estimate", "--memory", "2GiB", "--no-progress"]


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


def test_profile_config_emits_verl_keys_equal_to_the_budgets_and_the_merge_plans(tmp_path, model_dir, capsys):
    path, config = _verl_config(tmp_path, model_dir, ppo_mini_batch_size=8)
    # verl's defaults set no micro size: the config itself does not plan yet
    assert main(["plan", str(path)]) == 2
    capsys.readouterr()
    assert main(["profile", "--config", str(path), *FAST, "--json", "--emit", "verl"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["vocabulary"] == "verl" and data["max_seq_len"] == 256
    assert set(data["tokens"]) == {"policy", "policy_forward", "reference", "critic", "critic_forward"}
    assert data["colocated"] == ["policy", "reference", "critic"] and data["resident_bytes"]["policy"] > 0
    tokens = data["tokens"]
    assert tokens["policy_forward"] > tokens["policy"]  # a no_grad pass fits more
    assert data["emit"]["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == tokens["policy"]
    # torch 2.13 reshards the root after forward; the trained models say what an older torch adds
    root = format_bytes(root_parameter_bytes(model_dir, "bfloat16"))
    assert [note.split(" ")[0] for note in data["older_torch"]] == ["policy", "critic"]
    assert f"+{root} per rank" in data["older_torch"][0] and "torch < 2.8" in data["older_torch"][0]

    assert main(["profile", "--config", str(path), *FAST, "--emit", "verl"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# batchfit profile --config {path} --emit verl\n")
    assert f"# note: policy ({model_dir}): these budgets follow torch" in out
    emitted = yaml.safe_load(out)
    actor = emitted["actor_rollout_ref"]["actor"]
    assert actor == {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": tokens["policy"]}
    assert (
        emitted["actor_rollout_ref"]["rollout"]["log_prob_max_token_len_per_gpu"] == tokens["policy_forward"]
    )
    assert emitted["actor_rollout_ref"]["ref"]["log_prob_max_token_len_per_gpu"] == tokens["reference"]
    assert emitted["critic"]["ppo_max_token_len_per_gpu"] == tokens["critic"]
    assert emitted["critic"]["forward_max_token_len_per_gpu"] == tokens["critic_forward"]
    assert "# actor update: measured budget" in out
    merged = tmp_path / "merged.yaml"
    merged.write_text(yaml.safe_dump(_merge(config, emitted)))
    assert main(["plan", str(merged)]) == 0
    assert "verl vocabulary" in capsys.readouterr().out
    overrides = render_overrides([Key(path, value) for path, value in data["emit"].items()]).splitlines()
    assert "actor_rollout_ref.actor.use_dynamic_bsz=true" in overrides
    assert f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={tokens['policy']}" in overrides


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
    assert data["max_seq_len"] == 256 and data["profiles"]["policy"]["roles"]["policy"]["max_seq_len"] == 128
    assert set(data["tokens"]) == {"policy", "policy_forward"}  # no critic, no KL: no reference
    assert main(["profile", "--config", str(path), *FAST, "--emit", "skyrl"]) == 0
    emitted = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert emitted["max_tokens_per_microbatch"] > 0
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
        (["profile", "--config", "{d}/megatron.yaml"], "strategy='megatron', which batchfit does not model"),
        (["profile", "--emit", "verl"], "--emit needs --config"),
        (["profile", "--config", "{d}/megatron.yaml", "--emit", "openrlhf"], "--emit must be one of"),
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
        pytest.param(True, Sharding("fsdp2", world_size=2, reshard_after_forward=False), False, id="no-reshard"),
        pytest.param(True, Sharding("ddp", world_size=2), False, id="ddp"),
    ],
)
def test_older_torch_notes_only_where_the_installed_torch_reshards_the_root(root_resharded, sharding, noted):
    import types

    behaviour = Behaviour(ROOT_RESHARD, root_resharded, "", "probe", "2.8")
    torch_info = TorchBehaviours("2.13.0", (behaviour,)) if sharding.strategy == "fsdp2" else None
    profile = types.SimpleNamespace(torch=torch_info, sharding=sharding, compute_dtype="bfloat16")
    result = types.SimpleNamespace(profiles={"policy": profile, "reference": profile}, run=types.SimpleNamespace(models={"policy": "tiny"}))
    notes = older_torch_notes(result)
    # tiny: embedding and head 2 × 1,024 × 64 and the final norm 64, in bf16: 262,272 B
    assert notes == ([f"policy (tiny): these budgets follow torch 2.13.0, which reshards FSDP2's root after forward; on torch < 2.8 (a framework's pin through vLLM or SGLang) the root's parameters stay gathered until backward, +{format_bytes(262_272)} per rank at the backward peak: profile under that torch, or lower the training budget by that much"] if noted else [])
