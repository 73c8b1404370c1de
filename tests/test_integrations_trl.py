"""batchfit.integrations.trl: TRL's GRPO sized by a token budget (pure arithmetic first, then the real library)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.errors import BatchConfigError, BudgetError, InvalidArgument
from batchfit.integrations.trl import padded_row_length, plan_grpo_batches
from multirank import scaled

# ---------------------------------------------------------------- the arithmetic (no TRL needed)


def test_largest_micro_batch_that_divides_each_processes_rows():
    # 4096 // 512 = 8 rows fit; 96 sequences / 2 processes = 48 rows each: 8 divides 48 -> 6 accumulation steps
    s = plan_grpo_batches(4096, row_length=512, num_generations=8, generation_batch_size=96, num_processes=2)
    assert (s.per_device_train_batch_size, s.gradient_accumulation_steps, s.steps_per_generation) == (8, 6, 6)
    # 84 / 2 = 42 rows per process: 8 does not divide 42, its largest divisor not above 8 is 7 -> 6 steps
    s = plan_grpo_batches(4096, row_length=512, num_generations=4, generation_batch_size=84, num_processes=2)
    assert (s.per_device_train_batch_size, s.gradient_accumulation_steps) == (7, 6)
    # 7 fit (3584 // 512), 48 rows per process: divisors 1,2,3,4,6 -> 6, 8 steps; two optimizer steps per generation
    s = plan_grpo_batches(3584, row_length=512, num_generations=8, generation_batch_size=192, num_processes=2,
                          optimizer_steps_per_generation=2)
    assert (s.per_device_train_batch_size, s.gradient_accumulation_steps, s.steps_per_generation) == (6, 8, 16)
    assert s.generation_batch_size == 192 and s.sequences_per_step == 96 and s.largest_fitting == 7


def test_rows_the_divisor_rule_leaves_unused_are_said_with_the_generation_batch_sizes_that_use_them():
    # 3584 // 512 = 7 rows fit; 64 sequences / 2 processes = 32 rows each, whose divisors <= 7 are 1, 2, 4 -> 4 of 7;
    # all 7 need generation_batch_size a multiple of lcm(8 generations, 1 step x 2 processes x 7 rows) = 56
    s = plan_grpo_batches(3584, row_length=512, num_generations=8, generation_batch_size=64, num_processes=2)
    assert (s.per_device_train_batch_size, s.largest_fitting) == (4, 7)
    assert s.generation_batch_sizes_using_every_row() == (56, 112)
    assert s.unused_rows_note() == (
        "7 rows of 512 tokens fit the budget of 3,584 tokens, but per_device_train_batch_size must divide the 32 rows "
        "each process trains per optimizer step (generation_batch_size=64 / optimizer_steps_per_generation=1 / 2 "
        "process(es)), so it is 4; generation_batch_size=56 or generation_batch_size=112 would use all 7")
    for g in s.generation_batch_sizes_using_every_row():  # and they do
        assert plan_grpo_batches(3584, row_length=512, num_generations=8, generation_batch_size=g,
                                 num_processes=2).per_device_train_batch_size == 7
    # two optimizer steps of 24 rows: 6 of 7; lcm(4, 2 x 1 x 7) = 28 -> 28 (14 rows a step) or 56 (28)
    s = plan_grpo_batches(1000, row_length=128, num_generations=4, generation_batch_size=48,
                          optimizer_steps_per_generation=2)
    assert (s.per_device_train_batch_size, s.generation_batch_sizes_using_every_row()) == (6, (28, 56))
    # nothing to say: 8 divides 48, or every row of a step fits in one micro-batch
    assert plan_grpo_batches(4096, row_length=512, num_generations=8, generation_batch_size=96,
                             num_processes=2).unused_rows_note() is None
    assert plan_grpo_batches(40960, row_length=512, num_generations=8, generation_batch_size=16,
                             num_processes=2).unused_rows_note() is None


@dataclasses.dataclass
class _Config:
    """The fields of TRL's GRPOConfig that grpo_config reads and sets, and its bf16 default (None: not fp16)."""

    output_dir: str = "unused"
    num_generations: int = 8
    max_completion_length: int = 256
    pad_to_multiple_of: int | None = None
    bf16: bool | None = None
    fp16: bool = False
    use_cpu: bool = False
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    world_size: int = 2


