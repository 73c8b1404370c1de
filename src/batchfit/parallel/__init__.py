"""Data parallelism: collectives that agree across ranks, sharding specs, PyTorch's FSDP2, FSDP1 and DDP applied.

- :mod:`~batchfit.parallel.distributed`: min/max/any all-reduce helpers and agreement on
  errors (no-ops without a process group), :func:`simulated_world` (PyTorch's fake process
  group), :func:`sync_micro_batch_count`.
- :mod:`~batchfit.parallel.strategies`: one :class:`~batchfit.parallel.strategies.StrategySpec` per
  strategy (what it shards, how it builds and wraps a model), registered by name.
- :mod:`~batchfit.parallel.sharding`: :class:`Sharding`, the data-parallel layout as data.
- :mod:`~batchfit.parallel.shard`: :func:`shard_model` (``fully_shard`` per layer and root,
  FSDP1 or DDP), :func:`sharding_of`, :func:`unwrap`.
- :mod:`~batchfit.parallel.shard_state`: :func:`shard_state`, the :class:`ShardState` ``shard_model``
  recorded for a model (its sharding, communication buffers, ZeRO's state).
- :mod:`~batchfit.parallel.fsdp1`: FSDP1 (``FullyShardedDataParallel``) wrapped as verl wraps it.
- :mod:`~batchfit.parallel.sequence`: :func:`sequence_parallel_group` and Ulysses' collectives
  (all-to-all between the split of the sequence and of the heads, the gather of outputs).
- :mod:`~batchfit.parallel.sequence_split`: :func:`split_packed` / :func:`gather_packed`, a packed
  micro-batch cut over a sequence-parallel group and its per-token outputs put back.
- :mod:`~batchfit.parallel.behaviour`: what the installed torch does that changes a budget
  (FSDP2's root resharded after forward or kept), probed or read from its version.
"""

from batchfit.parallel.distributed import simulated_world, sync_micro_batch_count
from batchfit.parallel.sequence import sequence_parallel_group
from batchfit.parallel.sequence_split import SequenceShard, gather_packed, sequence_shard, split_packed
from batchfit.parallel.shard import shard_model, sharding_of, unwrap
from batchfit.parallel.shard_state import ShardState, shard_state
from batchfit.parallel.sharding import Sharding, as_sharding
from batchfit.parallel.strategies import StrategySpec, get_strategy, strategy_names

__all__ = [
    "SequenceShard",
    "ShardState",
    "Sharding",
    "StrategySpec",
    "as_sharding",
    "gather_packed",
    "get_strategy",
    "sequence_parallel_group",
    "sequence_shard",
    "shard_model",
    "shard_state",
    "sharding_of",
    "simulated_world",
    "split_packed",
    "strategy_names",
    "sync_micro_batch_count",
    "unwrap",
]
