"""batchfit.models.build: models built on the meta device, sharded before they are allocated, seeded.

The central checks run on 2 real gloo ranks: an FSDP2 build peaks at one rank's shard, so a
model larger than one rank's limit builds; the initial weights are the same on every rank
and equal to one process's under the same seed; the rotary buffers are computed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchfit import InvalidArgument
from batchfit.memory import get_backend
from batchfit.models import build_causal_lm
from batchfit.models.build import SEED_BLOCK_ELEMENTS, seeded_fills
from batchfit.parallel.distributed import simulated_world
from batchfit.parallel.shard import unwrap
from batchfit.parallel.sharding import Sharding
from multirank import run_ranks

# tiny: 223,552 parameters = 894,208 bytes in fp32; every tensor splits evenly over 2 ranks
TINY_FP32 = 894_208
# (name, sharding options, build options): builds compared with one process's
VARIANTS = [
    ("fsdp2", {"strategy": "fsdp2"}, {}),
    ("fsdp2-offload", {"strategy": "fsdp2", "offload": "cpu"}, {}),
    ("ddp", {"strategy": "ddp"}, {}),
    # tied embeddings: one parameter in two modules
    ("fsdp2-tied", {"strategy": "fsdp2"}, {"tie_word_embeddings": True}),
    # a padding row to zero in rank 0's shard (transformers would zero an all-gathered copy)
    ("fsdp2-padding", {"strategy": "fsdp2"}, {"pad_token_id": 3}),
    # uneven: the value head's single row lives on rank 0, rank 1 holds none of it
    ("fsdp2-critic", {"strategy": "fsdp2"}, {"value_head": True}),
]
SEED = 7
# rotary frequencies of tiny: head_dim 16, theta 1e4 -> 1e4 ** (-2i / 16) = 10 ** (-i / 2), i = 0..7
INV_FREQ = [1.0, 0.31622776, 0.1, 0.031622776, 0.01, 0.0031622776, 0.001, 0.00031622776]


def _full(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every parameter (gathered: a collective under FSDP2) and buffer, as numpy arrays."""
    out = {}
    for name, p in unwrap(model).named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).numpy().copy()
    for name, b in unwrap(model).named_buffers():
        out[name] = b.numpy().copy()
    return out


def _rank(rank: int) -> dict:
    torch.manual_seed(100 + rank)  # the ranks' own generators differ on purpose
    be = get_backend("cpu")
    sharding = Sharding("fsdp2", world_size=2)
    built: dict = {}
    build = be.measure(lambda: built.setdefault("m", build_causal_lm("tiny", backend=be, sharding=sharding, seed=SEED)))
    model = built["m"]
    local = sum(p._local_tensor.numel() * p.element_size() for p in model.parameters())

    limited = get_backend("cpu", memory_limit=700_000)
    whole = limited.measure(lambda: build_causal_lm("tiny", backend=limited, seed=SEED))
    swap_restored = not torch.__future__.get_swap_module_params_on_conversion()
    kept: dict = {}
    sharded = limited.measure(
        lambda: kept.setdefault("m", build_causal_lm("tiny", backend=limited, sharding=sharding, seed=SEED))
    )
    ids = torch.arange(12).reshape(1, 12)
    loss = kept["m"](input_ids=ids, labels=ids).loss
    loss.backward()

    values = {}
    for name, shard_opts, build_opts in VARIANTS:
        opts = dict(shard_opts)
        variant = Sharding(opts.pop("strategy"), world_size=2, **opts)
        m = build_causal_lm("tiny", backend="cpu", sharding=variant, seed=SEED, **build_opts)
        core = unwrap(m)
        tied = core.lm_head.weight is core.model.embed_tokens.weight if hasattr(core, "lm_head") else None
        values[name] = (_full(m), tied)
    unseeded = _full(build_causal_lm("tiny", backend="cpu", sharding=sharding))
    return {
        "build": (build.peak_bytes, build.fits),
        "local_bytes": local,
        "whole": (whole.fits, whole.exceeded),
        "swap_restored": swap_restored,
        "sharded": (sharded.fits, sharded.peak_bytes),
        "loss": float(loss),
        "values": values,
        "unseeded": unseeded,
    }


@pytest.fixture(scope="module")
def two_ranks() -> dict[int, dict]:
    return run_ranks(_rank, timeout=240)


def test_a_two_rank_fsdp2_build_peaks_at_one_rank_shard_not_the_whole_model(two_ranks):
    # 447,104 = 894,208 / 2, the rank's half of every parameter
    # +    64 = inv_freq and original_inv_freq, 8 fp32 each, on every rank (buffers are not sharded)
    # +45,056 = the largest random-fill block a rank draws whole to keep part of it: gate_proj
    #           and up_proj are 176 x 64 (11,264 elements <= SEED_BLOCK_ELEMENTS: one block),
    #           a rank keeps 88 rows and draws all 176: 176 x 64 x 4 bytes
    #   + 8 the seed drawn from torch's generator (an int64 scalar tensor, NOTE [ Initial weights from a seed ])
    # = 492,232, against 894,368 for one process building the whole model
    assert SEED_BLOCK_ELEMENTS == 16_384
    for rank in (0, 1):
        assert two_ranks[rank]["local_bytes"] == TINY_FP32 // 2
        assert two_ranks[rank]["build"] == (492_232, True)
    be = get_backend("cpu")
    assert be.measure(lambda: build_causal_lm("tiny", backend=be, seed=SEED)).peak_bytes == 894_368  # + 96 B of rope temporaries


