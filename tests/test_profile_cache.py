"""Profiles answered from disk (NOTE [ A profile is a function of its inputs ] in batchfit.budget.profile_cache)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from batchfit.budget import model_profile, profile_cache, profile_model
from batchfit.budget.options import ProfileOptions
from batchfit.budget.profile_cache import Uncacheable, caching, plain
from batchfit.parallel import Sharding

TINY = {"max_seq_len": 64, "backend": "estimate", "memory_limit": "1GiB", "seq_lens": [64]}


@pytest.fixture
def cache_on(monkeypatch, tmp_path):
    monkeypatch.delenv(profile_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv(profile_cache.CACHE_DIR_ENV, str(tmp_path / "profiles"))
    return tmp_path / "profiles"


def _measured(monkeypatch) -> list[int]:
    """Count the profiles really measured from now on."""
    calls: list[int] = []
    real = model_profile._profile_model

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_profile, "_profile_model", counted)
    return calls


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=10,
)


@given(json_values, json_values)
def test_plain_data_is_equal_exactly_when_the_inputs_are(a, b):
    same = json.dumps(plain(a), sort_keys=True) == json.dumps(plain(b), sort_keys=True)
    assert same == (json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True))


def test_plain_tells_apart_what_json_would_merge_and_refuses_what_is_not_data():
    assert plain((1, 2)) != plain([1, 2])
    assert plain(Sharding("fsdp2", world_size=8)) != plain(Sharding("fsdp2", world_size=16))
    assert plain(ProfileOptions(max_seq_len=64, progress=print)) == plain(ProfileOptions(max_seq_len=64))
    with pytest.raises(Uncacheable):
        plain(torch.nn.Linear(2, 2))
    with pytest.raises(Uncacheable):
        plain(lambda: None)


def test_a_second_profile_of_the_same_inputs_is_read_back_and_equal(cache_on, monkeypatch):
    measured = _measured(monkeypatch)
    with caching() as cache:
        first = profile_model("tiny", **TINY)
        again = profile_model("tiny", **TINY)
    assert again == first and len(measured) == 1
    assert cache.hits and cache.misses and len(list(cache_on.glob("*.pickle"))) == 1


def test_any_change_of_inputs_or_code_is_measured_again(cache_on, monkeypatch):
    measured = _measured(monkeypatch)
    with caching():
        profile_model("tiny", **TINY)
        profile_model("tiny", **{**TINY, "memory_limit": "2GiB"})
        profile_model("tiny", **TINY, roles=("policy", "reference"))
        monkeypatch.setattr(profile_cache, "_CODE_DIGEST", "an edited batchfit")
        profile_model("tiny", **TINY)
    assert len(measured) == 4


def test_outside_caching_off_or_on_a_device_nothing_is_kept(cache_on, monkeypatch):
    measured = _measured(monkeypatch)
    profile_model("tiny", **TINY)  # the library's default: no cache
    profile_model("tiny", **TINY)
    with caching(enabled=False) as none:
        assert none is None
        profile_model("tiny", **TINY)
    monkeypatch.setenv(profile_cache.CACHE_ENV, "0")
    with caching() as off:
        assert off is None
    assert len(measured) == 3 and not cache_on.exists()


def test_a_real_backend_or_a_model_object_is_never_answered_from_disk(cache_on):
    with caching(cache_on):
        on_cpu = model_profile._cache_key("tiny", ProfileOptions(max_seq_len=64, backend="cpu"), roles=("policy",))
        estimated = model_profile._cache_key("tiny", ProfileOptions(max_seq_len=64, backend="estimate"), roles=("policy",))
        a_module = model_profile._cache_key(torch.nn.Linear(2, 2), ProfileOptions(max_seq_len=64, backend="estimate"), roles=("policy",))
    assert on_cpu[1] is None and a_module[1] is None and estimated[1] is not None


def test_an_unreadable_file_is_measured_again_and_replaced(cache_on, monkeypatch):
    measured = _measured(monkeypatch)
    with caching():
        profile_model("tiny", **TINY)
    (kept,) = cache_on.glob("*.pickle")
    kept.write_bytes(b"cut sh")
    with caching() as cache:
        again = profile_model("tiny", **TINY)
        assert profile_model("tiny", **TINY) == again
    assert len(measured) == 2 and len(cache.hits) == 1


def test_the_command_line_answers_the_same_again_and_says_so(cache_on, capsys):
    from batchfit.cli import main

    argv = ["profile", "--model", "tiny", "--max-seq-len", "64", "--memory", "1GiB", "--json", "--no-progress"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert main(argv) == 0
    again = capsys.readouterr()
    assert again.out == first.out and "cache" not in first.err
    assert "answered from the cache" in again.err and "--no-cache measures again" in again.err
    assert main([*argv, "--no-cache"]) == 0
    fresh = capsys.readouterr()
    assert fresh.out == first.out and "cache" not in fresh.err
