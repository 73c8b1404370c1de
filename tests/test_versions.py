"""The version floors in pyproject.toml are those of the newest API the code uses."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

# API the code uses -> the first release that has it (from each project's release notes)
NEEDS = {
    "torch": [
        ("torch.OutOfMemoryError", "2.5"),  # memory/cuda.py
        ("torch.amp.is_autocast_available", "2.4"),  # logprobs/from_hidden.py
        ("torch.get_autocast_dtype", "2.4"),  # logprobs/from_hidden.py
        ("torch.distributed.tensor.DTensor", "2.5"),  # public DTensor (memory/tracker.py)
        ("torch.distributed.fsdp.fully_shard", "2.6"),  # public FSDP2 (models/shard.py)
        ("torch.distributed.fsdp.register_fsdp_forward_method", "2.6"),  # models/step.py
        ("torch.distributed.fsdp.CPUOffloadPolicy", "2.6"),
    ],
    "transformers": [
        ("transformers.AttentionInterface", "4.48"),  # attention.py
        ("transformers.masking_utils.AttentionMaskInterface", "4.53"),
        ("transformers.masking_utils.find_packed_sequence_indices", "4.53"),  # memory/fake_patches.py
        ("transformers.PreTrainedModel.set_attn_implementation", "4.56"),
        ("transformers.AutoModelForCausalLM.from_config(dtype=...)", "4.56"),  # models/build.py
    ],
}


def _floor(requirement: str) -> tuple[int, ...]:
    version = re.search(r">=\s*([\d.]+)", requirement).group(1)
    return tuple(int(x) for x in version.split("."))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_each_floor_is_the_newest_release_an_api_needs():
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    floors = {re.split(r"[<>=!~ ]", dep, maxsplit=1)[0]: _floor(dep) for dep in project["dependencies"]}
    for package, needs in NEEDS.items():
        needed = max(_version(v) for _, v in needs)
        assert floors[package] == needed, (package, floors[package], needed)


@pytest.mark.parametrize("dotted", [name for needs in NEEDS.values() for name, _ in needs if "(" not in name])
def test_each_listed_api_exists(dotted):
    module_name, _, attr = dotted.rpartition(".")
    try:
        target = importlib.import_module(module_name)
    except ModuleNotFoundError:  # a class attribute: import the module above
        module_name, _, cls = module_name.rpartition(".")
        target = getattr(importlib.import_module(module_name), cls)
    assert hasattr(target, attr), dotted
