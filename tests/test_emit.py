"""``profile --emit``: the emitted keys carry every setting the budgets assume (NOTE [ Emitted keys carry every
assumption ] in batchfit/frameworks/assumptions.py), or the option is refused in one line.

The round trip, for every framework and every option that changes memory: profile a config with the option on
the command line, apply the emitted keys to the config (YAML merged for verl and SkyRL, flags appended to the
launch command for OpenRLHF and slime), profile it again without the option: the same budgets. The matrix
records what ``profile_run`` hands ``profile_model`` (each role's options, roles and resident bytes) and gives
budgets that are a function of exactly that, so equal budgets mean the profiler saw the same run; one case per
framework runs the real estimate backend on the tiny preset.
"""

from __future__ import annotations

import json
import shlex
import types

import pytest
import yaml

import batchfit.frameworks.run_profile as framework_profile
from batchfit.cli import main
from batchfit.errors import BatchfitError, InvalidArgument
from batchfit.frameworks import read_run_config
from batchfit.frameworks.emit import EmitError, Key, emit_keys, render_flags, render_overrides, render_yaml
from recorder_helpers import ProfileRecorder, use_recorder
from script_helpers import flag_words

FAST = ["--backend", "estimate", "--memory", "64MiB", "--reserve", "0", "--engine-reserve", "0", "--no-progress", "--max-seq-len", "32"]
FLAG_TARGETS = ("openrlhf", "slime")
# slime trains with Megatron (tensor parallel 2 over its 2 GPUs here), profiled as its layout
BASE = {"verl": [], "skyrl": [], "openrlhf": [], "slime": []}


def _verl(tmp_path, every_model=True, model="tiny"):
    # GAE (a critic) and a KL loss (a reference): every model role verl has; padding kept, so --cost packed changes it
    config = {
        "data": {"train_batch_size": 8, "max_prompt_length": 16, "max_response_length": 48},
        "actor_rollout_ref": {
            "model": {"path": model, "use_remove_padding": False},
            "actor": {"strategy": "fsdp2", "ppo_mini_batch_size": 4, "use_kl_loss": True},
            "rollout": {"n": 2},
        },
        "algorithm": {"adv_estimator": "gae"},
        "critic": {"strategy": "fsdp2", "ppo_mini_batch_size": 4, "model": {"path": model}},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
    }
    if not every_model:  # GRPO without KL: the policy alone
        config["algorithm"]["adv_estimator"] = "grpo"
        config["actor_rollout_ref"]["actor"]["use_kl_loss"] = False
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _skyrl(tmp_path, every_model=True, model="tiny"):
    config = {
        "trainer": {
            "train_batch_size": 8,
            "policy_mini_batch_size": 4,
            "critic_mini_batch_size": 4,
            "micro_train_batch_size_per_gpu": 1,
            "remove_microbatch_padding": False,
            "placement": {
                "colocate_all": False,
                "policy_num_gpus_per_node": 2,
                "critic_num_gpus_per_node": 2,
                "ref_num_gpus_per_node": 2,
            },
            "policy": {"model": {"path": model}},
            "critic": {"model": {"path": model}},
            "algorithm": {"advantage_estimator": "gae", "use_kl_loss": True},
        },
        "generator": {"n_samples_per_prompt": 2, "max_input_length": 16, "sampling_params": {"max_generate_length": 48}},
    }
    if not every_model:  # GRPO without KL: the policy alone
        config["trainer"]["algorithm"] = {"advantage_estimator": "grpo", "use_kl_loss": False}
        del config["trainer"]["critic"], config["trainer"]["critic_mini_batch_size"]
    path = tmp_path / "skyrl.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _openrlhf(tmp_path, *extra, model="tiny"):
    # samples in micro-batches (no dynamic batches, so no packing): the emitted flags turn both on
    path = tmp_path / "openrlhf.sh"
    path.write_text(
        f"python3 -m openrlhf.cli.train_ppo_ray --actor.model_name_or_path {model} --actor.num_gpus_per_node 2 \\\n"
        "   --vllm.num_engines 1 --ds.zero_stage 3 --reward.remote_url http://localhost:5000/get_reward \\\n"
        "   --rollout.batch_size 8 --rollout.n_samples_per_prompt 2 --rollout.micro_batch_size 2 \\\n"
        "   --train.batch_size 8 --train.micro_batch_size 1 --data.max_len 64 --algo.advantage.estimator group_norm "
        + " ".join(extra)
        + "\n"
    )
    return path


