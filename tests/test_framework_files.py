"""The frameworks' own config files, read from their released wheels, pass ``plan`` and ``profile --emit``.

verl 0.9.1's generated trainer config (``_generated_ppo_trainer.yaml``, what Hydra composes and
what a verl user's dumped config looks like) and its Hydra config ``ppo_trainer.yaml``; SkyRL
0.4.0's default config, which its wheel ships as dataclasses only (``SkyRLTrainConfig``): it is
built from them by ``scripts/gen_framework_schemas.py``, as ``SkyRLTrainConfig()`` fills them.
Only what the framework itself requires is filled in (verl: the micro-batch sizes it refuses to
start without) and the model paths, which name models absent here. NOTE [ Interpolations resolve
before the schema check ] in :mod:`batchfit.frameworks.source`.

The wheels are never in the repository: the session fixture takes them from ``$BATCHFIT_WHEELS``
(default ``/tmp/wheels``), downloads them there when missing, and skips with the command to run
when it cannot.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from batchfit import BatchConfigError
from batchfit.cli import main
from batchfit.frameworks import read_run_config
from batchfit.models import preset_info
from script_helpers import flag_words

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path(os.environ.get("BATCHFIT_WHEELS", "/tmp/wheels"))
DOWNLOADS = {
    "verl-0.9.1-py3-none-any.whl": ["--no-deps", "verl==0.9.1"],
    # skyrl 0.4.0 requires Python >= 3.12; its wheel is pure Python and read, never installed
    "skyrl-0.4.0-py3-none-any.whl": ["--no-deps", "--python-version", "3.12", "--only-binary=:all:", "skyrl==0.4.0"],
}
VERL_CONFIG = "verl/trainer/config/"
# estimate backend, a tiny model, short sequences and a small device: each profile takes seconds
FAST = ["--backend", "estimate", "--memory", "8MiB", "--reserve", "0", "--engine-reserve", "0", "--no-progress", "--max-seq-len", "32"]

# verl 0.9.1 refuses to start without them (actor: ActorConfig.__post_init__; rollout:
# validate_config's check_mutually_exclusive; critic, trained by default since
# algorithm.adv_estimator is gae: CriticConfig.__post_init__)
VERL_REQUIRED = {
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
    "critic.ppo_micro_batch_size_per_gpu": 2,
}
VERL_MODELS = ("actor_rollout_ref.model.path", "critic.model.path")  # default: ~/models/deepseek-llm-7b-chat
SKYRL_MODELS = ("trainer.policy.model.path",)  # default: Qwen/Qwen2.5-1.5B-Instruct, a hub id


def _download_command(wheel: str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", *DOWNLOADS[wheel], "-d", str(WHEELS)]


@pytest.fixture(scope="session")
def wheels() -> dict[str, Path]:
    """The released wheels, by file name; downloaded into ``$BATCHFIT_WHEELS`` when missing, else a skip."""
    out = {}
    for wheel in DOWNLOADS:
        path = WHEELS / wheel
        if not path.is_file():
            command = _download_command(wheel)
            try:
                WHEELS.mkdir(parents=True, exist_ok=True)
                done = subprocess.run(
                    [*command, "--retries", "1", "--timeout", "20", "-q"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                failed = done.returncode != 0 or not path.is_file()
                why = (done.stderr.strip().splitlines() or ["no wheel written"])[-1] if failed else ""
            except (OSError, subprocess.TimeoutExpired) as exc:
                failed, why = True, str(exc)
            if failed:
                pytest.skip(
                    f"{wheel} is not in {WHEELS} and could not be downloaded ({why}); run: {shlex.join(command)}"
                )
        out[wheel] = path
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny preset cut to one layer and 256 tokens: a verl profile's 4 roles x ~17 probes in seconds."""
    directory = tmp_path_factory.mktemp("tiny-model")
    config = {**preset_info("tiny")["config"], "num_hidden_layers": 1, "vocab_size": 256}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _set(config: dict, values: dict) -> dict:
    for key, value in values.items():
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


@pytest.fixture(scope="session")
def verl_files(wheels, tmp_path_factory) -> dict[str, dict]:
    """verl 0.9.1's ``_generated_ppo_trainer.yaml`` and ``ppo_trainer.yaml``, as the wheel ships them."""
    with zipfile.ZipFile(wheels["verl-0.9.1-py3-none-any.whl"]) as zf:
        return {
            name: yaml.safe_load(zf.read(VERL_CONFIG + name))
            for name in ("_generated_ppo_trainer.yaml", "ppo_trainer.yaml")
        }


@pytest.fixture(scope="session")
def skyrl_default(wheels) -> dict:
    """SkyRL 0.4.0's default config: every key of ``SkyRLTrainConfig`` with its default, read from the wheel."""
    spec = importlib.util.spec_from_file_location(
        "gen_framework_schemas", ROOT / "scripts" / "gen_framework_schemas.py"
    )
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up
    try:
        spec.loader.exec_module(script)
        defaults, _ = script.skyrl_schema(script.Package(wheels["skyrl-0.4.0-py3-none-any.whl"]))
    finally:
        sys.modules.pop(spec.name, None)
    return defaults