def test_grpo_config_warns_of_unused_rows_naming_the_sizes_that_use_them():
    from batchfit.integrations.trl import UnusedRowsWarning, grpo_config

    with pytest.warns(UnusedRowsWarning, match=r"7 rows of 512 tokens fit .* so it is 4; generation_batch_size=56 or"):
        args = grpo_config(3584, max_prompt_length=256, generation_batch_size=64, config_class=_Config, use_cpu=True)
    assert args.per_device_train_batch_size == 4


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        pytest.param({"bf16": True}, r"trains in bf16 \(bf16=True\)", id="bf16-given"),
        pytest.param({}, r"bf16=None, which _Config turns into True when fp16 is not set", id="bf16-default"),
    ],
)
def test_bf16_on_a_machine_without_it_is_refused_naming_the_field_and_the_fixes(monkeypatch, fields, match):
    from batchfit.integrations import trl
    from batchfit.integrations.trl import grpo_config

    monkeypatch.setattr(trl, "_bf16_available", lambda: False)  # transformers' own test, on a machine without a GPU
    with pytest.raises(InvalidArgument, match=match + r".*pass use_cpu=True \(bf16 on the CPU\) or bf16=False"):
        grpo_config(4096, max_prompt_length=256, generation_batch_size=64, config_class=_Config, **fields)
    assert grpo_config(4096, max_prompt_length=256, generation_batch_size=64, config_class=_Config,
                       bf16=False).per_device_train_batch_size == 8  # 4096 // 512 = 8 rows, 32 per process


