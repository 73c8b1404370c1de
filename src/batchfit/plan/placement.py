"""Where a run's pieces sit on its GPUs, as its config says: the rollout engine beside the trainer, the allocator setting.

Pure descriptions that a framework config's reader fills and every rank reads alike, with no
device and no torch (reading a config stays light: ``import batchfit`` and ``batchfit plan``
load no torch): :class:`RolloutEngine` (how a vLLM or SGLang engine shares the trainer's GPUs;
what it keeps there is :mod:`batchfit.budget.engine`'s) and the CUDA allocator setting the
training processes run with (:data:`ALLOCATORS`, :func:`allocator_setting`; the margin each one
needs is NOTE [ The allocator's share ] in :mod:`batchfit.memory.cuda_untracked`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.validation import check_choice, check_number, check_positive_int

__all__ = [
    "ALLOCATORS",
    "ALLOCATOR_CONF",
    "ALLOCATOR_CONF_VARIABLES",
    "DEFAULT_ALLOCATOR",
    "ENGINES",
    "RolloutEngine",
    "allocator_setting",
    "process_allocator_setting",
    "vllm_capture_sizes",
]

#: The inference engines a framework runs beside its trainer.
ENGINES = ("vllm", "sglang")
#: vLLM's largest captured size (``config/vllm.py``: ``min(max_num_seqs × 2, 512)``, 1024 on Blackwell).
VLLM_MAX_CAPTURE = 512
#: SGLang's default decode ``cuda_graph_max_bs`` on 60–160 GiB GPUs (``memory_hook.py``; 512 at TP ≥ 4).
SGLANG_MAX_BATCH = 256

#: The allocator settings a budget assumes (NOTE [ The allocator's share ]): ``PYTORCH_CUDA_ALLOC_CONF``
#: with ``expandable_segments:True``, or without it (the caching allocator's default segments).
ALLOCATORS = ("expandable_segments", "caching")
#: The allocator a budget assumes when none is named: the one batchfit's emitted settings turn on.
DEFAULT_ALLOCATOR = "expandable_segments"
#: What ``PYTORCH_CUDA_ALLOC_CONF`` says of each allocator setting, for messages and emitted environments.
ALLOCATOR_CONF = {"expandable_segments": "expandable_segments:True", "caching": "expandable_segments:False"}
#: The environment variables torch reads its CUDA allocator's settings from, in the order torch 2.13 reads them.
ALLOCATOR_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def vllm_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default CUDA-graph sizes for ``max_num_seqs`` (``config/vllm.py``, 0.24–0.33).

    ``[1, 2, 4] + range(8, 256, 8) + range(256, top + 1, 16)`` up to ``top = min(2 × max_num_seqs, 512)``.

    Example:
        >>> sizes = vllm_capture_sizes(256)
        >>> len(sizes), sizes[-1], len([s for s in sizes if s <= 256])   # piecewise, largest, full
        (51, 512, 35)
    """
    top = min(2 * check_positive_int("max_num_seqs", max_num_seqs), VLLM_MAX_CAPTURE)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return tuple(s for s in sizes if s <= top)