def _slime(tmp_path, *extra, model="tiny"):
    path = tmp_path / "slime.sh"
    path.write_text(
        f"python3 train.py --actor-num-nodes 1 --actor-num-gpus-per-node 2 --tensor-model-parallel-size 2 --hf-checkpoint {model} \\\n"
        "   --rollout-batch-size 8 --n-samples-per-prompt 2 --global-batch-size 16 \\\n"
        "   --rollout-max-prompt-len 16 --rollout-max-response-len 48 " + " ".join(extra) + "\n"
    )
    return path


CONFIGS = {"verl": _verl, "skyrl": _skyrl, "openrlhf": _openrlhf, "slime": _slime}

# option -> (its flags, {framework: the refusal's words, or None for a round trip}). The bases check their
# frameworks' defaults: checkpointing on in verl and SkyRL, off in the OpenRLHF and slime commands.
OPTIONS = {
    "offload-cpu": (
        ["--offload", "cpu"],
        {"verl": None, "skyrl": None, "openrlhf": "never offloads the parameters", "slime": "offload='cpu' needs strategy='fsdp1' or 'fsdp2'"},
    ),
    "checkpointing-flipped": (
        {"verl": ["--no-gradient-checkpointing"], "skyrl": ["--no-gradient-checkpointing"]},
        {"verl": None, "skyrl": None, "openrlhf": None, "slime": None},
    ),
    "packed-rows": (["--cost", "packed"], {"verl": None, "skyrl": None, "openrlhf": None, "slime": None}),
    "padded-rows": (
        ["--cost", "padded"],
        {f: "drop --cost padded" for f in CONFIGS},
    ),
    "fsdp1": (
        ["--sharding", "fsdp1"],
        {"verl": None, "skyrl": "fully_shard (FSDP2", "openrlhf": "no DDP or FSDP1", "slime": "Megatron-LM only"},
    ),
    "ddp": (
        ["--sharding", "ddp"],
        {"verl": "not DDP", "skyrl": "fully_shard (FSDP2", "openrlhf": "no DDP or FSDP1", "slime": "Megatron-LM only"},
    ),
    "no-reshard": (
        ["--no-reshard-after-forward"],
        {"verl": None, "skyrl": None, "openrlhf": "ZeRO-2 keeps whole parameters", "slime": "needs strategy='fsdp1' or 'fsdp2'"},
    ),
    "world-size-4": (["--world-size", "4"], {"verl": None, "skyrl": None, "openrlhf": None, "slime": None}),
    "lora": (
        ["--lora-rank", "8", "--lora-alpha", "32"],
        {"verl": None, "skyrl": None, "openrlhf": None, "slime": "no LoRA flags"},
    ),
    "fused-head": (
        ["--logprobs", "fused"],
        {"verl": None, "skyrl": "fused_lm_head_logprob needs", "openrlhf": "no flag for", "slime": "no flag for"},
    ),
    "full-head": (
        ["--logprobs", "full"],
        {"verl": "its own head", "skyrl": "its own head", "openrlhf": None, "slime": "no flag for another head"},
    ),
    "response-share": (
        ["--response-only", "--response-fraction", "0.5"],
        {f: "response tokens of a micro-batch" for f in CONFIGS},
    ),
    "no-mixed-precision": (
        ["--mixed-precision", "none", "--dtype", "fp32"],
        {"verl": None, "skyrl": None, "openrlhf": "fp32 master weights", "slime": "bf16 with Megatron"},
    ),
    "bf16-parameters": (
        ["--dtype", "bf16"],
        {"verl": None, "skyrl": "in fp32", "openrlhf": "fp32 master weights", "slime": None},
    ),
}
_FLIP_ON = ["--gradient-checkpointing"]  # the OpenRLHF and slime bases train without it


def _option_flags(option: str, framework: str) -> list[str]:
    flags = OPTIONS[option][0]
    return flags.get(framework, _FLIP_ON) if isinstance(flags, dict) else flags


@pytest.fixture
def recorder(monkeypatch):
    return use_recorder(monkeypatch)


def _emitted(text: str, target: str):
    """The emitted keys: the YAML mapping (verl, SkyRL) or the flags (OpenRLHF, slime)."""
    if target in FLAG_TARGETS:
        return flag_words(text)
    return yaml.safe_load(text)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def _apply(path, emitted, target):
    """The config with the emitted keys merged in (YAML) or the emitted flags added to its command."""
    merged = path.with_name(f"merged-{path.name}")
    if target in FLAG_TARGETS:
        merged.write_text(path.read_text().rstrip("\n") + " " + shlex.join(emitted) + "\n")
    else:
        merged.write_text(yaml.safe_dump(_merge(yaml.safe_load(path.read_text()), emitted)))
    return merged


