"""One simulated world per run (NOTE [ One simulated world per run ] in batchfit.budget.model_profile).

``profile_run`` reads each colocated model's state off the step its own profile then searches: fewer
builds, and every budget and byte the same as the calls made apart.
"""

from __future__ import annotations

import json

import pytest

from batchfit.budget.model_profile import one_world, profile_model, resident_state_bytes
from batchfit.budget.options import ProfileOptions
from batchfit.models import load_config
from batchfit.parallel.sharding import Sharding


def _verl_config(tmp_path) -> dict:
    directory = tmp_path / "tiny-model"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(load_config("tiny").to_dict())))
    return {
        "data": {"train_batch_size": 16, "max_prompt_length": 64, "max_response_length": 192},
        "actor_rollout_ref": {
            "model": {"path": str(directory), "enable_gradient_checkpointing": True},
            "actor": {"strategy": "fsdp2", "ppo_mini_batch_size": 8, "use_kl_loss": True},
            "rollout": {"n": 2},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
    }


OPTIONS = ProfileOptions(
    max_seq_len=256,
    backend="estimate",
    memory_limit="48MiB",
    reserve_bytes=0,
    engine_reserve=0,
    sharding=Sharding("fsdp2", world_size=2),
    gradient_checkpointing=True,
    cost="packed",
    seq_lens=[256],
    progress=False,
)


def _counting_builds(monkeypatch) -> list[int]:
    import batchfit.models as models

    built: list[int] = []
    real = models.build_causal_lm

    def counted(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "build_causal_lm", counted)
    return built


@pytest.mark.slow
def test_a_run_builds_each_model_once_per_pass_and_gives_the_budgets_of_the_calls_made_apart(tmp_path, monkeypatch):
    from batchfit.frameworks import read_run_config
    from batchfit.frameworks.run_profile import PASSES, profile_run, role_options

    run = read_run_config(_verl_config(tmp_path))
    assert set(run.colocated) >= {"policy", "reference"} and run.resident["reference"]
    built = _counting_builds(monkeypatch)
    together = profile_run(run, OPTIONS)
    # the policy's update and old log-probs, the reference's log-probs; the resident states are read off them
    assert len(built) == 3
    built.clear()
    by_role = role_options(run, OPTIONS)
    apart = {
        role: resident_state_bytes(run.models[role], PASSES[role][0], by_role[role], kinds=run.resident[role])
        for role in ("policy", "reference")
    }
    assert together.resident == apart
    for role, opts in by_role.items():
        others = sum(b for other, b in apart.items() if other != role)
        alone = profile_model(run.models[role], opts, roles=PASSES[role], resident_bytes=others, engine=together.engine)
        assert alone.to_dict() == together.profiles[role].to_dict()
    assert len(built) == 2 + 3  # apart: each state from a model of its own


@pytest.mark.slow
def test_one_world_is_left_when_its_block_ends():
    import torch.distributed as dist

    with one_world():
        p = profile_model("tiny", OPTIONS.replace(seq_lens=[64], max_seq_len=64, memory_limit="1GiB"), roles=("policy",))
        assert dist.is_initialized()  # the run's world, kept for the run's next model
    assert not dist.is_initialized()
    assert p.budgets["policy"].tokens == profile_model(
        "tiny", OPTIONS.replace(seq_lens=[64], max_seq_len=64, memory_limit="1GiB"), roles=("policy",)
    ).budgets["policy"].tokens


@pytest.mark.slow
def test_a_run_whose_sequence_does_not_fit_names_the_world_size_that_fits_as_apart(tmp_path):
    from batchfit.errors import DoesNotFitError
    from batchfit.frameworks import read_run_config
    from batchfit.frameworks.run_profile import PASSES, profile_run, role_options

    run = read_run_config(_verl_config(tmp_path))
    tight = OPTIONS.replace(memory_limit="5MiB", suggest_world_size=True)  # one sequence: 5.18 MB
    with pytest.raises(DoesNotFitError) as together:
        profile_run(run, tight)  # the hint measures other world sizes, outside the run's world
    by_role = role_options(run, tight)
    reference = resident_state_bytes(run.models["reference"], "reference", by_role["reference"], kinds=run.resident["reference"])
    with pytest.raises(DoesNotFitError) as apart:
        profile_model(run.models["policy"], by_role["policy"], roles=PASSES["policy"], resident_bytes=reference)
    assert together.value.world_size_hint is not None
    assert str(together.value) == str(apart.value) and together.value.world_size_hint == apart.value.world_size_hint
