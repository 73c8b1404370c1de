"""batchfit.budget.causal_lm_probe: the budget's probe is the trainer's own micro-batch step (NOTE [ One micro-batch step ])."""

from __future__ import annotations

import pytest
import torch

from batchfit import InvalidArgument
from batchfit.batches import iter_micro_batches, loss_weights
from batchfit.budget import ProfileOptions, profile_model
from batchfit.budget.causal_lm_probe import StepSettings, causal_lm_step, synthetic_rollout
from batchfit.budget.probe import candidate_lengths
from batchfit.memory import get_backend
from batchfit.memory.cpu import CpuBackend
from batchfit.memory.cuda_attention import cuda_attention
from batchfit.memory.estimate import EstimateBackend
from batchfit.models import build_causal_lm, use_varlen_attention
from batchfit.plan import plan_micro_batches
from batchfit.train import PeakTracker, accumulate, micro_batch_loss
from tiers import second_tier_except

pytestmark = pytest.mark.usefixtures("one_thread")


def test_optimizer_state_exists_before_the_first_step_and_the_peak_is_stable():
    backend = get_backend("cpu")
    model = build_causal_lm("tiny", backend=backend)
    before = [p.detach().clone() for p in model.parameters()]
    step = causal_lm_step(model, backend=backend)
    assert len(step.optimizer.state) == len(before)  # every parameter has AdamW state
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # lr 0: unchanged
    peaks = [step.measure([16, 16]).peak_bytes for _ in range(2)]
    assert peaks[0] == peaks[1]
    # NOTE [ Gradients are resident between micro-batches ]: allocated, zeroed, kept
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("name", ["cpu", "estimate"])
def test_the_state_a_step_keeps_is_what_its_peak_holds_of_it(name):
    # resident_state_bytes reads measure_state() instead of running a step: the registered
    # state is live all along, so each state category is the same as at a step's peak
    backend = get_backend(name, memory_limit="1GiB")
    step = causal_lm_step(build_causal_lm("tiny", backend=backend), backend=backend)
    state, peak = step.measure_state(), step.measure([16, 16])
    for kind in ("parameters", "gradients", "optimizer_state"):
        assert state.breakdown[kind] == peak.breakdown[kind] > 0
    assert state.peak_bytes < peak.peak_bytes


def test_the_step_trains():
    backend = get_backend("cpu")
    model = build_causal_lm("tiny", backend=backend)
    before = next(model.parameters()).detach().clone()
    causal_lm_step(model, backend=backend, optimizer="sgd", lr=0.1)([8, 8])
    assert not torch.equal(before, next(model.parameters()))


def test_critic_is_inferred_from_a_value_head_model():
    backend = get_backend("cpu")
    assert causal_lm_step(build_causal_lm("tiny", backend=backend, value_head=True), backend=backend).critic
    assert not causal_lm_step(build_causal_lm("tiny", backend=backend), backend=backend).critic


def test_persistent_holds_model_and_optimizer():
    backend = get_backend("cpu")
    model = build_causal_lm("tiny", backend=backend)
    step = causal_lm_step(model, backend=backend)
    assert step.persistent == (model, step.optimizer) and step.backend is backend
    assert causal_lm_step(model, backend=backend, optimizer=None).persistent == (model,)


def _module_hooks(model: torch.nn.Module) -> int:
    """Forward, pre-forward and backward hooks on every module of ``model``."""
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in model.modules()
    )


@pytest.mark.parametrize("name", ["cpu", "estimate"])
def test_a_step_leaves_no_hooks_on_the_model_after_it_ran_ran_out_or_raised(name, monkeypatch):
    # NOTE [ A step leaves no hooks ]
    backend = get_backend(name, memory_limit="64MiB", reserve_bytes=0)
    model = build_causal_lm("tiny", backend=backend)
    before = _module_hooks(model)
    assert before == 0  # a plain model: any hook left would be the step's
    step = causal_lm_step(model, backend=backend)
    assert _module_hooks(model) == before  # made, not run
    assert step.measure([16, 16]).fits
    assert _module_hooks(model) == before  # ran
    assert not step.measure([4096] * 16).fits  # stopped at the limit inside the forward
    assert _module_hooks(model) == before
    seen = []

    def failing(*args, **kwargs):
        seen.append(_module_hooks(model))  # inside the step: its hooks are there
        raise RuntimeError("a bug in the step")

    monkeypatch.setattr("batchfit.budget.causal_lm_probe.micro_batch_loss", failing)
    with pytest.raises(RuntimeError, match="a bug in the step"):
        step([16, 16])
    assert seen[0] > before and _module_hooks(model) == before  # raised


@pytest.fixture(scope="module")
def cpu_model():
    backend = get_backend("cpu")
    return build_causal_lm("tiny", backend=backend), backend