@dataclass(frozen=True)
class RolloutEngine:
    """How a run's inference engine shares the trainer's GPUs, as its framework config says.

    Attributes:
        name: ``vllm`` or ``sglang``.
        colocated: the engine runs on the trainer's GPUs (else it costs them nothing).
        tensor_parallel: GPUs per engine (its ranks, one per GPU).
        memory_fraction: vLLM's ``gpu_memory_utilization`` (of the device's total) or SGLang's
            ``mem_fraction_static`` (of its free memory at start); ``None``: the engine's default.
        sleeps: the engine frees its weights and KV cache while the trainer steps.
        sleep_level: vLLM's sleep level (1: weights to the host, 2: discarded), for the report.
        cuda_graphs: the engine captures CUDA graphs (not ``enforce_eager`` /
            ``disable_cuda_graph``).
        capture_sizes: the batch sizes captured, ``None``: the engine's default list.
        max_num_seqs: the most sequences a step runs (vLLM's default list follows it), ``None``:
            the engine's default.
        releases_graphs: a sleep releases the CUDA-graph pool too (SGLang with every tag: slime).
        own_process: each engine rank runs in a process of its own (a CUDA context of its own);
            ``False`` for an engine inside the trainer's process (TRL's colocate mode).
        keys: the config keys these were read from (field → key), for messages.
    """

    name: str = "vllm"
    colocated: bool = True
    tensor_parallel: int = 1
    memory_fraction: float | None = None
    sleeps: bool = True
    sleep_level: int | None = None
    cuda_graphs: bool = True
    capture_sizes: tuple[int, ...] | None = None
    max_num_seqs: int | None = None
    releases_graphs: bool = False
    own_process: bool = True
    keys: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "name", check_choice("engine", self.name, ENGINES))
        set_(self, "tensor_parallel", check_positive_int(self.key("tensor_parallel"), self.tensor_parallel))
        if self.memory_fraction is not None:
            fraction = check_number(self.key("memory_fraction"), self.memory_fraction, low=0.0, high=1.0, low_open=True)
            set_(self, "memory_fraction", fraction)
        if self.max_num_seqs is not None:
            set_(self, "max_num_seqs", check_positive_int(self.key("max_num_seqs"), self.max_num_seqs))
        if self.capture_sizes is not None:
            sizes = self.capture_sizes
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
                raise InvalidArgument(
                    f"{self.key('capture_sizes')} must be a list of batch sizes, but got {sizes!r}; write e.g. [1, 2, 4, 8]"
                )
            set_(self, "capture_sizes", tuple(check_positive_int(self.key("capture_sizes"), s) for s in sizes))

    def key(self, name: str) -> str:
        """The config key a field was read from (the field's name when none was)."""
        return self.keys.get(name, name)

    def graph_count(self) -> int:
        """The CUDA graphs the engine captures: vLLM's piecewise and full graphs, SGLang's decode batch sizes."""
        if not self.cuda_graphs:
            return 0
        if self.name == "sglang":
            return len(self.capture_sizes) if self.capture_sizes else SGLANG_MAX_BATCH
        seqs = self.max_num_seqs or 256
        sizes = self.capture_sizes if self.capture_sizes is not None else vllm_capture_sizes(seqs)
        # FULL_AND_PIECEWISE (vLLM's default; verl sets it too): every size piecewise, decode sizes also whole
        return len(sizes) + len([s for s in sizes if s <= seqs])

    def describe(self) -> str:
        """``vllm, TP 2, gpu_memory_utilization 0.5, asleep at level 2``."""
        fraction = "gpu_memory_utilization" if self.name == "vllm" else "mem_fraction_static"
        shown = "default" if self.memory_fraction is None else f"{self.memory_fraction:g}"
        state = (f"asleep at level {self.sleep_level}" if self.sleep_level else "asleep") if self.sleeps else "awake"
        where = "on the trainer's GPUs" if self.colocated else "on GPUs of its own"
        return f"{self.name}, TP {self.tensor_parallel}, {fraction} {shown}, {state} while the trainer steps, {where}"

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (JSON-ready)."""
        return {
            "name": self.name,
            "colocated": self.colocated,
            "tensor_parallel": self.tensor_parallel,
            "memory_fraction": self.memory_fraction,
            "sleeps": self.sleeps,
            "sleep_level": self.sleep_level,
            "cuda_graphs": self.cuda_graphs,
            "capture_sizes": None if self.capture_sizes is None else list(self.capture_sizes),
            "max_num_seqs": self.max_num_seqs,
            "releases_graphs": self.releases_graphs,
            "own_process": self.own_process,
            "keys": dict(self.keys),
        }


def allocator_setting(conf: str | None) -> str:
    """The CUDA allocator setting a ``PYTORCH_CUDA_ALLOC_CONF`` value asks for: ``caching``, ``expandable_segments`` or ``""``.

    NOTE [ The allocator setting ]
    The caching allocator's overhead (``reserved − allocated``) depends on one of its settings
    above all: ``expandable_segments:True`` grows a segment in place instead of reserving a new
    one for each size, so it fragments far less (NOTE [ The margin's evidence ] in
    (:mod:`batchfit.memory.cuda_untracked`). A calibration records which setting its runs had,
    parsed as torch's ``c10`` allocator config parses it (``c10/core/AllocatorConfig.cpp``,
    ``c10/cuda/CUDAAllocatorConfig.h``): comma-separated ``key:value`` pairs, spaces ignored,
    the last ``expandable_segments`` wins and only ``True`` turns it on (torch refuses any other
    value at CUDA's start). Unset or empty, or without ``expandable_segments:True``: ``caching``.
    ``backend:cudaMallocAsync`` is another allocator altogether (CUDA's own pool): ``""``, as is
    a value torch would refuse, since neither says what the caching allocator did. The setting
    is what the process asked for; a platform without expandable segments (torch warns
    "expandable_segments not supported on this platform") runs the caching allocator anyway.

    Args:
        conf: the variable's value, or ``None`` when it is unset.

    Returns:
        One of :data:`ALLOCATORS`, or ``""`` (unknown).

    Example:
        >>> allocator_setting(None), allocator_setting("max_split_size_mb:128, expandable_segments:True")
        ('caching', 'expandable_segments')
        >>> allocator_setting("expandable_segments:True,expandable_segments:False"), allocator_setting("backend:cudaMallocAsync")
        ('caching', '')
    """
    if conf is None:
        return "caching"
    if not isinstance(conf, str):
        raise InvalidArgument(
            f"conf must be the value of PYTORCH_CUDA_ALLOC_CONF (a string) or None, but got conf={conf!r}"
        )
    expandable = False
    for item in conf.replace(" ", "").split(","):
        if not item:
            continue
        key, _, value = item.partition(":")
        if key == "backend" and value != "native":
            return ""  # cudaMallocAsync: not the caching allocator
        if key == "expandable_segments":
            if value not in ("True", "False"):
                return ""  # torch refuses it: "Expected 'True' or 'False'"
            expandable = value == "True"
    return "expandable_segments" if expandable else "caching"


def process_allocator_setting(environ: Mapping[str, str] | None = None) -> str:
    """The allocator setting of this process (``environ``, default ``os.environ``): :func:`allocator_setting` of its variable.

    torch reads ``PYTORCH_CUDA_ALLOC_CONF`` and, when it is unset, ``PYTORCH_ALLOC_CONF`` (the
    name recent torch prefers; torch 2.13's ``c10`` reads them in that order, some earlier
    releases the other way round). When both are set and ask for different settings, which one
    applies depends on the torch release: ``""`` (unknown).

    Example:
        >>> process_allocator_setting({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
        'expandable_segments'
    """
    env = os.environ if environ is None else environ
    settings = {allocator_setting(env[name]) for name in ALLOCATOR_CONF_VARIABLES if name in env}
    if not settings:
        return allocator_setting(None)
    return settings.pop() if len(settings) == 1 else ""
