"""What a framework's Megatron config sets that batchfit's Megatron profile does not model, refused in one line.

NOTE [ What a Megatron profile refuses ] (verl's and SkyRL's readers): a reader records each such setting
in :attr:`RunConfig.source` under ``"refused:<setting>"`` with the ``key=value`` it read it from (a Megatron
critic, Megatron LoRA); :func:`first_refusal` turns the first into the line ``profile`` raises, from the
reader's table of why and the fix. Context and expert parallelism are profiled (NOTE [ Context parallelism as
Megatron runs it ] in :mod:`batchfit.models.megatron_context`, NOTE [ The Megatron probe's worst rank ] in
:mod:`batchfit.budget.megatron_probe`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The prefix of a refused setting's entry in :attr:`RunConfig.source`.
REFUSED = "refused:"


def refused_sources(refused: Mapping[str, str]) -> dict[str, str]:
    """``{"refused:<setting>": "key=value"}`` for a reader's :attr:`RunConfig.source`."""
    return {f"{REFUSED}{setting}": said for setting, said in refused.items()}


def first_refusal(run: Any, why: Mapping[str, tuple[str, str]]) -> str | None:
    """The line refusing ``run``'s first refused setting (``why[setting]`` = why, fix), or ``None``: none, or not Megatron."""
    if run.strategy != "megatron":
        return None
    for setting, (reason, fix) in why.items():
        said = run.source.get(REFUSED + setting)
        if said is not None:
            return f"the config's {said} {reason}; {fix}"
    return None


__all__ = ["REFUSED", "first_refusal", "refused_sources"]