@pytest.mark.parametrize(
    ("kwargs", "lengths", "match"),
    [
        pytest.param(
            {"optimizer": "adam"}, None, r"optimizer must be one of 'adamw', 'sgd'.*did you mean 'adamw'\?", id="optimizer"
        ),
        pytest.param({"critic": True}, None, r"critic=True needs a value-head model.*value_head=True", id="critic-on-lm"),
        pytest.param({"vocab_size": 0}, None, r"vocab_size must be an integer >= 1, but got vocab_size=0", id="vocab"),
        pytest.param(
            {"backend": None}, None, r"backend must be a Backend or a backend name, but got backend=None", id="no-backend"
        ),
        pytest.param({"cost": "pack"}, None, r"cost must be one of 'padded', 'packed'", id="cost"),
        pytest.param({}, [], r"lengths must be a non-empty sequence", id="no-lengths"),
        pytest.param({}, (8, 0), r"lengths\[1\] must be an integer >= 1, but got lengths\[1\]=0", id="length-zero"),
        pytest.param({}, [True], r"lengths\[0\] must be an integer, but got lengths\[0\]=True", id="length-bool"),
        pytest.param({}, 8, r"lengths must be a non-empty sequence of sequence lengths, but got lengths=8", id="int"),
    ],
)
def test_step_rejects_bad_arguments(cpu_model, kwargs, lengths, match):
    model, backend = cpu_model
    with pytest.raises(InvalidArgument, match=match):
        step = causal_lm_step(model, **{"backend": backend, **kwargs})
        step(lengths)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"only_loss_tokens": 1}, r"only_loss_tokens must be True or False, but got only_loss_tokens=1", id="loss-tokens"),
        pytest.param({"activation_offload": "yes"}, r"activation_offload must be True or False, but got activation_offload='yes'", id="offload"),
        pytest.param({"response_fraction": 0}, r"response_fraction must be", id="fraction"),
    ],
)
def test_step_rejects_bad_settings(cpu_model, kwargs, match):
    model, backend = cpu_model
    with pytest.raises(InvalidArgument, match=match):
        causal_lm_step(model, backend=backend, **kwargs)


def test_an_unknown_keyword_is_a_type_error_naming_the_settings(cpu_model):
    model, backend = cpu_model
    with pytest.raises(TypeError, match=r"causal_lm_step\(\) got an unexpected keyword argument 'head'; .*logprobs, cost"):
        causal_lm_step(model, backend=backend, head="full")


def test_the_step_holds_its_settings_resolved_and_reads_them_as_attributes(cpu_model):
    model, backend = cpu_model  # tiny: vocab 1024, a causal LM (no value head)
    step = causal_lm_step(model, backend=backend, logprobs="chunked", forward_only=True, activation_offload=True)
    assert step.settings == StepSettings(
        critic=False, vocab_size=1024, logprobs="chunked", forward_only=True, activation_offload=False  # no_grad offloads nothing
    )
    assert (step.critic, step.vocab_size, step.logprobs, step.activation_offload) == (False, 1024, "chunked", False)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        step.nothing  # noqa: B018


def test_a_model_must_belong_to_the_backend(cpu_model):
    model, _ = cpu_model
    estimate = get_backend("estimate")
    with pytest.raises(InvalidArgument, match=r"model must be built inside this backend's context\(\)"):
        causal_lm_step(model, backend=estimate)
    fake = build_causal_lm("tiny", backend=estimate)
    with pytest.raises(InvalidArgument, match=r"model has fake parameters .* but got backend='cpu'"):
        causal_lm_step(fake, backend="cpu")
    with pytest.raises(InvalidArgument, match=r"model must be built inside this backend's context\(\)"):
        causal_lm_step(fake, backend=get_backend("estimate"))  # another estimate backend's fake mode


# the first tier runs training packed and forward-only padded (issue 41)
@pytest.mark.parametrize(
    ("forward_only", "cost"),
    second_tier_except(
        ["train-packed", "forward-only-padded"],
        [pytest.param(False, id="train"), pytest.param(True, id="forward-only")],
        ["padded", "packed"],
    ),
)
def test_every_head_estimate_equals_cpu_and_bounded_heads_use_less(forward_only, cost):
    peaks = {}
    lengths = [512, 512, 512, 300]  # 1,836 tokens: two chunks of the default 1,024 when packed
    for mode in ("full", "chunked", "fused"):
        measured = []
        # the CPU's own attention kernel: under CUDA's (the math path for float32 with grouped heads)
        # the tiny model's attention scores, not its head, bound the peak at these lengths
        for backend in (
            CpuBackend(attention_kernels="own"),
            EstimateBackend(memory_limit="80GiB", reserve_bytes=0, round_to=1, attention_kernels="own"),
        ):
            model = build_causal_lm("tiny", backend=backend)
            step = causal_lm_step(model, backend=backend, logprobs=mode, forward_only=forward_only, cost=cost)
            measured.append(step.measure(lengths).peak_bytes)
        assert measured[0] == measured[1]  # the estimate is exact for every head and layout
        peaks[mode] = measured[0]
    assert peaks["fused"] < peaks["chunked"] < peaks["full"]


