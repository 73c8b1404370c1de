"""batchfit.budget.depth: two shallow copies predict the full depth's peak, to the byte."""

from __future__ import annotations

import types

import pytest

from batchfit import InvalidArgument
from batchfit.budget.causal_lm_probe import causal_lm_step
from batchfit.budget.depth import (
    DEFAULT_DEPTHS,
    DepthExtrapolatedStep,
    build_depth_steps,
    extrapolate,
    uniform_layers,
)
from batchfit.memory import MemoryMeasurement, get_backend
from batchfit.models import build_causal_lm, load_config
from batchfit.parallel.distributed import simulated_world
from batchfit.parallel.sharding import Sharding


def _steps(spec: str, sharding: Sharding, depths, **opts):
    be = get_backend("estimate")
    build_opts = {k: opts[k] for k in ("gradient_checkpointing", "dtype") if k in opts}
    step_opts = {k: opts[k] for k in ("logprobs", "forward_only") if k in opts}

    def make(n_layers: int):
        model = build_causal_lm(spec, backend=be, sharding=sharding, num_hidden_layers=n_layers, **build_opts)
        return causal_lm_step(model, backend=be, **step_opts)

    return {k: make(k) for k in depths}


@pytest.mark.parametrize(
    ("strategy", "opts"),
    [
        # the first tier's time (issue 41): fsdp2-reference stays, and the default profile's training
        # step of 28 layers extrapolated from 5 and 6 (tests/test_cli_profile.py's default run)
        pytest.param("none", {"dtype": "bf16"}, id="one-device", marks=pytest.mark.slow),
        pytest.param(
            "none", {"dtype": "bf16", "logprobs": "chunked"}, id="one-device-chunked", marks=pytest.mark.slow
        ),
        pytest.param("fsdp2", {}, id="fsdp2", marks=pytest.mark.slow),
        pytest.param(
            "fsdp2",
            {"gradient_checkpointing": True, "logprobs": "fused"},
            id="fsdp2-checkpointing-fused",
            marks=pytest.mark.slow,  # the first tier's time (issue 29)
        ),
        pytest.param("fsdp2", {"forward_only": True}, id="fsdp2-reference"),
    ],
)
def test_extrapolation_equals_the_full_depth_estimate_for_the_tiny_model(strategy, opts):
    world = 4 if strategy == "fsdp2" else 1
    with simulated_world(world):
        sharding = Sharding(strategy, world_size=world)
        steps = _steps("tiny", sharding, (*DEFAULT_DEPTHS, 9, 14), **opts)
        shallow = {k: steps[k] for k in DEFAULT_DEPTHS}
        for depth in (9, 14):
            predicted = DepthExtrapolatedStep(shallow, depth).measure([40] * 2)
            full = steps[depth].measure([40] * 2)
            assert predicted.peak_bytes == full.peak_bytes, depth
            assert predicted.breakdown == full.breakdown, depth


@pytest.mark.slow
def test_extrapolation_equals_the_full_depth_estimate_for_qwen_0_5b(one_thread):
    # 24 layers, fsdp2 over 8 simulated ranks, checkpointing, 1 × 1024 tokens
    with simulated_world(8):
        sharding = Sharding("fsdp2", world_size=8)
        steps = _steps("qwen2.5-0.5b", sharding, (*DEFAULT_DEPTHS, 24), gradient_checkpointing=True)
        predicted = DepthExtrapolatedStep({k: steps[k] for k in DEFAULT_DEPTHS}, 24).measure([1024])
        full = steps[24].measure([1024])
    assert abs(predicted.peak_bytes - full.peak_bytes) <= 0.005 * full.peak_bytes
    assert predicted.peak_bytes == full.peak_bytes  # in fact to the byte


def _m(peak: int, phases: dict[str, int], host: int = 0) -> MemoryMeasurement:
    return MemoryMeasurement(
        peak_bytes=peak,
        fits=True,
        limit_bytes=None,
        backend="estimate",
        breakdown={"activations": peak},
        host_bytes=host,
        phase_peaks=phases,
        phase_breakdowns={k: {"activations": v} for k, v in phases.items()},
    )


