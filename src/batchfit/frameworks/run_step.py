"""The micro-batch step a framework config runs: its log-prob head and its micro-batch layout.

:func:`framework_step` reads what :mod:`batchfit.frameworks.verl` and
:mod:`batchfit.frameworks.skyrl` put in a :class:`~batchfit.frameworks.run.RunConfig`
(``remove_padding``, ``fused_kernels``, the entropy fields, ``temperature``) and says how the
budget's probe must run to be the framework's step (NOTE [ The framework's head, not ours ] in
:mod:`batchfit.train.framework_heads`), and what of the framework's step it does not reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.errors import InvalidArgument
from batchfit.frameworks.registry import get_framework
from batchfit.frameworks.run import RunConfig
from batchfit.train.framework_heads import FRAMEWORK_HEADS, FrameworkHead
from batchfit.train.megatron_heads import MegatronHead, MegatronHeads

__all__ = ["FrameworkStep", "default_megatron_heads", "framework_step", "megatron_heads"]

@dataclass(frozen=True)
class FrameworkStep:
    """How the budget's probe runs a framework's micro-batch.

    Attributes:
        head: the policy's log-prob head: a :class:`FrameworkHead`, or ``"fused"`` when the
            framework's fused kernels compute log-probs from the hidden states.
        cost: ``"packed"`` when the framework removes the micro-batch's padding (its token
            budget then bounds the packed row), else ``"padded"``.
        notes: what of the framework's step the probe does not reproduce, one sentence each.
    """

    head: FrameworkHead | str
    cost: str
    notes: tuple[str, ...] = ()


def framework_step(run: RunConfig) -> FrameworkStep | None:
    """The step ``run``'s framework runs per micro-batch, or ``None`` for batchfit's flat vocabulary.

    Args:
        run: a config read by :func:`batchfit.frameworks.read_run_config`.

    Returns:
        A :class:`FrameworkStep` for a verl or SkyRL config, else ``None``.
    """
    framework = run.vocabulary
    if framework not in FRAMEWORK_HEADS:  # its own log-prob head: the budgets probe it
        if run.fused_kernels and framework != "flat":  # prime-rl's fused LM head
            cost = "packed" if run.remove_padding else "padded"
            return FrameworkStep(
                head="fused",
                cost=cost,
                notes=(f"{framework}'s fused LM head computes log-probs from the hidden states: probed with batchfit's "
                       "fused head (logprobs_from_hidden); its chunking is batchfit's",),
            )
        return None
    notes: list[str] = []
    remove_padding = bool(run.remove_padding)
    cost = "packed" if remove_padding else "padded"
    if run.fused_kernels:
        notes.append(
            f"{framework}'s fused kernels compute log-probs from the hidden states: probed with batchfit's fused "
            "head (logprobs_from_hidden), which never builds the logits either; its chunking is batchfit's"
        )
        return FrameworkStep(head="fused", cost=cost, notes=tuple(notes))
    entropy = run.entropy
    forward_entropy = run.forward_entropy
    head = FrameworkHead(
        framework,
        entropy=entropy,
        entropy_grad=bool(run.entropy_grad),
        entropy_in_loss=bool(run.entropy_in_loss),
        entropy_chunk_size=run.entropy_chunk_size or FrameworkHead.default(framework).entropy_chunk_size,
        forward_entropy=forward_entropy,
        temperature=float(run.temperature or 1.0),
    )
    layout = "packed rows: it removes padding" if remove_padding else "padded rows: it keeps padding"
    notes.append(f"the budgets' probe runs {head.describe()}; micro-batches as {layout}")
    compiled = get_framework(framework).compiled_entropy
    if compiled is not None and "full" in (entropy, forward_entropy):
        notes.append(compiled)
    return FrameworkStep(head=head, cost=cost, notes=tuple(notes))


def megatron_heads(run: RunConfig) -> MegatronHeads | None:
    """Each pass's head of ``run``'s Megatron run, for a framework that names its head only under Megatron (slime).

    slime (624b824a) computes log-probs and entropy in one pass over the vocabulary-parallel
    logits (``_VocabParallelLogProbEntropy``), in chunks of ``--log-probs-chunk-size`` tokens
    (``RunConfig.logprobs_chunk_size``): the entropy in the update always
    (``policy_loss_function``: ``with_entropy=True``), with its graph when ``--entropy-coef`` is not
    0 (``get_log_probs_and_entropy``: ``with_entropy_grad``, ``RunConfig.entropy_grad``); the
    forward passes (old log-probs, and the reference's on the same model) compute it under
    ``--use-rollout-entropy`` (``model.forward_only``: ``with_entropy=args.use_rollout_entropy``,
    ``RunConfig.forward_entropy``). SkyRL under ``trainer.fused_lm_head_logprob``
    (``RunConfig.fused_kernels``; NOTE [ SkyRL's fused LM head ] in
    :mod:`batchfit.train.megatron_heads`): the fused head in every pass, in chunks of
    ``logprobs_chunk_size`` tokens, the update's entropy a metric; otherwise its vocab-parallel head
    with the config's ``logprobs_chunk_size``, ``vocab_entropy_chunk_size`` and
    ``vocab_entropy_chunk_memory_mb``, the update's entropy
    with its graph under ``use_entropy_loss``. verl's head comes from its :class:`FrameworkHead`
    (``None`` here).

    Raises:
        InvalidArgument: SkyRL's fused head with ``use_entropy_loss`` (SkyRL raises
            ``NotImplementedError``: its fused entropy has no graph).
    """
    if run.vocabulary == "skyrl" and run.fused_kernels:
        if run.entropy_grad:
            raise InvalidArgument(
                "trainer.fused_lm_head_logprob=true with trainer.algorithm.use_entropy_loss=true: SkyRL raises "
                "NotImplementedError (megatron_model_wrapper.py, a9564572: the fused entropy is a no-grad metric); turn "
                "one of them off"
            )
        chunk = run.logprobs_chunk_size  # None (null): the whole sequence as one chunk, as SkyRL's eff_chunk
        fused = MegatronHead("skyrl", chunk_size=chunk, fused=True)
        return MegatronHeads(update=MegatronHead("skyrl", entropy=True, chunk_size=chunk, fused=True), old_log_probs=fused, reference=fused)
    if run.vocabulary == "skyrl":
        # log-probs in trainer.logprobs_chunk_size chunks (None: DistributedLogprob, one piece); the update's entropy in
        # vocab_entropy_chunk_size chunks (RunConfig.entropy "full": None, no chunks; a size; 0: sized from memory)
        entropy_chunk = None if run.entropy == "full" else (run.entropy_chunk_size or 0)
        memory = run.entropy_chunk_memory_mb or MegatronHead.entropy_chunk_memory_mb  # SkyRL's default, 512 MiB
        plain = MegatronHead(
            "skyrl", chunk_size=run.logprobs_chunk_size, entropy_chunk_size=entropy_chunk, entropy_chunk_memory_mb=memory
        )
        update = MegatronHead(
            "skyrl", entropy=True, entropy_grad=bool(run.entropy_grad), chunk_size=run.logprobs_chunk_size,
            entropy_chunk_size=entropy_chunk, entropy_chunk_memory_mb=memory,
        )  # fmt: skip
        return MegatronHeads(update=update, old_log_probs=plain, reference=plain)
    if run.vocabulary != "slime":
        return None
    chunk = run.logprobs_chunk_size
    rollout_entropy = run.forward_entropy != "none"
    forward = MegatronHead("slime", entropy=rollout_entropy, chunk_size=chunk)
    return MegatronHeads(
        update=MegatronHead("slime", entropy=True, entropy_grad=bool(run.entropy_grad), chunk_size=chunk),
        old_log_probs=forward,
        reference=forward,
    )


def default_megatron_heads(framework: str) -> MegatronHeads | None:
    """The heads ``framework``'s default config runs under Megatron, for a profile of another framework's config
    emitted to it: slime's (:meth:`MegatronHead.default`: the update's entropy a metric, none in the forward
    passes, one chunk); ``None`` for a framework whose head is not carried this way."""
    if framework != "slime":
        return None
    forward = MegatronHead.default("slime", forward_only=True)
    return MegatronHeads(update=MegatronHead.default("slime"), old_log_probs=forward, reference=forward)
