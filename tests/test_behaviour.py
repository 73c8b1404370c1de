"""batchfit.parallel.behaviour: what the installed torch does that changes a budget, probed and cached."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from batchfit import InvalidArgument
from batchfit.memory import get_backend
from batchfit.parallel import behaviour
from batchfit.parallel.behaviour import CHANGED_IN, ROOT_RESHARD, behaviours_at, torch_behaviours
from batchfit.parallel.distributed import simulated_world

INSTALLED = behaviours_at(str(torch.__version__))


@pytest.fixture
def fresh_cache():
    """Forget the cached report before and after (a test that changes the conditions must not leak)."""
    torch_behaviours.cache_clear()
    yield
    torch_behaviours.cache_clear()


def test_the_installed_torch_is_probed_and_agrees_with_its_version(fresh_cache):
    report = torch_behaviours()
    assert report.torch_version == str(torch.__version__)
    root = report[ROOT_RESHARD]
    assert root.detected_by == "probe"
    assert root.value == INSTALLED[ROOT_RESHARD]
    assert root.changed_in == "2.8"
    assert not dist.is_initialized()  # the simulated world is gone again


def test_the_probe_tells_a_kept_root_from_a_resharded_one():
    # asked to keep it, every torch keeps the root; asked to reshard, only 2.8+ does
    assert behaviour._probe_root_reshard(reshard_after_forward=False) is False
    assert behaviour._probe_root_reshard(reshard_after_forward=True) is INSTALLED[ROOT_RESHARD]


def test_a_second_call_returns_the_cached_report(fresh_cache):
    first = torch_behaviours()
    assert torch_behaviours() is first
    assert torch_behaviours.cache_info().hits == 1


def test_inside_a_process_group_of_another_size_the_version_decides(fresh_cache):
    with simulated_world(4):  # simulated_world(2) would have to replace it: the probe does not
        report = torch_behaviours()
        assert dist.get_world_size() == 4  # left as it was
    assert report[ROOT_RESHARD].detected_by == "version"
    assert report[ROOT_RESHARD].value == INSTALLED[ROOT_RESHARD]


def test_inside_a_simulated_world_of_two_or_an_estimate_the_probe_still_runs():
    with simulated_world(2):
        assert behaviour._probe_root_reshard() is INSTALLED[ROOT_RESHARD]
    estimate = get_backend("estimate")
    with estimate.context():  # the caller's fake mode is set aside, not mixed with the probe's
        assert behaviour._probe_root_reshard() is INSTALLED[ROOT_RESHARD]


@pytest.mark.parametrize(
    ("version", "resharded"),
    [
        ("2.6.0", False),
        ("2.7.1", False),
        ("2.8.0", True),  # pytorch/pytorch#154704
        ("2.8.0+cu128", True),
        ("2.8.0rc1", True),  # release candidates are cut from the release branch
        ("2.8.0.dev20250601", False),  # a nightly may predate the change
        ("2.14.1", True),
    ],
)
def test_behaviours_at_a_version_follow_the_release_that_changed_them(version, resharded):
    assert behaviours_at(version) == {ROOT_RESHARD: resharded}


def test_a_bad_version_is_named():
    with pytest.raises(InvalidArgument, match=r"version must be a torch version such as '2\.8\.0', but got version='banana'"):
        behaviours_at("banana")


def test_the_report_is_json_ready_and_every_value_has_a_meaning():
    data = json.loads(json.dumps(torch_behaviours().to_dict()))
    assert data["torch_version"] == str(torch.__version__)
    assert [b["name"] for b in data["behaviours"]] == list(CHANGED_IN)
    assert set(data["behaviours"][0]) == {"name", "value", "meaning", "detected_by", "changed_in"}
    for name in CHANGED_IN:
        assert behaviour._MEANINGS[(name, True)] != behaviour._MEANINGS[(name, False)]
    with pytest.raises(KeyError):
        torch_behaviours()["no_such_behaviour"]
