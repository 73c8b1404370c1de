"""A sequence-parallel size the world or the model's heads cannot take, refused in the words the user wrote it in.

Shared by the profile request's resolver (:mod:`batchfit.frameworks.profile_request`) and ``batchfit plan``;
light to import (the model's config is read only when a size above 1 is set).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchfit.errors import InvalidArgument

if TYPE_CHECKING:
    from batchfit.frameworks.run import RunConfig


def check_sequence_parallel(
    sequence_parallel: Any,
    world_size: Any,
    run: RunConfig | None,
    model: Any,
    world: int | None,
    *,
    names: tuple[str, str] = ("--sequence-parallel", "--world-size"),
) -> None:
    """Refuse a sequence-parallel size the world or the model's heads cannot take, naming it as the user wrote it.

    Args:
        sequence_parallel, world_size: the flags' values (``None``: not given; digits as text are read).
        run: the ``--config`` read, or ``None``.
        model: the model without a config (``None``: unknown, nothing is checked).
        world: the world without a flag or a config (the command's default).
        names: how the caller names the two settings (the flags, or keywords).

    The size and the world are the caller's (named ``names``), else the
    config's (named by its own keys: ``run.key_names``, ``run.source``). Every fix offered is valid:
    sp sizes that divide the world and split the heads, and world sizes only when the size itself
    splits them (:func:`batchfit.plan.arith.sequence_parallel_fixes`).

    Raises:
        InvalidArgument: one line with the size, the world, the heads and the fixes.
    """
    from batchfit.plan.arith import or_list, sequence_parallel_fixes, splits_heads

    sp, given_world = (int(v) if isinstance(v, str) and v.strip().isdigit() else v for v in (sequence_parallel, world_size))
    world = given_world if given_world is not None else world
    sp_name, world_name = names
    if run is not None:
        if sp is None:
            sp = run.batch.sequence_parallel
            sp_name = run.key_names.get("sequence_parallel", "sequence_parallel")
        if given_world is None:
            world = run.world_size
            world_name = run.source.get("world_size", "world_size")
        model = run.models.get("policy") or model
    if model is None or not isinstance(sp, int) or isinstance(sp, bool) or sp <= 1 or not isinstance(world, int) or world < 1:
        return  # a bad value is named where it is checked
    from batchfit.models import load_config

    try:
        text = getattr(load_config(model), "get_text_config", lambda: None)() or load_config(model)
        heads = int(text.num_attention_heads)
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
    except (InvalidArgument, OSError, AttributeError, TypeError, ValueError):
        return  # the model is refused (or told) where it is loaded
    divides, splits = world % sp == 0, splits_heads(sp, heads, kv)
    if divides and splits:
        return
    sizes, worlds = sequence_parallel_fixes(sp, world, heads, kv)
    said = (lambda name, value: f"{name} {value}") if sp_name.startswith("--") else (lambda name, value: f"{name}={value}")
    faults = []
    if not splits:
        faults.append(
            f"cannot split {model}'s {heads} attention heads ({kv} key/value heads; Ulysses gives each rank heads/sp "
            "query heads, and the key/value heads must divide or be divided by sp)"
        )
    if not divides:
        faults.append(f"does not divide {said(world_name, world)} (world = data-parallel × sequence-parallel ranks)")
    fixes = [f"{said(sp_name, or_list(sizes))}" if sizes else f"{said(sp_name, 1)} (no size above 1 splits both)"]
    if worlds:
        fixes.append(f"{said(world_name, or_list(worlds))}")
    raise InvalidArgument(f"{said(sp_name, sp)} {' and '.join(faults)}: use {' or '.join(fixes)}")
