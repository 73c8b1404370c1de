"""Data-dependent shapes under the estimate backend (NOTE [ Integer tensors keep their values ]).

Every step runs through the cpu and the estimate backends, which must agree to the byte (peak
and every category) on masks with random padding; floats stay fake, and a shape that depends
on float data raises an error naming the op.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchfit.errors import BatchfitError
from batchfit.memory import get_backend
from batchfit.memory.backends import BACKENDS
from batchfit.memory.shadow_values import ShadowFakeTensorMode, UnknownValuesError, shadow_of
from batchfit.models import build_causal_lm, use_varlen_attention

pytestmark = pytest.mark.usefixtures("one_thread")

# --------------------------------------------------------------------------- flash-attn's bert_padding, rewritten


class IndexFirstAxis(torch.autograd.Function):
    """flash_attn.bert_padding.index_first_axis: gather rows by index, scatter the gradient back."""

    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        ctx.first_axis_dim, other_shape = input.shape[0], input.shape[1:]
        second_dim = other_shape.numel()
        flat = input.reshape(input.shape[0], second_dim)
        return torch.gather(flat, 0, indices[:, None].expand(-1, second_dim)).reshape(-1, *other_shape)

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        other_shape = grad_output.shape[1:]
        grad_output = grad_output.reshape(grad_output.shape[0], other_shape.numel())
        grad_input = torch.zeros(
            [ctx.first_axis_dim, grad_output.shape[1]], device=grad_output.device, dtype=grad_output.dtype
        )
        grad_input.scatter_(0, indices[:, None].expand(-1, grad_output.shape[1]), grad_output)
        return grad_input.reshape(ctx.first_axis_dim, *other_shape), None


class IndexPutFirstAxis(torch.autograd.Function):
    """flash_attn.bert_padding.index_put_first_axis: scatter rows into zeros, gather the gradient."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        ctx.save_for_backward(indices)
        output = torch.zeros(first_axis_dim, *values.shape[1:], device=values.device, dtype=values.dtype)
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