def _write(tmp_path: Path, name: str, config: dict) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _verl_file(verl_files, name, model_dir, tmp_path, *, required=True) -> tuple[Path, dict]:
    config = _set(yaml.safe_load(yaml.safe_dump(verl_files[name])), dict.fromkeys(VERL_MODELS, str(model_dir)))
    if required:
        _set(config, VERL_REQUIRED)
    return _write(tmp_path, name, config), config


def _emitted_tokens(out: str) -> dict[str, int]:
    """``--flag N`` lines of a launch-command emit, the token flags only."""
    words = flag_words(out)
    return {w: int(words[i + 1]) for i, w in enumerate(words[:-1]) if w.endswith("max_tokens_per_gpu") or w == "--max-tokens-per-gpu"}


# ------------------------------------------------------------------ verl 0.9.1


@pytest.mark.parametrize("name", ["_generated_ppo_trainer.yaml", "ppo_trainer.yaml"])
def test_verls_own_files_are_refused_only_for_the_micro_sizes_verl_requires(verl_files, model_dir, tmp_path, name):
    path, _ = _verl_file(verl_files, name, model_dir, tmp_path, required=False)
    with pytest.raises(BatchConfigError, match=r"3 faults") as info:
        read_run_config(path).plan()
    # the interpolations (rollout.mtp: ${oc.select:actor_rollout_ref.model.mtp, null}, ...) are no fault
    assert [fault.split(" ")[:4] for fault in info.value.faults] == [
        ["[actor]", "neither", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "nor"],
        ["[rollout]", "neither", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "nor"],
        ["[critic]", "neither", "critic.ppo_micro_batch_size_per_gpu", "nor"],
    ]


@pytest.mark.parametrize("name", ["_generated_ppo_trainer.yaml", "ppo_trainer.yaml"])
def test_verls_own_files_with_the_micro_sizes_plan(verl_files, model_dir, tmp_path, capsys, name):
    path, _ = _verl_file(verl_files, name, model_dir, tmp_path)
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    # verl's defaults: data.train_batch_size 1024, rollout.n 1, ppo_mini_batch_size 256, 1 × 8 GPUs
    assert "verl vocabulary" in out and "1,024 prompts × 1 samples" in out
    assert "GPUs: 8" in out and "gradient accumulation: 16 micro-batches of 2 samples per GPU" in out


def test_verls_hydra_config_reads_as_the_config_it_composes(verl_files, model_dir, tmp_path):
    # ppo_trainer.yaml's defaults list composes _generated_ppo_trainer.yaml (verl generates one from the other)
    generated, _ = _verl_file(verl_files, "_generated_ppo_trainer.yaml", model_dir, tmp_path)
    hydra, _ = _verl_file(verl_files, "ppo_trainer.yaml", model_dir, tmp_path)
    # reference_dtype aside: batchfit reads the reference's model_dtype only where a file sets it, and
    # the generated file sets every key while ppo_trainer.yaml leaves it to its ref group (both fp32)
    composed, dumped = read_run_config(hydra), read_run_config(generated)
    assert composed.replace(reference_dtype=None) == dumped.replace(reference_dtype=None)


