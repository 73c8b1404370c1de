"""Reading a :class:`~batchfit.plan.config.BatchConfig` from YAML, JSON, flat keys, SkyRL's or verl's vocabulary.

The batch layout of :func:`batchfit.frameworks.read_run_config`, for callers that need only
that. Flat mappings use the field names of :class:`BatchConfig`; a SkyRL or verl config is
told from its keys, merged over the framework's defaults and resolved by OmegaConf.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchfit.frameworks import coerce, read_run_config
from batchfit.plan.config import BatchConfig

__all__ = ["coerce", "config_from_mapping", "load_config"]


def config_from_mapping(data: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> BatchConfig:
    """Build a :class:`BatchConfig` from flat, SkyRL or verl keys, then apply ``overrides``.

    Args:
        data: flat field names, or a SkyRL / verl config (flat field names may sit beside
            their sections and win).
        overrides: flat field names, applied last (e.g. from ``--field value`` flags).

    Raises:
        BatchConfigError: see :func:`batchfit.frameworks.read_run_config`.
    """
    return read_run_config(data, overrides).batch


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> BatchConfig:
    """Read a YAML (``.yaml``/``.yml``) or JSON (``.json``) config file; see :func:`config_from_mapping`.

    Raises:
        BatchConfigError: the file is missing, unreadable, not YAML/JSON, or its keys are wrong.
    """
    return read_run_config(Path(path), overrides).batch
