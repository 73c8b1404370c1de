"""Packed rows never mix sequences: positions made per sequence, use_cache=False, and a refusal where a model would.

NOTE [ Packed rows must not attend across sequences ] (batchfit.models.attention) and
NOTE [ Packed position ids ] (batchfit.batches.layout).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.batches.layout import VARLEN_KWARGS
from batchfit.batches.microbatch import iter_micro_batches
from batchfit.errors import BatchError, InvalidArgument
from batchfit.models import attention as attention_module
from batchfit.models.attention import VARLEN, check_packed_attention, register_varlen_attention
from batchfit.plan.packing import plan_micro_batches
from batchfit.train import model_logprobs
from microbatch_helpers import tiny_lm

LENGTHS = (5, 3, 6, 2)
WIDTH = 8
IMPLEMENTATIONS = ("eager", "sdpa", VARLEN)


def _left_padded(positions: str | None = None) -> dict:
    """Left-padded rows of ``LENGTHS`` tokens; ``positions="arange"``: the arange-over-the-row convention."""
    g = torch.Generator().manual_seed(3)
    columns = torch.arange(WIDTH)
    lengths = torch.tensor(LENGTHS)
    mask = (columns[None, :] >= WIDTH - lengths[:, None]).long()
    batch = {"input_ids": torch.randint(1, 64, (len(LENGTHS), WIDTH), generator=g) * mask, "attention_mask": mask}
    if positions == "arange":
        batch["position_ids"] = columns.expand(len(LENGTHS), WIDTH).clone()
    return batch


def _one_packed_row(batch: dict):
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), sum(LENGTHS), cost="packed")
    (mb,) = iter_micro_batches(batch, plan, layout="packed")
    assert len(mb.indices) == len(LENGTHS)  # every sequence in the one row: they could mix
    return mb


def _model(kind: str, impl: str) -> torch.nn.Module:
    model = tiny_lm(kind, "sdpa").eval()
    if impl == VARLEN:
        register_varlen_attention()
    model.set_attn_implementation(impl)
    assert model.config.use_cache  # the default the finding is about
    return model


def _alone(model, batch: dict, index: int) -> torch.Tensor:
    """Log-softmax of sequence ``index`` run alone, one row without padding: ``[length, vocab]``."""
    ids = batch["input_ids"][index][batch["attention_mask"][index] == 1][None]
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)


def _assert_each_sequence_alone(model, batch, mb, logits: torch.Tensor) -> None:
    rows = mb.unpack(logits.float().log_softmax(-1))
    for row, index in enumerate(mb.indices):
        alone = _alone(model, batch, index)
        assert torch.allclose(rows[row, : alone.shape[0]], alone, atol=1e-5, rtol=0), index


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_model_logprobs_of_a_packed_row_equal_each_sequence_alone(kind, impl):
    model = _model(kind, impl)
    batch = _left_padded()
    mb = _one_packed_row(batch)
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager/sdpa: the T × T mask memory warning
        mb.write_back(out, model_logprobs(model, mb, head="full"))
    for index in range(len(LENGTHS)):
        valid = batch["attention_mask"][index] == 1
        ids = batch["input_ids"][index][valid]
        alone = _alone(model, batch, index)
        expected = torch.cat([torch.zeros(1), alone[:-1].gather(-1, ids[1:, None])[:, 0]])
        assert torch.allclose(out[index][valid], expected, atol=1e-5, rtol=0), (kind, impl, index)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_model_inputs_run_each_sequence_alone_and_a_cache_left_at_its_default_is_refused(kind, impl):
    model = _model(kind, impl)
    batch = _left_padded()
    mb = _one_packed_row(batch)
    inputs = mb.model_inputs()
    assert inputs["use_cache"] is False and "attention_mask" not in inputs
    assert set(VARLEN_KWARGS) <= set(inputs)
    in_row = [LENGTHS[i] for i in mb.indices]
    assert inputs["cu_seq_lens_q"].tolist() == torch.tensor([0, *in_row]).cumsum(0).tolist()
    assert inputs["max_length_q"] == inputs["max_length_k"] == 6
    check_packed_attention(model, inputs)
    with torch.no_grad():
        _assert_each_sequence_alone(model, batch, mb, model(**inputs).logits)
    # use_cache left at the model's default (True): equal, or a clear error, never silently mixed
    default = {k: v for k, v in inputs.items() if k != "use_cache"}
    if impl == VARLEN:
        check_packed_attention(model, default)
        with torch.no_grad():
            _assert_each_sequence_alone(model, batch, mb, model(**default).logits)
    else:
        with pytest.raises(InvalidArgument, match=rf"attn_implementation='{impl}' and a cache.*use_cache=False"):
            check_packed_attention(model, default)


def test_model_logprobs_checks_the_packed_call_it_makes(monkeypatch):
    """model_logprobs runs check_packed_attention on the inputs it passes (use_cache=False, varlen kwargs)."""
    model = _model("llama", "sdpa")
    mb = _one_packed_row(_left_padded())
    monkeypatch.setattr(attention_module, "_transformers_splits_packed_rows", lambda: False)
    for batch in (mb, mb.batch):  # a MicroBatch or its mapping
        with pytest.raises(InvalidArgument, match="does not split packed rows"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model_logprobs(model, batch, head="full")


def test_arange_positions_on_left_padded_rows_restart_at_each_sequence():
    batch = _left_padded(positions="arange")
    mb = _one_packed_row(batch)
    expected = torch.cat([torch.arange(LENGTHS[i]) for i in mb.indices])
    assert torch.equal(mb.batch["position_ids"][0], expected)
    model = _model("qwen2", VARLEN)
    with torch.no_grad():
        _assert_each_sequence_alone(model, batch, mb, model(**mb.model_inputs()).logits)


def test_positions_that_do_not_count_up_over_the_valid_tokens_are_refused():
    batch = _left_padded(positions="arange")
    batch["attention_mask"][1, -2] = 0  # a hole: arange positions skip over it
    batch["input_ids"][1, -2] = 0
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), sum(LENGTHS), cost="packed")
    with pytest.raises(BatchError, match=r"position_ids of row 1 of the batch are \[5, 7\].*do not count up by one"):
        list(iter_micro_batches(batch, plan, layout="packed"))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    offsets=st.data(),
    spoil=st.booleans(),
)
def test_consecutive_positions_become_per_sequence_aranges_and_others_are_refused(lengths, offsets, spoil):
    width = max(lengths) + 2
    columns = torch.arange(width)
    lengths_t = torch.tensor(lengths)
    mask = (columns[None, :] >= width - lengths_t[:, None]).long()
    starts = [offsets.draw(st.integers(0, 50)) for _ in lengths]
    positions = torch.stack([columns - (width - n) + s for n, s in zip(lengths, starts)])
    spoilable = [i for i, n in enumerate(lengths) if n > 1]
    spoil = spoil and bool(spoilable)
    if spoil:
        i = offsets.draw(st.sampled_from(spoilable))
        positions[i, -1] += offsets.draw(st.sampled_from([-3, -1, 1, 5]))  # the last step is not +1
    batch = {"input_ids": mask.clone(), "attention_mask": mask, "position_ids": positions}
    plan = plan_micro_batches(lengths, sum(lengths), cost="packed")
    if spoil:
        with pytest.raises(BatchError, match="do not count up by one"):
            list(iter_micro_batches(batch, plan, layout="packed"))
        return
    (mb,) = iter_micro_batches(batch, plan, layout="packed")
    packed_lengths = [lengths[i] for i in mb.indices]
    assert mb.batch["position_ids"][0].tolist() == [t for n in packed_lengths for t in range(n)]


def _packed_inputs(use_cache=None):
    inputs = {
        "input_ids": torch.zeros(1, 5, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
        "cu_seq_lens_q": torch.tensor([0, 3, 5], dtype=torch.int32),
    }
    if use_cache is not None:
        inputs["use_cache"] = use_cache
    return inputs


def test_check_packed_attention_passes_calls_that_are_not_packed_or_cannot_mix():
    model = _model("llama", "eager")
    check_packed_attention(model, {**_packed_inputs(True), "attention_mask": torch.ones(1, 5)})  # a mask
    check_packed_attention(model, {**_packed_inputs(True), "cu_seq_lens_q": torch.tensor([0, 5])})  # one sequence
    check_packed_attention(model, _packed_inputs(False))
    model.config.use_cache = False
    check_packed_attention(model, _packed_inputs())  # the config's default: no cache
    with pytest.raises(InvalidArgument, match="past_key_values given"):
        check_packed_attention(model, {**_packed_inputs(False), "past_key_values": object()})


def test_check_packed_attention_refuses_a_transformers_that_does_not_split_packed_rows(monkeypatch):
    model = _model("llama", "sdpa")
    monkeypatch.setattr(attention_module, "_transformers_splits_packed_rows", lambda: False)
    with pytest.raises(InvalidArgument, match=r"does not split packed rows.*use_varlen_attention"):
        check_packed_attention(model, _packed_inputs(False))
    model.set_attn_implementation(register_varlen_attention())
    check_packed_attention(model, _packed_inputs())  # varlen reads the boundaries itself


def test_check_packed_attention_warns_once_where_it_cannot_tell(monkeypatch):
    monkeypatch.setattr(attention_module, "_warned_unchecked", set())
    model = _model("llama", "sdpa")
    model.config._attn_implementation = "my_kernel"  # an implementation batchfit does not know
    with pytest.warns(UserWarning, match="attn_implementation='my_kernel' is not one batchfit knows"):
        check_packed_attention(model, _packed_inputs(False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_packed_attention(model, _packed_inputs(False))  # once
