"""The ``megatron`` strategy end to end: flags → Sharding → Megatron-core's GPTModel probed → a ModelProfile."""

from __future__ import annotations

import pytest

from batchfit.budget.choices import Choices
from batchfit.errors import InvalidArgument
from batchfit.parallel.sharding import Sharding

pytest.importorskip("megatron.core")


def test_the_command_lines_megatron_flags_reach_the_sharding():
    options = Choices(
        strategy="megatron", world_size=8, tensor_parallel=2, pipeline_parallel=2, megatron_sequence_parallel=True,
        distributed_optimizer=True, max_seq_len=1024,
    ).options()
    s = options.sharding
    assert (s.tensor_parallel, s.pipeline_parallel, s.data_parallel_size) == (2, 2, 2)
    assert s.megatron_sequence_parallel and s.distributed_optimizer


def test_a_megatron_critic_lora_or_model_object_is_refused_before_any_build():
    from batchfit.budget.model_profile import profile_model

    common = dict(max_seq_len=128, backend="estimate", memory_limit="1GiB", sharding="megatron")
    with pytest.raises(InvalidArgument, match="a critic trained with Megatron is not modelled"):
        profile_model("tiny", roles="policy,critic", **common)
    with pytest.raises(InvalidArgument, match="lora_rank is not modelled under Megatron"):
        profile_model("tiny", lora={"rank": 8}, **common)
    import torch

    with pytest.raises(InvalidArgument, match="not a model object"):
        profile_model(torch.nn.Linear(2, 2), **common)


@pytest.mark.slow
def test_a_megatron_profile_names_its_binding_stage_and_gives_forward_passes_budgets_above_trainings():
    from batchfit.budget.model_profile import profile_model

    p = profile_model(
        "tiny", roles="policy,reference", forward_too=True, max_seq_len=256, backend="estimate", memory_limit="1GiB",
        reserve_bytes=0, sharding=Sharding("megatron", world_size=4, tensor_parallel=2, pipeline_parallel=2),
    )
    assert set(p.budgets) == {"policy", "policy_forward", "reference"}
    # NOTE [ A Megatron profile's roles ]: each pass its own budget; under no_grad a forward pass keeps no
    # activations, and a reference no gradient buffer or optimizer state (tiny: 136,704 training tokens,
    # 276,992 for old log-probs, 277,248 for the reference's, 2026-12-02 07:35 UTC)
    tokens = {role: b.tokens for role, b in p.budgets.items()}
    assert tokens["policy"] < tokens["policy_forward"] <= tokens["reference"]
    assert p.combined.tokens == tokens["policy"] and all(b.role == role for role, b in p.budgets.items())
    assert all(t % 256 == 0 for t in tokens.values())
    assert p.megatron.binding_stage in (0, 1) and set(p.megatron.stage_peaks) == {0, 1}
    assert p.megatron.stage_peaks[p.megatron.binding_stage] == max(p.megatron.stage_peaks.values())
    # the stages' peaks are the budget point's (the largest micro-batch that fits), not the last probe's
    point = min(p.budgets["policy"].points, key=lambda q: q.tokens)
    assert p.megatron.stage_peaks[p.megatron.binding_stage] == point.peak_bytes
    doc = p.to_dict()
    assert doc["sharding"]["data_parallel"] == 1 and doc["megatron"]["attention"] == "sdpa"


@pytest.mark.slow
def test_doubling_tensor_parallelism_raises_the_budget():
    from batchfit.budget.model_profile import profile_model

    def tokens(tp: int) -> int:
        return profile_model(
            "tiny", max_seq_len=256, backend="estimate", memory_limit="512MiB", reserve_bytes=0,
            sharding=Sharding("megatron", world_size=tp, tensor_parallel=tp),
        ).combined.tokens

    assert tokens(2) > tokens(1)


