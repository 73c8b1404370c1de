"""batchfit.train.megatron_step: Megatron-core's GPTModel trained one step on gloo ranks, measured (second tier).

The cpu backend on real gloo ranks is the referee of the estimate backend under the fake process
group (NOTE [ Megatron under the fake process group ] in :mod:`batchfit.models.megatron`): the
same first step of a fresh tiny model, TP = 2, with and without sequence parallelism, to the byte.
Skipped where megatron-core or mbridge is not installed (``pip install -e '.[megatron]'``).
"""

from __future__ import annotations

import pytest

from batchfit import InvalidArgument
from multirank import run_ranks

pytestmark = pytest.mark.slow

BATCH, SEQ, LAYERS = 2, 64, 2
#: (tensor_parallel, sequence_parallel) of each measured run
LAYOUTS = ((2, False), (2, True))


@pytest.fixture
def megatron():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")


def _measure(backend_name: str, tp: int, sp: bool) -> dict[str, object]:
    """The first step of a fresh tiny model on this rank (or the simulated rank 0), with its loss."""
    import warnings

    import torch

    from batchfit.memory import get_backend
    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel
    from batchfit.train.megatron_step import (
        megatron_loss,
        megatron_optimizer,
        megatron_train_step,
        synthetic_batch,
    )

    warnings.filterwarnings("ignore")
    backend = get_backend(backend_name, round_to=1)
    real = backend_name == "cpu"
    torch.manual_seed(0)  # Megatron's CPU initialisation draws the full matrices from torch's generator
    with model_parallel(tp, 1), megatron_cpu_patches():
        with backend.context():
            model = build_gpt_model(
                "tiny", tensor_parallel=tp, sequence_parallel=sp, num_layers=LAYERS, initialise=real
            )
            optimizer = megatron_optimizer(model)
            batch = synthetic_batch(model.vocab_size, BATCH, SEQ, seed=1)
        got = backend.measure(
            lambda: megatron_train_step(model, optimizer, batch), register=(model, optimizer, batch.tensors())
        )
        loss = None
        if real:
            with torch.no_grad():
                loss = float(megatron_loss(model, batch))
    return {
        "peak": got.peak_bytes,
        "breakdown": got.breakdown,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "loss": loss,
    }


def _real_rank(rank: int, layouts: tuple[tuple[int, bool], ...]) -> list[dict[str, object]]:
    return [_measure("cpu", tp, sp) for tp, sp in layouts]


def _simulated(tp: int, sp: bool) -> dict[str, object]:
    from batchfit.parallel.distributed import simulated_world

    with simulated_world(tp):
        return _measure("estimate", tp, sp)


