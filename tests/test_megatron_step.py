"""batchfit.train.megatron_step: Megatron-core's GPTModel trained one step with Megatron's own DDP and optimizer, measured.

The cpu backend on real gloo ranks is the referee of the estimate backend under the fake process
group (NOTE [ Megatron under the fake process group ] in :mod:`batchfit.models.megatron`): the
same first step of a fresh tiny model, to the byte and rank by rank, at TP 2 (fp32, with and
without sequence parallelism, and bf16 with Megatron's mixed-precision optimizer), at DP 2 with
the distributed optimizer, and under PP 2. The resident bytes per parameter of Megatron's
optimizer (NOTE [ The Megatron step's optimizer ]) are checked on the estimate alone (first tier).
Skipped where megatron-core or mbridge is not installed (``pip install -e '.[megatron]'``).
"""

from __future__ import annotations

import pytest

from batchfit import InvalidArgument
from multirank import run_ranks

BATCH, SEQ, LAYERS = 2, 64, 2
#: (tensor_parallel, sequence_parallel, dtype, data_parallel, distributed_optimizer) of each 2-rank run
LAYOUTS = (
    (2, False, "float32", 1, False),
    (2, True, "float32", 1, False),
    (2, False, "bfloat16", 1, False),  # Megatron's mixed-precision optimizer (fp32 main params and grads)
    (1, False, "bfloat16", 2, True),  # DP 2, Megatron's distributed optimizer
)
IDS = ["tp2", "tp2-sp", "tp2-bf16", "dp2-distributed-optimizer"]


def _registered(model, training, inputs):
    objects, categories = training.registered()
    return (model, *objects, inputs), (None, *categories, None)


def _measure(backend_name: str, tp: int, sp: bool, dtype: str, dp: int, distributed: bool) -> dict[str, object]:
    """The first step of a fresh tiny model on this rank (or the simulated one), with its loss."""
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
                "tiny",
                tensor_parallel=tp,
                sequence_parallel=sp,
                num_layers=LAYERS,
                dtype=getattr(torch, dtype),
                initialise=real,
            )
            training = megatron_optimizer(model, distributed=distributed)
            batch = synthetic_batch(model.vocab_size, BATCH, SEQ, seed=1)
        register, categories = _registered(model, training, batch.tensors())
        got = backend.measure(lambda: megatron_train_step(model, training, batch), register=register, categories=categories)
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


def _real_rank(rank: int, layouts: tuple[tuple[object, ...], ...]) -> list[dict[str, object]]:
    # gloo's worker thread lets go of a finished collective's tensors after wait() returns (NOTE [ A
    # collective's worker outlives the interpreter ] in batchfit.parallel.process_exit): on a loaded
    # machine a buffer can outlive its last Python reference by an op or two and add its bytes to the
    # real peak (+14,208 B once at tp2-bf16). The step the estimate is compared with is the one whose
    # collectives let go on time: the lower of two real runs.
    return [min((_measure("cpu", *layout) for _ in range(2)), key=lambda got: got["peak"]) for layout in layouts]


def _simulated(rank: int, tp: int, sp: bool, dtype: str, dp: int, distributed: bool) -> dict[str, object]:
    from batchfit.models.megatron import simulated_rank

    with simulated_rank(tp * dp, rank):
        return _measure("estimate", tp, sp, dtype, dp, distributed)


