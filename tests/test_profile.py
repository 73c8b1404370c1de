"""batchfit.budget.model_profile: per-rank budgets of sharded roles, and the world size that makes a sequence fit.

The model is the tiny Llama widened to a 16k vocabulary (4.6M parameters), so that its
training state (sharded by FSDP2) matters next to the activations of short sequences.
"""

from __future__ import annotations

import json

import pytest

from batchfit.budget import ProfileOptions
from batchfit.budget.model_profile import profile_model
from batchfit.errors import DoesNotFitError, InvalidArgument
from batchfit.models import preset_info
from batchfit.parallel.sharding import Sharding

MiB = 1024**2
GiB = 1024**3


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    config = dict(preset_info("tiny")["config"])
    config.update(vocab_size=16384, hidden_size=128, intermediate_size=352, head_dim=32)
    folder = tmp_path_factory.mktemp("wide")
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _profile(model, world, strategy="fsdp2", memory=GiB + 300 * MiB, **kwargs):
    kwargs.setdefault("reserve_bytes", GiB)  # fixed: these budgets are about sharding, not the untracked terms
    kwargs.setdefault("safety_margin", 0.9)
    return profile_model(
        model,
        max_seq_len=kwargs.pop("max_seq_len", 256),
        backend="estimate",
        memory_limit=memory,
        sharding=Sharding(strategy, world_size=world, **kwargs.pop("sharding", {})),
        **kwargs,
    )


@pytest.fixture(scope="module")
def four_ranks(wide):
    """Policy and reference on 4 ranks: one profile the tests below read (the policy binds)."""
    return _profile(wide, 4, roles="policy,reference")


# the first tier's time (issue 41): one rank's 1/N share stays in the first tier (tests/test_shard.py's
# test_sharded_state_is_one_nth_and_ddp_adds_buckets_to_a_replica, and four_ranks below)
@pytest.mark.slow
def test_the_budget_grows_with_the_number_of_ranks(wide):
    two, eight = _profile(wide, 2), _profile(wide, 8)
    assert eight.combined.tokens > two.combined.tokens
    # the sharded state per rank: 4,563,584 fp32 parameters / 2 = 9,127,168 B and / 8 = 2,281,792 B,
    # plus shard padding and the estimate's 512 B allocator rounding per tensor (< 1%)
    assert two.combined.breakdown["parameters"] == pytest.approx(9_127_168, rel=0.01)
    assert eight.combined.breakdown["parameters"] == pytest.approx(2_281_792, rel=0.01)


def test_profile_reports_sharding_depth_and_the_per_rank_breakdown(four_ranks):
    data = json.loads(json.dumps(four_ranks.to_dict()))
    assert data["sharding"] == {
        "strategy": "fsdp2",
        "world_size": 4,
        "reshard_after_forward": True,
        "mixed_precision": "bf16",
        "offload": "none",
    }
    assert (data["dtype"], data["compute_dtype"]) == ("float32", "bfloat16")
    assert data["depth"] == 2 and data["measured_depths"] is None  # too shallow to extrapolate
    policy = data["budgets"]["policy"]
    assert {"parameters", "optimizer_state", "activations", "logprob_head"} <= set(policy["breakdown"])
    policy_point = policy["points"][0]
    assert sum(policy_point["breakdown"].values()) == policy_point["peak_bytes"]
    # the reference runs forward only: no optimizer state, no gradients
    assert data["budgets"]["reference"]["pass"] == "reference log-probs"
    assert "optimizer_state" not in data["budgets"]["reference"]["breakdown"]


def test_cpu_offload_moves_the_state_to_the_host(wide, four_ranks):
    on_device = four_ranks.budgets["policy"]
    assert four_ranks.combined.binding_role == "policy"  # so on_device's budget is the combined one
    offloaded = _profile(wide, 4, sharding={"offload": "cpu"})
    point = offloaded.combined.binding_point
    assert "optimizer_state" not in point.breakdown and "parameters" not in point.breakdown
    assert point.host_bytes >= on_device.breakdown["optimizer_state"]
    assert offloaded.combined.tokens >= on_device.tokens


