"""prime-rl 559b4477's keys for ``--emit prime_rl``: the shared ``seq_len`` (its packed micro-batch), and every setting the budgets assume.

:func:`token_keys` writes ``seq_len`` with ``trainer.model.seq_len`` and ``orchestrator.seq_len`` (which win
over the shared key when a file sets them: ``rl.py`` ``RLConfig.seq_len``); :func:`assumption_keys` the key of
every profiled setting, or refuses what prime-rl cannot express (NOTE [ Emitted keys carry every assumption ] in
:mod:`batchfit.frameworks.assumptions`). :data:`batchfit.frameworks.prime_rl.SPEC` names this module. The keys
are dotted names of prime-rl's TOML tables (``trainer.model.seq_len`` is ``seq_len`` in ``[trainer.model]``).
"""

from __future__ import annotations

from typing import Any

from batchfit.frameworks.assumptions import (
    Assumptions,
    Key,
    allocator_comment,
    check_head,
    check_strategy,
    refuse,
)
from batchfit.frameworks.run import RunConfig
from batchfit.frameworks.run_profile import RunProfile
from batchfit.train.framework_heads import FrameworkHead

__all__ = ["allocator_keys", "assumption_keys", "token_keys"]

_TM = "trainer.model."


def token_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """One budget: the policy update's, as the packed row every trainer micro-batch is.

    NOTE [ prime-rl's micro-batch is one packed row ] in :mod:`batchfit.frameworks.prime_rl`: the trainer runs no
    forward-only pass (old log-probs come from the inference server), so only the update's budget is written.
    """
    del world
    sp = profile.options["policy"].sharding.sequence_parallel if profile is not None else 1
    tokens = budgets["policy"]
    split = f", split over the {sp} GPUs of a context-parallel group (trainer.model.cp)" if sp > 1 else ""
    keys = [
        Key(
            "seq_len",
            tokens,
            why(
                "policy",
                "the trainer's packed micro-batch [1, seq_len] (prepare_batch): a hard cap, samples longer are truncated"
                + split,
            ),
        ),
        Key(_TM + "seq_len", tokens, "explicit per-component values win over the shared seq_len (rl.py)"),
        Key("orchestrator.seq_len", tokens, "the packer's bin and the truncation length (orchestrator/packing.py)"),
    ]
    if tokens < max_seq_len:
        keys.append(
            Key(
                "",
                False,
                f"seq_len={tokens:,} is below the longest sequence profiled ({max_seq_len:,} tokens): prime-rl truncates "
                "longer samples; lower orchestrator.train.sampling.max_completion_tokens or give each GPU more memory",
            )
        )
    else:
        keys.append(
            Key(
                "",
                False,
                f"the budgets were profiled with samples of at most {max_seq_len:,} tokens packed into each row: keep "
                "the prompt plus orchestrator.train.sampling.max_completion_tokens within that",
            )
        )
    return keys


