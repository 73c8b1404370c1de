"""``batchfit.integrations.hf_trainer``: a real ``Trainer``'s batch sizes found from memory, alike on every rank.

The second tier: transformers' ``Trainer`` (and Accelerate, which it needs) load in seconds, and the
torchrun check starts two of them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from batchfit.errors import InvalidArgument  # noqa: E402
from batchfit.integrations.hf_trainer import find_trainer_batch_sizes  # noqa: E402
from multirank import scaled  # noqa: E402
from script_helpers import load_script  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_batch_size.py"
LINE = re.compile(r"rank (\d): per_device_train_batch_size=(\d+) per_device_eval_batch_size=(\d+) .*? trained_steps=(\d+)")
SEQ = 32


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def _rows(n: int = 8, *, labels: bool = True) -> list[dict]:
    ids = torch.randint(0, 128, (n, SEQ), generator=torch.Generator().manual_seed(1)).tolist()
    return [{"input_ids": r, "text": "unused", **({"labels": r} if labels else {})} for r in ids]


def _args(tmp_path: Path, **overrides) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                                          per_device_train_batch_size=8, **overrides)


def _example(*flags: str, ranks: int) -> list[tuple[int, ...]]:
    # --standalone: torchrun's own rendezvous on a port the OS picks when it binds
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    command += [str(EXAMPLE), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(tuple(map(int, m.groups())) for m in LINE.finditer(done.stdout))


def test_under_torchrun_both_ranks_train_with_the_batch_size_of_the_smaller_rank(tmp_path):
    # rank 0 has 24 MiB, rank 1 has 32 MiB: alone, rank 1 would take more; agreed, both take rank 0's answer
    two = _example("--memory", "24MiB,32MiB", ranks=2)
    assert [r[0] for r in two] == [0, 1]
    assert two[0][1:] == two[1][1:]  # the same train and eval sizes, and both trained 3 steps
    assert two[0][3] == 3
    alone = {m: _alone(m, tmp_path) for m in ("24MiB", "32MiB")}  # one process each, as the example sizes
    assert alone["24MiB"] == two[0][1:3]
    assert alone["32MiB"][0] > two[0][1]  # without agreement rank 1 would have chosen another size


def _alone(memory: str, tmp_path: Path) -> tuple[int, int]:
    example = load_script(EXAMPLE, "hf_trainer_batch_size_example")
    model, data = example.build()
    sized = example.size(model, example.training_arguments(str(tmp_path), 3), data, memory).args
    return sized.per_device_train_batch_size, sized.per_device_eval_batch_size


def test_the_largest_size_within_the_target_and_the_next_over_it(tmp_path):
    model, args = _model(), _args(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sized = find_trainer_batch_sizes(model, args, _rows(), include_eval=True, backend="cpu", memory_limit="8MiB",
                                     progress=False)
    train, evaluated = sized.train, sized.eval
    assert train.peak_bytes <= train.target_bytes < train.next_peak_bytes  # size + 1 was measured over it
    assert evaluated.peak_bytes <= evaluated.target_bytes < evaluated.next_peak_bytes
    assert evaluated.batch_size > train.batch_size  # no gradients, no optimizer state, no saved activations
    assert (sized.args.per_device_train_batch_size, sized.args.per_device_eval_batch_size) == (
        train.batch_size, evaluated.batch_size)
    assert args.per_device_train_batch_size == 8  # the caller's arguments are left alone
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # trained during the search, then put back
    assert all(p.grad is None for p in model.parameters())


def test_gradient_accumulation_keeps_gradients_beside_the_next_forward(tmp_path):
    model = _model()
    plain = find_trainer_batch_sizes(model, _args(tmp_path), _rows(), backend="cpu", memory_limit="8MiB",
                                     progress=False).train
    accumulating = find_trainer_batch_sizes(model, _args(tmp_path, gradient_accumulation_steps=4), _rows(),
                                            backend="cpu", memory_limit="8MiB", progress=False).train
    at = {t.batch_size: t.peak_bytes for t in accumulating.trials}
    largest = max(t.batch_size for t in plain.trials if t.batch_size in at)
    # the second forward runs with a full set of fp32 gradients resident
    assert at[largest] > next(t.peak_bytes for t in plain.trials if t.batch_size == largest)
    assert accumulating.batch_size < plain.batch_size


def test_make_batch_stands_in_for_the_dataset(tmp_path):
    rows = _rows()
    kept = {k: rows[0][k] for k in ("input_ids", "labels")}  # what the Trainer keeps of a row
    from_rows = find_trainer_batch_sizes(_model(), _args(tmp_path), rows, backend="cpu", memory_limit="8MiB",
                                         progress=False).train
    given = find_trainer_batch_sizes(
        _model(), _args(tmp_path), make_batch=lambda b: transformers.default_data_collator([kept] * b),
        backend="cpu", memory_limit="8MiB", progress=False).train
    assert [(t.batch_size, t.peak_bytes) for t in given.trials] == [(t.batch_size, t.peak_bytes) for t in from_rows.trials]


def test_a_batch_without_labels_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(InvalidArgument, match=r"returned no loss .*DataCollatorForLanguageModeling"):
        find_trainer_batch_sizes(_model(), _args(tmp_path), _rows(labels=False), backend="cpu",
                                 memory_limit="8MiB", progress=False)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        pytest.param(None, r"train_dataset=None and make_batch=None", id="no-rows"),
        pytest.param([], r"train_dataset is empty", id="empty"),
        pytest.param(iter(_rows()), r"train_dataset must be an indexable dataset", id="iterator"),
    ],
)
def test_bad_rows_are_refused_naming_the_argument(tmp_path, data, match):
    with pytest.raises(InvalidArgument, match=match):
        find_trainer_batch_sizes(_model(), _args(tmp_path), data, backend="cpu", memory_limit="8MiB", progress=False)


def test_a_cpu_search_needs_a_memory_limit(tmp_path):
    with pytest.raises(InvalidArgument, match=r"memory_limit=None; pass memory_limit"):
        find_trainer_batch_sizes(_model(), _args(tmp_path), _rows(), backend="cpu", progress=False)


def test_the_real_trainer_at_the_sizes_found_peaks_within_the_targets(tmp_path):
    # the Trainer's own loops (its optimizer, Accelerate's dataloader; 2 steps, one full evaluation batch)
    # measured by the same tracker
    from batchfit.memory import get_backend

    example = load_script(EXAMPLE, "hf_trainer_batch_size_example")
    model, data = example.build()
    sized = example.size(model, example.training_arguments(str(tmp_path), 2), data, "24MiB")
    trainer = transformers.Trainer(model=model, args=sized.args, train_dataset=data,
                                   eval_dataset=(data * 2)[: sized.eval.batch_size])
    tracker = get_backend("cpu", memory_limit="1GiB")
    train = tracker.measure(trainer.train, register=(model,))
    assert train.peak_bytes <= sized.train.target_bytes
    # what the trial does not hold: at most the batch Accelerate fetches ahead on the host (23 rows × 64 × 3 × 8 B)
    assert 0 <= train.peak_bytes - sized.train.peak_bytes <= 23 * 64 * 3 * 8
    evaluated = tracker.measure(trainer.evaluate, register=(model,))
    assert evaluated.peak_bytes <= sized.eval.target_bytes
    assert abs(evaluated.peak_bytes - sized.eval.peak_bytes) <= 64  # no KV cache: use_cache as the Trainer sets it


def _pad(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Pads to the batch's longest row (ids 0, labels -100), as a tokenizer's padding collator does."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = [r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows]
    labels = [r["labels"] + [-100] * (width - len(r["labels"])) for r in rows]
    mask = [[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows]
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "attention_mask": torch.tensor(mask)}


def _short_then_long(short: int = 1024, long: int = 1024) -> list[dict]:
    # the first 1,024 rows hold 4 tokens, the rest SEQ = 32 (issue 40: rows <= 128 tokens, then 512)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 128, (4,), generator=g).tolist() for _ in range(short)]
    rows += [torch.randint(0, 128, (SEQ,), generator=g).tolist() for _ in range(long)]
    return [{"input_ids": r, "labels": r} for r in rows]


@pytest.mark.parametrize("as_dataset", [False, True], ids=["list", "datasets"])
def test_long_rows_after_row_1024_are_sized_and_the_real_trainer_peaks_within_the_target(tmp_path, as_dataset):
    from batchfit.memory import get_backend

    rows = _short_then_long()
    data = rows
    if as_dataset:
        datasets = pytest.importorskip("datasets")
        data = datasets.Dataset.from_list(rows).shuffle(seed=0)  # Arrow lengths, through the shuffle's indices
    model = _model()
    args = _args(tmp_path, max_steps=2, learning_rate=1e-3, logging_strategy="no", disable_tqdm=True,
                 dataloader_num_workers=0)
    sized = find_trainer_batch_sizes(model, args, data, data_collator=_pad, backend="cpu", memory_limit="8MiB",
                                     progress=False)
    assert (sized.train_rows.length, sized.train_rows.shortest, sized.train_rows.rows) == (SEQ, 4, 2048)
    assert data[sized.train_rows.index]["input_ids"] == data[sized.train_rows.index]["labels"]
    assert len(data[sized.train_rows.index]["input_ids"]) == SEQ
    # the Trainer's own loop over batches of only long rows: the worst its sampler can draw
    long_rows = rows[1024:]
    trainer = transformers.Trainer(model=model, args=sized.args, train_dataset=long_rows, data_collator=_pad)
    peak = get_backend("cpu", memory_limit="1GiB").measure(trainer.train, register=(model,)).peak_bytes
    assert peak <= sized.train.target_bytes