def unpad_input(hidden_states, attention_mask):
    """flash_attn.bert_padding.unpad_input: (total_nnz, ...), indices, cu_seqlens, max_seqlen, seqlens."""
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return IndexFirstAxis.apply(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, seqlens_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    """flash_attn.bert_padding.pad_input: (batch, seqlen, ...) with zeros where the mask was 0."""
    output = IndexPutFirstAxis.apply(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *output.shape[1:])


def masked_mean(values, mask):
    """verl's masked_mean: the mean of ``values`` where ``mask`` is set."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


# --------------------------------------------------------------------------- measuring one step on both backends


def _measure(backend_name, build, step, host):
    """Peak of ``step(state, **device_data)``; ``state = build()`` in the backend's context, registered.

    The host tensors are copied to the device inside the measured call, as a trainer's
    micro-batch is (NOTE [ Tensors made from host data are allocations ]).
    """
    backend = get_backend(backend_name, round_to=1, reserve_bytes=0)
    with backend.context():
        torch.manual_seed(0)
        state = build()

    def call():
        data = {k: v.to(backend.device, copy=True) for k, v in host.items()}
        step(state, **data)

    return backend.measure(call, register=state)


def _same_on_both(build, step, host):
    cpu = _measure("cpu", build, step, host)
    est = _measure("estimate", build, step, host)
    assert est.peak_bytes == cpu.peak_bytes
    assert est.breakdown == cpu.breakdown
    assert est.phase_peaks == cpu.phase_peaks
    return cpu


@st.composite
def padded_masks(draw, max_batch=4, max_len=24, min_tokens=0):
    """A (B, S) 0/1 int64 attention mask: right, left or arbitrary padding of random lengths."""
    batch = draw(st.integers(1, max_batch))
    seqlen = draw(st.integers(1, max_len))
    side = draw(st.sampled_from(["right", "left", "holes"]))
    rows = []
    for _ in range(batch):
        if side == "holes":
            row = draw(st.lists(st.integers(0, 1), min_size=seqlen, max_size=seqlen))
            rows.append([1] * min_tokens + row[min_tokens:] if sum(row) < min_tokens else row)
        else:
            n = draw(st.integers(min_tokens, seqlen))
            row = [1] * n + [0] * (seqlen - n)
            rows.append(row if side == "right" else row[::-1])
    return torch.tensor(rows, dtype=torch.int64)


_EXAMPLES = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HIDDEN = 8


class _Leaf(torch.nn.Module):
    """One trainable float tensor ``x``: its gradient is counted as ``gradients``."""

    def __init__(self, *shape):
        super().__init__()
        self.x = torch.nn.Parameter(torch.randn(*shape))


def _leaf(*shape):
    return lambda: _Leaf(*shape)


# --------------------------------------------------------------------------- one op at a time


@_EXAMPLES
@given(mask=padded_masks())
def test_masked_select_with_backward_equals_cpu(mask):
    b, s = mask.shape

    def step(x, mask):
        x = x.x
        torch.masked_select(x, mask.bool()[..., None]).square().sum().backward()

    _same_on_both(_leaf(b, s, HIDDEN), step, {"mask": mask})


@_EXAMPLES
@given(mask=padded_masks())
def test_nonzero_equals_cpu(mask):
    def step(x, mask):
        x = x.x
        rows = torch.nonzero(mask)  # (n, 2), int64
        flat = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
        kept = [rows, flat, torch.where(mask.bool())]  # one-argument where: nonzero's columns
        return kept, x.sum()

    _same_on_both(_leaf(1), step, {"mask": mask})


@_EXAMPLES
@given(mask=padded_masks())
def test_boolean_mask_indexing_with_backward_equals_cpu(mask):
    b, s = mask.shape

    def step(x, mask):
        x = x.x
        rows = x[mask.bool()]  # (n, HIDDEN)
        (rows * 2).sum().backward()

    _same_on_both(_leaf(b, s, HIDDEN), step, {"mask": mask})


@_EXAMPLES
@given(mask=padded_masks())
def test_index_select_by_nonzero_indices_with_backward_equals_cpu(mask):
    b, s = mask.shape

    def step(x, mask):
        x = x.x
        indices = torch.nonzero(mask.flatten()).flatten()
        rows = torch.index_select(x.reshape(b * s, HIDDEN), 0, indices)
        rows.tanh().sum().backward()

    _same_on_both(_leaf(b, s, HIDDEN), step, {"mask": mask})


@_EXAMPLES
@given(mask=padded_masks())
def test_unpad_then_pad_round_trip_with_backward_equals_cpu(mask):
    b, s = mask.shape

    def step(x, mask):
        x = x.x
        unpadded, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, mask)
        assert max_seqlen == max(mask.sum(-1).tolist())  # .item() of a known integer: the real value
        assert cu_seqlens.tolist()[-1] == unpadded.shape[0] == int(mask.sum())
        padded = pad_input(unpadded * 3, indices, b, s)
        assert padded.shape == (b, s, HIDDEN)
        padded.sum().backward()

    _same_on_both(_leaf(b, s, HIDDEN), step, {"mask": mask})


@_EXAMPLES
@given(mask=padded_masks(min_tokens=1), vocab=st.sampled_from([16, 33]))
def test_masked_logprobs_and_masked_mean_loss_with_backward_equals_cpu(mask, vocab):
    b, s = mask.shape
    labels = (torch.arange(b * s).reshape(b, s) * 7) % vocab
    advantages = torch.linspace(-1, 1, b * s).reshape(b, s)

    def build():
        return torch.nn.Linear(HIDDEN, vocab, bias=False), torch.randn(b, s, HIDDEN, requires_grad=True)

    def step(state, mask, labels, advantages):
        head, hidden = state
        logits = head(hidden)
        keep = mask.bool()
        # the masked kernel: only the valid positions' logits go through log_softmax
        logp = torch.log_softmax(logits[keep].float(), -1).gather(-1, labels[keep][:, None]).squeeze(-1)
        selected = torch.masked_select(advantages, keep)
        pg = -(logp * selected).mean()
        # the padded kernel with verl's masked_mean over the same positions
        full = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
        loss = pg + masked_mean(-full * advantages, mask)
        loss.backward()

    _same_on_both(build, step, {"mask": mask, "labels": labels, "advantages": advantages})


@_EXAMPLES
@given(mask=padded_masks(min_tokens=1))
def test_sizes_read_from_masks_repeat_interleave_unique_and_split_equal_cpu(mask):
    b, s = mask.shape

    def step(x, mask):
        x = x.x
        seqlens = mask.sum(-1)
        unpadded = x[mask.bool()]  # (n, HIDDEN)
        sequence_of_token = torch.repeat_interleave(torch.arange(b), seqlens)  # tensor repeats
        ids, counts = torch.unique(sequence_of_token, return_counts=True)
        assert counts.tolist() == seqlens.tolist() and ids.numel() == b
        per_sequence = torch.split(unpadded, seqlens.tolist())  # sizes read with .tolist()
        longest = int(seqlens.max())  # a size read with int()
        padded = torch.nn.utils.rnn.pad_sequence(list(per_sequence), batch_first=True)
        assert padded.shape == (b, longest, HIDDEN)
        (padded.square().sum() + unpadded.index_select(0, torch.argsort(sequence_of_token)).sum()).backward()

    _same_on_both(_leaf(b, s, HIDDEN), step, {"mask": mask})


# --------------------------------------------------------------------------- a tiny remove-padding model


class TinyRemovePadding(torch.nn.Module):
    """Embedding, unpad, per-sequence attention from cu_seqlens, MLP, pad, LM head: verl's remove-padding path."""

    def __init__(self, vocab=32, hidden=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
        )
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, attention_mask):
        b, s = input_ids.shape
        x, indices, cu_seqlens, max_seqlen, _ = unpad_input(self.embed(input_ids), attention_mask)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        bounds = cu_seqlens.tolist()
        outs = []
        for start, stop in itertools.pairwise(bounds):  # varlen attention, one sequence at a time
            assert stop - start <= max_seqlen
            if stop > start:
                outs.append(
                    F.scaled_dot_product_attention(
                        q[None, start:stop], k[None, start:stop], v[None, start:stop], is_causal=True
                    )[0]
                )
        x = x + (torch.cat(outs) if outs else torch.zeros_like(x))
        x = x + self.mlp(x)
        return self.head(pad_input(x, indices, b, s))


