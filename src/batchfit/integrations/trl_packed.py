"""TRL's GRPO with batchfit's token-budget micro-batches: packed without padding, TRL's own loss and gradient.

Importing this module imports TRL (``pip install -e '.[trl]'`` in batchfit's checkout).

NOTE [ TRL's loss over packed micro-batches ]
TRL's ``GRPOTrainer`` runs fixed micro-batches of ``per_device_train_batch_size`` rows, each
padded to the longest prompt and completion of the generation batch (NOTE [ TRL's batch
rules ] in :mod:`batchfit.integrations.trl`). :class:`TokenBudgetGRPOTrainer` keeps everything
TRL does (generation, rewards, advantages, its loss code and normalisation, its metrics) and
changes only how the model is run over the rows of one of TRL's micro-batches
(``_get_per_token_logps_and_entropies``): the rows are planned into micro-batches under a
*packed* token budget (:func:`batchfit.plan.plan_micro_batches`, cost = the sum of the valid
tokens), each micro-batch one padding-free row (:func:`batchfit.batches.iter_micro_batches`
``layout="packed"``, varlen attention: each sequence attends only to itself), its log-probs
and entropies from TRL's own kernel (``logprobs="trl"``, NOTE [ TRL's head ] in
:mod:`batchfit.train.trl_head`). So TRL's micro-batch can be large (a whole optimizer step's
rows) while each forward/backward stays within the budget.

The loss stays exactly TRL's, whatever its ``loss_type`` (including ``bnpo``, whose
normalisation depends on the micro-batch): the gradient is taken in two steps, by the chain
rule. (1) Every packed micro-batch runs forward without gradients; the per-token log-probs and
entropies (``[rows, completion]``, small) are assembled and given to TRL's ``_compute_loss`` as
leaves that require gradients, so the loss is TRL's own on TRL's micro-batch; its gradient
with respect to those leaves is taken (``torch.autograd.grad``). (2) Every packed micro-batch
runs forward again with gradients and back-propagates ``Σ logps · dL/dlogps + Σ entropy ·
dL/dentropy`` (one rank's backward per micro-batch; under DDP all but the last in
``no_sync``): the parameters' gradient is ``Σ_k J_kᵀ g_k = dL/dθ``, the gradient of TRL's
loss, with no padding token run. The price is one forward pass per micro-batch without
gradients (about a third of a training step's compute). Forward-only passes (old and
reference log-probs in ``_generate_and_score_completions``) run step (1) only.

NOTE [ The guard around TRL's packed micro-batches ]
Step (2) runs inside :class:`batchfit.train.MicroBatchGuard` (NOTE [ A micro-batch runs out ] in
:mod:`batchfit.train.micro_batch_guard`): a packed micro-batch that runs out of memory drops the
step's partial gradients, the rows are planned again at a budget lowered by the measured
shortfall, and step (2) runs again; the gradient is still exactly TRL's (it does not depend on
the plan), the lower budget holds for the rest of the run (step (1) plans with it too) and is
logged. Each micro-batch's peak is compared with the budget's memory model when the budget is a
``TokenBudget`` or ``ModelProfile`` (drift, logged once). ``guard="auto"`` (the default) guards
a trainer in one process, where it costs one peak read per micro-batch (``benchmarks/guard.py``:
within the noise of the loop's own time); under DDP the guard adds one synchronising pass of one
token per optimizer step (DDP's all-reduce, run after the ranks agree that no micro-batch ran
out), so it is off there unless ``guard=True``. The forward-only passes of step (1) and of
generation are not guarded; an out-of-memory in TRL's optimizer step is TRL's.

Not supported (refused): MoE auxiliary losses, multimodal inputs, ``cast_lm_head_to_fp32``,
DeepSpeed and FSDP (every rank plans its own rows, so ranks run different numbers of
micro-batches: DDP allows that with ``no_sync``, sharded engines do not).
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer

from batchfit.batches import iter_micro_batches
from batchfit.budget import ModelProfile, TokenBudget
from batchfit.errors import BudgetError, InvalidArgument
from batchfit.models.attention import use_varlen_attention
from batchfit.plan import plan_micro_batches
from batchfit.train import MicroBatchGuard, model_logprobs
from batchfit.validation import check_positive_int, describe

__all__ = ["TokenBudgetGRPOTrainer", "packed_budget_tokens"]

_GRAD_LOGPROBS, _GRAD_ENTROPY = "grad_logprobs", "grad_entropy"


def packed_budget_tokens(budget: TokenBudget | ModelProfile | int) -> int:
    """The token count of a packed budget (a :class:`~batchfit.budget.ModelProfile` gives its ``combined`` one).

    Raises:
        BudgetError: a budget that counts padded tokens (pack with the budget the rows were measured packed).
        InvalidArgument: an int that is not positive.
    """
    if isinstance(budget, ModelProfile):
        budget = budget.combined
    if isinstance(budget, TokenBudget):
        if budget.cost != "packed":
            raise BudgetError(
                f"TokenBudgetGRPOTrainer packs its micro-batches, so its budget must count packed tokens, but got a "
                f"budget with cost={budget.cost!r}; profile with cost='packed' (--cost packed) and logprobs='trl'"
            )
        return budget.tokens
    return check_positive_int("token_budget", budget)


class TokenBudgetGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose forward/backward runs packed micro-batches under a token budget (NOTE [ TRL's loss over packed micro-batches ]).

    Args:
        token_budget: a packed :class:`~batchfit.budget.TokenBudget` (profiled with
            ``logprobs="trl"`` and ``cost="packed"``), a ``ModelProfile`` or a token count.
        guard: run the gradient passes inside a :class:`~batchfit.train.MicroBatchGuard` (NOTE
            [ The guard around TRL's packed micro-batches ]): ``"auto"`` (in one process, not
            under DDP), ``True`` or ``False``.
        *args, **kwargs: as ``GRPOTrainer``. Give ``per_device_train_batch_size`` the rows one
            optimizer step trains per process and ``gradient_accumulation_steps=1``: the
            memory of a step is bounded by the budget, not by the row count.

    Attributes:
        micro_batches: ``(rows, tokens)`` of every packed micro-batch run with gradients, in order
            (of a guarded step, the micro-batches of the attempt that succeeded).
        token_budget: the packed budget now (a guard lowers it after an out-of-memory).
        guard: the :class:`~batchfit.train.MicroBatchGuard` once a guarded step has run, else ``None``.

    Raises:
        BudgetError: a padded budget, or a sequence longer than the budget.
        InvalidArgument: a setting this trainer does not support (see the NOTE).
    """

    def __init__(
        self, *args: Any, token_budget: TokenBudget | ModelProfile | int, guard: bool | str = "auto", **kwargs: Any
    ):
        self.token_budget = packed_budget_tokens(token_budget)
        if not (guard == "auto" or isinstance(guard, bool)):
            raise InvalidArgument(f"guard must be 'auto', True or False, but got guard={describe(guard)}")
        self._guard_option = guard
        self._budget = token_budget.combined if isinstance(token_budget, ModelProfile) else token_budget
        self.guard: MicroBatchGuard | None = None
        super().__init__(*args, **kwargs)
        if self.aux_loss_enabled:
            raise InvalidArgument(
                "TokenBudgetGRPOTrainer does not run MoE auxiliary losses, but the model's config asks for one "
                "(output_router_logits=True); set it to False or use GRPOTrainer"
            )
        if self.args.cast_lm_head_to_fp32:
            raise InvalidArgument(
                "TokenBudgetGRPOTrainer runs TRL's head in the model's dtype, but got cast_lm_head_to_fp32=True; "
                "drop it or use GRPOTrainer"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise InvalidArgument(
                "TokenBudgetGRPOTrainer runs a different number of micro-batches on each rank, which DeepSpeed and "
                "FSDP cannot; train under DDP or in one process"
            )
        use_varlen_attention(self.model)  # packed rows attend per sequence, with no T × T mask
        if self.ref_model is not None:
            use_varlen_attention(self.ref_model)
        self.micro_batches: list[tuple[int, int]] = []
        self._pending: tuple[Any, ...] | None = None

    # ------------------------------------------------------------------ the packed passes
    def _plan(self, attention_mask: torch.Tensor, token_budget: int | None = None) -> Any:
        lengths = attention_mask.sum(-1).tolist()
        budget = self.token_budget if token_budget is None else token_budget
        try:
            return plan_micro_batches(lengths, budget, cost="packed")
        except BudgetError as exc:
            raise BudgetError(
                f"a sequence of {max(lengths)} tokens is longer than token_budget={budget}; profile for "
                "longer sequences (max_seq_len) or lower max_completion_length"
            ) from exc

    def _guarded(self) -> bool:
        if self._guard_option == "auto":
            return self.accelerator.num_processes == 1
        return bool(self._guard_option)

    def _make_guard(self, model: torch.nn.Module) -> MicroBatchGuard:
        """The guard of ``model`` (as the Trainer wraps it): the budget's memory model and margin when it has them."""
        budget = self._budget if isinstance(self._budget, TokenBudget) else self.token_budget
        guard = MicroBatchGuard(model, budget)
        guard.token_budget = min(guard.token_budget, self.token_budget)  # a budget lowered before stays lowered
        return guard

    def _micro_batches(self, fields: dict[str, torch.Tensor], plan: Any) -> Any:
        return iter_micro_batches(fields, plan, 0, layout="packed", token_fields=tuple(fields))

    def _logprobs(self, model: torch.nn.Module, mb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return model_logprobs(model, mb, head="trl", return_entropy=True, temperature=self.temperature)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's method, run as packed micro-batches without gradients (step (1) of the NOTE); with gradients on,
        the results are leaves whose gradient :meth:`compute_loss` carries back through the model."""
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given:
            raise InvalidArgument(
                f"TokenBudgetGRPOTrainer packs text rows only, but got {given[0]}; use GRPOTrainer for multimodal models"
            )
        plan = self._plan(attention_mask)
        logps = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        entropies = torch.zeros_like(logps)
        fields = {"input_ids": input_ids, "attention_mask": attention_mask}
        with torch.no_grad():
            for mb in self._micro_batches(fields, plan):
                lp, ent = self._logprobs(model, mb)
                mb.write_back(logps, lp)
                mb.write_back(entropies, ent)
        logps, entropies = logps[:, -logits_to_keep:], entropies[:, -logits_to_keep:]
        if torch.is_grad_enabled():
            logps.requires_grad_(True)
            entropies.requires_grad_(True)
            self._pending = (logps, entropies, fields, plan, logits_to_keep)
        return logps, (entropies if compute_entropy else None), None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss on TRL's micro-batch; its gradient carried through the packed micro-batches (step (2)).

        Every backward runs here, the last one synchronised across ranks; the loss returned
        for the Trainer's own backward is detached (a leaf: nothing more to propagate).
        """
        self._pending = None
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        pending, self._pending = self._pending, None
        if pending is None or not loss.requires_grad:
            return loss
        logps, entropies, fields, plan, keep = pending
        grad_logps, grad_entropies = torch.autograd.grad(loss, (logps, entropies), allow_unused=True)
        width = fields["input_ids"].shape[1]
        for name, grad in ((_GRAD_LOGPROBS, grad_logps), (_GRAD_ENTROPY, grad_entropies)):
            if grad is None:  # the loss does not read it (entropy only logged): nothing to carry back
                continue
            full = torch.zeros((fields["input_ids"].shape[0], width), dtype=torch.float32, device=logps.device)
            full[:, width - keep :] = grad
            fields = {**fields, name: full}
        if not self._guarded():
            micro = list(self._micro_batches(fields, plan))
            for k, mb in enumerate(micro):
                last = k == len(micro) - 1
                self._micro_batch_backward(model, mb, sync=last)
            return loss.detach().requires_grad_(True)
        # NOTE [ The guard around TRL's packed micro-batches ]
        if self.guard is None or self.guard.model is not model:
            self.guard = self._make_guard(model)
        ran = len(self.micro_batches)
        record = self.guard.mini_batch(
            plan=lambda budget: self._plan(fields["attention_mask"], budget),
            micro_batches=lambda p: self._micro_batches(fields, p),
            # the plan's last micro-batch synchronises (under DDP the guard's padding pass, after the agreement)
            run=lambda mb, p: self._micro_batch_backward(model, mb, sync=mb.position == p.num_micro_batches - 1),
        )
        self.token_budget = self.guard.token_budget
        self.micro_batches[ran:] = [(m.rows, m.cost) for m in record.micro_batches]
        return loss.detach().requires_grad_(True)

    def _micro_batch_backward(self, model: torch.nn.Module, mb: Any, *, sync: bool) -> None:
        """Forward and backward of one packed micro-batch, its log-probs' and entropies' gradients given."""
        lp, ent = self._logprobs(model, mb)
        parts = [(lp, mb.batch.get(_GRAD_LOGPROBS)), (ent, mb.batch.get(_GRAD_ENTROPY))]
        surrogate = sum((value * grad).sum() for value, grad in parts if grad is not None)
        if sync:
            self.accelerator.backward(surrogate)
        else:
            with self.accelerator.no_sync(model):
                self.accelerator.backward(surrogate)
        self.micro_batches.append((len(mb.indices), int(mb.batch["input_ids"].shape[-1])))
