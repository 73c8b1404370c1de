"""verl 0.9.1's own Hydra config, for the tests that compose with it (tests/test_verl_overrides.py, tests/test_verl_launch.py).

The config comes from the verl wheel installed without its dependencies (``pip install --no-deps verl==0.9.1
hydra-core==1.3.8 antlr4-python3-runtime==4.9.3``; ``.ci/run`` does so for the second tier) and is found with
``importlib.util.find_spec``, never imported (verl's own imports need torch builds, Ray and vLLM). Where
``BATCHFIT_NEEDS_VERL_CONFIG`` is set (``.ci/run``), a missing config fails the tests instead of skipping them.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import pytest

INSTALL = "pip install --no-deps verl==0.9.1 hydra-core==1.3.8 antlr4-python3-runtime==4.9.3"


def _config_dir() -> Path | None:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("hydra") is None:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config"


CONFIG_DIR = _config_dir()
needs_verl = pytest.mark.skipif(
    CONFIG_DIR is None and not os.environ.get("BATCHFIT_NEEDS_VERL_CONFIG"),
    reason=f"needs verl 0.9.1's config and hydra-core: {INSTALL} (.ci/run installs them for the second tier)",
)


def compose(overrides: list[str], config_name: str = "ppo_trainer"):
    """verl's ``config_name`` composed with ``overrides`` by Hydra, as ``main_ppo`` composes it.

    Raises:
        hydra.errors.HydraException: what verl's launcher would refuse (an override Hydra cannot apply).
    """
    assert CONFIG_DIR is not None and (CONFIG_DIR / f"{config_name}.yaml").is_file(), (
        f"BATCHFIT_NEEDS_VERL_CONFIG is set but verl's config is not installed: {INSTALL}"
    )
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with warnings.catch_warnings():  # hydra-core 1.3.8 calls OmegaConf 2.4's deprecated resolver registration
        warnings.simplefilter("ignore")
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return hydra_compose(config_name, overrides=overrides)