# the first tier's time (issue 41): remove padding through a model stays in the first tier
# (test_verl_remove_padding_through_a_transformers_model_equals_cpu[varlen])
@pytest.mark.slow
@_EXAMPLES
@given(mask=padded_masks(max_batch=3, max_len=20, min_tokens=1))
def test_a_remove_padding_model_forward_backward_equals_cpu(mask):
    b, s = mask.shape
    input_ids = (torch.arange(b * s).reshape(b, s) * 5) % 32

    def step(model, input_ids, attention_mask):
        logits = model(input_ids, attention_mask)
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        masked_mean(-logp, attention_mask[:, 1:]).backward()

    m = _same_on_both(TinyRemovePadding, step, {"input_ids": input_ids, "attention_mask": mask})
    params = sum(p.numel() for p in TinyRemovePadding().parameters()) * 4
    assert m.breakdown["parameters"] == params


def _hf_row_peak(backend_name, lengths, attention_kernels="cuda"):
    """Forward + backward of the tiny HF model (sdpa) on one row of sequences packed by their position ids."""
    backend = BACKENDS[backend_name](round_to=1, reserve_bytes=0, attention_kernels=attention_kernels)
    model = build_causal_lm("tiny", backend=backend)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    input_ids = (torch.arange(sum(lengths))[None] * 7) % 1000

    def step():
        out = model(
            input_ids=input_ids.to(backend.device, copy=True),
            position_ids=positions.to(backend.device, copy=True),
        )
        out.logits.sum().backward()

    return backend.measure(step, register=model)


def test_a_packed_row_through_sdpa_is_estimated_with_the_mask_the_real_run_builds():
    # NOTE [ Fake tensors are not tracing ]: the known position ids decide "packed" as the real
    # run does; before, a packed row was estimated as unpacked (8.9 MB low here)
    packed = _hf_row_peak("cpu", [300, 500, 224])
    estimated = _hf_row_peak("estimate", [300, 500, 224])
    assert estimated.peak_bytes == packed.peak_bytes and estimated.breakdown == packed.breakdown
    # the block-diagonal (1, 1, 1024, 1024) mask and sdpa's masked path: above one 1024-token sequence
    # under the CPU's flash kernel (under CUDA's, the unmasked float32 row with grouped heads takes
    # the math path, NOTE [ The estimate runs CUDA's attention kernel ])
    masked = _hf_row_peak("cpu", [300, 500, 224], attention_kernels="own")
    assert masked.peak_bytes > _hf_row_peak("cpu", [1024], attention_kernels="own").peak_bytes + 1024 * 1024