@pytest.mark.parametrize("cost", ["padded", "packed"])
def test_a_critic_estimate_equals_cpu(cost):
    peaks = []
    for backend in (get_backend("cpu"), get_backend("estimate", reserve_bytes=0, round_to=1)):
        step = causal_lm_step(build_causal_lm("tiny", backend=backend, value_head=True), backend=backend, cost=cost)
        peaks.append(step.measure([64, 64, 30]).peak_bytes)
    assert peaks[0] == peaks[1]


def test_forward_only_step_has_no_optimizer_and_leaves_no_gradients():
    backend = get_backend("cpu")
    model = build_causal_lm("tiny", backend=backend)
    step = causal_lm_step(model, backend=backend, forward_only=True)
    step([16, 16])
    assert step.optimizer is None and step.persistent == (model,)
    assert all(p.grad is None for p in model.parameters())


def test_unknown_logprobs_mode_names_the_choices(cpu_model):
    model, backend = cpu_model
    with pytest.raises(InvalidArgument, match=r"logprobs must be one of 'full', 'chunked', 'fused'"):
        causal_lm_step(model, backend=backend, logprobs="fast")


def test_the_synthetic_micro_batch_is_laid_out_as_a_trainer_cuts_one():
    backend = get_backend("cpu")
    step = causal_lm_step(build_causal_lm("tiny", backend=backend), backend=backend, cost="packed")
    mb = step.micro_batch([6, 6, 3])
    assert mb.indices == (0, 1, 2) and mb.batch["input_ids"].shape == (1, 15)  # one packed row of 6 + 6 + 3
    assert mb.batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2]]
    # every token but each sequence's first is a response token, weighted by the token mean
    assert mb.batch["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1]]
    assert torch.allclose(mb.batch["weights"].sum(), torch.tensor(1.0))
    padded = causal_lm_step(build_causal_lm("tiny", backend=backend), backend=backend).micro_batch([6, 6])
    assert padded.batch["input_ids"].shape == (2, 6) and padded.batch["advantages"].shape == (2, 5)


# --------------------------------------------------------------------------- the trainer at C and C + 1


def _trainer_peak(model, optimizer, lengths, vocab_size, cost):
    """A trainer's micro-batch of ``lengths`` after an earlier one (gradients resident), then the optimizer step."""
    rollout = synthetic_rollout(lengths, vocab_size=vocab_size, seed=3)
    rollout["weights"] = loss_weights(rollout["loss_mask"], reduction="token_mean")
    budget = len(lengths) * max(lengths) if cost == "padded" else sum(lengths)
    plan = plan_micro_batches(rollout["attention_mask"].sum(-1), budget, cost=cost)
    layout = "packed" if cost == "packed" else "padded"
    for p in model.parameters():  # an earlier micro-batch of the step left its gradients
        p.grad = torch.zeros_like(p)
    with PeakTracker(model, optimizer, host=rollout) as peaks:
        for mb in accumulate(model, iter_micro_batches(rollout, plan, 0, layout=layout), plan.num_micro_batches):
            micro_batch_loss(model, mb, head="fused").backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return peaks.take()


# the first tier's time (issue 41): packed stays in the first tier
@pytest.mark.parametrize("cost", ["packed", pytest.param("padded", marks=pytest.mark.slow)])
def test_a_trainer_micro_batch_at_the_budget_fits_and_one_token_more_does_not_as_the_probe_predicted(cost):
    options = ProfileOptions(
        max_seq_len=64, backend="cpu", memory_limit="12MiB", dtype="fp32", logprobs="fused", cost=cost
    )
    budget = profile_model("tiny", options).budgets["policy"]
    point = budget.points[0]  # the longest length
    backend = get_backend("cpu", memory_limit="12MiB")
    model = build_causal_lm("tiny", backend=backend, dtype="fp32")
    if cost == "packed":
        use_varlen_attention(model)
    step = causal_lm_step(model, backend=backend, logprobs="fused", cost=cost)
    vocab = model.config.vocab_size
    unit = 1 if cost == "packed" else point.seq_len
    at_c = candidate_lengths(point.tokens if cost == "packed" else point.max_batch_size, point.seq_len, cost)
    above = candidate_lengths(point.tokens + unit if cost == "packed" else point.max_batch_size + 1, point.seq_len, cost)
    assert sum(at_c) == point.tokens and sum(above) == point.tokens + unit
    with cuda_attention():  # the kernels the probe ran (NOTE [ The estimate runs CUDA's attention kernel ])
        trainer = [_trainer_peak(model, step.optimizer, lengths, vocab, cost) for lengths in (at_c, above)]
    probed = [step.measure(lengths).peak_bytes for lengths in (at_c, above)]
    assert trainer[0] <= budget.limit_bytes < trainer[1]  # C fits, one token (or row) more does not
    assert trainer == probed  # the probe ran the trainer's micro-batch: the same bytes
