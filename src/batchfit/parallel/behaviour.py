"""What the installed torch does that changes a memory budget, found by probing it: :func:`torch_behaviours`.

batchfit's estimates run the installed torch's own FSDP2 code, so they already follow it;
the report says which behaviour that was, because the same configuration trains with a
different peak on a torch that behaves otherwise (a framework pinning an older release).

The behaviours, from the FSDP2 source of the torch releases 2.6, 2.7, 2.8, 2.9, 2.10, 2.11,
2.12, 2.13 and 2.14:

- ``fsdp2_root_reshard_after_forward``: ``fully_shard(root, reshard_after_forward=True)``
  frees the root's gathered parameters after forward since torch 2.8 (pytorch/pytorch#154704);
  2.6 and 2.7 keep the root unsharded until backward whatever was asked (``_lazy_init`` sets
  the root's ``post_forward_mesh_info`` to ``None``), which verl's and SkyRL's comments
  expect. Without the argument (``None``, 2.8+) the root is kept on every release. The probe
  reads "kept" on torch 2.7.1 and "resharded" on 2.13.

Other memory-relevant defaults of FSDP2 read the same in all of them: one reduce-scatter
input is held until the next reduce-scatter (configurable from 2.13,
``set_reduce_scatter_max_input_buffers``, default 1), the all-gather outputs are freed on
reshard, non-root modules reshard after forward, and ``checkpoint`` still defaults to
``use_reentrant=True`` when not told (batchfit always passes ``False``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from batchfit.errors import InvalidArgument

ROOT_RESHARD = "fsdp2_root_reshard_after_forward"

#: behaviour -> the first torch release that has today's value (True)
CHANGED_IN = {ROOT_RESHARD: "2.8"}

_MEANINGS = {
    (ROOT_RESHARD, True): (
        "fully_shard(root, reshard_after_forward=True) frees the root's gathered parameters "
        "(embeddings, final norm, head) after forward and gathers them again for backward: "
        "between forward and backward a rank holds only its shard of them"
    ),
    (ROOT_RESHARD, False): (
        "the root's gathered parameters (embeddings, final norm, head) stay unsharded from "
        "forward to backward even with reshard_after_forward=True: a rank holds them whole in "
        "the compute dtype at the backward peak (qwen2.5-7b in bf16: embedding and head "
        "2 x 152,064 x 3,584 x 2 B = +2.03 GiB per rank)"
    ),
}


@dataclass(frozen=True)
class Behaviour:
    """One behaviour of the installed torch that changes a memory budget.

    Attributes:
        name: a stable identifier, e.g. ``"fsdp2_root_reshard_after_forward"``.
        value: what this torch does (``True``/``False``).
        meaning: what the value means for memory, one sentence for reports.
        detected_by: ``"probe"`` (observed by running torch's code) or ``"version"`` (read
            off ``torch.__version__`` because the probe could not run, e.g. inside a real
            process group).
        changed_in: the torch release from which the value is ``True``.
    """

    name: str
    value: bool
    meaning: str
    detected_by: str
    changed_in: str

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (JSON-ready)."""
        return asdict(self)


@dataclass(frozen=True)
class TorchBehaviours:
    """The installed torch's version and its memory-relevant behaviours, for a report's header.

    Attributes:
        torch_version: ``torch.__version__``.
        behaviours: one :class:`Behaviour` per entry of :data:`CHANGED_IN`.
    """

    torch_version: str
    behaviours: tuple[Behaviour, ...]

    def __getitem__(self, name: str) -> Behaviour:
        for behaviour in self.behaviours:
            if behaviour.name == name:
                return behaviour
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """``{"torch_version": ..., "behaviours": [Behaviour.to_dict(), ...]}`` (JSON-ready)."""
        return {"torch_version": self.torch_version, "behaviours": [b.to_dict() for b in self.behaviours]}


@functools.cache
def torch_behaviours() -> TorchBehaviours:
    """The installed torch's memory-relevant behaviours, probed once per process (cached).

    The probe shards a two-module toy (52 parameters) on a simulated world of 2 ranks (no
    rank is contacted; well under a second) and looks at what FSDP2 left registered after
    forward. When it cannot run (a real process group, or a
    simulated one of another size, is initialised; or the probe itself fails) the value is
    read off the version (:func:`behaviours_at`) and ``detected_by`` says so.

    Returns:
        A :class:`TorchBehaviours`; the same object on every call.

    Example:
        >>> report = torch_behaviours()
        >>> report["fsdp2_root_reshard_after_forward"].value in (True, False)
        True
    """
    expected = behaviours_at(str(torch.__version__))
    probed = _probe_root_reshard()
    value, how = (expected[ROOT_RESHARD], "version") if probed is None else (probed, "probe")
    root = Behaviour(ROOT_RESHARD, value, _MEANINGS[(ROOT_RESHARD, value)], how, CHANGED_IN[ROOT_RESHARD])
    return TorchBehaviours(torch_version=str(torch.__version__), behaviours=(root,))


def behaviours_at(version: str) -> dict[str, bool]:
    """What a torch release does, by its version alone (for a framework that pins another torch).

    Args:
        version: a torch version such as ``"2.7.1"`` or ``"2.8.0+cu128"``. A release
            candidate counts as its release (cut from the release branch); a nightly
            (``2.8.0.dev20250601``) as the release before it (it may predate the change).

    Returns:
        ``{behaviour name: value}`` for every entry of :data:`CHANGED_IN`.

    Raises:
        InvalidArgument: ``version`` is not a version number.

    Example:
        >>> behaviours_at("2.7.1"), behaviours_at("2.8.0")
        ({'fsdp2_root_reshard_after_forward': False}, {'fsdp2_root_reshard_after_forward': True})
    """
    from torch._vendor.packaging.version import InvalidVersion, Version

    try:
        parsed = Version(str(version))
    except InvalidVersion as exc:
        raise InvalidArgument(
            f"version must be a torch version such as '2.8.0', but got version={version!r}"
        ) from exc
    release = tuple(parsed.release[:2])
    out = {}
    for name, since in CHANGED_IN.items():
        first = tuple(int(part) for part in since.split("."))
        out[name] = release > first or (release == first and parsed.dev is None)
    return out


def _probe_root_reshard(reshard_after_forward: bool = True) -> bool | None:
    """Whether the root's parameters are resharded after a forward asked to reshard; ``None`` if it cannot tell.

    ``fully_shard`` on a child module and on the root (an embedding of its own) over a
    simulated world of 2; after forward the root's parameter is its ``DTensor`` shard when
    resharded, the gathered plain tensor when kept.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import _disable_current_modes

    from batchfit.parallel.distributed import simulated_world

    try:
        # outside the caller's fake mode or tracker: the probe's tensors are its own
        with contextlib.ExitStack() as stack:
            stack.enter_context(unset_fake_temporarily())
            stack.enter_context(_disable_current_modes())
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            stack.enter_context(simulated_world(2))
            mesh = init_device_mesh("cpu", (2,))
            # real tensors of 52 floats: torch 2.7 has no fake-tensor implementation of the fake
            # process group's all-gather (c10d._allgather_base_), and these cost nothing
            root = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
            fully_shard(root[1], mesh=mesh)
            fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward)
            root(torch.zeros(3, dtype=torch.long))
            return isinstance(root[0].weight, DTensor)
    except InvalidArgument:
        return None  # a process group is initialised: simulated_world refuses to replace it
    except Exception:  # any failure of the probe itself: the version decides (detected_by="version")
        return None