def test_a_model_over_one_rank_limit_builds_on_two_ranks_each_holding_its_shard(two_ranks):
    # limit 700,000 bytes: above a rank's 492,232, below the whole model's 894,208
    for rank in (0, 1):
        assert two_ranks[rank]["whole"] == (False, True)  # one process building it all is stopped
        assert two_ranks[rank]["swap_restored"]  # ... and the stopped build put torch's flag back
        assert two_ranks[rank]["sharded"] == (True, 492_232)
    assert two_ranks[0]["loss"] == two_ranks[1]["loss"]  # and it trains: one forward/backward


@pytest.mark.parametrize("variant", [v[0] for v in VARIANTS])
def test_initial_weights_are_equal_on_every_rank_and_to_one_process_with_the_same_seed(two_ranks, variant):
    build_opts = next(v[2] for v in VARIANTS if v[0] == variant)
    single = _full(build_causal_lm("tiny", seed=SEED, **build_opts))
    (rank0, tied0), (rank1, tied1) = two_ranks[0]["values"][variant], two_ranks[1]["values"][variant]
    assert rank0.keys() == rank1.keys() == single.keys()
    for name, expected in single.items():
        assert np.array_equal(rank0[name], expected), name
        assert np.array_equal(rank1[name], expected), name
    if variant == "fsdp2-tied":
        assert tied0 and tied1  # still one parameter
    if variant == "fsdp2-padding":
        assert not single["model.embed_tokens.weight"][3].any()  # the padding row is zero
        assert single["model.embed_tokens.weight"][4].any()


def test_without_a_seed_every_rank_builds_rank_zero_model(two_ranks):
    # rank r seeded its generator with 100 + r; both build what one process seeded with 100 builds
    torch.manual_seed(100)
    single = _full(build_causal_lm("tiny", sharding=Sharding("none")))
    for name, expected in single.items():
        assert np.array_equal(two_ranks[0]["unseeded"][name], expected), name
        assert np.array_equal(two_ranks[1]["unseeded"][name], expected), name


def test_rotary_buffers_are_computed_after_the_build(two_ranks):
    for got in (two_ranks[0]["values"]["fsdp2"][0], two_ranks[1]["values"]["fsdp2"][0], _full(build_causal_lm("tiny"))):
        np.testing.assert_allclose(got["model.rotary_emb.inv_freq"], INV_FREQ, rtol=1e-6)
        np.testing.assert_array_equal(got["model.rotary_emb.original_inv_freq"], got["model.rotary_emb.inv_freq"])


@pytest.mark.parametrize("world", [3, 4])
def test_a_rank_shard_is_its_rows_of_one_process_model_whatever_the_world_size(world):
    # simulated ranks: this process is rank 0 and holds the first ceil(rows / world) rows
    single = dict(build_causal_lm("tiny", seed=SEED).named_parameters())
    with simulated_world(world):
        sharded = build_causal_lm("tiny", backend="cpu", sharding=Sharding("fsdp2", world_size=world), seed=SEED)
        for name, p in sharded.named_parameters():
            local = p._local_tensor
            assert torch.equal(local, single[name][: local.shape[0]]), name


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="fp32"),
        pytest.param({"dtype": "bf16"}, id="bf16"),
        pytest.param({"value_head": True}, id="critic"),
        pytest.param({"gradient_checkpointing": True, "tie_word_embeddings": True}, id="checkpointing-tied"),
    ],
)
def test_a_real_build_has_the_structure_of_the_fake_one(options):
    # the estimate backend builds the ordinary way (from_config under its fake mode)
    fake = build_causal_lm("tiny", backend="estimate", **options)
    real = build_causal_lm("tiny", backend="cpu", seed=0, **options)

    def layout(model):
        return (
            type(model).__name__,
            [(n, p.dtype, tuple(p.shape), p.requires_grad, p.device.type) for n, p in model.named_parameters()],
            [(n, b.dtype, tuple(b.shape), b.device.type) for n, b in model.named_buffers()],
            [m.training for m in model.modules()],
            model.config.use_cache,
        )

    assert layout(real) == layout(fake)


def test_a_build_inside_an_active_fake_mode_stays_fake():
    # AutoBatch calls task factories inside the backend's context, without passing the backend
    from torch._subclasses.fake_tensor import FakeTensor

    with get_backend("estimate").context():
        model = build_causal_lm("tiny")
    assert all(isinstance(p, FakeTensor) for p in model.parameters())


def test_a_different_seed_gives_other_weights_and_a_seeded_build_leaves_torch_generator_alone():
    torch.manual_seed(0)
    a = build_causal_lm("tiny", seed=1)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after)  # a seeded build drew nothing from the global generator
    b = build_causal_lm("tiny", seed=2)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
    std = float(a.lm_head.weight.detach().std())
    assert 0.019 < std < 0.021  # transformers' normal(0, initializer_range=0.02), drawn from the seed


def test_seeded_fills_name_a_parameter_through_its_data_alias():
    # transformers 4.x initialises with module.weight.data.normal_(): the alias is the parameter
    direct, alias = torch.nn.Linear(64, 100), torch.nn.Linear(64, 100)
    with torch.no_grad(), seeded_fills(direct, 5):
        direct.weight.normal_(0.0, 0.02)
    with torch.no_grad(), seeded_fills(alias, 5):
        alias.weight.data.normal_(0.0, 0.02)
    assert torch.equal(direct.weight, alias.weight)


@pytest.mark.parametrize(
    ("seed", "message"),
    [
        pytest.param(-1, r"seed must be an integer >= 0, but got seed=-1", id="negative"),
        pytest.param(True, r"seed must be an integer, but got seed=True \(bool\)", id="bool"),
        pytest.param(1.5, r"seed must be an integer, but got seed=1.5 \(float\)", id="float"),
    ],
)
def test_a_bad_seed_is_named(seed, message):
    with pytest.raises(InvalidArgument, match=message):
        build_causal_lm("tiny", seed=seed)
