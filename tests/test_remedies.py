"""budget/remedies.py and the "does not fit" refusal of budget/model_profile.py: the term too large, and remedies that fit.

NOTE [ Remedies are measured ]: a refusal names the term of the peak that exceeds the limit, offers each remedy that
changes the run only once it was measured to fit, keeps the step's own remedies only where the terms they remove
could bring the peak under the limit, and computes the memory that would fit it.
"""

from __future__ import annotations

import json
import shlex
import types

import pytest

from batchfit.budget import model_profile
from batchfit.budget.remedies import memory_needed, pertinent, term_bytes, term_words
from batchfit.errors import DoesNotFitError, Phrase, Setting
from batchfit.memory.sizes import format_bytes
from batchfit.parallel.sharding import Sharding

GiB = 1024**3

# Mixtral-8x7B at 8,192 tokens, fsdp2 over 16 ranks, checkpointing (estimate backend, one rank's bytes): the
# categories its refusal printed, rounded to the MiB (113.94 GiB against a 67.21 GiB limit)
MIXTRAL = {
    "optimizer_state": 43776 * 2**20,  # 42.75 GiB
    "parameters": 21883 * 2**20,  # 21.37 GiB
    "gradients": 21883 * 2**20,
    "gathered_parameters": 11407 * 2**20,  # 11.14 GiB
    "communication": 10916 * 2**20,  # 10.66 GiB
    "activations": 6564 * 2**20,  # 6.41 GiB
    "logprob_head": 250 * 2**20,
}
NEEDED = sum(MIXTRAL.values())
LIMIT = int(0.85 * 79.07 * GiB)


def _step_remedies() -> list[Phrase]:
    """The step's own remedies as causal_lm_step gives them under fsdp2 over 16 ranks with checkpointing."""
    return [
        Phrase("reduce ", Setting("max_seq_len")),
        Phrase("offload each layer's saved activations to the host (", Setting("activation_offload", True), ")"),
        Phrase("compute log-probs fused from the hidden states (", Setting("logprobs", "fused"), ")"),
        Phrase("run the head only on the loss tokens (", Setting("response_only", True), ")"),
        Phrase("offload the sharded state (", Setting("sharding", {"strategy": "fsdp2", "offload": "cpu"}), ")"),
        Phrase("give more memory (", Setting("memory_limit"), ", ", Setting("safety_margin"), ")"),
    ]


def test_the_breakdown_sums_into_the_terms_remedies_act_on():
    terms = term_bytes(MIXTRAL)
    # parameters + gradients + optimizer state = 21,883 + 21,883 + 43,776 MiB = 87,542 MiB
    assert list(terms) == ["sharded state", "gathered layers", "activations", "logprob head"]
    assert terms["sharded state"] == 87542 * 2**20 and terms["gathered layers"] == (11407 + 10916) * 2**20


def test_a_remedy_that_cannot_remove_enough_is_left_out():
    kept = [r.say() for r in pertinent(_step_remedies(), MIXTRAL, NEEDED, LIMIT)]
    # activations and the head are 6,814 MiB of 116,679 MiB: without both, 109,865 MiB > the 68,822 MiB limit
    assert not any("activation_offload" in r or "logprobs" in r or "response_only" in r or "max_seq_len" in r for r in kept)
    assert any("offload='cpu'" in r for r in kept) and any("memory_limit" in r for r in kept)
    # a head that is most of the peak: the fused head and a shorter sequence can help, so they stay
    head_heavy = {"parameters": 10 * 2**20, "logprob_head": 60 * 2**20, "activations": 5 * 2**20}
    kept = [r.say() for r in pertinent(_step_remedies(), head_heavy, 75 * 2**20, 40 * 2**20)]
    assert any("logprobs='fused'" in r for r in kept) and any("max_seq_len" in r for r in kept)
    assert not any("activation_offload" in r for r in kept)  # 70 MiB without the activations > 40 MiB


def test_the_term_too_large_is_named_with_its_bytes():
    words = term_words(MIXTRAL, NEEDED, LIMIT, format_bytes)
    assert words == (
        "the sharded state (parameters, gradients, optimizer state) takes 85.49 GiB of the 113.94 GiB, alone above "
        "the 67.21 GiB limit"
    )


def test_the_memory_that_fits_is_computed_from_the_peak():
    # 113.94 GiB / 0.85 + 0.58 GiB = 134.63 GiB -> 135GiB; 81 MiB / 0.85 = 95.3 MiB -> 96MiB
    assert memory_needed(NEEDED, 0.85, int(593.75 * 2**20)) == "135GiB"
    assert memory_needed(81 * 2**20, 0.85, 0) == "96MiB"