@pytest.mark.slow
def test_two_shallow_copies_extrapolated_stage_by_stage_give_the_full_depths_budget():
    from batchfit.budget.model_profile import profile_model
    from batchfit.models import load_config

    config = load_config("tiny")
    config.num_hidden_layers = 8

    def profile(extrapolate: bool):
        return profile_model(
            config, max_seq_len=256, backend="estimate", memory_limit="1GiB", reserve_bytes=0, depth_extrapolation=extrapolate,
            sharding=Sharding("megatron", world_size=2, pipeline_parallel=2),
        )

    shallow, full = profile(True), profile(False)
    assert shallow.measured_depths == (4, 6) and full.measured_depths is None
    assert shallow.combined.tokens == full.combined.tokens
    # NOTE [ Megatron stages are affine in their depth ]: each stage within the allocator's rounding, above
    for stage, peak in full.megatron.stage_peaks.items():
        assert 0 <= shallow.megatron.stage_peaks[stage] - peak <= 8 * 512


@pytest.mark.slow
def test_forward_passes_extrapolated_stage_by_stage_give_the_full_depths_budgets():
    from batchfit.budget.model_profile import profile_model
    from batchfit.models import load_config

    config = load_config("tiny")
    config.num_hidden_layers = 8

    def profile(extrapolate: bool):
        return profile_model(
            config, roles="policy_forward,reference", max_seq_len=256, backend="estimate", memory_limit="1GiB",
            reserve_bytes=0, depth_extrapolation=extrapolate, sharding=Sharding("megatron", world_size=2, pipeline_parallel=2),
        )

    shallow, full = profile(True), profile(False)
    assert shallow.measured_depths == (4, 6)
    # tiny, 8 layers, PP 2: 142,592 tokens for old log-probs, 143,360 for the reference's, the stages' peaks
    # equal to the byte (a forward pass under no_grad holds its resident state and one layer's transients)
    assert {r: b.tokens for r, b in shallow.budgets.items()} == {r: b.tokens for r, b in full.budgets.items()}
    assert shallow.megatron.stage_peaks == full.megatron.stage_peaks


