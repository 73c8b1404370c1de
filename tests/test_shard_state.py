"""batchfit.parallel.shard_state: the record of how shard_model sharded a model, found for every strategy, nothing set on the module."""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest
import torch

import batchfit
from batchfit.memory import get_backend
from batchfit.models import build_causal_lm
from batchfit.parallel import Sharding, ShardState, shard_model, shard_state, sharding_of, simulated_world
from batchfit.parallel.shard import ddp_bucket_bytes, unwrap
from batchfit.parallel.shard_state import zero_state
from batchfit.parallel.zero import ZeroState

WORLD = 2
# The tiny preset's trainable parameters (tests/test_fsdp1.py): 223,552 fp32 elements, 894,208 bytes.
TINY_BYTES = 894_208


def _batchfit_attributes(model: torch.nn.Module) -> list[str]:
    """Every ``batchfit`` entry in the instance dict of the model or any module inside it."""
    return sorted(f"{name}.{key}" for name, m in model.named_modules() for key in vars(m) if "batchfit" in key)


@pytest.mark.parametrize("strategy", ["none", "ddp", "fsdp1", "fsdp2", "zero1", "zero2"])
def test_the_record_is_found_after_shard_model_and_nothing_is_set_on_the_module(strategy):
    be = get_backend("estimate")
    options = {"reduce_bucket_size": 1_000} if strategy.startswith("zero") else {}
    sharding = Sharding(strategy, world_size=1 if strategy == "none" else WORLD, **options)
    with simulated_world(WORLD):
        model = build_causal_lm("tiny", backend=be, sharding=sharding)
    state = shard_state(model)
    assert isinstance(state, ShardState) and state.sharding is sharding and sharding_of(model) is sharding
    assert _batchfit_attributes(model) == []
    if strategy.startswith("zero"):
        assert isinstance(state.zero, ZeroState) and zero_state(model) is state.zero
        assert state.zero.stage == int(strategy[-1])
    else:
        assert state.zero is None and zero_state(model) is None
    # DDP's buckets: every trainable element once (894,208 bytes); ZeRO-1's bucket held between
    # steps: 1,000 fp32 elements = 4,000 bytes; ZeRO-2 holds it only during a backward
    sizes = [t.numel() for t in state.comm_buffers]
    assert sizes == {"ddp": [TINY_BYTES], "zero1": [4_000]}.get(strategy, [])
    assert all(t.device.type == "meta" for t in state.comm_buffers)
    if strategy == "ddp":
        assert ddp_bucket_bytes(unwrap(model)) == TINY_BYTES


def test_a_wrapper_carries_the_record_and_the_module_inside_it_none():
    be = get_backend("estimate")
    with simulated_world(WORLD):
        model = build_causal_lm("tiny", backend=be, sharding=Sharding("fsdp1", world_size=WORLD))
    assert model is not unwrap(model)  # FSDP1 wraps the model
    assert shard_state(model).sharding.strategy == "fsdp1"
    assert shard_state(unwrap(model)) is None and sharding_of(unwrap(model)) == Sharding()


def test_a_model_never_sharded_and_a_non_module_have_no_record():
    assert shard_state(torch.nn.Linear(2, 2)) is None
    assert shard_state(3) is None and shard_state([1]) is None  # neither weakly referenceable nor hashable
    assert sharding_of(torch.nn.Linear(2, 2)) == Sharding() and zero_state(torch.nn.Linear(2, 2)) is None


def test_sharding_again_replaces_the_record():
    be = get_backend("estimate")
    with simulated_world(WORLD), be.context():
        model = build_causal_lm("tiny", backend=be, dtype="bf16", sharding=Sharding("zero2", world_size=WORLD))
        assert zero_state(model) is not None
        none = Sharding()
        assert shard_model(model, none, fake=True) is model
    assert shard_state(model) == ShardState(none)  # ZeRO's state is not kept from the first record


def test_the_record_does_not_keep_its_model_alive():
    be = get_backend("estimate")
    with simulated_world(WORLD):
        model = build_causal_lm("tiny", backend=be, dtype="bf16", sharding=Sharding("zero1", world_size=WORLD))
    gone = weakref.ref(model)
    assert shard_state(model).zero is not None
    del model
    gc.collect()
    assert gone() is None


#: The attributes the record replaced (NOTE [ The record of a sharded model ]).
OLD_ATTRIBUTES = frozenset({"batchfit_sharding", "batchfit_comm_buffers", "batchfit_zero"})


def _old_attribute_lines(source: str) -> list[int]:
    """Lines of ``source`` that name an old attribute: ``x.batchfit_zero`` (set or read) or ``getattr(x, "batchfit_zero")``."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if (isinstance(node, ast.Attribute) and node.attr in OLD_ATTRIBUTES)
        or (isinstance(node, ast.Constant) and node.value in OLD_ATTRIBUTES)
    ]


def test_no_module_sets_or_reads_the_old_batchfit_attributes():
    root = Path(batchfit.__file__).parent
    found = {
        str(path.relative_to(root)): lines
        for path in sorted(root.rglob("*.py"))
        if (lines := _old_attribute_lines(path.read_text(encoding="utf-8")))
    }
    assert found == {}


def test_the_attribute_check_finds_a_setter_and_a_getattr():
    source = "out.batchfit_sharding = s\nx = 1\nzero = getattr(m, 'batchfit_zero', None)\n"
    assert _old_attribute_lines(source) == [1, 3]