@pytest.mark.slow
def test_a_sequence_too_long_for_one_device_names_the_world_size_that_fits(wide):
    # 33 MiB usable: one 32-token sequence needs ~36 MB unsharded (bf16 state + AdamW)
    memory = GiB + 33 * MiB
    fits = r"it fits with sharding=Sharding\('fsdp2', world_size=16\), gradient_checkpointing=True"
    with pytest.raises(DoesNotFitError, match=fits) as info:
        _profile(wide, 1, strategy="none", memory=memory, max_seq_len=32)
    assert info.value.world_size_hint == 16
    assert _profile(wide, 16, memory=memory, max_seq_len=32, gradient_checkpointing=True).combined.tokens >= 32
    with pytest.raises(DoesNotFitError):  # the node below does not
        _profile(wide, 8, memory=memory, max_seq_len=32, gradient_checkpointing=True)


def test_a_sequence_that_does_not_fit_gives_its_breakdown_and_names_keyword_arguments():
    # tiny at 2048 on one device: 38.04 MiB for one sequence (the fp32 log-prob head 24.02 MiB of it), run to
    # the end under 64 MiB; the limit is 0.3 × 64 MiB = 20,132,659 bytes (int(20,132,659.2)), no reserve
    with pytest.raises(DoesNotFitError) as info:
        profile_model(
            "tiny", max_seq_len=2048, backend="estimate", memory_limit="64MiB", reserve_bytes=0, safety_margin=0.3,
            progress=False, suggest_world_size=False,
        )  # fmt: skip
    error, text = info.value, str(info.value)
    assert text.startswith(
        "policy: one sequence of max_seq_len=2048 does not fit: its training step needs 38.04 MiB (logprob head "
        "24.02 MiB, activations 12.29 MiB, optimizer state 887.50 KiB, parameters 438.50 KiB, gradients 438.50 KiB, "
        "buffers 1.00 KiB) but the limit is 19.20 MiB = safety_margin=0.3 × 64.00 MiB usable (memory 64.00 MiB − "
        "reserve 0 B); to make it fit: reduce max_seq_len; "
    )
    for keyword in ("(gradient_checkpointing=True)", "(logprobs='fused')", "(response_only=True)",
                    "(sharding=Sharding('fsdp2', world_size=N))", "(memory_limit, safety_margin)"):  # fmt: skip
        assert keyword in text
    assert "--" not in text  # no command-line flags from the library (NOTE [ Messages in the caller's vocabulary ])
    assert (error.available, error.usable_bytes, error.reserve_bytes) == (20_132_659, 64 * MiB, 0)
    assert sum(error.breakdown.values()) == error.needed == 39_885_312  # 38.04 MiB, whole: nothing stopped it
    assert error.to_dict()["remedies"][2] == {
        "text": "compute log-probs fused from the hidden states (logprobs='fused')",
        "change": ["logprobs='fused'"],
    }


def test_a_sequence_above_the_whole_device_still_gets_its_whole_breakdown_from_the_estimate():
    # the same 38.04 MiB step under a 16 MiB device: the estimate holds no memory, so the one-sequence
    # check runs past the device to the end (a cpu run stops there and says "at least")
    with pytest.raises(DoesNotFitError) as info:
        profile_model(
            "tiny", max_seq_len=2048, backend="estimate", memory_limit="16MiB", reserve_bytes=0, progress=False,
            suggest_world_size=False,
        )  # fmt: skip
    assert "needs 38.04 MiB (logprob head 24.02 MiB" in str(info.value) and "at least" not in str(info.value)
    assert sum(info.value.breakdown.values()) == info.value.needed == 39_885_312


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_activations_that_never_fit_say_no_world_size_helps(wide):
    # 4,096 tokens of a 16k vocabulary: fp32 logits and log-softmax alone exceed 60 MiB
    with pytest.raises(DoesNotFitError, match=r"no fsdp2 world size up to 4096 fits it either") as info:
        _profile(wide, 2, memory=GiB + 60 * MiB, max_seq_len=4096)
    assert info.value.world_size_hint is None


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_a_cpu_profile_confirms_the_estimate_with_two_real_steps_per_length(one_thread, monkeypatch):
    # the estimate predicts the cpu run to the byte: the longest length costs the predicted size
    # (measured to fit) and the size above (measured not to), the answer of an unguided search;
    # a shorter one, one probe or none (NOTE [ A length that does not bind ])
    from batchfit.budget import find_token_budget
    from batchfit.budget.causal_lm_probe import causal_lm_step
    from batchfit.memory import get_backend
    from batchfit.models import build_causal_lm

    # NOTE [ Estimates guide real cpu searches ]: the tiny model's real probes are cheap; guide them all the same
    monkeypatch.setattr("batchfit.budget.model_profile.ESTIMATE_HINTS_FROM_PARAMETERS", 0)
    guided = profile_model("tiny", max_seq_len=128, backend="cpu", memory_limit="48MiB", dtype="fp32")
    budget = guided.budgets["policy"]
    assert budget.points[0].probes == 2 and all(p.probes <= 1 for p in budget.points[1:])
    be = get_backend("cpu", memory_limit="48MiB")
    blind = find_token_budget(
        causal_lm_step(build_causal_lm("tiny", backend=be), backend=be), max_seq_len=128, progress=False
    )
    assert {p.seq_len: (p.max_batch_size, p.largest) for p in budget.points} == {
        p.seq_len: (p.max_batch_size, p.largest) for p in blind.points
    }
    assert budget.probes < blind.probes


