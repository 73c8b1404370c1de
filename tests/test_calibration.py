"""batchfit.memory.calibration: the allocator setting a calibration records, and files without it.

The confirm that writes calibrations, the formula and the file's other fields are tested in
``tests/test_confirm.py``.
"""

from __future__ import annotations

import json

import pytest

from batchfit.errors import InvalidArgument
from batchfit.memory.calibration import (
    Calibration,
    allocator_setting,
    load_calibration,
    process_allocator_setting,
)

MiB = 1024**2
FIELDS = {
    "backend": "cuda", "device": "gpu", "device_total_bytes": 80 * 1024**3, "untracked_bytes": 600 * MiB,
    "allocator_overhead_bytes": 2 * 1024**3, "allocator_overhead_fraction": 0.10, "estimate_ratio": 1.05,
}  # fmt: skip


@pytest.mark.parametrize(
    ("conf", "setting"),
    [
        pytest.param(None, "caching", id="unset"),
        pytest.param("", "caching", id="empty"),
        pytest.param("max_split_size_mb:128", "caching", id="other-keys"),
        pytest.param("expandable_segments:True", "expandable_segments", id="expandable"),
        pytest.param(" expandable_segments : True ", "expandable_segments", id="spaces"),
        pytest.param(
            "max_split_size_mb:128,expandable_segments:True", "expandable_segments", id="among-others"
        ),
        pytest.param("expandable_segments:False", "caching", id="off"),
        pytest.param("expandable_segments:True,expandable_segments:False", "caching", id="last-wins"),
        pytest.param(
            "roundup_power2_divisions:[256:1,>:4],expandable_segments:True", "expandable_segments", id="list"
        ),
        pytest.param("backend:native,expandable_segments:True", "expandable_segments", id="native"),
        pytest.param("backend:cudaMallocAsync", "", id="malloc-async"),
        pytest.param("expandable_segments:true", "", id="torch-refuses-lowercase"),
    ],
)
def test_the_allocator_setting_is_read_as_torch_reads_its_config(conf, setting):
    assert allocator_setting(conf) == setting


def test_an_allocator_config_that_is_not_a_string_names_the_argument():
    with pytest.raises(InvalidArgument, match=r"conf must be the value of PYTORCH_CUDA_ALLOC_CONF .* conf=1"):
        allocator_setting(1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("environ", "setting"),
    [
        pytest.param({}, "caching", id="neither"),
        pytest.param(
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "expandable_segments", id="cuda-name"
        ),
        pytest.param(
            {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "expandable_segments", id="new-name"
        ),
        pytest.param(
            {
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                "PYTORCH_ALLOC_CONF": "expandable_segments:True",
            },
            "expandable_segments",
            id="both-agree",
        ),
        # torch 2.13 reads the CUDA name first, earlier releases the other: unknown
        pytest.param(
            {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"},
            "",
            id="both-differ",
        ),
    ],
)
def test_the_process_setting_reads_both_names_of_the_variable(environ, setting):
    assert process_allocator_setting(environ) == setting


def test_the_process_setting_reads_os_environ_by_default(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert process_allocator_setting() == "expandable_segments"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert process_allocator_setting() == "caching"


def test_a_calibration_records_its_allocator_and_reads_it_back(tmp_path):
    cal = Calibration(**FIELDS, allocator="expandable_segments")
    path = tmp_path / "cal.json"
    cal.save(path)
    data = json.loads(path.read_text())
    assert (data["version"], data["allocator"]) == (1, "expandable_segments")
    assert load_calibration(path) == cal


def test_a_file_written_before_the_allocator_field_still_loads_as_unknown(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "batchfit-calibration", "version": 1, **FIELDS}))
    assert load_calibration(path).allocator == ""


def test_an_unknown_allocator_names_the_field_and_the_choices():
    with pytest.raises(
        InvalidArgument,
        match="Calibration: field allocator must be one of '', 'expandable_segments', 'caching', but got 'async'",
    ):
        Calibration(**FIELDS, allocator="async")
