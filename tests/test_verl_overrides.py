"""``profile --emit verl --emit-format overrides``: lines verl's own Hydra composes, with the YAML form's caveats beside.

verl 0.9.1 composes ``verl/trainer/config/ppo_trainer.yaml`` with the command line's overrides, and refuses
to override a key the composed config lacks (``mixed_precision`` is a field of ``FSDPEngineConfig`` that
``engine/fsdp.yaml`` leaves out). The first tier checks the prefixes and the stderr; the second composes the
emitted lines with the wheel's config and hydra-core (``.ci/run`` installs both, ``--no-deps``, and sets
``BATCHFIT_NEEDS_VERL_CONFIG=1`` so that the compose test fails there instead of skipping).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from batchfit.cli import main
from batchfit.frameworks.emit import Key, render_overrides
from batchfit.frameworks.source import flatten
from batchfit.frameworks.verl_emit import override_prefix
from recorder_helpers import use_recorder
from verl_config_helpers import compose, needs_verl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "verl_grpo.yaml"
FAST = ["--backend", "estimate", "--memory", "64MiB", "--reserve", "0", "--engine-reserve", "0", "--no-progress", "--max-seq-len", "32"]
MIXED = "actor_rollout_ref.actor.fsdp_config.mixed_precision."


def _verl_ppo(tmp_path, **actor) -> Path:
    """GAE (a critic) and a KL loss (a reference): every model role verl has."""
    config = {
        "data": {"train_batch_size": 8, "max_prompt_length": 16, "max_response_length": 48},
        "actor_rollout_ref": {
            "model": {"path": "tiny"},
            "actor": {"strategy": "fsdp2", "ppo_mini_batch_size": 4, "use_kl_loss": True, **actor},
            "rollout": {"n": 2},
        },
        "algorithm": {"adv_estimator": "gae"},
        "critic": {"strategy": "fsdp2", "ppo_mini_batch_size": 4, "model": {"path": "tiny"}},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
    }
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _overrides(config: Path, flags: list[str], capsys) -> tuple[list[str], str]:
    """The emitted overrides (stdout lines) and what went to stderr."""
    code = main(["profile", "--config", str(config), *FAST, *flags, "--emit", "verl", "--emit-format", "overrides"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out.splitlines(), captured.err


def test_a_key_verls_composed_config_lacks_is_added_with_plus_plus():
    assert override_prefix("actor_rollout_ref.actor.ppo_max_token_len_per_gpu") == ""
    assert override_prefix("critic.fsdp.reshard_after_forward") == ""
    assert override_prefix("critic.ppo_infer_max_token_len_per_gpu") == "++"  # CriticConfig field, not in critic.yaml
    assert override_prefix(MIXED + "param_dtype") == "++"  # FSDPEngineConfig.mixed_precision: None, not in fsdp.yaml
    keys = [Key(MIXED + "param_dtype", "bf16"), Key("trainer.nnodes", 1), Key("", False, "a comment only")]
    assert render_overrides(keys, override_prefix) == f"++{MIXED}param_dtype=bf16\ntrainer.nnodes=1\n"


def test_the_examples_overrides_add_the_keys_verl_lacks_and_carry_the_yaml_forms_caveats(capsys, monkeypatch):
    use_recorder(monkeypatch)  # the keys, not the budgets: no probe
    lines, err = _overrides(EXAMPLE, [], capsys)
    # today's main wrote these three without a prefix, and verl's Hydra refused them
    assert [line for line in lines if "mixed_precision" in line] == [
        f"++{MIXED}param_dtype=bf16",
        f"++{MIXED}reduce_dtype=fp32",
        f"++{MIXED}buffer_dtype=fp32",
    ]
    assert "actor_rollout_ref.actor.strategy=fsdp2" in lines  # a key of the composed config: no prefix
    assert all(not line.startswith("#") for line in lines)  # stdout is overrides only: Hydra refuses '#'
    comments = err.splitlines()
    assert all(line.startswith("# ") for line in comments)
    assert comments[0] == f"# batchfit profile --config {EXAMPLE} --emit verl"
    # the caveats the YAML form's header prints: how the budgets were found, verl's compiled entropy
    assert "budgets estimated (estimate backend)" in comments[1]
    assert any("use_torch_compile" in line for line in comments)
    # and each key's reason, as the YAML form's comments give them
    assert any(line.startswith("# actor_rollout_ref.actor.ppo_max_token_len_per_gpu: actor update: estimated budget") for line in comments)


def _config_overrides(config: Path) -> list[str]:
    """The user's YAML keys as the overrides that give verl the same config."""
    out = []
    for key, value in flatten(yaml.safe_load(config.read_text())).items():
        out.append(f"{key}={'true' if value is True else 'false' if value is False else value}")
    return out


