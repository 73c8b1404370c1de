"""This repository's scripts loaded as modules, and emitted launch commands read back as the shell reads them.

- :func:`load_script`: a file under ``benchmarks/`` or ``scripts/`` (not a package) as a module.
- :func:`flag_words`: the words of an emitted OpenRLHF or slime launch command.
- :func:`openrlhf_release_source` / :func:`slime_commit_source`: the flag extractor
  (``scripts/extract_framework_flags.py``) and the source of the framework's own argument parser,
  read from OpenRLHF's wheel or from a slime checkout; the test is skipped where they are missing.
"""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
FLAG_EXTRACTOR = REPO / "scripts" / "extract_framework_flags.py"


def load_script(path: Path, name: str, *, register: bool = False) -> ModuleType:
    """The file ``path`` run as module ``name``; ``register`` puts it in ``sys.modules`` first (dataclasses look there)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def flag_words(text: str) -> list[str]:
    """The words of an emitted launch command: comment lines dropped, continued lines joined (as the shell does)."""
    flags = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return shlex.split(flags.replace("\\\n", " "))


def openrlhf_release_source(wheel: Path) -> tuple[ModuleType, str, str]:
    """(the flag extractor, train_ppo_ray.py's parser source, where it was read) from OpenRLHF's ``wheel``."""
    if not wheel.is_file():
        pytest.skip(f"the OpenRLHF wheel is not on this machine ({wheel}; set BATCHFIT_OPENRLHF_WHEEL)")
    module = load_script(FLAG_EXTRACTOR, "extract_framework_flags")
    text, where = module.read_source("openrlhf", wheel)
    return module, text, where


def slime_commit_source(source: Path, commit: str) -> tuple[ModuleType, str, str]:
    """(the flag extractor, slime's parser source at ``commit``, where it was read) from the checkout ``source``."""
    if not (source / "HEAD").is_file() and not (source / "slime").is_dir():
        pytest.skip(f"slime's source is not on this machine ({source}; set BATCHFIT_SLIME_SOURCE)")
    module = load_script(FLAG_EXTRACTOR, "extract_framework_flags")
    try:
        text, where = module.read_source("slime", source, commit)
    except subprocess.CalledProcessError:
        pytest.skip(f"commit {commit[:8]} is not in {source}")
    return module, text, where