def test_a_refusal_names_the_state_more_ranks_do_not_shrink_and_offers_only_what_was_measured_to_fit(monkeypatch):
    # the refusal's arithmetic on stub measurements shaped like Mixtral's (NOTE [ Remedies are measured ]): the
    # sharded state does not halve from 16 to 32 ranks, CPU offload fits, LoRA is measured not to
    floor = dict(MIXTRAL, gathered_parameters=2 * MIXTRAL["gathered_parameters"])
    monkeypatch.setattr(
        model_profile,
        "_hint_measure",
        lambda build, role, seq_len, world, sequence_parallel=1: types.SimpleNamespace(
            peak_bytes=sum((MIXTRAL if world <= 16 else floor).values()), breakdown=MIXTRAL if world <= 16 else floor
        ),
    )
    monkeypatch.setattr(model_profile, "smallest_fitting_sequence_parallel", lambda *a, **k: None)
    measured = []

    def candidate(build, role, seq_len, **change):
        measured.append(sorted(change))
        return 28 * GiB if "sharding" in change else 80 * GiB  # offload fits, LoRA does not

    monkeypatch.setattr(model_profile, "_candidate_peak", candidate)
    options = types.SimpleNamespace(lora=None, safety_margin=0.85)
    build = types.SimpleNamespace(
        sharding=Sharding("fsdp2", world_size=16), options=options, backend=types.SimpleNamespace(untracked=None)
    )
    moe = types.SimpleNamespace(experts=8)
    exc = DoesNotFitError(
        "one sequence does not fit", needed=NEEDED, available=LIMIT, breakdown=MIXTRAL, reserve_bytes=622_854_144,
        usable_bytes=int(79.07 * GiB), remedies=_step_remedies(),
    )  # fmt: skip
    out = model_profile._with_world_size_hint(exc, "policy", build, 8192, moe)
    text = str(out)
    assert measured == [["sharding"], ["lora"]]  # each state-changing remedy measured once
    assert "activations of one sequence alone" not in text
    assert "the sharded state (parameters, gradients, optimizer state) takes 85.49 GiB" in text
    assert "at 32 ranks the sharded state alone is 85.49 GiB per rank (85.49 GiB at 16): FSDP2 shards each tensor " in text
    assert "8 experts held in one tensor per layer give at most 8 ranks a share" in text
    remedies = [r.say() for r in out.remedies]
    assert remedies == [
        "offload the sharded state to the CPU (sharding=Sharding('fsdp2', world_size=16, offload='cpu'))",
        "give more memory (memory_limit='135GiB' or more at safety_margin=0.85)",
    ]
    assert out.world_size_hint is None


MIXTRAL_CONFIG = {
    # Mixtral-8x7B's config.json (mistralai/Mixtral-8x7B-v0.1), written out here
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}


@pytest.mark.slow
def test_mixtral_on_16_h100_names_the_sharded_state_and_every_remedy_it_offers_profiles(tmp_path, capsys):
    from batchfit.cli import main

    model = tmp_path / "mixtral-8x7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MIXTRAL_CONFIG))
    base = ["profile", "--model", str(model), "--world-size", "16", "--no-progress"]
    assert main([*base, "--json"]) == 1
    out, err = capsys.readouterr()
    error = json.loads(out)["error"]
    assert "activations of one sequence alone" not in err
    assert "the sharded state (parameters, gradients, optimizer state) takes 85.50 GiB of the 113.95 GiB" in err
    assert "8 experts held in one tensor per layer give at most 8 ranks a share" in err
    changes = [remedy["change"] for remedy in error["remedies"]]
    assert changes == [
        ["--sharding fsdp2 --world-size 16 --offload cpu"],
        ["--lora-rank 64"],
        ["--memory 135GiB", "--safety-margin 0.85"],
    ]
    assert "--activation-offload" not in err  # 6.41 GiB of activations cannot bring 113.95 GiB under 67.21 GiB
    for change in changes:  # every remedy offered, run as offered: it fits 8,192 tokens
        flags = [word for part in change for word in shlex.split(part)]
        assert main([*base, *flags, "--json"]) == 0, capsys.readouterr().err
        tokens = json.loads(capsys.readouterr().out)["combined"]["tokens"]
        assert tokens >= 8192, (change, tokens)