def _verl_remove_padding_step(model, input_ids, attention_mask, advantages):
    """verl's dp_actor with use_remove_padding: unpad to one packed row, log-probs, pad back, masked mean."""
    b, s = input_ids.shape
    response = advantages.shape[1]
    position_ids = torch.clip(
        torch.cumsum(attention_mask, dim=-1) - 1, min=0
    )  # compute_position_id_with_mask
    input_ids_rmpad, indices, *_ = unpad_input(input_ids.unsqueeze(-1), attention_mask)
    input_ids_rmpad = input_ids_rmpad.transpose(0, 1)  # (1, total_nnz)
    flat_positions = position_ids.unsqueeze(-1).reshape(b * s, 1)
    position_ids_rmpad = IndexFirstAxis.apply(flat_positions, indices).transpose(0, 1)
    rolled = torch.roll(input_ids_rmpad, shifts=-1, dims=1).squeeze(0)
    logits_rmpad = model(input_ids=input_ids_rmpad, position_ids=position_ids_rmpad, use_cache=False).logits
    logits_rmpad = logits_rmpad.squeeze(0)
    log_probs = torch.log_softmax(logits_rmpad.float(), -1).gather(-1, rolled[:, None]).squeeze(-1)
    full = pad_input(log_probs.unsqueeze(-1), indices, b, s).squeeze(-1)
    log_probs = full[:, -response - 1 : -1]
    masked_mean(-log_probs * advantages, attention_mask[:, -response:]).backward()


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mask=padded_masks(max_batch=3, max_len=16, min_tokens=1))
# the first tier's time (issue 41): varlen, verl's own remove-padding attention, stays in the first tier
@pytest.mark.parametrize("attention", [pytest.param("sdpa", marks=pytest.mark.slow), "varlen"])
def test_verl_remove_padding_through_a_transformers_model_equals_cpu(attention, mask):
    b, s = mask.shape
    host = {
        "input_ids": (torch.arange(b * s).reshape(b, s) * 11) % 1000,
        "attention_mask": mask,
        "advantages": torch.linspace(-1, 1, b * max(s // 2, 1)).reshape(b, max(s // 2, 1)),
    }

    def build():
        model = build_causal_lm("tiny")
        if attention == "varlen":  # batchfit's per-sequence attention reads the packed position ids
            use_varlen_attention(model)
        return model

    _same_on_both(build, _verl_remove_padding_step, host)


# --------------------------------------------------------------------------- floats stay fake


def _remove_padding_head_step(b, s, h, v, lengths):
    """unpad_input, an LM head on the valid tokens only, log-softmax, backward."""
    mask = (torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]).long()

    def build():
        return torch.nn.Linear(h, v, bias=False), torch.randn(b, s, h, requires_grad=True)

    def step(state, mask):
        head, hidden = state
        unpadded, _, _, _, _ = unpad_input(hidden, mask)
        logits = head(unpadded)
        torch.log_softmax(logits, -1)[:, 0].sum().backward()

    return build, step, {"mask": mask}


def test_large_float_tensors_stay_fake_on_a_remove_padding_step(host_memory):
    _measure("estimate", *_remove_padding_head_step(2, 16, 8, 8, [16, 3]))  # first-use costs, small
    # 4 x 8192 tokens, hidden 4096, vocab 8192: the hidden states are 4 * 8192 * 4096 * 4 B = 512 MiB
    lengths = [8192, 5000, 123, 1]
    h, v = 4096, 8192
    start = host_memory.reset_peak()
    m = _measure("estimate", *_remove_padding_head_step(4, 8192, h, v, lengths))
    grown = host_memory.peak() - start
    tokens = sum(lengths)  # 13,316
    assert m.breakdown["parameters"] == h * v * 4  # 134,217,728
    assert m.peak_bytes > 3 * tokens * v * 4  # logits (436 MB), log-softmax, their gradient: 1.3 GB
    # the hidden states alone would make 512 MiB resident; the shadows (mask, indices,
    # lengths: < 1 MB) and the fake machinery a little (bytes, whatever the page size)
    assert grown < 64 * 2**20, grown


# --------------------------------------------------------------------------- what is and is not known


def _mode():
    return ShadowFakeTensorMode(allow_non_fake_inputs=True)


@pytest.mark.parametrize(
    ("op", "match"),
    [
        pytest.param(
            lambda x: torch.nonzero(x > 0),
            r"cannot run aten\.nonzero\.default: an output shape",
            id="nonzero",
        ),
        pytest.param(
            lambda x: x[x > 0],
            r"cannot run aten\.index\.Tensor: an output shape depends on the values of indices",
            id="bool-index",
        ),
        pytest.param(
            lambda x: torch.masked_select(x, x > 0),
            r"cannot run aten\.masked_select\.default: .* of mask",
            id="masked-select",
        ),
        pytest.param(
            lambda x: x.argmax(-1).tolist(),
            r"aten\._local_scalar_dense\.default: a Python number",
            id="tolist",
        ),
        pytest.param(
            lambda x: x.sum().item(),
            r"values of self, a torch\.float32 tensor of shape \(\): float values are never kept",
            id="float-item",
        ),
        pytest.param(
            lambda x: torch.repeat_interleave(x.long().flatten()),
            r"aten\.repeat_interleave\.Tensor",
            id="repeat-interleave",
        ),
        pytest.param(lambda x: torch.unique(x.argmax(-1)), r"aten\._unique2\.default", id="unique"),
    ],
)
def test_a_shape_from_float_data_raises_naming_the_op(op, match):
    with _mode():
        x = torch.randn(4, 8)
        with pytest.raises(UnknownValuesError, match=match) as info:
            op(x)
    assert isinstance(info.value, BatchfitError) and "backend='cpu'" in str(info.value)


def test_a_float_data_dependent_shape_raises_through_the_estimate_backend():
    def step(x):
        x = x.x
        x[x.sum(-1) > 0].sum().backward()  # which rows: decided by float values

    with pytest.raises(UnknownValuesError, match=r"aten\.index\.Tensor") as info:
        _measure("estimate", _leaf(4, 8), lambda x: step(x), {})
    assert info.value.op == "aten.index.Tensor" and info.value.argument == "indices"
    _measure("cpu", _leaf(4, 8), lambda x: step(x), {})  # the real run has the values


def test_item_of_a_known_integer_is_its_real_value():
    host = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    with _mode():
        mask = host.to("cpu", copy=True)
        lengths = mask.sum(-1)
        assert lengths.max().item() == 3 and lengths.tolist() == [2, 3] and bool(mask.any())
        assert int(torch.arange(5).sum()) == 10  # factories are known too
        assert torch.tensor([4, 5]).tolist() == [4, 5]
        assert isinstance(mask.float(), torch.Tensor) and shadow_of(mask.float()) is None  # floats never


def test_a_write_the_shadows_follow_keeps_values_and_any_other_write_drops_them_with_views():
    with _mode():
        ids = torch.arange(6).reshape(2, 3)
        row = ids[1]
        row.add_(10)  # known: followed
        assert ids.tolist() == [[0, 1, 2], [13, 14, 15]] and row.tolist() == [13, 14, 15]
        other = torch.arange(3)
        row.copy_(torch.randn(3).long())  # values from floats: unknown from here, through the view
        assert shadow_of(row) is None and shadow_of(ids) is None
        assert other.tolist() == [0, 1, 2]  # unrelated tensors keep theirs
        with pytest.raises(UnknownValuesError, match=r"aten\.nonzero\.default.*computed from values"):
            torch.nonzero(ids)


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_a_write_through_a_float_view_drops_the_values_of_what_it_views(inference):
    # under inference_mode no version counter exists: the explicit marks alone must do it
    with _mode(), torch.inference_mode(inference):
        ids = torch.arange(4)
        row = ids[1:]
        as_float = row.view(torch.float64)  # same bytes, no values kept
        assert shadow_of(as_float) is None and row.tolist() == [1, 2, 3]
        as_float.fill_(1.5)
        assert shadow_of(ids) is None and shadow_of(row) is None


@_EXAMPLES
@given(mask=padded_masks())
def test_remove_padding_under_inference_mode_equals_cpu(mask):
    # inference tensors have no version counter: the shadows rely on explicit marks alone
    b, s = mask.shape

    def step(x, mask):
        with torch.inference_mode():
            unpadded, indices, cu_seqlens, max_seqlen, _ = unpad_input(x.x * 1, mask)
            assert max_seqlen == max(mask.sum(-1).tolist()) and int(cu_seqlens[-1]) == unpadded.shape[0]
            mask.mul_(2)  # followed: the shadows stay right
            assert int(mask.sum()) == 2 * unpadded.shape[0]
            return pad_input(unpadded, indices, b, s).sum()

    _same_on_both(_leaf(b, s, HIDDEN), step, {"mask": mask})


def test_the_out_form_of_a_data_dependent_op_is_refused_by_name():
    with _mode():
        mask = torch.tensor([1, 0, 1])
        assert torch.nonzero(mask).tolist() == [[0], [2]]
        with pytest.raises(
            UnknownValuesError, match=r"aten\.nonzero\.out: .* its out= form cannot follow it"
        ):
            torch.nonzero(mask, out=torch.empty(0, 1, dtype=torch.long))


def test_integer_tensors_above_the_limit_are_fakes_without_values():
    mode = _mode()
    mode.shadow_limit_bytes = 1024
    with mode:
        small = torch.ones(128, dtype=torch.int64)  # 1024 B: kept
        big = torch.ones(129, dtype=torch.int64)  # 1032 B: not kept
        assert shadow_of(small) is not None and shadow_of(big) is None
        assert shadow_of(big.expand(4, 129)) is None
        assert shadow_of(small.expand(64, 128)) is not None  # a view holds no more than its storage
        with pytest.raises(UnknownValuesError, match=r"1\.01 KiB: integer values are kept up to 1\.00 KiB"):
            torch.nonzero(big)
