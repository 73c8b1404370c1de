"""slime's MoE router flags (Megatron-LM's --moe-router-load-balancing-type, --moe-aux-loss-coeff, --moe-router-dtype,
--moe-z-loss-coeff) carried into the Megatron profile: ProfileOptions.megatron_router (NOTE [ Megatron's router
settings ] in batchfit.budget.options), its cache key, its refusals, the probe's peak."""

from __future__ import annotations

import json

import pytest

from batchfit.budget.options import ProfileOptions
from batchfit.errors import InvalidArgument
from batchfit.frameworks import read_run_config
from test_slime import _script

ROUTER = "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 --moe-router-dtype fp32 --moe-z-loss-coeff 1e-4"


def _options(tmp_path, extra: str = "", **chosen) -> ProfileOptions:
    from batchfit.frameworks.config_options import run_profile_options

    run = read_run_config(_script(tmp_path, extra=extra))
    return run_profile_options(run, {"backend": "estimate", "max_seq_len": 4096, **chosen}).options


def test_a_slime_command_s_router_flags_reach_the_options(tmp_path):
    options = _options(tmp_path, ROUTER)
    assert options.megatron_router == {
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 0.001,
        "moe_router_dtype": "fp32",
        "moe_z_loss_coeff": 0.0001,
    }


@pytest.mark.parametrize(
    ("extra", "router"),
    [
        # Megatron-LM's default type is aux_loss (arguments.py l. 3534): the coefficient alone turns that loss on
        ("--moe-aux-loss-coeff 0.01", {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01}),
        # the type alone keeps Megatron-LM's coefficient 0.0 (no loss), not the model's mapping's (mbridge: the HF config's)
        ("--moe-router-load-balancing-type seq_aux_loss", {"moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.0}),
        ("--moe-router-dtype fp64", {"moe_router_dtype": "fp64"}),
        ("", None),  # nothing set: the model's own mapping
    ],
    ids=["coeff-alone", "type-alone", "dtype", "none"],
)
def test_a_flag_not_given_keeps_megatron_lms_default_or_the_models_mapping(tmp_path, extra, router):
    assert _options(tmp_path, extra).megatron_router == router


def test_the_command_lines_router_replaces_the_configs(tmp_path):
    options = _options(tmp_path, ROUTER, megatron_router="moe_router_dtype=fp64")
    assert options.megatron_router == {"moe_router_dtype": "fp64"}


def test_profiling_slime_as_fsdp2_drops_the_megatron_router(tmp_path):
    assert _options(tmp_path, ROUTER, strategy="fsdp2").megatron_router is None


def test_two_profiles_differing_only_in_router_flags_are_kept_apart(tmp_path, monkeypatch):
    from batchfit.budget import model_profile, profile_cache

    monkeypatch.delenv(profile_cache.CACHE_ENV, raising=False)
    keys = []
    with profile_cache.caching(tmp_path / "profiles"):
        for extra in ("", "--moe-aux-loss-coeff 1e-3", "--moe-aux-loss-coeff 1e-2", "--moe-router-dtype fp32", "--moe-z-loss-coeff 1e-3"):
            _, key = model_profile._cache_key("tiny", _options(tmp_path, extra), roles=("policy",))
            keys.append(key)
        _, again = model_profile._cache_key("tiny", _options(tmp_path, "--moe-aux-loss-coeff 1e-3"), roles=("policy",))
    assert None not in keys and len(set(keys)) == len(keys)
    assert again == keys[1]  # the same flags, the same entry


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("--moe-router-load-balancing-type sinkhorn", r"^--moe-router-load-balancing-type='sinkhorn' is not modelled: Sinkhorn"),
        ("--moe-router-load-balancing-type quantile_balancing", r"^--moe-router-load-balancing-type='quantile_balancing' is Megatron-LM's, not megatron-core 0\.16\.1's"),
        ("--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-3 1e-3", r"combines several load balancing types"),
        ("--moe-aux-loss-coeff -0.1", r"^--moe-aux-loss-coeff must be in \[0, inf\], but got --moe-aux-loss-coeff=-0\.1"),
        # what Megatron-LM's own parser refuses, slime refuses: said as its parser says it
        ("--moe-router-dtype bf16", r"argument --moe-router-dtype: invalid choice: 'bf16' \(choose from 'fp32', 'fp64'\)"),
        ("--moe-z-loss-coeff high", r"argument --moe-z-loss-coeff: invalid float value: 'high'"),
    ],
    ids=["sinkhorn", "quantile", "several-types", "negative-coeff", "bf16-dtype", "not-a-number"],
)
def test_a_router_setting_not_modelled_is_refused_in_one_line(tmp_path, extra, match):
    with pytest.raises(InvalidArgument, match=match) as caught:
        _options(tmp_path, extra)
    assert "\n" not in str(caught.value).split("\n  - ", 1)[-1]  # one line (a slime parser fault: one listed)