# about 2 s per case: the profile (the recorder stands in for the probes) and Hydra's compose
@pytest.mark.slow
@needs_verl
@pytest.mark.parametrize(
    "case",
    ["example", "ppo", "ppo-offload", "ppo-lora-fused-sp2", "ppo-fsdp1-no-mixed-precision"],
)
def test_the_emitted_overrides_compose_with_verls_own_config(tmp_path, capsys, monkeypatch, case):
    use_recorder(monkeypatch)
    flags = {
        "example": [],
        "ppo": [],
        "ppo-offload": ["--offload", "cpu"],
        "ppo-lora-fused-sp2": ["--lora-rank", "8", "--lora-alpha", "16", "--logprobs", "fused", "--sequence-parallel", "2"],
        "ppo-fsdp1-no-mixed-precision": ["--sharding", "fsdp1", "--mixed-precision", "none", "--dtype", "fp32"],
    }[case]
    config = EXAMPLE if case == "example" else _verl_ppo(tmp_path)
    lines, _ = _overrides(config, flags, capsys)
    composed = compose(lines)  # raised ConfigCompositionException ("Could not override …") on today's main
    # what verl then reads: each emitted value, where the line put it
    from omegaconf import OmegaConf

    for line in lines:
        path, value = line.lstrip("+").split("=", 1)
        got = OmegaConf.select(composed, path)
        shown = str(got).lower() if isinstance(got, bool) else str(got).replace(" ", "").replace("'", "")
        assert shown == value, (path, got, value)
    # the user's own keys first (a launch command's), the emitted lines after: verl composes them too
    composed = compose([*_config_overrides(config), *lines])
    assert OmegaConf.select(composed, MIXED + "param_dtype") in ("bf16", "fp32")


@pytest.mark.slow
@needs_verl
def test_lengths_emitted_for_pad_to_length_are_multiples_of_the_bucket_and_compose(tmp_path, capsys, monkeypatch):
    # NOTE [ verl pads packed micro-batches to a bucket ]: verl pads each packed micro-batch up to a multiple of
    # pad_to_length_bucket, so each emitted length (× sp) is one, and verl's Hydra takes the bucket key
    use_recorder(monkeypatch)
    config = _verl_ppo(tmp_path, pad_to_length=True, fsdp_config={"pad_to_length_bucket": 16})
    lines, err = _overrides(config, ["--sequence-parallel", "2"], capsys)
    lengths = {p: int(v) for p, v in (line.lstrip("+").split("=", 1) for line in lines) if p.endswith("max_token_len_per_gpu")}
    assert lengths and all(v * 2 % 16 == 0 for v in lengths.values()), lengths
    assert "actor_rollout_ref.actor.fsdp_config.pad_to_length_bucket=16" in lines
    assert "_get_packed_pad_size" in err
    from omegaconf import OmegaConf

    composed = compose([*_config_overrides(config), *lines])
    assert OmegaConf.select(composed, "actor_rollout_ref.actor.fsdp_config.pad_to_length") is True
    assert OmegaConf.select(composed, "actor_rollout_ref.actor.fsdp_config.pad_to_length_bucket") == 16
