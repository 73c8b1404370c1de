"""Every input to the public API gets a batchfit error or a right answer (issue 21).

Hypothesis mixes valid arguments with junk (None, strings, nested lists, dicts, NaN/inf, bools
where ints are meant, empty and wrong-rank tensors, huge integers) for each entry point and
asserts that the call either returns a result that keeps its invariants or raises an error
of batchfit's family that is also a ``ValueError`` -- never a raw ``TypeError``/``IndexError``/
``AttributeError``/``OverflowError`` from deep inside.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchfit import BatchConfig, BatchfitError
from batchfit.batches import (
    concat_batches,
    iter_micro_batches,
    loss_weights,
    mini_batch_boundaries,
    pad_for_data_parallel,
    prompt_boundaries,
    slice_batch,
    split_for_data_parallel,
    take_rows,
)
from batchfit.batches.minibatch import pad_rows
from batchfit.batches.weights import REDUCTIONS
from batchfit.errors import InvalidArgument
from batchfit.parallel import sync_micro_batch_count
from batchfit.plan import largest_fitting, plan_micro_batches

FAST = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))

HUGE = [2**63, 2**64 + 1, 10**30, -(10**30), 10**400]

junk = st.one_of(
    st.none(),
    st.text(max_size=4),
    st.booleans(),
    st.just([[1, 2], [3]]),
    st.just([[1], [2]]),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2),
    st.sampled_from([math.nan, math.inf, -math.inf, 1.5, -0.0]),
    st.sampled_from(HUGE),
    st.just(object()),
    st.just(1 + 2j),
    st.builds(torch.empty, st.just(0)),
    st.builds(torch.empty, st.just(0), st.just(3)),
    st.just(torch.tensor(3)),
    st.just(torch.ones(2, 2, 2)),
    st.just(torch.tensor([math.nan, 1.0])),
    st.just(np.array([[1, 2]])),
    st.just(np.float64("nan")),
)


def maybe(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly valid values, sometimes junk."""
    return st.one_of(valid, valid, junk)


@contextlib.contextmanager
def batchfit_error_or_result():
    """Only errors of batchfit's family (which are also ``ValueError``) may escape."""
    try:
        yield
    except BatchfitError as exc:
        assert isinstance(exc, ValueError), f"{type(exc).__name__} is not a ValueError: {exc}"
        assert str(exc), "an error without a message"


# ------------------------------------------------------------------ plans


INT_FIELDS = (
    "n_samples_per_prompt",
    "micro_train_batch_size_per_gpu",
    "micro_forward_batch_size_per_gpu",
    "update_epochs_per_batch",
    "tensor_parallel",
)
OPTIONAL_FIELDS = ("critic_mini_batch_size", "max_tokens_per_micro_batch", "world_size", "num_nodes", "gpus_per_node")


@FAST
@given(
    train=maybe(st.integers(1, 16)),
    mini=maybe(st.integers(1, 8)),
    ints=st.fixed_dictionaries({k: maybe(st.integers(1, 4)) for k in INT_FIELDS}),
    optional=st.fixed_dictionaries({k: maybe(st.none() | st.integers(1, 8)) for k in OPTIONAL_FIELDS}),
    step_wise=maybe(st.booleans()),
    framework=maybe(st.sampled_from(["batchfit", "skyrl", "verl"])),
    strict=maybe(st.booleans()),
    big=st.booleans(),
)
def test_batch_config_plan(train, mini, ints, optional, step_wise, framework, strict, big):
    if big and isinstance(train, int) and not isinstance(train, bool):
        train *= 10**12  # with a string epochs field this used to build a 10¹²-character string
    cfg = BatchConfig(train, mini, **ints, **optional, step_wise=step_wise, framework=framework)
    with batchfit_error_or_result():
        plan = cfg.plan(strict=strict)
        assert plan.optimizer_steps_per_step == train // mini * ints["update_epochs_per_batch"]
        assert plan.dp_size * plan.model_parallel_size == plan.world_size
        plan.to_dict()
        str(plan)


lengths_valid = st.lists(st.integers(1, 50), max_size=12)


@FAST
@given(
    lengths=maybe(
        lengths_valid
        | st.builds(lambda v: torch.tensor(v, dtype=torch.long), lengths_valid)
        | st.lists(st.one_of(st.integers(1, 9), junk), min_size=1, max_size=3)
    ),
    budget=maybe(st.integers(1, 120)),
    dp=maybe(st.integers(1, 4)),
    cost=maybe(st.sampled_from(["padded", "packed"])),
    balance=maybe(st.booleans()),
    oversize=maybe(st.sampled_from(["raise", "alone"])),
)
def test_plan_micro_batches(lengths, budget, dp, cost, balance, oversize):
    with batchfit_error_or_result():
        plan = plan_micro_batches(lengths, budget, dp_size=dp, cost=cost, balance=balance, oversize=oversize)
        assert sorted(plan.order().tolist()) == list(range(len(lengths)))
        assert len({len(r) for r in plan.ranks}) <= 1
        for rank, costs in zip(plan.ranks, plan.costs):
            for mb, c in zip(rank, costs):
                assert c <= budget or set(mb) <= set(plan.oversize)