def test_pad_to_multiple_of_rounds_prompt_and_completion_apart():
    assert padded_row_length(100, 250) == 350
    assert padded_row_length(100, 250, 64) == 384  # 128 + 256, not ceil(350 / 64) * 64 = 384 by luck:
    assert padded_row_length(65, 65, 64) == 256  # 128 + 128, where the sum rounded once would be 192


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"tokens": 500}, BudgetError, "row_length=512 tokens .* costs more than the token budget of 500"),
        ({"num_generations": 1, "generation_batch_size": 8}, BatchConfigError, "num_generations=1"),
        ({"generation_batch_size": 60}, BatchConfigError, "generation_batch_size=60 must be a multiple of num_generations=8.*use 56 or 64"),
        ({"generation_batch_size": 24, "num_processes": 16}, BatchConfigError, "split evenly over num_processes=16"),
        ({"optimizer_steps_per_generation": 5}, BatchConfigError, "optimizer_steps_per_generation=5"),
        ({"num_processes": 0}, InvalidArgument, "num_processes"),
        ({"tokens": True}, InvalidArgument, "tokens"),
    ],
    ids=["one-row-too-long", "one-generation", "partial-group", "ranks", "steps", "no-process", "bool"],
)
def test_broken_rules_name_the_field_and_the_fix(kwargs, error, match):
    args = {"tokens": 4096, "row_length": 512, "num_generations": 8, "generation_batch_size": 64, **kwargs}
    with pytest.raises(error, match=match):
        plan_grpo_batches(**args)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.integers(1, 100_000),
    row=st.integers(1, 4096),
    groups=st.integers(1, 64),
    num_generations=st.integers(2, 16),
    world=st.integers(1, 8),
    k=st.integers(1, 4),
)
def test_every_trl_rule_holds_and_the_micro_batch_fits(tokens, row, groups, num_generations, world, k):
    generation = groups * num_generations * world * k  # a generation batch every rule allows
    if tokens < row:
        with pytest.raises(BudgetError):
            plan_grpo_batches(tokens, row_length=row, num_generations=num_generations,
                              generation_batch_size=generation, num_processes=world, optimizer_steps_per_generation=k)
        return
    s = plan_grpo_batches(tokens, row_length=row, num_generations=num_generations, generation_batch_size=generation,
                          num_processes=world, optimizer_steps_per_generation=k)
    assert s.micro_batch_tokens <= tokens  # fits the budget
    assert s.generation_batch_size == generation  # TRL's derivation gives back what was asked
    assert s.generation_batch_size % num_generations == 0  # whole prompt groups
    assert s.steps_per_generation == k * s.gradient_accumulation_steps
    assert s.sequences_per_step * k == generation
    # no larger micro-batch both fits and divides the rows of a step
    rows = generation // k // world
    assert all(rows % d for d in range(s.per_device_train_batch_size + 1, min(rows, tokens // row) + 1))


# ---------------------------------------------------------------- the real library (second tier)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py"


def _run_example(launcher: list[str]) -> list[dict]:
    done = subprocess.run([*launcher, str(EXAMPLE)], capture_output=True, text=True, timeout=scaled(300))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["ranks"]


def _check_run(ranks: list[dict], world: int) -> None:
    assert len(ranks) == world
    for r in ranks:
        # sized by batchfit from the budget TRL's own head was probed with (MEMORY_LIMIT, rows of 8 + 24 tokens)
        assert r["world_size"] == world and r["optimizer_steps"] == 3
        rows, steps = r["per_device_train_batch_size"], r["gradient_accumulation_steps"]
        assert rows * 32 <= r["token_budget"]  # a micro-batch of `rows` padded rows fits the budget
        assert r["generation_batch_size"] == 32 and r["generation_batch_size"] % 4 == 0  # whole prompt groups
        assert rows * world * steps == 32 and r["steps_per_generation"] == steps
        assert r["micro_batch_rows"] == [rows] * (3 * steps)  # every micro-batch TRL ran had that many rows
        # every micro-batch's measured peak (forward + backward, batchfit's cpu tracker) within the limit it was sized for
        assert r["micro_batch_peaks"] and max(r["micro_batch_peaks"]) <= r["limit_bytes"], r
    assert len({(r["per_device_train_batch_size"], r["gradient_accumulation_steps"]) for r in ranks}) == 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_grpo_trainer_sized_by_batchfit_keeps_every_micro_batch_within_its_limit():
    pytest.importorskip("trl")
    ranks = _run_example([sys.executable])
    _check_run(ranks, world=1)
    assert ranks[0]["per_device_train_batch_size"] > 1  # the budget holds several rows: a real choice was made


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_grpo_trainer_on_two_gloo_ranks_under_torchrun():
    pytest.importorskip("trl")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ranks = _run_example(launcher)
    _check_run(ranks, world=2)
    assert {r["model_wrapper"] for r in ranks} == {"DistributedDataParallel"}


_CONFIG = {"output_dir": "unused", "report_to": "none", "use_cpu": True, "bf16": False}


@pytest.mark.slow
@pytest.mark.parametrize("config_name", ["GRPOConfig", "RLOOConfig"])
def test_grpo_config_builds_trls_config_with_the_sized_fields(config_name):
    trl = pytest.importorskip("trl")
    from batchfit.integrations.trl import UnusedRowsWarning, grpo_config, token_budget_grpo_config

    cls = getattr(trl, config_name)
    # 1000 // (100 + 28) = 7 rows fit; 48 sequences in 2 optimizer steps: 24 rows a step, largest divisor <= 7 is 6
    with pytest.warns(UnusedRowsWarning, match=r"so it is 6; generation_batch_size=28 or generation_batch_size=56"):
        args = grpo_config(1000, max_prompt_length=100, generation_batch_size=48, optimizer_steps_per_generation=2,
                           config_class=cls, num_generations=4, max_completion_length=28, **_CONFIG)
    assert type(args) is cls
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation) == (6, 4, 8)
    assert args.generation_batch_size == 48  # derived by TRL's own __post_init__
    packed = token_budget_grpo_config(generation_batch_size=48, optimizer_steps_per_generation=2, config_class=cls,
                                      num_generations=4, **_CONFIG)
    assert (packed.per_device_train_batch_size, packed.gradient_accumulation_steps, packed.steps_per_generation) == (24, 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("budget", "kwargs", "error", "match"),
    [
        (1000, {"per_device_train_batch_size": 4}, InvalidArgument, "per_device_train_batch_size=4; drop it"),
        (1000, {"auto_find_batch_size": True}, InvalidArgument, "auto_find_batch_size=True"),
        (1000, {"num_generations": 5}, BatchConfigError, "generation_batch_size=48 must be a multiple of num_generations=5"),
        (100, {}, BudgetError, "costs more than the token budget of 100"),
        ("packed", {}, BudgetError, "cost='packed'"),
        ("short", {}, BudgetError, r"profile with max_seq_len=128"),
    ],
    ids=["sized-field", "auto-find", "groups", "one-row", "packed-budget", "too-long"],
)
def test_grpo_config_refusals_name_the_field(budget, kwargs, error, match):
    pytest.importorskip("trl")
    from batchfit.budget import profile_model
    from batchfit.integrations.trl import grpo_config

    if isinstance(budget, str):  # a real (estimated) budget: packed, or one that covers 64-token rows only
        cost, max_seq_len = ("packed", 128) if budget == "packed" else ("padded", 64)
        budget = profile_model("tiny", max_seq_len=max_seq_len, backend="estimate", memory_limit="1GiB", cost=cost)
    with pytest.raises(error, match=match):
        grpo_config(budget, max_prompt_length=100, generation_batch_size=48, max_completion_length=28,
                    **{"num_generations": 4, **kwargs}, **_CONFIG)


@pytest.mark.slow
def test_trls_own_config_with_bf16_on_this_cpu_machine_is_one_line_naming_the_fixes():
    trl = pytest.importorskip("trl")
    import torch

    from batchfit.integrations.trl import UnusedRowsWarning, grpo_config

    if torch.cuda.is_available():
        pytest.skip("a GPU machine: bf16 is available")
    fields = {**_CONFIG, "use_cpu": False, "bf16": True, "num_generations": 4, "max_completion_length": 28}
    with pytest.raises(InvalidArgument, match=r"GRPOConfig trains in bf16 \(bf16=True\).*pass use_cpu=True"):
        grpo_config(1000, max_prompt_length=100, generation_batch_size=48, **fields)
    del fields["bf16"]  # TRL's default: bf16 = not fp16
    with pytest.raises(InvalidArgument, match=r"bf16=None, which GRPOConfig turns into True"):
        grpo_config(1000, max_prompt_length=100, generation_batch_size=48, **fields)
    # use_cpu=True: bf16 on the CPU, which transformers accepts; the 6-of-7 rows are said
    with pytest.warns(UnusedRowsWarning, match=r"generation_batch_size=28 or generation_batch_size=56"):
        args = grpo_config(1000, max_prompt_length=100, generation_batch_size=48, optimizer_steps_per_generation=2,
                           **{**fields, "use_cpu": True, "bf16": True})
    assert type(args) is trl.GRPOConfig and args.bf16 and args.per_device_train_batch_size == 6



def test_without_trl_the_refusal_says_how_to_install_it_from_the_checkout(monkeypatch):
    from batchfit.integrations.trl import grpo_config

    monkeypatch.setitem(sys.modules, "trl", None)  # import trl raises ImportError
    with pytest.raises(InvalidArgument, match=r"needs TRL: pip install -e '\.\[trl\]' in batchfit's checkout"):
        grpo_config(4096, max_prompt_length=256, generation_batch_size=64)


def test_no_install_line_names_a_package_index_batchfit_is_not_on():
    # batchfit is installed from its checkout: `pip install 'batchfit[trl]'` fails (issue 40, item 8)
    root = Path(__file__).resolve().parents[1]
    texts = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "src").rglob("*.py"), *(root / "examples").glob("*.py")]
    wrong = re.compile(r"pip install '?batchfit\[(trl|lora|hf|lightning)")
    found = [f"{p.relative_to(root)}: {line.strip()}" for p in texts for line in p.read_text().splitlines()
             if wrong.search(line) and "fails" not in line]
    assert found == []


