"""Megatron's uneven pipeline stages (``num_layers_in_first/last_pipeline_stage``): each stage's layers, the refusals,
the probe's stage peaks on the estimate equal to real gloo ranks', and the depth extrapolation read per stage.

The first tests need no megatron (``stage_layers`` and :class:`Sharding` are plain); the rest are slow.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batchfit import InvalidArgument
from batchfit.budget.megatron_layout import stage_layers
from batchfit.parallel.sharding import Sharding


def _pp(pp: int, first: int | None = None, last: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(pipeline_parallel=pp, first_pipeline_stage_layers=first, last_pipeline_stage_layers=last)


@pytest.mark.parametrize(
    ("layers", "pp", "first", "last", "want"),
    [
        (94, 4, None, 22, (24, 24, 24, 22)),  # slime's Qwen3-235B-A22B: (94 - 22) / 3 = 24 on each other stage
        (94, 4, 22, None, (22, 24, 24, 24)),
        (10, 4, 1, 3, (1, 3, 3, 3)),  # (10 - 1 - 3) / 2 = 3 in the middle
        (3, 2, None, 1, (2, 1)),
        (3, 2, 2, 1, (2, 1)),  # no middle stage, the two add up
        (8, 4, None, None, (2, 2, 2, 2)),
    ],
)
def test_each_stage_holds_the_layers_megatron_builds_there(layers, pp, first, last, want):
    assert stage_layers(layers, _pp(pp, first, last)) == want
    assert sum(want) == layers


@pytest.mark.parametrize(
    ("layers", "pp", "first", "last", "match"),
    [
        # 94 - 21 = 73 over 3 middle stages: not even; 19 and 22 leave 75 and 72
        (94, 4, None, 21, r"last_pipeline_stage_layers=21 leave 73 .* 3 middle .* set last_pipeline_stage_layers to 19 or 22"),
        (5, 2, 2, 2, r"leave 1 of the model's 5 layers to 0 middle .* set last_pipeline_stage_layers to 3"),  # middle layers, no middle stage
        (4, 3, 2, 2, r"leave 0 of the model's 4 layers to 1 middle"),  # a middle stage without layers
        (3, 2, None, 4, r"leave -1 of the model's 3 layers"),
    ],
)
def test_uneven_stages_megatron_refuses_are_refused_naming_the_field_and_the_fix(layers, pp, first, last, match):
    with pytest.raises(InvalidArgument, match=match):
        stage_layers(layers, _pp(pp, first, last))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "megatron", "world_size": 2, "pipeline_parallel": 2, "last_pipeline_stage_layers": 0}, "last_pipeline_stage_layers"),
        ({"strategy": "megatron", "world_size": 2, "last_pipeline_stage_layers": 1}, "needs pipeline_parallel > 1"),
        ({"strategy": "fsdp2", "world_size": 2, "first_pipeline_stage_layers": 1}, "needs strategy='megatron'"),
    ],
    ids=["zero", "no-pipeline", "fsdp2"],
)
def test_sharding_refuses_uneven_stages_it_cannot_carry(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        Sharding(**kwargs)


def test_the_sharding_describes_and_serialises_its_uneven_stages():
    s = Sharding("megatron", world_size=8, pipeline_parallel=4, last_pipeline_stage_layers=22)
    assert "last stage 22 layers" in s.describe()
    assert s.to_dict()["last_pipeline_stage_layers"] == 22 and "first_pipeline_stage_layers" not in s.to_dict()


# ---------------------------------------------------------------- megatron-core (slow) ---------------------------------


#: tiny at 3 layers over PP 2, the last stage 1 (the first 2): Megatron-core's num_layers_in_last_pipeline_stage
UNEVEN = {"num_layers": 3, "num_layers_in_last_pipeline_stage": 1}
SHAPE = [64, 64]


def _stage_peaks(backend_name: str) -> dict[int, int]:
    import warnings

    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    warnings.filterwarnings("ignore")
    backend = get_backend(backend_name, reserve_bytes=0, round_to=1)
    step = MegatronStep("tiny", pipeline_parallel=2, backend=backend, **UNEVEN)
    step.measure(SHAPE)
    return dict(step.stage_peaks)


def _real_rank(rank: int) -> dict[int, int]:
    return _stage_peaks("cpu")


@pytest.mark.slow
def test_an_uneven_pipelines_stage_peaks_on_the_estimate_equal_the_real_ranks_to_the_byte(megatron):
    from multirank import run_ranks

    real = run_ranks(_real_rank, world=2, timeout=400)
    estimate = _stage_peaks("estimate")
    assert {**real[0], **real[1]} == estimate
    # the first stage's 2 layers and 2 micro-batches in flight against the last's 1 layer and the head
    assert estimate[0] != estimate[1]


@pytest.mark.slow
def test_an_uneven_stage_is_extrapolated_to_its_own_depth_as_the_full_build_measures_it(megatron):
    from batchfit.budget.megatron_depth import DepthExtrapolatedMegatronStep
    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    backend = get_backend("estimate", reserve_bytes=0, round_to=1)
    full = MegatronStep("tiny", pipeline_parallel=2, backend=backend, num_layers=9, num_layers_in_last_pipeline_stage=4)
    full.measure(SHAPE)
    # NOTE [ Megatron stages are affine in their depth ]: even copies of 2 and 3 layers per stage, read at 5 and 4
    deep = DepthExtrapolatedMegatronStep(
        lambda n: MegatronStep("tiny", pipeline_parallel=2, backend=backend, num_layers=n), 2, (5, 4), backend
    )
    deep.measure(SHAPE)
    assert deep.stage_peaks == full.stage_peaks
    assert deep.binding_stage == full.binding_stage


@pytest.mark.slow
def test_a_profile_names_each_uneven_stages_layers_and_refuses_them_beside_virtual_stages(megatron):
    from batchfit.budget.model_profile import profile_model
    from batchfit.budget.options import ProfileOptions

    sharding = Sharding("megatron", world_size=2, pipeline_parallel=2, last_pipeline_stage_layers=1)
    options = ProfileOptions(max_seq_len=128, backend="estimate", memory_limit="24MiB", reserve_bytes=0, sharding=sharding)
    profile = profile_model("tiny", options, roles=["policy"])
    assert profile.megatron.stage_layers == {0: 1, 1: 1}
    assert "stage 1 (1 layers)" in profile.megatron.describe()
    assert set(profile.megatron.stage_peaks) == {0, 1}
    bad = Sharding("megatron", world_size=2, pipeline_parallel=2, last_pipeline_stage_layers=3)
    with pytest.raises(InvalidArgument, match="last_pipeline_stage_layers=3 leave -1 of the model's 2 layers"):
        profile_model("tiny", ProfileOptions(max_seq_len=128, backend="estimate", memory_limit="24MiB", sharding=bad), roles=["policy"])