@st.composite
def plans(draw):
    lengths = draw(st.lists(st.integers(1, 12), min_size=0, max_size=8))
    return plan_micro_batches(lengths, 24, dp_size=draw(st.integers(1, 3)), cost=draw(st.sampled_from(["padded", "packed"])))


@FAST
@given(
    plan=plans(),
    kind=st.sampled_from(["list", "tuple", "array", "tensor", "junk"]),
    rank=maybe(st.none() | st.integers(0, 3)),
    junk_outputs=junk,
    count=maybe(st.integers(0, 12)),
)
def test_restore_order_and_pad_to(plan, kind, rank, junk_outputs, count):
    n = plan.num_sequences
    with batchfit_error_or_result():
        order = plan.order(rank)
        outputs = {
            "list": order.tolist(),
            "tuple": tuple(order.tolist()),
            "array": order,
            "tensor": torch.as_tensor(order),
            "junk": junk_outputs,
        }[kind]
        restored = plan.restore_order(outputs, rank)
        if kind != "junk":
            values = [int(v) for v in restored]
            assert values == (sorted(order.tolist()) if rank is not None else list(range(n)))
    with batchfit_error_or_result():
        padded = plan.pad_to(count)
        assert padded.num_micro_batches == count
        assert sorted(padded.order().tolist()) == list(range(n))
    with batchfit_error_or_result():
        synced = sync_micro_batch_count(plan if kind != "junk" else junk_outputs)
        assert synced is plan


@FAST
@given(
    answer=st.integers(0, 300),
    verdict=st.sampled_from(["bool", "numpy", "junk"]),
    junk_verdict=junk,
    low=maybe(st.integers(1, 20)),
    high=maybe(st.none() | st.integers(1, 400)),
    guess=maybe(st.none() | st.floats(allow_nan=True) | st.just(junk)),
    start=maybe(st.none() | st.integers(1, 50)),
)
def test_largest_fitting(answer, verdict, junk_verdict, low, high, guess, start):
    def probe(size):
        fits = size <= answer
        return {"bool": fits, "numpy": np.bool_(fits), "junk": junk_verdict}[verdict]

    if isinstance(guess, st.SearchStrategy):
        guess_fn = lambda trials: junk_verdict  # noqa: E731 - a guess that returns junk
    elif isinstance(guess, float) or guess is None:
        guess_fn = None if guess is None else (lambda trials, g=guess: g)
    else:
        guess_fn = guess  # junk where a function is meant
    with batchfit_error_or_result():
        result = largest_fitting(probe, low=low, high=high, guess=guess_fn, start=start)
        assert len(result.trials) <= result.max_trials
        if verdict != "junk":
            assert result.batch_size == (max(low - 1, min(answer, high)) if high is not None else max(low - 1, answer))


# ------------------------------------------------------------------ batches


def _valid_batch(n: int, width: int = 4) -> dict:
    mask = torch.zeros(n, width, dtype=torch.long)
    for i in range(n):
        mask[i, : 1 + i % width] = 1
    return {
        "input_ids": torch.arange(n * width).reshape(n, width),
        "attention_mask": mask,
        "loss_mask": mask.clone(),
        "uid": [f"p{i // 2}" for i in range(n)],
        "meta": "run-1",
    }


batches = st.one_of(
    st.integers(0, 6).map(_valid_batch),
    st.integers(1, 6).map(lambda n: {**_valid_batch(n), "reward": torch.ones(n + 1)}),  # disagreeing counts
    st.just({1: None, "a": 2}),  # no per-sample field, keys of mixed types
    st.just({"x": np.zeros((3, 2))}),
    st.builds(lambda n, v: {**_valid_batch(n), "extra": v}, st.integers(1, 4), junk),
    st.builds(lambda n, key, v: {**_valid_batch(n), key: v}, st.integers(1, 4), st.sampled_from(["attention_mask", "loss_mask", "input_ids"]), junk),
    junk,
)


@FAST
@given(batch=batches, start=maybe(st.integers(-1, 7)), end=maybe(st.integers(-1, 7)))
def test_slice_batch(batch, start, end):
    with batchfit_error_or_result():
        out = slice_batch(batch, start, end)
        assert all(len(v) == end - start for v in out.values())


indices = st.lists(st.integers(-1, 6), max_size=6)