def _profile(path, target, flags, capsys):
    # a later --memory wins: the real round trips pass a smaller one
    assert main(["profile", "--config", str(path), *FAST, *flags, "--emit", target]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _round_trip(tmp_path, framework, flags, capsys, calls=None, *, path=None, fast=()):
    """Profile with ``flags``, apply the keys, profile without: both runs' emitted keys (and recorded calls)."""
    path = path or CONFIGS[framework](tmp_path)
    first = _profile(path, framework, [*BASE[framework], *fast, *flags], capsys)
    seen = list(calls) if calls is not None else None
    emitted = _emitted(first, framework)
    second = _profile(_apply(path, emitted, framework), framework, [*BASE[framework], *fast], capsys)
    if calls is not None:
        assert calls[len(seen) :] == seen, "the merged config was profiled as another run"
    return emitted, _emitted(second, framework)


@pytest.mark.parametrize(
    ("framework", "option"),
    [
        pytest.param(framework, option, id=f"{framework}-{option}")
        for option, (_, expected) in OPTIONS.items()
        for framework in CONFIGS
        if expected[framework] is None
    ],
)
def test_the_emitted_keys_give_the_budgets_the_option_gave(tmp_path, capsys, recorder, framework, option):
    before, after = _round_trip(tmp_path, framework, _option_flags(option, framework), capsys, recorder.calls)
    # the same budgets, and the same keys again: the merged config already says everything the option said
    assert after == before


@pytest.mark.parametrize(
    ("framework", "option"),
    [
        pytest.param(framework, option, id=f"{framework}-{option}")
        for option, (_, expected) in OPTIONS.items()
        for framework in CONFIGS
        if expected[framework] is not None
    ],
)
def test_an_option_the_framework_cannot_express_is_refused_in_one_line_before_any_probe(
    tmp_path, capsys, recorder, framework, option
):
    flags = [*BASE[framework], *_option_flags(option, framework)]
    path = CONFIGS[framework](tmp_path)
    assert main(["profile", "--config", str(path), *FAST, *flags, "--emit", framework]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and OPTIONS[option][1][framework] in err, err
    # or the sharding's own refusal (an FSDP option under Megatron)
    assert f"--emit {framework} cannot carry" in err or "--cost padded" in err or "needs strategy=" in err
    assert recorder.calls == []  # refused before profiling


@pytest.mark.parametrize(
    ("framework", "flag", "words"),
    [
        pytest.param("openrlhf", "--actor.gradient_checkpointing_enable", "remove --actor.gradient_checkpointing_enable", id="openrlhf"),
        pytest.param("slime", "--recompute-granularity full", "remove --recompute-granularity full", id="slime"),
    ],
)
def test_a_switch_the_command_gives_cannot_be_undone_by_an_added_flag(tmp_path, capsys, recorder, framework, flag, words):
    path = CONFIGS[framework](tmp_path, flag)
    argv = ["profile", "--config", str(path), *FAST, *BASE[framework], "--no-gradient-checkpointing", "--emit", framework]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot carry --no-gradient-checkpointing" in err and words in err and recorder.calls == []


def test_skyrl_offload_sets_skyrls_offload_key_for_every_model(tmp_path, capsys, recorder):
    # issue 28: the budget held only with CPU offload, and only a header comment said so
    out = _profile(_skyrl(tmp_path), "skyrl", ["--offload", "cpu"], capsys)
    trainer = yaml.safe_load(out)["trainer"]
    for model in ("policy", "critic", "ref"):
        assert trainer[model]["fsdp_config"]["cpu_offload"] is True
    assert "# FSDP2's CPUOffloadPolicy" in out or "cpu_offload: true  # FSDP2's CPUOffloadPolicy" in out


def test_openrlhf_lora_for_the_actor_alone_is_refused_when_a_critic_trains(tmp_path, capsys, recorder):
    path = _openrlhf(tmp_path, "--critic.model_name_or_path tiny --critic.num_gpus_per_node 2")
    path.write_text(path.read_text().replace("group_norm", "gae"))
    argv = ["profile", "--config", str(path), *FAST, "--lora-rank", "8", "--emit", "openrlhf"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "adapt the actor and the critic alike" in err and recorder.calls == []


def test_another_frameworks_config_is_profiled_with_the_targets_head(tmp_path, capsys, recorder):
    # a verl config emitted for OpenRLHF: OpenRLHF's head (batchfit's full), not verl's
    out = _profile(_verl(tmp_path), "openrlhf", [], capsys)
    assert "the budgets' probe runs openrlhf's log-prob head" in out
    assert {call[1].logprobs for call in recorder.calls} == {"full"}
    # SkyRL's config emitted for verl: verl's head, and a comment on the algorithm it assumes
    out = _profile(_skyrl(tmp_path), "verl", [], capsys)
    assert "# the budgets assume verl's head where the update computes no entropy" in out


def test_emit_keys_needs_the_options_each_model_was_profiled_with(tmp_path):
    run = read_run_config(_verl(tmp_path))
    profile = types.SimpleNamespace(run=run, budgets={}, options={})
    with pytest.raises(InvalidArgument, match=r"profile\.options is empty"):
        emit_keys(profile, "verl", max_seq_len=64, margin=0.85)


def test_emit_error_is_a_value_error_of_the_family():
    assert issubclass(EmitError, InvalidArgument) and issubclass(EmitError, ValueError)
    assert issubclass(EmitError, BatchfitError) and EmitError.__doc__


def test_values_render_as_yaml_overrides_and_flags():
    keys = [Key("a.targets", ("q_proj", "v_proj")), Key("a.on", False), Key("", False, "what no key says")]
    assert render_yaml(keys, []) == "# what no key says\na:\n  targets: [q_proj, v_proj]\n  on: false\n"
    assert render_overrides(keys) == "a.targets=[q_proj,v_proj]\na.on=false\n"
    flags = [Key("--ds.lora.target_modules", ("q_proj", "v_proj")), Key("", False, "note")]
    assert render_flags(flags, []) == "# note\n--ds.lora.target_modules q_proj v_proj\n"


# ------------------------------------------------------------------ real budgets


def _seq_lens_once(monkeypatch):
    """The real profile_model, probing the longest length only (both runs alike): a round trip in seconds."""
    real = framework_profile.profile_model

    def once(model, options, **kwargs):
        return real(model, options.replace(seq_lens=(options.max_seq_len,)), **kwargs)

    monkeypatch.setattr(framework_profile, "profile_model", once)


@pytest.fixture
def micro_model(tmp_path):
    """A one-layer Llama (hidden 32, vocabulary 256): each probe of the estimate backend is mostly dispatch."""
    from batchfit.models import preset_info

    config = dict(preset_info("tiny")["config"])
    config.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config.update(num_key_value_heads=1, head_dim=16, vocab_size=256)
    directory = tmp_path / "micro"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize(
    ("framework", "flags"),
    [
        # the case: SkyRL's budget held only with CPU offload, which its keys did not set
        pytest.param("skyrl", ["--offload", "cpu"], id="skyrl-offload-cpu", marks=pytest.mark.slow),
        pytest.param(
            "openrlhf", ["--gradient-checkpointing"], id="openrlhf-checkpointing", marks=pytest.mark.slow
        ),  # the first tier's time (issue 29): the recorded round trips above stay fast
    ],
)
def test_real_budgets_round_trip(tmp_path, capsys, monkeypatch, micro_model, framework, flags):
    _seq_lens_once(monkeypatch)
    if framework == "skyrl":
        path = _skyrl(tmp_path, every_model=False, model=micro_model)
    else:
        path = _openrlhf(tmp_path, model=micro_model)
    fast = ["--memory", "8MiB"]
    before, after = _round_trip(tmp_path, framework, flags, capsys, path=path, fast=fast)
    assert after == before and "max_tokens" in str(before)


def test_a_model_on_cudas_math_attention_path_is_named_in_the_emitted_header(tmp_path, capsys, monkeypatch):
    # NOTE [ The estimate runs CUDA's attention kernel ]: the budgets assume it, so the emitted keys say so
    from batchfit.models.attention import CudaAttention

    rec = ProfileRecorder()

    def profile_model(model, options, *, roles, resident_bytes=0, engine=None):
        out = rec.profile_model(model, options, roles=roles, resident_bytes=resident_bytes, engine=engine)
        out.model, out.attention = model, CudaAttention("math", "attention: CUDA runs its math path (…)")
        return out

    monkeypatch.setattr(framework_profile, "profile_model", profile_model)
    monkeypatch.setattr(framework_profile, "resident_state_bytes", rec.resident_state_bytes)
    out = _profile(_verl(tmp_path), "verl", [], capsys)
    assert out.count("note: tiny: attention: CUDA runs its math path (…)") == 1  # once per model, not per pass
