"""Activation offload (batchfit.train.activation_offload) and the probe's host bytes under it."""

from __future__ import annotations

import pytest
import torch

from batchfit.budget.causal_lm_probe import causal_lm_step
from batchfit.memory.backends import BACKENDS
from batchfit.memory.categories import OFFLOADED_ACTIVATIONS
from batchfit.models import build_causal_lm
from batchfit.train.activation_offload import activation_offload


def _grads(net: torch.nn.Module, ids: torch.Tensor, offload: bool) -> tuple[list[torch.Tensor], object]:
    net.zero_grad(set_to_none=True)
    off = None
    if offload:
        with activation_offload(net) as off:
            net(input_ids=ids).logits.float().pow(2).mean().backward()
    else:
        net(input_ids=ids).logits.float().pow(2).mean().backward()
    return [p.grad.clone() for p in net.parameters()], off


@pytest.mark.slow
def test_offloaded_step_has_the_unoffloaded_gradients_and_leaves_no_hooks():
    # no checkpointing: every tensor a layer saves goes to the host, among them sdpa's output, a
    # [B, H, S, D] view of the [B·S, H·D] buffer o_proj saves too (NOTE [ One copy per buffer ])
    torch.manual_seed(0)
    net = build_causal_lm("tiny", num_hidden_layers=4, dtype="fp32")
    net.train()
    ids = torch.randint(0, 1024, (2, 32))
    ref, _ = _grads(net, ids, offload=False)
    got, off = _grads(net, ids, offload=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert off.offloaded_bytes > 0 and off.host_peak_bytes == off.offloaded_bytes
    assert off.host_bytes == 0  # every group came back in backward
    assert all("forward" not in layer.__dict__ for layer in net.model.layers)


def test_checkpointed_layers_offload_their_inputs_and_stay_checkpointed():
    torch.manual_seed(0)
    net = build_causal_lm("tiny", num_hidden_layers=4, dtype="fp32", gradient_checkpointing=True)
    net.train()
    ids = torch.randint(0, 1024, (2, 32))
    ref, _ = _grads(net, ids, offload=False)
    got, off = _grads(net, ids, offload=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # layers 0..2 (not the last) offload their checkpointed inputs: hidden states [2, 32, 64] fp32
    # = 16,384 B and position_ids [1, 32] int64 = 256 B each: 3 × 16,640 = 49,920
    assert off.offloaded_bytes == 49_920
    assert all(layer.gradient_checkpointing for layer in net.model.layers)


def test_a_training_step_without_offload_names_it_as_a_remedy():
    import types

    from batchfit.budget.causal_lm_probe import TrainingStep
    from batchfit.parallel import Sharding

    def said(**changes):
        fields = dict(model=torch.nn.Linear(1, 1), forward_only=False, logprobs="full", critic=False, only_loss_tokens=False)
        step = types.SimpleNamespace(**{**fields, "sharding": Sharding(), "_layers": [None] * 4, **changes})
        return " ".join(str(r) for r in TrainingStep.remedies(step))

    assert "activation_offload=True" in said(activation_offload=False)
    assert "activation_offload=True" not in said(activation_offload=True)
    assert "activation_offload=True" not in said(forward_only=True)  # no_grad saves nothing to offload
    assert "activation_offload=True" not in said(_layers=[None] * 2)  # verl offloads nothing below 3 layers


def test_fewer_than_three_layers_offload_nothing_as_verl():
    net = build_causal_lm("tiny")  # 2 layers
    with pytest.warns(UserWarning, match="at least 3 decoder layers"), activation_offload(net) as off:
        pass
    assert off is None


def _measure(backend: str, *, offload: bool, checkpointing: bool, logprobs: str = "full", attention_kernels: str = "cuda"):
    be = BACKENDS[backend](memory_limit="8GiB", reserve_bytes=0, round_to=1, attention_kernels=attention_kernels)
    net = build_causal_lm("tiny", backend=be, num_hidden_layers=4, gradient_checkpointing=checkpointing)
    step = causal_lm_step(net, backend=be, activation_offload=offload, logprobs=logprobs)
    return step.measure([256, 256])


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_estimate_equals_cpu_to_the_byte_with_activation_offload(checkpointing):
    cpu = _measure("cpu", offload=True, checkpointing=checkpointing)
    est = _measure("estimate", offload=True, checkpointing=checkpointing)
    assert (est.peak_bytes, est.host_bytes, est.breakdown) == (cpu.peak_bytes, cpu.host_bytes, cpu.breakdown)
    assert cpu.host_bytes > 0
    assert OFFLOADED_ACTIVATIONS not in cpu.breakdown  # host bytes are not device bytes


@pytest.mark.slow
def test_offload_lowers_the_device_peak_and_moves_the_saved_activations_to_the_host():
    # fused head, no checkpointing: the layers' saved activations dominate the peak
    without = _measure("estimate", offload=False, checkpointing=False, logprobs="fused")
    with_ = _measure("estimate", offload=True, checkpointing=False, logprobs="fused")
    assert with_.peak_bytes < without.peak_bytes
    assert without.host_bytes == 0
    # checkpointed, the head binding (the CPU's own attention kernel): at the peak the host holds
    # layers 0..2's inputs, hidden states [2, 256, 64] fp32 = 131,072 B and position_ids [1, 256]
    # int64 = 2,048 B each: 3 × 133,120 = 399,360
    ckpt = _measure("estimate", offload=True, checkpointing=True, attention_kernels="own")
    assert ckpt.host_bytes == 399_360
    # CUDA's math attention path (float32, grouped heads) binds in layer 2's recomputed backward,
    # its input back on the device: the host holds layers 0 and 1's, 2 × 133,120
    assert _measure("estimate", offload=True, checkpointing=True).host_bytes == 266_240


def test_verls_key_is_read_profiled_and_emitted_and_other_targets_refuse_it():
    from batchfit.budget.choices import Choices
    from batchfit.frameworks import read_run_config
    from batchfit.frameworks.assumptions import setting_keys
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.frameworks.emit import EmitError

    config = {
        "data": {"train_batch_size": 8, "max_prompt_length": 64, "max_response_length": 64},
        "actor_rollout_ref": {
            "model": {"path": "tiny", "enable_activation_offload": True, "enable_gradient_checkpointing": True},
            "actor": {"strategy": "fsdp2", "ppo_mini_batch_size": 8},
            "rollout": {"n": 1},
        },
        "trainer": {"nnodes": 1, "n_gpus_per_node": 8},
    }
    run = read_run_config(config)
    assert run.activation_offload is True
    # modelled: no "batchfit does not model" warning (a critic that differs from the actor still gets one)
    assert not any("actor_rollout_ref.model.enable_activation_offload" in w and "differs" not in w for w in run.warnings)
    options = run_profile_options(run, Choices(cost="packed"), Choices()).options
    assert options.activation_offload is True
    keys = {k.path: k.value for k in setting_keys(run, {"policy": options}, "verl")}
    assert keys["actor_rollout_ref.model.enable_activation_offload"] is True
    # profiled without it (--no-activation-offload), the config's own switch is turned off
    off = {k.path: k.value for k in setting_keys(run, {"policy": options.replace(activation_offload=False)}, "verl")}
    assert off["actor_rollout_ref.model.enable_activation_offload"] is False
    with pytest.raises(EmitError, match="--emit skyrl cannot carry --activation-offload"):
        setting_keys(run, {"policy": options}, "skyrl")