def test_the_batch_plan_of_a_command_the_profile_refuses_still_holds(tmp_path):
    # sinkhorn is slime's to run: only the profile refuses it
    assert read_run_config(_script(tmp_path, extra="--moe-router-load-balancing-type sinkhorn")).plan().dp_size == 4


@pytest.mark.parametrize(
    ("router", "match"),
    [
        ({"moe_router_dtype": "bf16"}, r"^megatron_router moe_router_dtype must be one of 'fp32', 'fp64', but got megatron_router moe_router_dtype='bf16'"),
        ({"moe_aux_los_coeff": 0.1}, r"^megatron_router has no field 'moe_aux_los_coeff' \(did you mean 'moe_aux_loss_coeff'\?\)"),
        ("moe_aux_loss_coeff", r"^megatron_router takes field=value pairs, but got megatron_router='moe_aux_loss_coeff'"),
        ("moe_z_loss_coeff=big", r"^megatron_router moe_z_loss_coeff must be a number, but got megatron_router moe_z_loss_coeff='big'"),
        ([("moe_router_dtype", "fp32")], r"^megatron_router must map Megatron TransformerConfig router fields to values"),
    ],
    ids=["dtype", "misspelt", "no-value", "not-a-number", "not-a-mapping"],
)
def test_a_bad_megatron_router_is_named_with_its_value_and_fix(router, match):
    with pytest.raises(InvalidArgument, match=match):
        ProfileOptions(max_seq_len=64, sharding="megatron", megatron_router=router)


def test_the_router_needs_a_megatron_profile_and_normalises_its_fields():
    with pytest.raises(InvalidArgument, match=r"^megatron_router='moe_router_dtype=fp32' sets Megatron's router, read only by a Megatron profile, but got sharding='fsdp2'"):
        ProfileOptions(max_seq_len=64, sharding="fsdp2", megatron_router={"moe_router_dtype": "fp32"})
    options = ProfileOptions(max_seq_len=64, sharding="megatron", megatron_router="moe_router_dtype=fp32, moe_aux_loss_coeff=1e-3")
    assert list(options.megatron_router.items()) == [("moe_aux_loss_coeff", 0.001), ("moe_router_dtype", "fp32")]  # the fields' order
    assert ProfileOptions(max_seq_len=64, sharding="megatron", megatron_router={}).megatron_router is None
    assert options.replace(megatron_router=None).megatron_router is None


