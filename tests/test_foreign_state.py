"""Other libraries' state is left as found: accelerate's hooks on the head, host ``out`` tensors, collectives' devices.

NOTE [ The head's instance attributes are left as found ] (batchfit.train.model_outputs) and
NOTE [ Collectives run on the group's device ] (batchfit.parallel.collective_device).
accelerate is installed in the project's environment, so its real ``add_hook_to_module`` is used.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from batchfit.batches.microbatch import iter_micro_batches
from batchfit.parallel import collective_device as cd
from batchfit.plan.packing import plan_micro_batches
from multirank import run_ranks

# transformers, batchfit.train and accelerate are imported inside the tests: the gloo ranks
# spawned below import this module, and should not pay for them


def _counting_hook():
    """An accelerate hook that counts its calls (the output unchanged)."""
    hooks = pytest.importorskip("accelerate.hooks")

    class CountingHook(hooks.ModelHook):
        def __init__(self):
            self.pre = self.post = 0

        def pre_forward(self, module, *args, **kwargs):
            self.pre += 1
            return args, kwargs

        def post_forward(self, module, output):
            self.post += 1
            return output

    return hooks, CountingHook()


def _batch():
    g = torch.Generator().manual_seed(5)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])
    return {"input_ids": torch.randint(1, 64, mask.shape, generator=g) * mask, "attention_mask": mask}


def test_an_accelerate_hook_on_the_head_runs_during_model_logprobs_and_survives_it():
    from batchfit.train import model_logprobs
    from microbatch_helpers import tiny_lm

    hooks, hook = _counting_hook()
    model = tiny_lm("llama").eval()
    batch = _batch()
    with torch.no_grad():
        expected = model_logprobs(model, batch)  # fused head, no hook
    head = model.get_output_embeddings()
    hooks.add_hook_to_module(head, hook)
    forward, old_forward = head.__dict__["forward"], head.__dict__["_old_forward"]
    with torch.no_grad():
        got = model_logprobs(model, batch)
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert hook.pre == hook.post == 1  # the hook ran around the fused head
    # left as found: the same instance attributes, and the hook still runs with the real forward
    assert head.__dict__["forward"] is forward and head.__dict__["_old_forward"] is old_forward
    assert head._hf_hook is hook
    hidden = torch.randn(2, model.config.hidden_size)
    assert torch.equal(head(hidden), torch.nn.functional.linear(hidden, head.weight))
    assert hook.pre == hook.post == 2
    hooks.remove_hook_from_module(head)  # accelerate can still take its hook off
    assert not hasattr(head, "_hf_hook") and torch.equal(head(hidden), torch.nn.functional.linear(hidden, head.weight))


def test_an_instance_forward_is_restored_and_none_is_left_behind_even_on_an_error():
    from batchfit.train.model_outputs import fused_output_head
    from microbatch_helpers import tiny_lm

    model = tiny_lm("llama")
    head = model.get_output_embeddings()
    labels = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(RuntimeError, match="boom"), fused_output_head(model, labels):
        assert "forward" in head.__dict__
        raise RuntimeError("boom")
    assert "forward" not in head.__dict__  # batchfit added it, batchfit removed it

    def own(hidden):
        return hidden

    head.forward = own  # another library's instance forward (not accelerate's)
    with fused_output_head(model, labels):
        assert head.forward is not own
    assert head.__dict__["forward"] is own


class _SetItems(TorchFunctionMode):
    """Records the device of every value written by ``target[...] = value``."""

    def __init__(self, target: torch.Tensor):
        super().__init__()
        self.target, self.writes = target, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__setitem__ and args[0] is self.target and isinstance(args[2], torch.Tensor):
            self.writes.append(args[2].device)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_write_back_copies_values_to_out_s_device_and_dtype(layout):
    batch = _batch()
    lengths = batch["attention_mask"].sum(-1)
    plan = plan_micro_batches(lengths, 12, cost=layout)
    host = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    elsewhere = torch.zeros(batch["input_ids"].shape, device="meta")  # a device the values are not on
    array = np.zeros(batch["input_ids"].shape, dtype=np.float32)
    for mb in iter_micro_batches(batch, plan, layout=layout):
        values = mb.batch["input_ids"].float().requires_grad_()  # per-token outputs of the micro-batch
        mb.write_back(host, values)
        mb.write_back(array, values)  # a host array: copied off autograd (and off the device)
        with _SetItems(elsewhere) as mode:
            mb.write_back(elsewhere, values)
        assert mode.writes and set(mode.writes) == {torch.device("meta")}
    assert host.dtype == torch.float64 and torch.equal(host, batch["input_ids"].double())
    assert np.array_equal(array, batch["input_ids"].numpy())


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [
        ("gloo", "cpu", "cpu"),
        ("nccl", "cpu", "cuda:1"),  # a host tensor over NCCL: the current CUDA device
        ("NCCL", "cuda:0", "cuda:0"),
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),
        ("cpu:gloo,cuda:nccl", "cuda:1", "cuda:1"),
        ("mpi", "cpu", "cpu"),
        ("fake", "cpu", "cpu"),  # PyTorch's fake group (simulated worlds): trusted
    ],
)
def test_collective_device_is_one_the_backend_reduces(monkeypatch, backend, device, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert cd.collective_device(backend, torch.device(device)) == torch.device(expected)


def test_collective_device_without_a_cuda_runtime_names_cuda_0(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cd.collective_device("nccl", "cpu") == torch.device("cuda", 0)


def test_all_reduce_reduces_a_copy_on_the_group_s_device_and_copies_it_back(monkeypatch):
    import torch.distributed as dist

    seen = []

    def fake_all_reduce(tensor, op=None, group=None):
        seen.append((tensor.device, tensor.is_contiguous()))
        tensor.mul_(2)  # two ranks holding the same values

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(cd, "collective_device", lambda backend, device: torch.device("cpu"))
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    out = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: reduced as a copy
    cd.all_reduce_(out)
    assert seen == [(torch.device("cpu"), True)]
    assert torch.equal(out, 2 * torch.arange(6.0).reshape(2, 3).t())


def _rank(rank: int) -> list:
    out = torch.full((3, 2), float(rank + 1)).t()  # a host tensor, not contiguous
    cd.all_reduce_(out)
    return out.tolist()


def test_all_reduce_sums_host_tensors_over_two_gloo_ranks():
    results = run_ranks(_rank, timeout=60)
    assert results[0] == results[1] == [[3.0] * 3] * 2
