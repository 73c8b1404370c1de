"""batchfit.integrations.trl_packed: TRL's GRPO over token-budget packed micro-batches (needs TRL: second tier)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multirank import scaled
from script_helpers import load_script

pytestmark = pytest.mark.slow  # TRL is an optional package

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _trainers(loss_type: str):
    """TRL's own trainer (2 rows × 4 accumulation steps) and the token-budget one (8 rows, budget 48), same model."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from batchfit.integrations.trl_packed import TokenBudgetGRPOTrainer

    example = load_script(EXAMPLES / "trl_grpo.py", "trl_grpo_example")
    tokenizer = example.char_tokenizer()
    model = example.tiny_llama(len(tokenizer))
    common = {"output_dir": "unused", "num_generations": 4, "max_completion_length": 16, "bf16": False, "use_cpu": True,
              "report_to": "none", "save_strategy": "no", "loss_type": loss_type, "seed": 0}
    data = Dataset.from_dict({"prompt": example.PROMPTS})
    theirs = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=example.count_a, train_dataset=data,
                         args=GRPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=4, **common),
                         processing_class=tokenizer)
    ours = TokenBudgetGRPOTrainer(model=copy.deepcopy(model), reward_funcs=example.count_a, train_dataset=data,
                                  args=GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=1, **common),
                                  processing_class=tokenizer, token_budget=48)
    theirs.current_gradient_accumulation_steps, ours.current_gradient_accumulation_steps = 4, 1  # set by train()
    return theirs, ours, example


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_token_budget_step_gives_trls_loss_and_gradient_with_fewer_micro_batches_and_no_padding(loss_type):
    from trl.trainer.utils import split_tensor_dict

    theirs, ours, example = _trainers(loss_type)
    theirs.model.train()
    ours.model.train()
    torch.manual_seed(0)
    rows = [{"prompt": p} for p in example.PROMPTS[:2] for _ in range(4)]  # 2 prompts × 4 completions
    inputs = theirs._generate_and_score_completions(rows)  # the same data for both
    trl_loss = 0.0
    for micro in split_tensor_dict(inputs, 4):  # TRL's own step: 4 micro-batches of 2 padded rows
        loss = theirs.compute_loss(theirs.model, micro)
        loss.backward()
        trl_loss += loss.item()
    our_loss = ours.compute_loss(ours.model, inputs)
    assert our_loss.item() == pytest.approx(trl_loss, abs=1e-5)
    for p, q in zip(theirs.model.parameters(), ours.model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5)
    valid = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
    assert len(ours.micro_batches) < 4  # fewer micro-batches than TRL's
    assert sum(rows for rows, _ in ours.micro_batches) == 8
    assert sum(tokens for _, tokens in ours.micro_batches) == valid  # every token run is a real one: no padding
    assert all(tokens <= 48 for _, tokens in ours.micro_batches)  # each within the budget


def test_an_out_of_memory_in_a_packed_micro_batch_lowers_the_budget_and_the_gradient_is_still_trls():
    # NOTE [ The guard around TRL's packed micro-batches ]: step (2) runs again at a lower budget
    from trl.trainer.utils import split_tensor_dict

    theirs, ours, example = _trainers("grpo")
    theirs.model.train()
    ours.model.train()
    torch.manual_seed(0)
    rows = [{"prompt": p} for p in example.PROMPTS[:2] for _ in range(4)]
    inputs = theirs._generate_and_score_completions(rows)
    for micro in split_tensor_dict(inputs, 4):
        theirs.compute_loss(theirs.model, micro).backward()
    backward, calls = ours._micro_batch_backward, []

    def runs_out_once(model, mb, *, sync):
        backward(model, mb, sync=sync)  # its gradient is in .grad when it runs out: the guard drops it
        calls.append(mb.position)
        if len(calls) == 1:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which "
                "1.00 MiB is free. Of the allocated memory 1.00 GiB is allocated by PyTorch, and 0 bytes is "
                "reserved by PyTorch but unallocated."
            )

    ours._micro_batch_backward = runs_out_once
    ours.compute_loss(ours.model, inputs)
    (shortfall,) = ours.guard.shortfalls
    assert shortfall.position == 0 and ours.token_budget == shortfall.lowered_to < 48
    for p, q in zip(theirs.model.parameters(), ours.model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5)  # TRL's gradient, counted once
    assert sum(r for r, _ in ours.micro_batches) == 8  # the rows of the attempt that succeeded, once each
    assert all(tokens <= ours.token_budget for _, tokens in ours.micro_batches)


