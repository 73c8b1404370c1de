"""The version a config is written for, told from its keys (issue 44 item 1), and which version the emitted keys are.

NOTE [ Which SkyRL a config is written for ] in :mod:`batchfit.frameworks.skyrl`, NOTE [ Which verl a config is
written for ] in :mod:`batchfit.frameworks.verl`; OpenRLHF's renamed flags: NOTE [ Old OpenRLHF flags are translated ]
(tests/test_openrlhf*.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from batchfit.frameworks import read_run_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str) -> dict:
    return copy.deepcopy(yaml.safe_load((EXAMPLES / name).read_text(encoding="utf-8")))


def test_a_skyrl_config_with_use_sample_packing_is_told_written_before_its_rename():
    data = _example("skyrl_grpo.yaml")
    data["trainer"].pop("remove_microbatch_padding")
    data["trainer"]["use_sample_packing"] = False
    run = read_run_config(data)
    (note,) = run.notes
    assert note.startswith(
        "trainer.use_sample_packing is the name SkyRL #1738 renamed trainer.remove_microbatch_padding: the config is "
        "written for a SkyRL before #1738 (8cd5f165, 2026-06-01)"
    )
    assert "--emit skyrl writes the keys of SkyRL 0.4.0" in note and "trainer.max_tokens_per_microbatch #1477" in note
    assert run.remove_padding is False  # read under its new name


def test_a_skyrl_config_mixing_the_old_name_with_newer_keys_is_told_so():
    data = _example("skyrl_grpo.yaml")
    data["trainer"].pop("remove_microbatch_padding")
    data["trainer"]["use_sample_packing"] = True
    data["trainer"]["max_tokens_per_microbatch"] = 8192
    (note,) = read_run_config(data).notes
    assert "the config mixes it with keys of a later SkyRL (trainer.max_tokens_per_microbatch)" in note


def test_a_current_skyrl_config_gets_no_version_note():
    assert not [n for n in read_run_config(EXAMPLES / "skyrl_grpo.yaml").notes if "#1738" in n]


def test_a_verl_config_with_the_legacy_worker_key_is_told_written_before_0_8():
    data = _example("verl_grpo.yaml")
    data["trainer"]["use_legacy_worker_impl"] = "enable"
    notes = [n for n in read_run_config(data).notes if n.startswith("trainer.use_legacy_worker_impl='enable'")]
    assert len(notes) == 1
    assert "is a key of verl before 0.8.0: #6067 (044bbba2, 2026-04-20)" in notes[0]
    assert "runs the legacy workers" in notes[0] and "--emit verl writes their keys" in notes[0]


def test_a_current_verl_config_gets_no_version_note():
    assert not [n for n in read_run_config(EXAMPLES / "verl_grpo.yaml").notes if "0.8.0" in n]