@pytest.mark.slow
def test_a_slime_script_with_tensor_2_and_pipeline_2_on_8_gpus_profiles_and_emits_its_token_flag(capsys):
    from pathlib import Path

    from batchfit.cli import main
    from script_helpers import flag_words

    script = Path(__file__).parents[1] / "examples" / "slime_megatron.sh"
    code = main(["profile", "--config", str(script), "--model", "tiny", "--max-seq-len", "512", "--emit", "slime",
                 "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "warn" not in err.lower()  # Megatron's own warnings are not the user's
    words = flag_words(out)
    tokens = int(words[words.index("--max-tokens-per-gpu") + 1])
    assert tokens > 0 and tokens % 512 == 0  # whole longest sequences (NOTE [ Megatron budgets bound packed micro-batches ])
    layout = words[words.index("--tensor-model-parallel-size"):]
    assert layout[:4] == ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert "--sequence-parallel" in words
    assert "megatron over 8 ranks (tensor 2 × pipeline 2 × data 2, sequence parallel, distributed optimizer)" in out


def test_a_megatron_confirm_is_refused_with_what_to_run_instead():
    from batchfit.budget.confirm import plan_confirm

    with pytest.raises(InvalidArgument, match="profile with backend='cpu' under torchrun instead of confirming"):
        plan_confirm("tiny", max_seq_len=64, backend="cpu", memory_limit="1GiB", sharding=Sharding("megatron"))


@pytest.mark.slow
def test_a_colocated_megatron_models_resident_state_counts_megatrons_optimizer_sharded_over_data_parallel():
    from batchfit.budget.megatron_profile import resident_state_bytes
    from batchfit.budget.options import ProfileOptions

    def state(role: str, world: int, kinds=("parameters", "gradients", "optimizer_state")) -> int:
        options = ProfileOptions(max_seq_len=128, backend="estimate", memory_limit="80GB", sharding=Sharding(
            "megatron", world_size=world, tensor_parallel=2, distributed_optimizer=True))
        return resident_state_bytes("tiny", role, options, kinds=kinds)

    params = state("reference", 2, ("parameters",))
    # bf16 parameters (2 B) + fp32 main_grad (4 B) + fp32 main parameters and two moments (12 B), the last sharded
    assert state("policy", 2) > 8 * params
    assert state("policy", 2) - state("policy", 4) > 2 * params  # half of the 12 B per parameter at DP 2


@pytest.mark.slow
def test_old_log_probs_under_optimizer_offload_keep_ddps_buffers_without_the_optimizer_state():
    from batchfit.budget.megatron_profile import role_pass
    from batchfit.budget.model_profile import profile_model
    from batchfit.budget.options import ProfileOptions

    # NOTE [ A Megatron profile's roles ]: what each role's MegatronStep keeps resident
    plain, offload = ProfileOptions(max_seq_len=64), ProfileOptions(max_seq_len=64, optimizer_offload=True)
    assert role_pass("policy", plain) == {} == role_pass("policy", offload)
    assert role_pass("policy_forward", plain) == {"forward_only": True, "optimizer": "resident"}
    assert role_pass("policy_forward", offload) == {"forward_only": True, "optimizer": "offloaded"}
    assert role_pass("reference", offload) == {"forward_only": True, "optimizer": "none"}

    def forward(offloaded: bool) -> int:
        return profile_model(
            "tiny", roles="policy_forward", max_seq_len=128, backend="estimate", memory_limit="64MiB", reserve_bytes=0,
            optimizer_offload=offloaded, sharding=Sharding("megatron", world_size=2, tensor_parallel=2),
        ).budgets["policy_forward"].tokens

    assert forward(True) > forward(False)


def test_virtual_pipeline_stages_reach_the_sharding_and_need_a_pipeline():
    options = Choices(strategy="megatron", world_size=4, pipeline_parallel=2, virtual_pipeline_parallel=2, max_seq_len=64).options()
    assert options.sharding.virtual_pipeline_parallel == 2
    assert options.sharding.to_dict()["virtual_pipeline_parallel"] == 2
    assert "2 virtual stages per pipeline stage" in options.sharding.describe()
    assert Sharding("megatron", pipeline_parallel=1, virtual_pipeline_parallel=1).virtual_pipeline_parallel is None
    assert "virtual_pipeline_parallel" not in Sharding("megatron").to_dict()
    with pytest.raises(InvalidArgument, match="virtual_pipeline_parallel=2 needs pipeline_parallel > 1"):
        Sharding("megatron", virtual_pipeline_parallel=2)
    with pytest.raises(InvalidArgument, match="virtual_pipeline_parallel=2 is Megatron's and needs strategy='megatron'"):
        Sharding("fsdp2", virtual_pipeline_parallel=2)
    with pytest.raises(InvalidArgument, match="virtual_pipeline_parallel must be"):
        Sharding("megatron", pipeline_parallel=2, virtual_pipeline_parallel=0)
    from batchfit.budget.model_profile import profile_model

    # qwen2.5-0.5b's 24 layers over 2 stages: 5 chunks each would be 10, which does not divide 24 (no build)
    with pytest.raises(InvalidArgument, match=r"virtual_pipeline_parallel=5 × pipeline_parallel=2 = 10 model chunks must "
                       r"divide the model's 24 layers .*; use one of 2, 3, 4, 6, 12"):
        profile_model("qwen2.5-0.5b", max_seq_len=64, backend="estimate", memory_limit="80GB",
                      sharding=Sharding("megatron", world_size=2, pipeline_parallel=2, virtual_pipeline_parallel=5))


@pytest.mark.slow
def test_virtual_stages_extrapolated_per_model_chunk_give_the_full_depths_budget():
    from batchfit.budget.model_profile import profile_model
    from batchfit.models import load_config

    config = load_config("tiny")
    config.num_hidden_layers = 16  # PP 2 × VPP 2: 4 layers per model chunk, deeper than the copies' 2 and 3

    def profile(extrapolate: bool):
        return profile_model(
            config, max_seq_len=256, backend="estimate", memory_limit="1GiB", reserve_bytes=0, depth_extrapolation=extrapolate,
            sharding=Sharding("megatron", world_size=2, pipeline_parallel=2, virtual_pipeline_parallel=2),
        )

    shallow, full = profile(True), profile(False)
    # NOTE [ Megatron stages are affine in their depth ]: copies of 2 and 3 layers per chunk (8 and 12 layers);
    # tiny at 16 layers: 14,848 tokens, each stage's peak equal to the byte (07:55 UTC)
    assert shallow.measured_depths == (8, 12) and full.measured_depths is None
    assert shallow.combined.tokens == full.combined.tokens
    assert shallow.megatron.stage_peaks == full.megatron.stage_peaks
