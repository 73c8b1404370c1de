"""batchfit.batches.layout through iter_micro_batches: the cap on real tensors, the prompt | response layout, write-back.

Rollouts are built the way SkyRL and verl lay them out (NOTE [ Sequence and response
columns ]): every token id encodes its row and its place in the sequence, and every
response-width field holds the id of the sequence token it belongs to, so alignment,
loss and duplication are all checked by value.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import BatchError, BudgetError
from batchfit.batches.layout import field_roles
from batchfit.batches.microbatch import iter_micro_batches
from batchfit.plan.packing import plan_micro_batches


def rollouts(prompts: list[int], responses: list[int], P: int, R: int, side: str, mask_key="attention_mask"):
    """Rows of prompt + response tokens; ``side``: skyrl (P left-padded | R right-padded), left, right."""
    n = len(prompts)
    W = P + R
    ids = torch.zeros(n, W, dtype=torch.long)
    mask = torch.zeros(n, W, dtype=torch.long)
    loss = torch.zeros(n, R, dtype=torch.long)
    adv = torch.zeros(n, R, dtype=torch.float64)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        length = p + r
        token = [1000 * (i + 1) + t for t in range(length)]
        start = {"skyrl": P - p, "left": W - length, "right": 0}[side]
        ids[i, start : start + length] = torch.tensor(token)
        mask[i, start : start + length] = 1
        if side != "right":
            # response column j belongs to sequence column W - R + j
            for t in range(p, length):
                j = start + t - (W - R)
                loss[i, j] = 1
                adv[i, j] = token[t]
    batch = {"input_ids": ids, mask_key: mask, "uid": [f"u{i}" for i in range(n)]}
    if side != "right":
        batch.update(loss_mask=loss, advantages=adv)
    return batch


layouts = st.sampled_from(["skyrl", "left", "right"])


@st.composite
def cases(draw):
    side = draw(layouts)
    n = draw(st.integers(1, 12))
    P = draw(st.integers(1, 10))
    R = draw(st.integers(1, 10))
    prompts = draw(st.lists(st.integers(1, P), min_size=n, max_size=n))
    responses = draw(st.lists(st.integers(1, R), min_size=n, max_size=n))
    dp = draw(st.integers(1, 3))
    longest = max(p + r for p, r in zip(prompts, responses))
    budget = draw(st.integers(longest, 4 * longest))
    return side, prompts, responses, P, R, dp, budget


@given(cases())
@settings(max_examples=150, deadline=None)
def test_padded_micro_batches_hold_the_cap_keep_alignment_and_lose_nothing(case):
    side, prompts, responses, P, R, dp, budget = case
    batch = rollouts(prompts, responses, P, R, side)
    lengths = batch["attention_mask"].sum(-1)
    plan = plan_micro_batches(lengths, budget, dp_size=dp, cost="padded")
    seen = []
    rebuilt = torch.zeros_like(batch["input_ids"])
    for rank in range(dp):
        for mb in iter_micro_batches(batch, plan, rank):
            ids, mask = mb.batch["input_ids"], mb.batch["attention_mask"]
            rows, width = ids.shape
            assert rows * width <= mb.cost <= budget  # the cap, on the tensors
            if "loss_mask" in mb.batch:
                loss, adv = mb.batch["loss_mask"], mb.batch["advantages"]
                r = loss.shape[1]
                assert r <= width and adv.shape == loss.shape
                # response column j is sequence column width - r + j, in every row
                tail = ids[:, width - r :]
                assert torch.equal(adv[loss == 1], tail[loss == 1].double())
            if mb.is_padding:
                assert mask.sum() == 1 and mb.batch.get("loss_mask", torch.zeros(1)).sum() == 0
                continue
            seen += ids[mask == 1].tolist()
            mb.write_back(rebuilt, ids)
    assert sorted(seen) == sorted(batch["input_ids"][batch["attention_mask"] == 1].tolist())
    valid = batch["attention_mask"] == 1
    assert torch.equal(rebuilt[valid], batch["input_ids"][valid])


def test_a_skyrl_micro_batch_is_longest_wide_not_the_union_of_spans():
    # short prompt + long response and long prompt + short response: the spans cover all 10
    # columns, but the longest sequence is 6 tokens, so 2 rows cost 12, not 20
    batch = rollouts([1, 5], [5, 1], P=5, R=5, side="skyrl")
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 12, cost="padded")
    (mb,) = iter_micro_batches(batch, plan)
    assert mb.batch["input_ids"].shape == (2, 6) and mb.cost == 12
    assert mb.batch["loss_mask"].shape == (2, 5)  # response columns that belong to the kept 6
    assert mb.batch["loss_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]


def test_response_fields_are_written_back_to_their_columns():
    batch = rollouts([2, 4, 1], [3, 1, 4], P=4, R=4, side="skyrl")
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 10, cost="padded")
    out = torch.zeros_like(batch["advantages"])
    for mb in iter_micro_batches(batch, plan):
        mb.write_back(out, mb.batch["advantages"], response=True)
    assert torch.equal(out, batch["advantages"])


def test_padding_micro_batches_honour_custom_keys_and_carry_response_fields():
    batch = rollouts([2], [2], P=3, R=3, side="skyrl", mask_key="attn")
    batch["mask"] = batch.pop("loss_mask")
    plan = plan_micro_batches([4], 8, dp_size=2)
    pads = [
        mb
        for rank in range(2)
        for mb in iter_micro_batches(
            batch,
            plan,
            rank,
            attention_mask_key="attn",
            loss_mask_key="mask",
            pad_values={"input_ids": 7},
            response_fields=["mask", "advantages"],
        )
        if mb.is_padding
    ]
    (pad,) = pads
    assert pad.batch["attn"].tolist() == [[1]] and pad.batch["input_ids"].tolist() == [[7]]
    assert pad.batch["mask"].tolist() == [[0]] and pad.batch["advantages"].shape == (1, 1)
    assert pad.cost == 1


def test_a_mask_with_holes_breaks_the_plan_loudly():
    batch = {"attention_mask": torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]]), "input_ids": torch.ones(2, 4)}
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 4, cost="padded")  # lengths 2, 2
    with pytest.raises(BudgetError, match=r"2 rows × 4 columns = 8 tokens, above its planned cost 4"):
        list(iter_micro_batches(batch, plan))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"response_fields": ["nope"]}, r"response_fields names 'nope'", id="missing"),
        pytest.param({"token_fields": ["loss_mask"]}, r"token field 'loss_mask' must be 7 columns wide", id="narrow-token"),
        pytest.param(
            {"token_fields": ["input_ids"], "response_fields": ["input_ids"]},
            r"both a token and a response field",
            id="both",
        ),
    ],
)
def test_field_roles_name_the_field_and_the_fix(kwargs, match):
    batch = rollouts([2], [2], P=4, R=3, side="skyrl")
    with pytest.raises(BatchError, match=match):
        field_roles(batch, **kwargs)


def test_field_roles_guess_by_width_and_name():
    batch = rollouts([2], [2], P=4, R=3, side="skyrl")
    batch["features"] = torch.zeros(1, 3)  # narrower, but not a known response name: left alone
    roles = field_roles(batch)
    assert set(roles.token) == {"input_ids", "attention_mask"}
    assert set(roles.response) == {"loss_mask", "advantages"} and roles.response_width == 3


# ---------------------------------------------------------------- packed rows


def _model(kind: str, attn: str) -> torch.nn.Module:
    from microbatch_helpers import tiny_lm

    return tiny_lm(kind, attn).eval()


def _small_ids(batch):
    out = dict(batch)
    out["input_ids"] = torch.where(batch["attention_mask"] == 1, batch["input_ids"] % 61 + 1, 0)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_forward_gives_each_sequence_s_own_log_probs(kind, attn):
    model = _model(kind, attn)
    batch = _small_ids(rollouts([3, 1, 4, 2, 5], [4, 6, 2, 3, 1], P=5, R=6, side="skyrl"))
    lengths = batch["attention_mask"].sum(-1)
    plan = plan_micro_batches(lengths, 20, cost="packed")
    for mb in iter_micro_batches(batch, plan, layout="packed"):
        ids, positions = mb.batch["input_ids"], mb.batch["position_ids"]
        assert ids.shape == (1, mb.cost) and mb.cost <= 20 and "attention_mask" not in mb.batch
        assert mb.batch["cu_seq_lens"].tolist() == [0, *torch.tensor(mb.packed.lengths).cumsum(0).tolist()]
        with torch.no_grad():
            logp = model(input_ids=ids, position_ids=positions, use_cache=False).logits.log_softmax(-1)
        rows = mb.unpack(logp)  # [sequences, longest, vocab]
        for row, index in enumerate(mb.indices):
            alone_ids = batch["input_ids"][index][batch["attention_mask"][index] == 1][None]
            with torch.no_grad():
                alone = model(input_ids=alone_ids, use_cache=False).logits.log_softmax(-1)[0]
            assert torch.allclose(rows[row, : alone.shape[0]], alone, atol=1e-5), (kind, attn, index)


def test_packed_response_fields_follow_their_tokens_and_write_back():
    batch = rollouts([3, 1, 4], [2, 5, 3], P=4, R=5, side="skyrl")
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 9, cost="packed", dp_size=2)
    rebuilt = torch.zeros_like(batch["input_ids"])
    for rank in range(2):
        for mb in iter_micro_batches(batch, plan, rank, layout="packed"):
            ids, loss, adv = mb.batch["input_ids"][0], mb.batch["loss_mask"][0], mb.batch["advantages"][0]
            assert ids.shape == loss.shape == adv.shape
            assert torch.equal(adv[loss == 1], ids[loss == 1].double())  # each response value on its token
            assert (loss[mb.batch["position_ids"][0] == 0] == 0).all()  # first tokens are prompt
            mb.write_back(rebuilt, mb.batch["input_ids"])
            if mb.is_padding:
                assert ids.shape == (1,) and loss.sum() == 0 and mb.batch["max_length"] == 1
    assert torch.equal(rebuilt, batch["input_ids"])


def test_a_packed_micro_batch_loop_gives_the_whole_mini_batch_gradient():
    from microbatch_helpers import grads, make_batch, relative_error, tiny_model, whole_batch_grads

    batch = make_batch(num_sequences=8)
    expected = whole_batch_grads(batch)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 24, cost="packed")
    model = tiny_model()
    for mb in iter_micro_batches(batch, plan, layout="packed"):
        ids, positions, weights = mb.batch["input_ids"], mb.batch["position_ids"], mb.batch["weights"]
        logp = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, :-1].log_softmax(-1)
        per_token = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        # a sequence's first token is never predicted: its weight is 0 (the prompt), so the
        # prediction across a boundary adds nothing
        (per_token * weights[:, 1:]).sum().backward()
    assert relative_error(grads(model), expected) < 1e-6


def test_unpack_round_trips_each_sequence_s_tokens():
    batch = rollouts([2, 5, 1, 3], [4, 1, 6, 2], P=5, R=6, side="skyrl")
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 11, cost="packed")
    for mb in iter_micro_batches(batch, plan, layout="packed"):
        rows = mb.unpack(mb.batch["input_ids"])
        for row, index in enumerate(mb.indices):
            tokens = batch["input_ids"][index][batch["attention_mask"][index] == 1]
            assert torch.equal(rows[row, : len(tokens)], tokens)
            assert (rows[row, len(tokens) :] == 0).all()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_custom_keys_reach_every_calling_form(layout):
    from batchfit.batches.minibatch import pad_for_data_parallel, pad_rows

    batch = rollouts([2, 3, 1], [2, 1, 3], P=3, R=3, side="skyrl", mask_key="valid")
    batch["mask"] = batch.pop("loss_mask")
    keys = {"attention_mask_key": "valid", "loss_mask_key": "mask", "pad_values": {"input_ids": 9}}
    one = pad_rows(batch, 1, **keys)
    assert one["valid"].sum() == 1 and one["mask"].sum() == 0 and (one["input_ids"] == 9).all()
    padded, n_pad = pad_for_data_parallel(batch, 4, **keys)
    assert n_pad == 1 and padded["valid"][-1].sum() == 1 and padded["mask"][-1].sum() == 0
    plan = plan_micro_batches(padded["valid"].sum(-1), 6, dp_size=2, cost="packed")
    for rank in range(2):
        for mb in iter_micro_batches(padded, plan, rank, layout=layout, response_fields=["mask", "advantages"], **keys):
            fields = mb.batch
            if layout == "packed":
                assert "valid" not in fields and fields["input_ids"].shape == fields["mask"].shape
            else:
                assert fields["mask"].shape[1] <= fields["valid"].shape[1]