@pytest.fixture(scope="module")
def real_runs():
    """Each layout on 2 real gloo ranks, and TP = 1 (fp32) on one."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    two = run_ranks(_real_rank, LAYOUTS, world=2, timeout=300)
    one = run_ranks(_real_rank, ((1, False, "float32", 1, False),), world=1, timeout=240)
    return {"two": two, "one": one[0][0]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_estimate_equals_every_real_rank_to_the_byte(megatron, real_runs, layout):
    index = LAYOUTS.index(layout)
    for rank in (0, 1):  # under the distributed optimizer the ranks' shards differ: each is simulated as itself
        real = real_runs["two"][rank][index]
        estimate = _simulated(rank, *layout)
        assert (real["peak"], real["breakdown"]) == (estimate["peak"], estimate["breakdown"]), rank


@pytest.mark.slow
def test_tensor_parallelism_halves_the_sharded_parameters(megatron, real_runs):
    tp1 = real_runs["one"]["parameter_bytes"]
    tp2 = real_runs["two"][0][0]["parameter_bytes"]
    # tiny: 223,552 fp32 parameters = 894,208 B at TP 1; the 5 RMSNorm weights of 64 (2 per layer and
    # the final one, 5 × 64 × 4 = 1,280 B) are replicated, the rest split: (894,208 - 1,280) / 2 + 1,280
    assert (tp1, tp2) == (894_208, 447_744)
    assert real_runs["two"][0][0]["peak"] < real_runs["one"]["peak"]


@pytest.mark.slow
def test_the_loss_is_the_same_whatever_the_tensor_parallelism(megatron, real_runs):
    # Megatron's CPU initialisation draws each full matrix and slices the rank's shard: the same model
    losses = [real_runs["one"]["loss"]] + [real_runs["two"][r][i]["loss"] for r in (0, 1) for i in range(2)]
    assert max(losses) - min(losses) < 1e-4, losses


@pytest.mark.slow
def test_sequence_parallelism_lowers_the_activations_per_rank(megatron, real_runs):
    plain, split = real_runs["two"][0][:2]
    assert split["breakdown"]["activations"] < plain["breakdown"]["activations"]
    assert split["peak"] < plain["peak"]


@pytest.mark.slow
def test_the_mixed_precision_optimizer_keeps_fp32_main_params_and_grads(megatron, real_runs):
    bf16 = real_runs["two"][0][2]["breakdown"]
    # TP 2, bf16: 111,936 parameters on a rank (447,744 B / 4 at fp32): 2 B each, their fp32 main_grad
    # 4 B, fp32 main parameter and two fp32 moments 12 B, and a 4-byte step per tensor (15 tensors)
    assert (bf16["parameters"], bf16["gradients"]) == (2 * 111_936, 4 * 111_936)
    assert bf16["optimizer_state"] == 12 * 111_936 + 4 * 15


@pytest.mark.slow
def test_the_distributed_optimizer_halves_the_optimizer_state_per_rank(megatron, real_runs):
    ranks = [real_runs["two"][r][3]["breakdown"] for r in (0, 1)]
    one = _simulated(0, 1, False, "bfloat16", 1, False)["breakdown"]
    # DP 1, bf16: 223,552 parameters, 12 B of main parameter and moments each, 15 tensors' steps
    assert one["optimizer_state"] == 12 * 223_552 + 4 * 15
    # DP 2: the gradient buffer (each parameter starting at a multiple of 64 elements, the whole at
    # a multiple of lcm(2, 128)) holds 223,616 elements, 111,808 per rank; rank 0's range is all
    # parameters (8 pieces), rank 1's ends in 64 elements of padding (7 pieces)
    assert [r["optimizer_state"] for r in ranks] == [12 * 111_808 + 4 * 8, 12 * 111_744 + 4 * 7]
    assert all(r["gradients"] == 4 * 223_616 for r in ranks)  # every rank keeps the whole buffer
    assert all(r["parameters"] == 2 * 223_616 for r in ranks)  # the parameters moved into one padded buffer


def _resident(dtype: str, dp: int, distributed: bool) -> dict[str, int]:
    """The state a fresh tiny model of 1 layer keeps with Megatron's optimizer (estimate, DP rank 0), no step."""
    import warnings

    import torch

    from batchfit.memory import get_backend
    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel, simulated_rank
    from batchfit.train.megatron_step import megatron_optimizer

    warnings.filterwarnings("ignore")
    backend = get_backend("estimate", round_to=1)
    with simulated_rank(dp, 0), model_parallel(1, 1), megatron_cpu_patches(), backend.context():
        model = build_gpt_model("tiny", num_layers=1, dtype=getattr(torch, dtype), initialise=False)
        training = megatron_optimizer(model, distributed=distributed)
        register, categories = _registered(model, training, ())
        got = backend.measure(lambda: None, register=register, categories=categories)
        assert sum(p.numel() for p in model.parameters()) == 177_344  # tiny, 1 layer
    return dict(got.breakdown)


def test_resident_bytes_per_parameter_of_megatrons_optimizer(megatron):
    # bf16, DP 1: 177,344 parameters of 2 B; 4 B of fp32 main_grad, 4 B of fp32 main parameter and
    # 8 B of two fp32 moments each (16 B), and a 4-byte step per tensor (9 tensors)
    one = _resident("bfloat16", 1, False)
    assert one == {"parameters": 2 * 177_344, "gradients": 4 * 177_344, "optimizer_state": 12 * 177_344 + 4 * 9}
    # the distributed optimizer at DP 2: the buffer padded to 177,408 elements (parameters at multiples
    # of 64, the end at a multiple of 128), the gradients whole, main parameters and moments for this
    # rank's 88,704 (4 pieces): the optimizer part halves
    two = _resident("bfloat16", 2, True)
    assert two == {"parameters": 2 * 177_408, "gradients": 4 * 177_408, "optimizer_state": 12 * 88_704 + 4 * 4}
    # without it, DP 2 keeps DP 1's state; fp32 parameters have no main copy (4 + 4 + 8 B)
    assert _resident("bfloat16", 2, False) == one
    assert _resident("float32", 1, False) == {
        "parameters": 4 * 177_344,
        "gradients": 4 * 177_344,
        "optimizer_state": 8 * 177_344 + 4 * 9,
    }