@FAST
@given(
    batch=batches,
    idx=maybe(indices | indices.map(torch.tensor) | indices.map(np.array) | st.lists(junk, min_size=1, max_size=2)),
)
def test_take_rows(batch, idx):
    with batchfit_error_or_result():
        out = take_rows(batch, idx)
        assert all(len(v) == len(idx) for v in out.values())


@FAST
@given(parts=maybe(st.lists(batches, max_size=3)))
def test_concat_batches(parts):
    with batchfit_error_or_result():
        out = concat_batches(parts)
        assert isinstance(out, dict)


@FAST
@given(
    batch=batches,
    n=maybe(st.integers(-1, 5)),
    loss_key=maybe(st.just("loss_mask")),
    attention_key=maybe(st.just("attention_mask")),
    pad_values=maybe(st.none() | st.just({"input_ids": 7}) | st.dictionaries(st.sampled_from(["input_ids", "uid"]), junk, max_size=1)),
    dp=maybe(st.integers(1, 5)),
)
def test_pad_rows_and_data_parallel(batch, n, loss_key, attention_key, pad_values, dp):
    kw = {"loss_mask_key": loss_key, "pad_values": pad_values, "attention_mask_key": attention_key}
    with batchfit_error_or_result():
        rows = pad_rows(batch, n, **kw)
        assert all(len(v) == n for v in rows.values())
    with batchfit_error_or_result():
        padded, n_pad = pad_for_data_parallel(batch, dp, **kw)
        shards = split_for_data_parallel(padded, dp)
        assert len(shards) == dp and 0 <= n_pad < dp


uids = st.lists(st.integers(0, 3), max_size=8).map(sorted)


@FAST
@given(
    ids=maybe(uids | uids.map(torch.tensor) | st.lists(junk, min_size=1, max_size=3)),
    k=maybe(st.integers(1, 4)),
    partial=maybe(st.booleans()),
)
def test_prompt_and_mini_batch_boundaries(ids, k, partial):
    with batchfit_error_or_result():
        bounds = prompt_boundaries(ids)
        assert sum(e - s for s, e in bounds) == len(ids)
        assert all(e > s for s, e in bounds)
    with batchfit_error_or_result():
        cuts = mini_batch_boundaries(ids, k, allow_partial=partial)
        assert sum(e - s for s, e in cuts) == len(ids)


masks = st.one_of(
    st.tuples(st.integers(0, 5), st.integers(0, 5), st.sampled_from([torch.bool, torch.long, torch.float32, torch.float16])).map(
        lambda t: (torch.rand(t[0], t[1]) > 0.3).to(t[2])
    ),
    st.just(torch.tensor([[1.0, math.nan], [1.0, 1.0]])),
    st.just(torch.tensor([[1.0, math.inf]])),
    st.just(torch.full((2, 2), 1e300, dtype=torch.float64)),
    st.just(torch.ones(2, 2, dtype=torch.complex64)),
    junk,
)
ranges = st.one_of(
    st.none(),
    st.just([]),
    st.lists(st.tuples(st.integers(-1, 6), st.integers(-1, 6)), max_size=3),
    st.lists(junk, min_size=1, max_size=2),
    st.just(["ab"]),
    st.just([(0, 1, 2)]),
    st.just([(0.0, 1.5)]),
    st.just([(True, 2)]),
    st.just([(0, 10**30)]),
)


@FAST
@given(
    mask=masks,
    reduction=maybe(st.sampled_from(REDUCTIONS)),
    mini=ranges,
    prompts=ranges,
    max_seq_len=maybe(st.none() | st.integers(1, 9)),
    dtype=maybe(st.sampled_from([None, torch.float16, torch.bfloat16, torch.float32, torch.float64])),
)
def test_loss_weights(mask, reduction, mini, prompts, max_seq_len, dtype):
    with batchfit_error_or_result():
        w = loss_weights(
            mask, reduction=reduction, mini_batch_boundaries=mini, prompt_boundaries=prompts, max_seq_len=max_seq_len, dtype=dtype
        )
        assert w.shape == mask.shape and bool(torch.isfinite(w).all())
        assert bool((w[mask == 0] == 0).all())