def test_a_padded_budget_is_refused():
    pytest.importorskip("trl")
    from batchfit.budget import profile_model
    from batchfit.errors import BudgetError
    from batchfit.integrations.trl_packed import packed_budget_tokens

    padded = profile_model("tiny", max_seq_len=64, backend="estimate", memory_limit="1GiB", cost="padded")
    with pytest.raises(BudgetError, match=r"cost='padded'.*profile with cost='packed'"):
        packed_budget_tokens(padded)


def _run(launcher: list[str]) -> list[dict]:
    done = subprocess.run([*launcher, str(EXAMPLES / "trl_grpo_packed.py")], capture_output=True, text=True,
                          timeout=scaled(300))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["ranks"]


def _check(ranks: list[dict], world: int) -> None:
    assert len(ranks) == world
    for r in ranks:
        assert r["world_size"] == world and r["optimizer_steps"] == 3
        assert r["per_device_train_batch_size"] == 32 // world and r["gradient_accumulation_steps"] == 1
        assert sum(rows for rows, _ in r["micro_batches"]) == 3 * 32 // world  # every row of every step, once
        assert all(tokens <= r["token_budget"] for _, tokens in r["micro_batches"])
        # every packed micro-batch's measured peak (forward + backward) within the limit it was sized for
        assert len(r["micro_batch_peaks"]) == len(r["micro_batches"])
        assert max(r["micro_batch_peaks"]) <= r["limit_bytes"], r


@pytest.mark.timeout(900)
def test_real_token_budget_trainer_trains_in_one_process():
    pytest.importorskip("trl")
    _check(_run([sys.executable]), world=1)


@pytest.mark.timeout(900)
def test_real_token_budget_trainer_trains_on_two_gloo_ranks_under_torchrun():
    pytest.importorskip("trl")
    ranks = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])
    _check(ranks, world=2)
    assert {r["model_wrapper"] for r in ranks} == {"DistributedDataParallel"}


def test_refusals_name_the_setting():
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig

    from batchfit.errors import BudgetError, InvalidArgument
    from batchfit.integrations.trl_packed import TokenBudgetGRPOTrainer

    example = load_script(EXAMPLES / "trl_grpo.py", "trl_grpo_example")
    tokenizer = example.char_tokenizer()
    common = {"output_dir": "unused", "num_generations": 4, "max_completion_length": 16, "bf16": False,
              "use_cpu": True, "report_to": "none", "per_device_train_batch_size": 8}
    kwargs = {"reward_funcs": example.count_a, "train_dataset": Dataset.from_dict({"prompt": example.PROMPTS}),
              "processing_class": tokenizer}
    with pytest.raises(InvalidArgument, match="cast_lm_head_to_fp32=True"):
        TokenBudgetGRPOTrainer(model=example.tiny_llama(len(tokenizer)), token_budget=48,
                               args=GRPOConfig(cast_lm_head_to_fp32=True, **common), **kwargs)
    with pytest.raises(InvalidArgument, match="token_budget"):
        TokenBudgetGRPOTrainer(model=example.tiny_llama(len(tokenizer)), token_budget=0, args=GRPOConfig(**common),
                               **kwargs)
    with pytest.raises(InvalidArgument, match=r"^guard must be 'auto', True or False, but got guard=1 "):
        TokenBudgetGRPOTrainer(model=example.tiny_llama(len(tokenizer)), token_budget=48, guard=1,
                               args=GRPOConfig(**common), **kwargs)
    trainer = TokenBudgetGRPOTrainer(model=example.tiny_llama(len(tokenizer)), token_budget=4,
                                     args=GRPOConfig(**common), **kwargs)
    rows = torch.ones(2, 6, dtype=torch.long)
    with pytest.raises(BudgetError, match="a sequence of 6 tokens is longer than token_budget=4"):
        trainer._get_per_token_logps_and_entropies(trainer.model, rows, torch.ones_like(rows), 3)