def test_a_torch_optimizer_and_bf16_without_main_params_under_the_distributed_optimizer_are_refused(megatron):
    import torch

    from batchfit.memory import get_backend
    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel, simulated_rank
    from batchfit.train.megatron_step import megatron_optimizer, megatron_train_step, synthetic_batch

    backend = get_backend("estimate")
    with simulated_rank(2, 0), model_parallel(1, 1), megatron_cpu_patches(), backend.context():
        model = build_gpt_model("tiny", num_layers=1, dtype=torch.bfloat16, initialise=False)
        with pytest.raises(InvalidArgument, match="mixed_precision=False with distributed=True"):
            megatron_optimizer(model, mixed_precision=False, distributed=True)
        batch = synthetic_batch(model.vocab_size, 1, 8)
        with pytest.raises(InvalidArgument, match="pass what megatron_optimizer"):
            megatron_train_step(model, torch.optim.AdamW(model.parameters()), batch)


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
            training = megatron_optimizer(model)
            batches = [synthetic_batch(model.vocab_size, BATCH, SEQ, seed=i) for i in range(micro_batches)]
        register, categories = _registered(model, training, [b.tensors() for b in batches])
        got = backend.measure(
            lambda: out.setdefault("loss", megatron_pipeline_step(model, training, batches)),
            register=register,
            categories=categories,
        )
    return {"peak": got.peak_bytes, "breakdown": got.breakdown, "loss": out["loss"]}


def _real_stage(rank: int, tp: int, pp: int, micro_batches: int) -> dict[str, object]:
    return _measure_pipeline("cpu", tp, pp, micro_batches)


def _simulated_stage(rank: int, tp: int, pp: int, micro_batches: int) -> dict[str, object]:
    from batchfit.models.megatron import simulated_rank

    with simulated_rank(tp * pp, rank):
        return _measure_pipeline("estimate", tp, pp, micro_batches)


@pytest.mark.slow
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


@pytest.mark.slow
def test_one_f_one_b_holds_at_most_pp_micro_batches_on_the_first_stage(megatron):
    activations = {n: _simulated_stage(0, 1, 2, n)["breakdown"]["activations"] for n in (1, 2, 4)}
    # stage 0 of 2 runs 2 - 0 - 1 = 1 warm-up forward: from 2 micro-batches on, 2 are in flight
    assert activations[1] < activations[2] == activations[4]


#: (tensor_parallel, pipeline_parallel, what stays resident) of each forward-only pass on 2 ranks
FORWARD_LAYOUTS = ((2, 1, "resident"), (2, 1, "none"), (1, 2, "resident"))
FORWARD_IDS = ["tp2-policy-forward", "tp2-reference", "pp2-policy-forward"]


def _forward_measurements(backend_name: str, layouts) -> list[dict[int, tuple[int, dict[str, int]]]]:
    """Each layout's forward-only pass (NOTE [ The Megatron forward-only pass ]) of 2 × 64 tokens, bf16, stage by stage."""
    import warnings

    import torch

    from batchfit.budget.megatron_probe import MegatronStep, stage_measurements
    from batchfit.memory import get_backend

    warnings.filterwarnings("ignore")
    out = []
    for tp, pp, optimizer in layouts:
        backend = get_backend(backend_name, round_to=1)
        step = MegatronStep(
            "tiny", tensor_parallel=tp, pipeline_parallel=pp, backend=backend, num_layers=LAYERS, dtype=torch.bfloat16,
            forward_only=True, optimizer=optimizer,
        )
        if backend.simulated:
            measured = stage_measurements(step, [SEQ] * BATCH)
        else:
            got = step.measure([SEQ] * BATCH)
            measured = {step.binding_stage: got}
        out.append({stage: (m.peak_bytes, dict(m.breakdown)) for stage, m in measured.items()})
    return out


def _real_forward(rank: int, layouts) -> list[dict[int, tuple[int, dict[str, int]]]]:
    # the lower of two real runs, as in _real_rank (a gloo buffer let go late: tp2-reference once)
    runs = zip(_forward_measurements("cpu", layouts), _forward_measurements("cpu", layouts), strict=True)
    return [min(pair, key=lambda stages: sum(peak for peak, _ in stages.values())) for pair in runs]