@FAST
@given(
    plan=plans(),
    batch_kind=st.sampled_from(["matching", "matching", "other", "attention_mask", "loss_mask", "input_ids"]),
    field_value=st.sampled_from(
        [
            lambda t: t.float(),
            lambda t: t.bool(),
            lambda t: t.float().masked_fill(t == 0, math.nan),
            lambda t: t[:, :, None],
            lambda t: t.tolist(),
            lambda t: t[:, :3],
            lambda t: t[:, 0],
        ]
    ),
    other=batches,
    rank=maybe(st.integers(0, 3)),
    trim=maybe(st.booleans()),
    attention_key=maybe(st.just("attention_mask")),
    loss_key=maybe(st.just("loss_mask")),
    pad_values=maybe(st.none() | st.just({"input_ids": 0})),
    fields=maybe(st.none() | st.just(["input_ids"]) | st.lists(junk, min_size=1, max_size=2)),
    layout=maybe(st.sampled_from(["padded", "packed"])),
    junk_plan=st.one_of(st.none(), junk),
)
def test_iter_micro_batches(plan, batch_kind, field_value, other, rank, trim, attention_key, loss_key, pad_values, fields, layout, junk_plan):
    if batch_kind != "other":
        n, lengths = plan.num_sequences, plan.lengths.tolist()
        mask = torch.zeros(n, 12, dtype=torch.long)
        for i, length in enumerate(lengths):
            mask[i, :length] = 1
        batch = {"input_ids": torch.arange(n * 12).reshape(n, 12), "attention_mask": mask, "loss_mask": mask.clone()}
        if batch_kind in batch:  # one field of the right rows made odd: float, bool, NaN, 3-D, a list
            batch[batch_kind] = field_value(batch[batch_kind])
    else:
        batch = other
    with batchfit_error_or_result():
        out = list(
            iter_micro_batches(
                batch,
                plan if junk_plan is None else junk_plan,
                rank,
                trim=trim,
                attention_mask_key=attention_key,
                loss_mask_key=loss_key,
                pad_values=pad_values,
                token_fields=fields,
                layout=layout,
            )
        )
        assert len(out) == plan.num_micro_batches
        assert sorted(i for mb in out for i in mb.indices) == sorted(plan.order(rank).tolist())


# ------------------------------------------------------------------ numbers


@pytest.mark.parametrize(
    ("reduction", "tokens"), [("token_mean", 50_000), ("sequence_mean", 300_007), ("token_mean", 700_000)]
)
def test_float16_weights_sum_to_one_within_its_epsilon(reduction, tokens):
    # 1/700k is a float16 subnormal (grid 2**-24): cast one by one, every weight rounded the same
    # way and the sum was 1 ± 1.36e-3, 1.4× float16's epsilon (NOTE [ Float16 weights keep their sums ])
    rows = 1000
    mask = torch.zeros(rows, -(-tokens // rows), dtype=torch.bool)
    mask.view(-1)[:tokens] = True
    w = loss_weights(mask, reduction=reduction, dtype=torch.float16)
    assert w.dtype == torch.float16
    assert abs(float(w.double().sum()) - 1.0) <= torch.finfo(torch.float16).eps
    assert bool((w[~mask] == 0).all()) and bool((w[mask] > 0).all())
    exact = loss_weights(mask, reduction=reduction, dtype=torch.float64)
    assert float((w.double() - exact).abs().max()) < 2**-24  # each weight within one grid step


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 4000), min_size=1, max_size=16),
    k=st.integers(1, 4),
    reduction=st.sampled_from(REDUCTIONS),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    binary=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_low_precision_weights_keep_each_mini_batch_sum(counts, k, reduction, dtype, binary, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(counts), max(counts) or 1)
    for i, c in enumerate(counts):
        mask[i, :c] = 1.0 if binary else torch.rand(c, generator=gen) * 2
    mini = [(s, min(s + k, len(counts))) for s in range(0, len(counts), k)]
    prompts = [(i, i + 1) for i in range(len(counts))]
    kw = {"reduction": reduction, "mini_batch_boundaries": mini, "prompt_boundaries": prompts}
    exact = loss_weights(mask, dtype=torch.float64, **kw)
    low = loss_weights(mask, dtype=dtype, **kw)
    assert bool((low[mask == 0] == 0).all())
    for s, e in mini:
        want = float(exact[s:e].sum())
        assert abs(float(low[s:e].double().sum()) - want) <= torch.finfo(dtype).eps * want + 2**-24


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_mask_is_refused(bad):
    mask = torch.ones(3, 4)
    mask[1, 2] = bad
    with pytest.raises(InvalidArgument, match=r"loss_mask must be finite.*\[1, 2\]"):
        loss_weights(mask, reduction="token_mean")


@pytest.mark.parametrize(
    ("field", "value"),
    [("update_epochs_per_batch", {}), ("update_epochs_per_batch", None), ("update_epochs_per_batch", "abc"), ("train_batch_size", 10**400)],
)
def test_junk_config_fields_are_faults_naming_field_value_and_fix(field, value):
    cfg = BatchConfig(8, 4).replace(**{field: value})
    with pytest.raises(InvalidArgument, match=field) as info:
        cfg.plan()
    assert len(str(info.value)) < 400


def test_lengths_nested_unevenly_are_refused_by_name():
    """Found by the property test under load: numpy could read this neither as numbers nor as objects."""
    from batchfit import plan_micro_batches

    with pytest.raises(BatchfitError, match=r"lengths\[0\]"):
        plan_micro_batches([[[1, 2], [3]], torch.ones(2, 2, 2)], 8)