def test_the_command_line_takes_the_router_and_says_a_bad_one_in_one_line(capsys):
    from batchfit.cli import main

    code = main(["profile", "--model", "tiny", "--sharding", "fsdp2", "--backend", "estimate", "--megatron-router", "moe_router_dtype=fp32"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert "--megatron-router moe_router_dtype=fp32 sets Megatron's router" in err and "--sharding fsdp2" in err


# tests/test_megatron_moe.py's small Qwen3-MoE (8 experts of 32, 2 per token, 2 layers), as slime's --hf-checkpoint
def _moe_script(tmp_path, extra: str):
    """slime's script with ``extra`` flags over tests/test_megatron_moe.py's small Qwen3-MoE as its --hf-checkpoint;
    the model's directory and the script."""
    from test_megatron_moe import CONFIG

    model = tmp_path / "tiny-qwen3-moe"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
    script = _script(tmp_path, extra=extra)
    script.write_text(script.read_text().replace("--hf-checkpoint /root/Qwen3-4B", f"--hf-checkpoint {model}"))
    return model, script


@pytest.mark.slow  # megatron-core's import and two estimates of the profile's own step
def test_the_auxiliary_loss_flag_raises_the_profiles_peak(tmp_path, megatron):
    import warnings

    from batchfit.budget.megatron_profile import budget_step, quiet_megatron
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.memory import get_backend
    from batchfit.models import load_config, parse_dtype

    warnings.filterwarnings("ignore")
    measured = {}
    for extra in ("", "--moe-aux-loss-coeff 1e-3"):
        model, script = _moe_script(tmp_path, f"--expert-model-parallel-size 2 {extra}")  # TP 2 + SP, EP 2, dp 4 of 8 GPUs
        options = run_profile_options(read_run_config(script), {"backend": "estimate", "max_seq_len": 64}).options
        backend = get_backend("estimate", memory_limit="1GiB", reserve_bytes=0, round_to=1)
        with quiet_megatron():
            step = budget_step(load_config(str(model)), options.sharding, backend, parse_dtype("bf16"), options)
            measured[extra] = step.measure([64])
    without, with_loss = measured[""], measured["--moe-aux-loss-coeff 1e-3"]
    # the auxiliary loss keeps its fp32 scores for backward (tests/test_megatron_moe.py: +4,240 B at EP 2 without TP)
    assert with_loss.peak_bytes > without.peak_bytes
    assert with_loss.breakdown["activations"] > without.breakdown["activations"]


def test_the_megatron_report_names_the_router_settings_profiled():
    from batchfit.budget.megatron_layout import MegatronLayout

    layout = MegatronLayout(stage_peaks={0: 1}, binding_stage=0, micro_batches=1, attention="sdpa", recompute="full")
    assert "router" not in layout.describe() and "router" not in layout.to_dict()  # the model's own mapping
    layout = MegatronLayout(
        stage_peaks={0: 1}, binding_stage=0, micro_batches=1, attention="sdpa", recompute="full",
        router={"moe_aux_loss_coeff": 0.001, "moe_router_dtype": "fp32"},
    )  # fmt: skip
    assert layout.describe() == (
        "Megatron-core GPTModel, sdpa attention, recompute full, router moe_aux_loss_coeff=0.001 moe_router_dtype=fp32"
    )
    assert layout.to_dict()["router"] == {"moe_aux_loss_coeff": 0.001, "moe_router_dtype": "fp32"}


@pytest.mark.slow  # a budget search of the Megatron step (about 30 s on 2 cores)
def test_a_slime_profiles_json_states_the_router_it_profiled(tmp_path, megatron):
    import warnings

    from batchfit.budget import profile_model
    from batchfit.frameworks.config_options import run_profile_options

    warnings.filterwarnings("ignore")
    model, script = _moe_script(tmp_path, "--expert-model-parallel-size 2 --moe-aux-loss-coeff 1e-3")
    chosen = {"backend": "estimate", "max_seq_len": 64, "memory_limit": "16MiB", "reserve_bytes": 0}
    options = run_profile_options(read_run_config(script), chosen).options
    profile = profile_model(str(model), options=options, roles=("policy",))
    assert profile.to_dict()["megatron"]["router"] == {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.001}
    assert profile.megatron.describe().endswith("router moe_router_load_balancing_type=aux_loss moe_aux_loss_coeff=0.001")


def _example(framework: str) -> tuple[dict, dict]:
    import copy
    from pathlib import Path

    import yaml

    data = copy.deepcopy(yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / f"{framework}_megatron.yaml").read_text()))
    node = data["actor_rollout_ref"]["actor"]["megatron"] if framework == "verl" else data["trainer"]["policy"]["megatron_config"]
    return data, node


def _config_router(data: dict) -> dict | None:
    from batchfit.budget.choices import Choices
    from batchfit.frameworks.config_options import run_profile_options

    return run_profile_options(read_run_config(data), Choices()).options.megatron_router


def test_skyrls_router_keys_reach_the_options_with_skyrls_defaults():
    data, node = _example("skyrl")
    # SkyRL's MegatronConfig defaults, which its worker sets on the provider: no load balancing, fp32 router logits
    assert _config_router(data) == {"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "moe_router_dtype": "fp32"}
    node.update(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.001)
    node.setdefault("transformer_config_kwargs", {}).update(moe_z_loss_coeff="1e-3", moe_router_dtype="fp64")  # applied last
    assert _config_router(data) == {
        "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.001, "moe_router_dtype": "fp64",
        "moe_z_loss_coeff": 0.001,
    }  # fmt: skip


def test_verls_override_transformer_config_router_keys_reach_the_options():
    data, node = _example("verl")
    assert _config_router(data) is None  # none set: mbridge's mapping
    node.setdefault("override_transformer_config", {}).update(moe_aux_loss_coeff="1e-3", moe_router_load_balancing_type="aux_loss")
    assert _config_router(data) == {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.001}


@pytest.mark.parametrize(
    ("framework", "key", "value", "match"),
    [
        ("skyrl", "moe_router_load_balancing_type", "sinkhorn",
         r"^the config's trainer\.policy\.megatron_config\.moe_router_load_balancing_type='sinkhorn' is not modelled"),
        ("verl", "moe_router_dtype", "bf16",
         r"^the config's actor_rollout_ref\.actor\.megatron\.override_transformer_config\.moe_router_dtype must be one of "
         r"'fp32', 'fp64', but got .*='bf16'$"),
    ],
    ids=["skyrl-sinkhorn", "verl-bf16"],
)
def test_a_configs_router_not_modelled_is_refused_naming_its_key(framework, key, value, match):
    data, node = _example(framework)
    (node if framework == "skyrl" else node.setdefault("override_transformer_config", {}))[key] = value
    with pytest.raises(InvalidArgument, match=match):
        _config_router(data)