@pytest.fixture(scope="module")
def real_forward_runs():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    return run_ranks(_real_forward, FORWARD_LAYOUTS, world=2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("layout", FORWARD_LAYOUTS, ids=FORWARD_IDS)
def test_forward_only_estimate_equals_every_real_rank_to_the_byte(megatron, real_forward_runs, layout):
    index = FORWARD_LAYOUTS.index(layout)
    (estimate,) = _forward_measurements("estimate", (layout,))
    tp, pp, optimizer = layout
    for rank in (0, 1):
        (stage, real), = real_forward_runs[rank][index].items()
        assert stage == rank // tp  # Megatron's order: tp fastest, pp slowest
        assert real == estimate[stage], rank
    _, breakdown = estimate[pp - 1]
    assert "logprob_head" in breakdown  # the last stage's logits and cross-entropy
    # NOTE [ Forward-only Megatron probes ]: a reference keeps its parameters alone
    assert ("gradients" in breakdown, "optimizer_state" in breakdown) == ((True, True) if optimizer == "resident" else (False, False))


#: MegatronStep arguments of each interleaved run on 2 ranks: PP 2 × VPP 2, tiny at 4 layers (1 per model chunk)
INTERLEAVED = (
    {"pipeline_parallel": 2, "virtual_pipeline": 2, "micro_batches": 4},
    {"pipeline_parallel": 2, "virtual_pipeline": 2, "micro_batches": 4, "forward_only": True},
    {"pipeline_parallel": 2, "micro_batches": 4},  # the same model without virtual stages
)
INTERLEAVED_IDS = ["pp2-vpp2-training", "pp2-vpp2-forward", "pp2"]


def _step_measurements(backend_name: str, runs) -> list[dict[int, tuple[int, dict[str, int]]]]:
    """Each run's MegatronStep of 2 × 64 tokens on tiny at 4 layers, fp32, stage by stage (this rank's on real ranks)."""
    import warnings

    from batchfit.budget.megatron_probe import MegatronStep, stage_measurements
    from batchfit.memory import get_backend

    warnings.filterwarnings("ignore")
    out = []
    for kwargs in runs:
        backend = get_backend(backend_name, round_to=1)
        step = MegatronStep("tiny", backend=backend, num_layers=4, **kwargs)
        if backend.simulated:
            measured = stage_measurements(step, [SEQ] * BATCH)
        else:
            got = step.measure([SEQ] * BATCH)
            measured = {step.binding_stage: got}
        out.append({stage: (m.peak_bytes, dict(m.breakdown)) for stage, m in measured.items()})
    return out


def _real_interleaved(rank: int, runs) -> list[dict[int, tuple[int, dict[str, int]]]]:
    return _step_measurements("cpu", runs)


@pytest.fixture(scope="module")
def real_interleaved_runs():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    return run_ranks(_real_interleaved, INTERLEAVED, world=2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("run", INTERLEAVED, ids=INTERLEAVED_IDS)
def test_interleaved_estimate_equals_every_real_rank_to_the_byte(megatron, real_interleaved_runs, run):
    index = INTERLEAVED.index(run)
    (estimate,) = _step_measurements("estimate", (run,))
    for rank in (0, 1):
        (stage, real), = real_interleaved_runs[rank][index].items()
        assert stage == rank and real == estimate[stage], rank


@pytest.mark.slow
def test_virtual_stages_hold_more_micro_batches_in_flight_on_the_first_stage(megatron):
    (interleaved, _, plain) = _step_measurements("estimate", INTERLEAVED)
    # NOTE [ Virtual pipeline stages ]: stage 0 of 2 with 2 chunks warms up (2 - 0 - 1) × 2 + (2 - 1) × 2 = 4
    # chunk forwards, the plain 1F1B 1: more activations at the same parameters
    assert interleaved[0][1]["activations"] > plain[0][1]["activations"]
    assert interleaved[0][1]["parameters"] == plain[0][1]["parameters"]


def test_virtual_stages_are_refused_without_a_pipeline_or_a_multiple_of_its_stages(megatron):
    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    backend = get_backend("estimate", reserve_bytes=0)
    with pytest.raises(InvalidArgument, match="virtual_pipeline=2 needs pipeline_parallel > 1"):
        MegatronStep("tiny", virtual_pipeline=2, backend=backend)
    with pytest.raises(InvalidArgument, match="micro_batches=3 with virtual_pipeline=2"):
        MegatronStep("tiny", pipeline_parallel=2, virtual_pipeline=2, micro_batches=3, backend=backend)
    with pytest.raises(InvalidArgument, match="num_layers=2 must be divisible by pipeline_parallel × virtual_pipeline"):
        MegatronStep("tiny", pipeline_parallel=2, virtual_pipeline=2, backend=backend, num_layers=2).measure([8])
