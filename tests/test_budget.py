"""batchfit.budget: the memory model, TokenBudget,
find_token_budget on a synthetic backend, on the real cpu backend, and across two gloo ranks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batchfit.budget import (
    BudgetPoint,
    BudgetProgress,
    TokenBudget,
    default_seq_lens,
    find_token_budget,
    fit_memory_model,
    guess_max_batch,
)
from batchfit.budget.probe import candidate_lengths
from batchfit.errors import DoesNotFitError, InvalidArgument
from budget_helpers import SyntheticBackend, shape_step
from multirank import run_ranks

# --------------------------------------------------------------------------- helpers


def linear_quadratic(b, s):
    # 10 MB base + 1000 B per token + 3 B per token per position (attention-like)
    return 10_000_000 + 1_000 * b * s + 3 * b * s * s


def synthetic_budget(peak_fn=linear_quadratic, limit=2_000_000_000, **kwargs):
    be = SyntheticBackend(peak_fn, limit)
    kwargs.setdefault("max_seq_len", 4096)
    kwargs.setdefault("safety_margin", 1.0)
    return find_token_budget(shape_step, backend=be, progress=False, **kwargs), be


# --------------------------------------------------------------------------- memory model (pure)


def test_fit_recovers_the_literal_coefficients():
    # peak = 100 + 2·b·s + 0.1·b·s²: (1,10) -> 100+20+10 = 130, (2,10) -> 160, (1,20) -> 100+40+40 = 180
    model = fit_memory_model([(1, 10, 130), (2, 10, 160), (1, 20, 180)])
    assert (round(model.base), round(model.linear, 6), round(model.quadratic, 6)) == (100, 2.0, 0.1)
    assert model.r2 == pytest.approx(1.0)
    assert model.predict(3, 10) == pytest.approx(190)  # 100 + 60 + 30
    assert model.max_batch_size(10, 190) == pytest.approx(3)  # (190 - 100) / (20 + 10)


@settings(max_examples=40, deadline=None)
@given(
    base=st.integers(0, 10**9),
    a=st.integers(1, 10**5),
    q=st.integers(0, 100),
)
def test_fit_is_exact_on_model_data_and_never_negative(base, a, q):
    pts = [(b, s, base + a * b * s + q * b * s * s) for s in (512, 1024, 4096) for b in (1, 7, 30)]
    model = fit_memory_model(pts)
    assert model.linear >= 0 and model.quadratic >= 0
    assert model.max_residual <= 1e-6 * max(p for *_, p in pts) + 1
    assert model.predict(5, 2048) == pytest.approx(base + a * 5 * 2048 + q * 5 * 2048**2, rel=1e-6)


def test_guess_from_two_probes_solves_the_line():
    # peak = 1000 + 100·b at s=100; limit 2000 -> b = 10
    assert guess_max_batch([(1, 100, 1_100), (2, 100, 1_200)], 100, 2_000) == pytest.approx(10)


def test_guess_for_a_shorter_length_errs_small_with_one_length_known():
    # at s=1000: peak = 0 + 3000·b (a=1, q=0.002 -> 1000 + 2000 per sequence). Linear scaling to s=500
    # predicts 1500 per sequence, the truth is 500 + 500 = 1000: the guess (limit/1500) is below the truth.
    pts = [(1, 1000, 3000), (2, 1000, 6000)]
    guess = guess_max_batch(pts, 500, 30_000)
    assert guess == pytest.approx(20)  # 30000 / 1500; the true answer is 30000 / 1000 = 30
    assert guess <= 30


def test_guess_is_none_without_data():
    assert guess_max_batch([], 128, 1000) is None


# --------------------------------------------------------------------------- TokenBudget


def _budget(tokens, role, max_seq_len=1024):
    point = BudgetPoint(
        seq_len=max_seq_len, max_batch_size=tokens // max_seq_len, peak_bytes=1, next_peak_bytes=2, probes=3
    )
    return TokenBudget(
        tokens=tokens, max_seq_len=max_seq_len, cost="padded", points=(point,), memory_model=None,
        probes=3, limit_bytes=10, usable_bytes=11, safety_margin=0.9, backend="cpu", role=role,
    )  # fmt: skip


def test_token_budget_max_batch_size_and_fits():
    budget = _budget(12288, "policy", max_seq_len=4096)
    assert budget.max_batch_size(1000) == 12  # 12288 // 1000
    assert budget.max_batch_size(4096) == 3  # 12288 // 4096
    assert budget.fits(12, 1000) and not budget.fits(13, 1000)  # 12000 <= 12288 < 13000
    assert not budget.fits(1, 4097)  # longer than the budget covers
    with pytest.raises(InvalidArgument, match="seq_len must be <= max_seq_len=4096"):
        budget.max_batch_size(5000)


def test_min_of_roles_is_the_smallest_and_keeps_every_part():
    policy, critic = _budget(8192, "policy"), _budget(4096, "critic")
    both = TokenBudget.min(policy, critic)
    assert both.tokens == 4096
    assert both.role == "policy+critic" and both.binding_role == "critic"
    assert both.parts == (policy, critic)
    assert both.probes == 6  # 3 + 3
    json.dumps(both.to_dict())


def test_print_of_a_budget_is_one_short_line_with_its_numbers():
    # a budget carrying a long breakdown (the dataclass repr printed every category, point and trial)
    breakdown = {f"category_{i}": 10**9 + i for i in range(60)}
    point = BudgetPoint(
        seq_len=4096, max_batch_size=7, peak_bytes=3 * 1024**3, next_peak_bytes=4 * 1024**3, probes=9,
        breakdown=breakdown,
    )  # fmt: skip
    budget = TokenBudget(
        tokens=28_672, max_seq_len=4096, cost="padded", points=(point,) * 5, memory_model=None, probes=9,
        limit_bytes=61 * 1024**3, usable_bytes=68 * 1024**3, safety_margin=0.9, backend="estimate", role="policy",
    )  # fmt: skip
    assert str(budget) == repr(budget) == (
        "TokenBudget(tokens=28,672, max_seq_len=4,096, cost='padded', role='policy', backend='estimate', "
        "limit=61.00 GiB, probes=9)"
    )
    assert repr(point) == "BudgetPoint(seq_len=4,096, max_batch_size=7, tokens=28,672, peak=3.00 GiB)"
    both = TokenBudget.min(budget, _budget(8192, "critic"))
    assert repr(both).endswith("probes=12, parts=[policy: 28,672, critic: 8,192])")  # 9 + 3 probes
    assert len(repr(both)) < 200


@pytest.mark.parametrize(
    "budgets, match",
    [
        pytest.param((), "at least one budget", id="none"),
        pytest.param((7,), r"budgets\[0\]=7", id="not-a-budget"),
    ],
)
def test_min_rejects_bad_input(budgets, match):
    with pytest.raises(InvalidArgument, match=match):
        TokenBudget.min(*budgets)


# --------------------------------------------------------------------------- find_token_budget (synthetic)


def test_every_reported_max_batch_fits_and_a_searched_ones_next_does_not():
    budget, _ = synthetic_budget()
    for p in budget.points:
        assert linear_quadratic(p.max_batch_size, p.seq_len) <= budget.limit_bytes
        if p.largest:
            assert linear_quadratic(p.max_batch_size + 1, p.seq_len) > budget.limit_bytes
    assert budget.binding_point.largest  # the length that sets C was searched to the row
    # NOTE [ A length that does not bind ]: the shorter lengths hold C = 147,456 tokens and are not
    # searched further; 2,048 and 1,024 lie between the longest and the shortest, and 72 × 2,048 and
    # 144 × 1,024 are cut out of the 36 × 4,096 measured to fit (NOTE [ Lengths the probes already decide ])
    assert [(p.seq_len, p.largest, p.measured, p.probes) for p in budget.points] == [
        (4096, True, True, budget.points[0].probes), (2048, False, False, 0), (1024, False, False, 0), (512, False, True, 1)
    ]
    # C = min over lengths of b·s; at 4096: 10e6 + b·(4096000 + 3·4096²=50331648) <= 2e9 -> b = 36
    assert budget.points[0].seq_len == 4096 and budget.points[0].max_batch_size == 36
    assert budget.tokens == 36 * 4096


def packed_peak(lengths):
    # the linear-quadratic model over the sequences themselves: Σ (1000·l + 3·l²)
    return 10_000_000 + sum(1_000 * n + 3 * n * n for n in lengths)


def test_a_packed_budget_counts_tokens_and_one_more_token_does_not_fit():
    budget, _ = synthetic_budget(packed_peak, cost="packed")
    for p in budget.points:
        fits = candidate_lengths(p.tokens, p.seq_len, "packed")
        assert packed_peak(fits) <= budget.limit_bytes
        if p.largest:
            assert packed_peak(candidate_lengths(p.tokens + 1, p.seq_len, "packed")) > budget.limit_bytes
    # at 4096: 36 sequences take 10e6 + 36·54,427,648 = 1,969,395,328 B; the remaining 30,604,672 B
    # hold r tokens with 1000·r + 3·r² <= 30,604,672 -> r = 3,031 (30,591,883 B; 3,032 need 30,611,072)
    assert budget.points[0].tokens == 36 * 4096 + 3_031
    assert budget.tokens == 36 * 4096 + 3_031 > 36 * 4096  # the padded budget of the same memory
    # rows as a padded search counts them, then the remainder; a shorter length first tries the
    # tokens of the longer one (two probes when they fit there too, as with varlen attention)
    assert budget.points[0].probes <= 8 and max(p.probes for p in budget.points) <= 10


def test_a_packed_budget_holds_every_split_into_shorter_sequences():
    budget, _ = synthetic_budget(packed_peak, cost="packed")
    C = budget.tokens
    for s in (1, 17, 1000, 4095, 4096):
        assert packed_peak(candidate_lengths(C, s, "packed")) <= budget.limit_bytes


def test_probe_count_is_bounded_and_warm_starts_need_fewer():
    budget, backend = synthetic_budget()
    per_length = [p.probes for p in budget.points]
    assert budget.probes == len(backend.calls) == sum(per_length)
    assert max(per_length) <= 8
    assert all(n <= 3 for n in per_length[1:]), per_length  # the memory model predicts; 2-3 verify


@pytest.mark.parametrize("kind", ["plateau", "steps"])
def test_search_stays_exact_and_cheap_when_memory_is_not_exactly_the_model(kind):
    peak_fns = {
        # the optimizer step sets a floor at small batches
        "plateau": lambda b, s: max(50_000_000, 10_000_000 + 1_500 * b * s + b * s * s),
        # allocations come in 4 KiB pages
        "steps": lambda b, s: 10_000_000 + 4096 * math.ceil(1_500 * b * s / 4096) + (b * s * s) // 2,
    }
    budget, _ = synthetic_budget(peak_fns[kind])
    for p in budget.points:
        assert peak_fns[kind](p.max_batch_size, p.seq_len) <= budget.limit_bytes
        if p.largest:
            assert peak_fns[kind](p.max_batch_size + 1, p.seq_len) > budget.limit_bytes
    assert max(p.probes for p in budget.points) <= 8


def test_the_budget_holds_at_every_length_under_the_model():
    budget, _ = synthetic_budget()
    assert "agrees at every length" in budget.model_check
    for s in range(1, 4097, 37):
        b = budget.max_batch_size(s)
        assert linear_quadratic(b, s) <= budget.limit_bytes


def test_safety_margin_scales_the_limit():
    budget, _ = synthetic_budget(safety_margin=0.5)
    assert budget.limit_bytes == 1_000_000_000  # 0.5 × 2e9
    # at 4096: (1e9 - 1e7) / 54427648 = 18.19 -> 18
    assert budget.points[0].max_batch_size == 18


def test_one_sequence_that_does_not_fit_names_what_to_reduce():
    with pytest.raises(DoesNotFitError, match=r"max_seq_len=4096 does not fit.*reduce max_seq_len") as info:
        synthetic_budget(limit=20_000_000)  # one sequence of 4096 needs 10e6 + 54.4e6 bytes
    assert info.value.available == 20_000_000


def test_progress_callback_sees_every_probe_and_nothing_is_printed(capsys):
    events: list[BudgetProgress] = []
    be = SyntheticBackend(linear_quadratic, 2_000_000_000)
    budget = find_token_budget(
        shape_step, max_seq_len=1024, backend=be, progress=events.append, role="critic"
    )
    probes = [e for e in events if e.probe is not None]
    done = [e for e in events if e.probe is None]
    assert len(probes) == budget.probes
    # the longest and the shortest length first, then those between (NOTE [ Lengths the probes already decide ])
    assert [e.seq_len for e in done] == [1024, 128, 512, 256]
    assert sorted(e.seq_len for e in done) == sorted(p.seq_len for p in budget.points)
    assert all(e.role == "critic" for e in events)
    find_token_budget(shape_step, max_seq_len=1024, backend=be, progress=True)
    assert capsys.readouterr() == ("", "")


def test_seq_lens_always_include_max_seq_len_longest_first():
    assert default_seq_lens(4096) == [4096, 2048, 1024, 512]
    assert default_seq_lens(2) == [2]  # 1 is dropped: a next-token loss needs two tokens
    assert default_seq_lens(1) == [1]
    budget, _ = synthetic_budget(seq_lens=[100, 1000])
    assert [p.seq_len for p in budget.points] == [4096, 1000, 100]


def test_to_dict_is_json():
    budget, _ = synthetic_budget()
    data = json.loads(json.dumps(budget.to_dict()))
    assert data["tokens"] == budget.tokens
    assert set(data["memory_model"]) == {"base", "linear", "quadratic", "r2", "max_residual", "n_points"}
    assert len(data["trials"]) == budget.probes


BAD_ARGUMENTS = [
    pytest.param({"max_seq_len": 0}, "max_seq_len must be an integer >= 1", id="max_seq_len-zero"),
    pytest.param({"max_seq_len": True}, "max_seq_len must be an integer", id="max_seq_len-bool"),
    pytest.param({"safety_margin": 0.0}, r"safety_margin must be in \(0, 1\]", id="margin-zero"),
    pytest.param({"safety_margin": 1.5}, r"safety_margin must be in \(0, 1\]", id="margin-above-one"),
    pytest.param({"cost": "pad"}, "did you mean 'padded'", id="cost-typo"),
    pytest.param({"seq_lens": [8192]}, "seq_lens must be <= max_seq_len=4096", id="seq-len-too-long"),
    pytest.param({"seq_lens": "4096"}, "seq_lens must be a sequence", id="seq-lens-string"),
    pytest.param({"seq_lens": [0]}, r"seq_lens\[0\] must be an integer >= 1", id="seq-len-zero"),
    pytest.param({"progress": "yes"}, "progress must be True, False or a callable", id="progress-string"),
    pytest.param({"backend": "gpu"}, "backend must be one of", id="backend-unknown"),
    pytest.param({"backend": object()}, "backend must be a backend name or a batchfit.memory.Backend", id="backend-object"),
]


@pytest.mark.parametrize("kwargs, match", BAD_ARGUMENTS)
def test_invalid_arguments_are_named(kwargs, match):
    be = SyntheticBackend(linear_quadratic, 2_000_000_000)
    kwargs = {"max_seq_len": 4096, "backend": be, **kwargs}
    with pytest.raises(InvalidArgument, match=match):
        find_token_budget(shape_step, **kwargs)


def test_a_backend_without_a_limit_asks_for_memory_limit():
    be = SyntheticBackend(linear_quadratic, None)
    with pytest.raises(
        InvalidArgument, match=r"memory_limit must be given for backend 'synthetic'.*pass memory_limit='80GiB'"
    ):
        find_token_budget(shape_step, max_seq_len=64, backend=be)


# --------------------------------------------------------------------------- real cpu backend


class TinyLM(torch.nn.Module):
    """Embedding -> MLP -> vocabulary logits: memory grows with b·s, exactly measured on cpu."""

    def __init__(self, vocab=64, hidden=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
        )
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids):
        return self.head(self.mlp(self.embed(ids)))


def make_tiny_step(vocab=64):
    torch.manual_seed(0)
    model = TinyLM(vocab)

    def step(lengths):
        ids = torch.randint(0, vocab, (len(lengths), max(lengths)))
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        model.zero_grad(set_to_none=True)

    return step, model


def test_cpu_budget_max_batch_fits_and_one_more_does_not_by_measurement():
    from batchfit.memory import get_backend

    backend = get_backend("cpu", memory_limit=4_000_000)
    step, model = make_tiny_step()
    budget = find_token_budget(
        step, backend=backend, register=model, max_seq_len=256, seq_lens=[256, 64], safety_margin=1.0, progress=False
    )
    assert budget.backend == "cpu"
    for point in budget.points:
        s, b = point.seq_len, budget.max_batch_size(point.seq_len)
        assert b >= 1
        at_b = backend.measure(lambda b=b, s=s: step([s] * b), register=model)
        above = backend.measure(lambda b=point.max_batch_size + 1, s=s: step([s] * b), register=model)
        assert at_b.fits and at_b.peak_bytes <= budget.limit_bytes
        if point.largest:
            assert not above.fits or above.peak_bytes > budget.limit_bytes
    assert max(p.probes for p in budget.points) <= 8


# --------------------------------------------------------------------------- two gloo ranks


def _rank_worker(rank: int, fail: list) -> tuple:
    be = SyntheticBackend(linear_quadratic, 2_000_000_000, fail=[tuple(f) for f in fail] if rank == 1 else ())
    budget = find_token_budget(shape_step, max_seq_len=4096, backend=be, safety_margin=1.0, progress=False)
    return budget.tokens, [p.max_batch_size for p in budget.points], len(be.calls)


@pytest.mark.timeout(120)
def test_two_ranks_agree_on_a_smaller_budget_when_one_rank_runs_out():
    # alone, 36 sequences of 4096 fit (see above); rank 1 runs out of memory at (36, 4096)
    got = run_ranks(_rank_worker, [(36, 4096)])
    assert got[0] == got[1]  # same budget, same points, same number of probes on both ranks
    assert got[0][0] == 35 * 4096  # the verdict at 36 was "does not fit" on every rank
    assert got[0][1][0] == 35


def test_a_token_count_probed_twice_counts_once_in_the_phase_guess():
    # a length's probes may repeat a token count (a predicted probe, then the run): the line must
    # go through two distinct counts, not divide by zero
    from batchfit.budget.memory_model import guess_tokens_by_phase

    twice = [(200, {"fwd": 5_800}, {}), (260, {"fwd": 7_000}, {}), (260, {"fwd": 7_000}, {})]
    assert guess_tokens_by_phase(twice, 10, 8_200) == pytest.approx(320.5)  # 5,800 + 20·(T − 200)
    assert guess_tokens_by_phase(twice[1:], 10, 8_200) == pytest.approx(304.5)  # one count: 7,000 / 260 per token


@settings(max_examples=60, deadline=None)
@given(
    base=st.integers(0, 10**9),
    a=st.integers(1, 10**5),
    q=st.integers(0, 100),
    s=st.sampled_from([512, 1000, 4096]),
    rows=st.lists(st.integers(0, 100), min_size=3, max_size=3, unique=True),
    headroom=st.integers(1, 10**11),
)
def test_the_phase_guess_is_exact_on_the_memory_model(base, a, q, s, rows, headroom):
    # NOTE [ Each phase is a line in tokens ]: three probes of base + a·T + q·(k·s² + r²) give the
    # answer when q is 0 or their remainders show it (a half row beside whole rows, spread apart)
    from batchfit.budget.memory_model import _curvature_shows, guess_tokens_by_phase

    tokens = [rows[0] * s + s // 2, rows[1] * s + s, rows[2] * s + s]
    assume(q == 0 or _curvature_shows(*tokens, s))

    def peak(t: int) -> int:
        k, r = divmod(t, s)
        return base + a * t + q * (k * s * s + r * r)

    limit = max(peak(t) for t in tokens) + headroom  # below the limit, as a device that stops above it leaves them
    guess = guess_tokens_by_phase([(t, {"step": peak(t)}, {}) for t in tokens], s, limit)
    answer = math.floor(guess)
    assert peak(answer) <= limit < peak(answer + 1) or (answer < 0 and peak(0) > limit)


def test_the_phase_guess_keeps_to_a_line_where_the_remainders_cannot_show_a_curvature():
    # three remainders on a line in r·(s − r) (whole rows) say nothing of q: the secant of the two
    # nearest, not a fit that reads a real step's wobble as curvature
    from batchfit.budget.memory_model import guess_tokens_by_phase

    points = [(t, {"step": 1_000 + 10 * t + (7 if t == 300 else 0)}, {}) for t in (100, 200, 300)]
    assert guess_tokens_by_phase(points, 100, 5_000) == pytest.approx(200 + (5_000 - 3_000) / ((4_007 - 3_000) / 100) + 0.5, abs=1)


def test_the_phase_guess_is_the_phase_that_reaches_the_limit_first():
    from batchfit.budget.memory_model import guess_tokens_by_phase

    # the forward holds 100 + 2·T, the backward 300 + 1·T: at a limit of 1,000 the forward binds first
    points = [(t, {"forward": 100 + 2 * t, "backward": 300 + t}, {}) for t in (10, 20)]
    assert guess_tokens_by_phase(points, 64, 1_000) == pytest.approx(450.5)
    # one probe: each phase's line from the state it holds whatever the batch
    one = [(10, {"forward": 120, "backward": 310}, {"forward": 100, "backward": 300})]
    assert guess_tokens_by_phase(one, 64, 1_000) == pytest.approx(450.5)
    assert guess_tokens_by_phase([(10, {"step": 50}, {"step": 50})], 64, 1_000) == math.inf  # nothing grows
    assert guess_tokens_by_phase([], 64, 1_000) is None


# --------------------------------------------------------------------------- profile_model: one call, a model object


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_one_call_gives_the_training_and_the_forward_only_budget_of_a_module():
    import dataclasses

    from batchfit.budget import profile_model
    from batchfit.errors import BudgetError
    from batchfit.models import build_causal_lm

    module = build_causal_lm("tiny", dtype="fp32")
    profile = profile_model(
        module, max_seq_len=64, seq_lens=[64], backend="estimate", memory_limit="64MiB", reserve_bytes=0, forward_too=True
    )
    assert list(profile.budgets) == ["policy", "policy_forward"]
    assert profile.dtype == "float32"  # read from the module's parameters, not the bf16 default
    assert profile.train.tokens == profile.budgets["policy"].tokens
    # forward-only keeps no activations for a backward: more tokens fit
    assert profile.forward.tokens > profile.train.tokens == profile.combined.tokens
    alone = dataclasses.replace(profile, budgets={"policy": profile.budgets["policy"]})  # roles="policy"
    with pytest.raises(BudgetError, match=r"no forward-only budget: it profiled roles policy; profile with forward_too=True"):
        alone.forward  # noqa: B018
    with pytest.raises(InvalidArgument, match=r"forward_too must be True or False, but got forward_too=1"):
        profile_model(module, max_seq_len=64, backend="estimate", memory_limit="64MiB", forward_too=1)


def test_an_fsdp2_module_gives_its_sharding_and_dtype_unless_told_otherwise():
    from batchfit.budget import ProfileOptions
    from batchfit.budget.model_profile import module_settings
    from batchfit.models import build_causal_lm
    from batchfit.parallel import Sharding, simulated_world

    with simulated_world(4):
        sharded = build_causal_lm("tiny", dtype="fp32", sharding=Sharding("fsdp2", world_size=4, mixed_precision="none"))
        got = module_settings(sharded, None, {})
    assert got == {"dtype": "float32", "sharding": Sharding("fsdp2", world_size=4, mixed_precision="none")}
    assert module_settings(sharded, None, {"dtype": "bf16", "sharding": "none"}) == {}  # given settings win
    assert module_settings(sharded, ProfileOptions(max_seq_len=64), {}) == {}  # options are taken as given
    assert module_settings("tiny", None, {}) == {}