def test_one_device_over_eight_ranks_reserves_no_nccl_buffers():
    # sharding "none" runs no collective: no NCCL communicator, whatever world_size says (the CLI's default
    # --world-size is 8). 400 MB holds the context (287,047,680) and workspaces (67,108,864) = 354,156,544 bytes
    # of reserve; NCCL's 2 × 2 × 16 × 4 MiB = 268,435,456 more would leave nothing (main refused it)
    one = profile_model("tiny", max_seq_len=32, backend="estimate", memory_limit="400MB", sharding=Sharding("none", world_size=8))
    assert one.untracked.nccl_bytes == 0 and one.untracked.reserve_bytes == 354_156_544
    assert one.combined.usable_bytes == 400_000_000 - 354_156_544  # 45,843,456


def test_the_cpu_backend_refuses_a_model_this_host_cannot_hold():
    with pytest.raises(InvalidArgument, match=r"backend='cpu' runs 'qwen2.5-72b' for real.*use backend='estimate'"):
        profile_model("qwen2.5-72b", max_seq_len=128, backend="cpu", memory_limit="80GiB")


# --------------------------------------------------------------------------- what a model can be; the options


def test_a_model_a_config_and_a_preset_give_the_same_budget():

    from batchfit.models import build_causal_lm, load_config

    options = ProfileOptions(max_seq_len=64, seq_lens=[64], backend="cpu", memory_limit=12 * MiB, dtype="fp32")
    by_name = profile_model("tiny", options)
    by_config = profile_model(load_config("tiny"), options)
    module = build_causal_lm("tiny")
    by_module = profile_model(module, options)
    assert by_name.combined.tokens == by_config.combined.tokens == by_module.combined.tokens > 0
    assert by_name.model == "tiny" and by_module.model == by_config.model == "llama"  # named, never a repr


def test_a_module_without_a_transformers_config_is_one_line_naming_its_type():
    import torch

    with pytest.raises(InvalidArgument) as info:
        profile_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), max_seq_len=64, backend="estimate", memory_limit=GiB)
    message = str(info.value)
    assert "but got a Sequential without one" in message and "\n" not in message and "Linear(" not in message


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        pytest.param({}, r"max_seq_len is required", id="no-max-seq-len"),
        pytest.param({"max_seq_len": 64, "seq_len": 8}, r"unknown setting 'seq_len'; the settings are max_seq_len, ", id="typo"),
        pytest.param({"max_seq_len": 64, "cost": "pack"}, r"cost must be one of 'padded', 'packed'", id="cost"),
        pytest.param({"max_seq_len": 64, "logprobs": "fast"}, r"logprobs must be one of 'full', 'chunked', 'fused'", id="head"),
        pytest.param(
            {"max_seq_len": 64, "gradient_checkpointing": "yes"},
            r"gradient_checkpointing must be True or False, but got gradient_checkpointing='yes'",
            id="checkpointing",
        ),
        pytest.param({"max_seq_len": 64, "safety_margin": 2}, r"safety_margin must be in \(0, 1\]", id="margin"),
    ],
)
def test_bad_settings_are_named(settings, match):
    with pytest.raises(InvalidArgument, match=match):
        profile_model("tiny", backend="estimate", memory_limit=GiB, **settings)


def test_options_are_one_object_and_keywords_override_its_fields():
    options = ProfileOptions(max_seq_len=64, seq_lens=[64], backend="cpu", memory_limit=12 * MiB, dtype="fp32")
    assert options.replace(cost="packed").cost == "packed" and options.cost == "padded"
    with pytest.raises(InvalidArgument, match=r"ProfileOptions has no field 'costs'; its fields are max_seq_len"):
        options.replace(costs="packed")
    with pytest.raises(InvalidArgument, match=r"options must be a ProfileOptions, but got a dict"):
        profile_model("tiny", {"max_seq_len": 128})
    packed = profile_model("tiny", options, cost="packed")
    assert packed.budgets["policy"].cost == "packed"