def assumption_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """``[deployment]`` and ``[trainer.model]`` keys of every profiled setting (trainer.py ModelConfig at 559b4477)."""
    del same
    target = "prime_rl"
    s = a.sharding
    check_strategy(target, a, ("fsdp2",), "prime-rl's trainer shards with FSDP2 (fully_shard)")
    if set(a.roles) - {"policy", "policy_forward"}:
        raise refuse(
            target,
            f"the roles {', '.join(sorted(set(a.roles) - {'policy', 'policy_forward'}))}",
            "prime-rl's trainer runs the policy's update only (no critic, no reference model)",
            "profile the policy only (--roles policy)",
        )
    if a.lora.get("policy") is not None:
        raise refuse(target, f"--lora-rank {a.lora['policy'].rank}", "batchfit does not write prime-rl's LoRA keys yet", "pass --lora-rank 0")
    if s.mixed_precision != "bf16":
        raise refuse(
            target,
            f"--mixed-precision {s.mixed_precision}",
            "prime-rl computes in bf16 over optimization_dtype parameters (trainer.py ModelConfig)",
            "profile with --mixed-precision bf16",
        )
    if not a.gradient_checkpointing:
        raise refuse(
            target,
            "--no-gradient-checkpointing",
            "prime-rl checkpoints every layer by default ([trainer.model.ac], and ac_offloading turns it back on), "
            "and a TOML file cannot set it to None",
            "profile with --gradient-checkpointing",
        )
    head = a.head
    name = head.framework if isinstance(head, FrameworkHead) else head
    check_head(
        target,
        a,
        ("full", "fused"),
        "prime-rl takes log-probs from its fused LM head (hidden states, chunked) or the vanilla one",
        "drop --logprobs, or pass --logprobs fused or full",
    )
    keys: list[Key] = []
    if s.sequence_parallel > 1:
        keys += [
            Key(_TM + "cp", s.sequence_parallel, "each packed row split over these GPUs, as profiled"),
            Key(_TM + "cp_style", "ulysses", "all-to-all head split (Ulysses), as batchfit profiles it"),
        ]
    if run.vocabulary == target and run.source.get("deployment") == "multi_node":
        keys.append(
            Key("", False, f"the trainer was profiled on {s.world_size} GPUs: set deployment.num_train_nodes to match")
        )
    else:
        keys.append(
            Key(
                "deployment.num_train_gpus",
                s.world_size,
                f"the {s.world_size} trainer GPUs profiled (single_node: with num_infer_gpus within gpus_per_node)",
            )
        )
    keys += [
        Key(_TM + "fsdp_cpu_offload", s.offload == "cpu", "FSDP2's CPU offload of parameters, gradients and optimizer state"),
        Key(_TM + "reshard_after_forward", bool(s.reshard_after_forward)),
        Key(
            _TM + "optimization_dtype",
            "bfloat16" if a.trained_dtype == "bf16" else "float32",
            "the parameters' dtype the optimizer steps, as profiled",
        ),
        _head_key(run, name),
        Key(
            "",
            False,
            "the budgets keep the optimizer state and the checkpointed activations on the GPU; prime-rl's default "
            "optim_cpu_offload and ac_offloading move them to the host, so they hold with room to spare",
        ),
    ]
    return keys


def _head_key(run: RunConfig, name: str) -> Key:
    """The LM head: batchfit's full head (the whole logits) bounds prime-rl's fused one from above, so a config that
    fuses keeps it; ``disabled`` only where the config itself disables it, or for another framework's config."""
    key = _TM + "fused_lm_head_token_chunk_size"
    if name == "fused":
        return Key(key, 8192, "the fused LM head (from the hidden states), as profiled with batchfit's fused head")
    if run.vocabulary == "prime_rl" and run.fused_kernels:
        return Key(
            "",
            False,
            f"{key}: keep the config's fused LM head; the budgets hold the whole logits, which bound it from above",
        )
    return Key(key, "disabled", "the vanilla LM head (whole logits), as profiled")


def allocator_keys(a: Assumptions) -> list[Key]:
    """prime-rl launches its trainer with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (utils/process.py)."""
    how = (
        "prime-rl's trainer default (utils/process.py DEFAULT_TRAINER_ENV_VARS)"
        if a.allocator == "expandable_segments"
        else "prime-rl's trainer turns expandable segments on (utils/process.py): the caching budgets hold too"
    )
    return [allocator_comment(a, how)]


def render(keys: list[Key], header: list[str]) -> str:
    """The keys as prime-rl's TOML: ``# comment`` lines, top-level keys, then one ``[table]`` per section.

    A key of a table is written under its table header (``trainer.model.seq_len`` is ``seq_len`` in
    ``[trainer.model]``), each with its comment; keys without a path are comments. The shared patch's
    ``emit.render_keys`` calls this for ``--emit prime_rl`` (its ``render`` hook).

    >>> print(render([Key("seq_len", 4096, "why"), Key("trainer.model.cp", 2)], []), end="")
    seq_len = 4096  # why
    <BLANKLINE>
    [trainer.model]
    cp = 2
    """
    lines = [f"# {line}" for line in header]
    lines += [f"# {key.comment}" for key in keys if not key.path and key.comment]
    tables: dict[str, list[str]] = {}
    for key in keys:
        if not key.path:
            continue
        table, _, leaf = key.path.rpartition(".")
        comment = f"  # {key.comment}" if key.comment else ""
        tables.setdefault(table, []).append(f"{leaf} = {_toml(key.value)}{comment}")
    lines += tables.pop("", [])
    for table, rows in tables.items():
        lines += ["", f"[{table}]", *rows]
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    """A value as TOML writes it: ``true``, ``4096``, ``"ulysses"``, ``["q_proj", "v_proj"]``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
