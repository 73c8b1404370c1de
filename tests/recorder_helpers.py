"""A stand-in for ``profile_model`` and ``resident_state_bytes`` in ``profile_run``: records what each pass was given.

The emit round trips (tests/test_emit.py) and the engine's wiring (tests/test_engine.py) check what
``profile_run`` hands the profiler (each role's options, roles, the colocated models' bytes, the
rollout engine) without running a probe: the recorded budgets are a function of exactly that.
"""

from __future__ import annotations

import types
import zlib

import batchfit.frameworks.run_profile as framework_profile


class ProfileRecorder:
    """Stands in for profile_model and resident_state_bytes: records the profiles' inputs, budgets a function of them."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.engines: list = []  # the EngineReserve each profile_model call got

    @staticmethod
    def _key(model, options, *rest):
        return (model, options.replace(progress=False), *rest)

    def profile_model(self, model, options, *, roles, resident_bytes=0, engine=None):
        key = self._key(model, options, tuple(roles), resident_bytes, None if engine is None else engine.bytes)
        self.calls.append(key)
        self.engines.append(engine)
        budgets = {
            role: types.SimpleNamespace(
                tokens=1_000 + zlib.crc32(repr((key, role)).encode()) % 90_000,
                backend=options.backend,
                usable_bytes=64 * 2**20,
                cost=options.cost,
                response_tokens=None,
                response_fraction=None,
            )
            for role in roles
        }
        return types.SimpleNamespace(
            budgets=budgets, torch=None, sharding=options.sharding, moe=None, attention=None, engine=engine,
            allocator=options.allocator, safety_margin=options.safety_margin,
        )  # fmt: skip

    def resident_state_bytes(self, model, role, options, *, kinds=()):
        # what a colocated model keeps on the device reaches profile_model as resident_bytes (recorded there);
        # state offloaded to the host counts 0, as the real function says
        if options.sharding.offload == "cpu":
            return 0
        return 1_000 + zlib.crc32(repr(self._key(model, options, role, tuple(kinds))).encode()) % 10_000


def use_recorder(monkeypatch) -> ProfileRecorder:
    """Put a :class:`ProfileRecorder` in ``profile_run``'s place of the profiler for one test."""
    rec = ProfileRecorder()
    monkeypatch.setattr(framework_profile, "profile_model", rec.profile_model)
    monkeypatch.setattr(framework_profile, "resident_state_bytes", rec.resident_state_bytes)
    return rec