def test_verls_default_critic_path_is_named_when_model_replaces_the_policys_only(verl_files, model_dir, tmp_path, capsys):
    config = _set(yaml.safe_load(yaml.safe_dump(verl_files["_generated_ppo_trainer.yaml"])), VERL_REQUIRED)
    path = _write(tmp_path, "verl.yaml", config)
    assert main(["profile", "--config", str(path), "--model", str(model_dir), *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "spec='~/models/deepseek-llm-7b-chat'" in err, err
    assert "(read from the critic's model path in the config; --model sets the policy's model only" in err


@pytest.mark.slow  # 4 roles (verl trains a critic by default) over 8 FSDP1 ranks: 14-20 s each at load 1 per core
@pytest.mark.parametrize(
    ("target", "extra"),
    [
        ("verl", []),
        # verl's default strategy is fsdp (FSDP1): OpenRLHF (ZeRO-3) is profiled as FSDP2 (slime below)
        ("openrlhf", ["--sharding", "fsdp2"]),
    ],
)
def test_verls_generated_config_profiles_and_emits(verl_files, model_dir, tmp_path, capsys, target, extra):
    path, _ = _verl_file(verl_files, "_generated_ppo_trainer.yaml", model_dir, tmp_path)
    assert main(["profile", "--config", str(path), *FAST, *extra, "--emit", target]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# batchfit profile --config {path} --emit {target}\n")
    if target == "verl":
        # (no round trip into plan: budgets for 32-token sequences in 8 MiB are below the file's own
        # longest sequence, 512 + 512 tokens, which verl's rearrange_micro_batches refuses)
        emitted = yaml.safe_load(out)
        assert emitted["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] > 0
        assert emitted["critic"]["ppo_max_token_len_per_gpu"] > 0  # gae: verl trains a critic by default
    else:
        tokens = _emitted_tokens(out)
        assert tokens and all(n > 0 for n in tokens.values()), out


@pytest.mark.slow
def test_verls_generated_config_emitted_as_slime_is_refused_for_its_critic(verl_files, model_dir, tmp_path, capsys):
    # verl trains a critic by default (gae), which batchfit's Megatron profile (slime's) does not model
    path, _ = _verl_file(verl_files, "_generated_ppo_trainer.yaml", model_dir, tmp_path)
    argv = ["profile", "--config", str(path), *FAST, "--sharding", "megatron", "--dtype", "bf16", "--emit", "slime"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a critic trained with Megatron is not modelled" in err


# ------------------------------------------------------------------ SkyRL 0.4.0


def _skyrl_file(skyrl_default, model_dir, tmp_path) -> tuple[Path, dict]:
    config = _set(yaml.safe_load(yaml.safe_dump(skyrl_default)), dict.fromkeys(SKYRL_MODELS, str(model_dir)))
    return _write(tmp_path, "skyrl_default.yaml", config), config


def test_skyrls_default_config_plans(skyrl_default, model_dir, tmp_path, capsys):
    path, _ = _skyrl_file(skyrl_default, model_dir, tmp_path)
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    # SkyRL's defaults: train_batch_size 1024, n_samples_per_prompt 5, policy_mini_batch_size 256, 1 GPU
    assert "SkyRL vocabulary" in out and "1,024 prompts × 5 samples = 5,120 trajectories" in out
    assert "mini-batches per epoch: 4 (= 1,024 / 256)" in out


# about 8 s each at load 1 per core: the first tier keeps SkyRL's own emit, the second the others
@pytest.mark.parametrize(
    ("target", "extra"),
    [
        pytest.param("skyrl", [], marks=pytest.mark.slow),
        pytest.param("verl", [], marks=pytest.mark.slow),
        # the flags their refusals name: DeepSpeed and Megatron train bf16 over fp32 master parameters
        pytest.param("openrlhf", ["--sharding", "fsdp2", "--mixed-precision", "bf16"], marks=pytest.mark.slow),
        pytest.param("slime", ["--sharding", "megatron", "--dtype", "bf16"], marks=pytest.mark.slow),
    ],
)
def test_skyrls_default_config_profiles_and_emits(skyrl_default, model_dir, tmp_path, capsys, target, extra):
    path, config = _skyrl_file(skyrl_default, model_dir, tmp_path)
    assert main(["profile", "--config", str(path), *FAST, *extra, "--emit", target]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# batchfit profile --config {path} --emit {target}\n")
    if target == "skyrl":
        emitted = yaml.safe_load(out)
        assert emitted["trainer"]["max_tokens_per_microbatch"] > 0
        merged = _write(tmp_path, "merged.yaml", _merge(config, emitted))
        assert main(["plan", str(merged)]) == 0
        assert "SkyRL vocabulary" in capsys.readouterr().out
    elif target == "verl":
        assert yaml.safe_load(out)["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] > 0
    else:
        tokens = _emitted_tokens(out)
        assert tokens and all(n > 0 for n in tokens.values()), out


# ------------------------------------------------------------------ the same rules on small files (no wheel)


def _small_verl(**extra) -> dict:
    config = {
        "data": {"train_batch_size": 8, "max_prompt_length": 16, "max_response_length": 16},
        "actor_rollout_ref": {
            "model": {"path": "tiny"},
            "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
            "rollout": {"n": 2, "log_prob_micro_batch_size_per_gpu": 2},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
    }
    return _set(config, extra)


def test_an_interpolation_that_resolves_to_a_section_is_read_as_that_section():
    config = _small_verl(**{"actor_rollout_ref.rollout.mtp": "${oc.select:actor_rollout_ref.model.mtp, null}"})
    run = read_run_config(config)
    assert run.plan().config.train_batch_size == 8 and run.warnings == ()


def test_an_interpolation_that_resolves_to_a_value_where_verl_has_a_section_is_a_fault():
    config = _small_verl(**{"actor_rollout_ref.rollout.mtp": "${data.train_batch_size}"})
    with pytest.raises(
        BatchConfigError, match=r"actor_rollout_ref\.rollout\.mtp=8: 'actor_rollout_ref\.rollout\.mtp' is a section"
    ):
        read_run_config(config).plan()


@pytest.mark.parametrize(
    ("config", "match"),
    [
        pytest.param(
            {**_small_verl(), "defaults": [{"model_engine": "megatron"}, "_self_"]},
            r"the Hydra defaults list composes other config groups \(\{'model_engine': 'megatron'\}",
            id="verl-other-groups",
        ),
        pytest.param(
            {"defaults": ["_self_"], "trainer": {"train_batch_size": 8, "policy_mini_batch_size": 4}},
            r"SkyRL 0\.4\.0 composes its config without a Hydra defaults list; remove the 'defaults' key",
            id="skyrl",
        ),
    ],
)
def test_a_hydra_defaults_list_that_is_not_the_frameworks_own_is_one_fault(config, match):
    with pytest.raises(BatchConfigError, match=match) as info:
        read_run_config(config)
    assert len(info.value.faults) == 1