@pytest.fixture(scope="module")
def real_runs():
    """Each layout on 2 real gloo ranks, and TP = 1 on one."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    two = run_ranks(_real_rank, LAYOUTS, world=2, timeout=240)
    one = run_ranks(_real_rank, ((1, False),), world=1, timeout=240)
    return {"two": two, "one": one[0][0]}


@pytest.mark.parametrize(("tp", "sp"), LAYOUTS, ids=["tp2", "tp2-sp"])
def test_estimate_equals_every_real_rank_to_the_byte(megatron, real_runs, tp, sp):
    index = LAYOUTS.index((tp, sp))
    ranks = [real_runs["two"][r][index] for r in (0, 1)]
    estimate = _simulated(tp, sp)
    for real in ranks:
        assert (real["peak"], real["breakdown"]) == (estimate["peak"], estimate["breakdown"])


def test_tensor_parallelism_halves_the_sharded_parameters(megatron, real_runs):
    tp1 = real_runs["one"]["parameter_bytes"]
    tp2 = real_runs["two"][0][0]["parameter_bytes"]
    # tiny: 223,552 fp32 parameters = 894,208 B at TP 1; the 5 RMSNorm weights of 64 (2 per layer and
    # the final one, 5 × 64 × 4 = 1,280 B) are replicated, the rest split: (894,208 - 1,280) / 2 + 1,280
    assert (tp1, tp2) == (894_208, 447_744)
    assert real_runs["two"][0][0]["peak"] < real_runs["one"]["peak"]


def test_the_loss_is_the_same_whatever_the_tensor_parallelism(megatron, real_runs):
    # Megatron's CPU initialisation draws each full matrix and slices the rank's shard: the same model
    losses = [real_runs["one"]["loss"]] + [real_runs["two"][r][i]["loss"] for r in (0, 1) for i in range(2)]
    assert max(losses) - min(losses) < 1e-4, losses


def test_sequence_parallelism_lowers_the_activations_per_rank(megatron, real_runs):
    plain, split = real_runs["two"][0]
    assert split["breakdown"]["activations"] < plain["breakdown"]["activations"]
    assert split["peak"] < plain["peak"]


def _measure_pipeline(backend_name: str, tp: int, pp: int, micro_batches: int) -> dict[str, object]:
    """The first pipeline step (Megatron's 1F1B schedule) of a fresh tiny model on this stage."""
    import warnings

    import torch

    from batchfit.memory import get_backend
    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel
    from batchfit.train.megatron_step import megatron_optimizer, megatron_pipeline_step, synthetic_batch

    warnings.filterwarnings("ignore")
    backend = get_backend(backend_name, round_to=1)
    real = backend_name == "cpu"
    torch.manual_seed(0)
    out: dict[str, object] = {}
    with model_parallel(tp, pp), megatron_cpu_patches():
        with backend.context():
            model = build_gpt_model("tiny", tensor_parallel=tp, pipeline_parallel=pp, num_layers=LAYERS, initialise=real)
            optimizer = megatron_optimizer(model)
            batches = [synthetic_batch(model.vocab_size, BATCH, SEQ, seed=i) for i in range(micro_batches)]
        got = backend.measure(
            lambda: out.setdefault("loss", megatron_pipeline_step(model, optimizer, batches)),
            register=(model, optimizer, [b.tensors() for b in batches]),
        )
    return {"peak": got.peak_bytes, "breakdown": got.breakdown, "loss": out["loss"]}


def _real_stage(rank: int, tp: int, pp: int, micro_batches: int) -> dict[str, object]:
    return _measure_pipeline("cpu", tp, pp, micro_batches)


def _simulated_stage(rank: int, tp: int, pp: int, micro_batches: int) -> dict[str, object]:
    from batchfit.models.megatron import simulated_rank

    with simulated_rank(tp * pp, rank):
        return _measure_pipeline("estimate", tp, pp, micro_batches)


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2)], ids=["pp2-2ranks", "tp2-pp2-4ranks"])
def test_pipeline_estimate_equals_every_real_rank_to_the_byte(megatron, tp, pp):
    world = tp * pp
    real = run_ranks(_real_stage, tp, pp, 4, world=world, timeout=300)  # 4 micro-batches, 1F1B
    for rank in range(world):
        estimate = _simulated_stage(rank, tp, pp, 4)
        assert (real[rank]["peak"], real[rank]["breakdown"]) == (estimate["peak"], estimate["breakdown"]), rank
    first, last = real[0], real[world - 1]  # Megatron's order: tp fastest, pp slowest
    assert first["loss"] is None and last["loss"] > 0  # the loss lives on the last stage
    assert "logprob_head" in last["breakdown"] and "logprob_head" not in first["breakdown"]
    assert first["peak"] > last["peak"]  # the first stage binds: 2 micro-batches in flight


def test_one_f_one_b_holds_at_most_pp_micro_batches_on_the_first_stage(megatron):
    activations = {n: _simulated_stage(0, 1, 2, n)["breakdown"]["activations"] for n in (1, 2, 4)}
    # stage 0 of 2 runs 2 - 0 - 1 = 1 warm-up forward: from 2 micro-batches on, 2 are in flight
    assert activations[1] < activations[2] == activations[4]


def test_data_parallel_ranks_are_refused(megatron):
    from batchfit.memory import get_backend
    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel
    from batchfit.parallel.distributed import simulated_world
    from batchfit.train.megatron_step import megatron_optimizer, megatron_train_step, synthetic_batch

    backend = get_backend("estimate")
    with simulated_world(2), model_parallel(1, 1), megatron_cpu_patches(), backend.context():
        model = build_gpt_model("tiny", num_layers=1, initialise=False)
        optimizer = megatron_optimizer(model)
        batch = synthetic_batch(model.vocab_size, 1, 8)
        with pytest.raises(InvalidArgument, match="data_parallel=2"):
            megatron_train_step(model, optimizer, batch)