def test_each_position_is_extrapolated_alone_and_the_largest_wins():
    # backward: 150 B at 5 layers, +10 B per layer; optimizer: 210 B at 5 layers, +30 B per layer.
    # At depth 10 the optimizer's 210 + 5·30 = 360 B beats backward's 150 + 5·10 = 200 B.
    m5 = _m(150, {"backward:head": 150, "optimizer": 210})
    m6 = _m(240, {"backward:head": 160, "optimizer": 240})
    out = extrapolate(m5, m6, 5, 6, 10, limit_bytes=300)
    assert out.phase_peaks == {"backward:head": 200, "optimizer": 360}
    assert out.peak_bytes == 360 and not out.fits  # 360 > 300
    assert out.breakdown == {"activations": 360}


def test_the_allocators_reservation_is_extrapolated_and_judged_with_the_peak():
    # cuda: no phase peaks; the reservation (100 B more per layer than allocated) survives extrapolation
    m5 = MemoryMeasurement(peak_bytes=1_000, fits=True, limit_bytes=None, backend="cuda", reserved_bytes=1_500)
    m6 = MemoryMeasurement(peak_bytes=1_100, fits=True, limit_bytes=None, backend="cuda", reserved_bytes=1_700)
    out = extrapolate(m5, m6, 5, 6, 10, limit_bytes=2_000)
    assert (out.peak_bytes, out.reserved_bytes) == (1_500, 2_500)
    assert not out.fits  # allocated 1,500 B fits under 2,000 B, reserved 2,500 B does not
    assert extrapolate(_m(100, {"forward": 100}), _m(110, {"forward": 110}), 5, 6, 8, None).reserved_bytes is None


def test_a_position_seen_at_one_depth_only_is_not_extrapolated():
    m5 = _m(100, {"forward": 100})
    m6 = _m(130, {"forward": 110, "backward:layers-middle": 130})
    assert set(extrapolate(m5, m6, 5, 6, 8, limit_bytes=None).phase_peaks) == {"forward"}


def test_a_shallow_run_over_the_limit_decides_without_the_second():
    calls = []

    def measure_over(lengths):
        calls.append("k1")
        return MemoryMeasurement(peak_bytes=10, fits=False, limit_bytes=5, backend="estimate", exceeded=True)

    backend = types.SimpleNamespace(limit_bytes=5)
    one = types.SimpleNamespace(backend=backend, measure=measure_over)
    two = types.SimpleNamespace(backend=backend, measure=lambda lengths: calls.append("k2"))
    result = DepthExtrapolatedStep({5: one, 6: two}, 20).measure([8])
    assert result.exceeded and not result.fits and calls == ["k1"]


@pytest.mark.parametrize(
    ("depths", "depth", "message"),
    [
        pytest.param((5,), 20, r"exactly two depths, but got depths=\[5\]", id="one-depth"),
        pytest.param((5, 6), 6, r"must be in \[1, depth\), but got depths=\(5, 6\) for depth=6", id="not-shallower"),
    ],
)
def test_bad_depths_are_rejected(depths, depth, message):
    backend = types.SimpleNamespace(limit_bytes=None)
    steps = {k: types.SimpleNamespace(backend=backend) for k in depths}
    with pytest.raises(InvalidArgument, match=message):
        DepthExtrapolatedStep(steps, depth)


def test_build_depth_steps_measures_shallow_models_at_full_depth():
    made = []
    backend = types.SimpleNamespace(limit_bytes=None)

    def make(n):
        made.append(n)
        return types.SimpleNamespace(backend=backend)

    assert not isinstance(build_depth_steps(make, 6), DepthExtrapolatedStep) and made == [6]
    assert isinstance(build_depth_steps(make, 28), DepthExtrapolatedStep) and made[1:] == [5, 6]


def test_uniform_layers_recognises_mixed_stacks():
    assert uniform_layers(load_config("qwen2.5-7b"))
    assert uniform_layers(load_config("tiny"))
    assert not uniform_layers(types.SimpleNamespace(layer_types=["sliding_attention", "full_attention"]))
    assert not uniform_layers(types.SimpleNamespace(first_k_dense_replace=1))
    assert not uniform_layers(types.SimpleNamespace(mlp_only_layers=[0]))