@pytest.mark.slow
def test_the_longest_prompt_is_read_from_every_row_as_grpo_tokenizes_it():
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from batchfit.integrations.trl_prompts import longest_prompt
    from script_helpers import load_script

    tokenizer = load_script(EXAMPLE, "trl_grpo_example").char_tokenizer()  # one token per character
    # 1,100 prompts of 3 characters, then one of 40: a length taken from the first rows says 3
    texts = ["abc"] * 1100 + ["a" * 40] + ["xy"] * 10
    found = longest_prompt(datasets.Dataset.from_dict({"prompt": texts}), tokenizer, rows_per_call=256)
    assert (found.index, found.length, found.shortest, found.rows) == (1100, 40, 2, 1111)
    # a conversational prompt goes through the chat template with the generation prompt: "<" + content + ">"
    template = "{% for m in messages %}<{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    chats = [{"prompt": [{"role": "user", "content": t}]} for t in ("ab", "abcdef", "a")]
    found = longest_prompt(chats, tokenizer, chat_template=template)
    assert (found.index, found.length) == (1, 8)  # 6 characters + "<" + ">", each unknown to the vocabulary: <unk>
    assert "apply_chat_template(add_generation_prompt=True)" in found.source
    with pytest.raises(InvalidArgument, match=r"row 1 is dict without one"):
        longest_prompt([{"prompt": "a"}, {"text": "b"}], tokenizer)


class _CharTokenizer:
    """One token per character; a chat template of '<' + each message + '>' for the generation prompt."""

    def __call__(self, text):
        return {"input_ids": [[0] * len(t) for t in text]}

    def apply_chat_template(self, conversation, add_generation_prompt, tokenize, return_dict, **kwargs):
        assert add_generation_prompt and tokenize and return_dict  # as GRPOTrainer._tokenize_prompts calls it
        return {"input_ids": [[0] * (sum(len(m["content"]) + 1 for m in c) + 1) for c in conversation]}


def test_the_longest_prompt_comes_from_every_row_not_the_first(monkeypatch):
    from types import SimpleNamespace

    from batchfit.integrations.trl_prompts import longest_prompt

    # TRL's own is_conversational stands in (the real one: the second-tier test above)
    monkeypatch.setitem(sys.modules, "trl.data_utils",
                        SimpleNamespace(is_conversational=lambda example: isinstance(example["prompt"], list)))
    rows = [{"prompt": "abc"}] * 1100 + [{"prompt": "a" * 40}]
    found = longest_prompt(rows, _CharTokenizer(), rows_per_call=256)
    assert (found.index, found.length, found.shortest, found.rows) == (1100, 40, 3, 1101)
    chats = [{"prompt": [{"role": "user", "content": t}]} for t in ("ab", "abcdef")]
    assert longest_prompt(chats, _CharTokenizer()).length == 8  # "<" + 6 + ">"
