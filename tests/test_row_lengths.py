"""``batchfit.integrations.row_lengths``: the longest of every row, not of a sample (issue 40, item 1).

First tier: plain torch and lists (``datasets`` only where named); the whole ``Trainer`` is in
``tests/test_hf_trainer.py`` (second tier).
"""

from __future__ import annotations

import types

import pytest
import torch

from batchfit.autobatch import find_batch_size
from batchfit.autobatch.batch_search import limited_backend
from batchfit.errors import InvalidArgument
from batchfit.integrations.hf_trainer import _batch_maker, _TrainStep
from batchfit.integrations.row_lengths import longest_row, row_length
from batchfit.memory import get_backend

SHORT, LONG = 4, 32


def _short_then_long(short: int = 1024, long: int = 1024) -> list[dict]:
    # the first 1,024 rows hold 4 tokens, the rest 32 (issue 40: <= 128 tokens, then 512)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 64, (SHORT,), generator=g).tolist() for _ in range(short)]
    rows += [torch.randint(0, 64, (LONG,), generator=g).tolist() for _ in range(long)]
    return [{"input_ids": r, "labels": r} for r in rows]


def _pad(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Pads to the batch's longest row, as a tokenizer's padding collator does."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = [r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows]
    labels = [r["labels"] + [-100] * (width - len(r["labels"])) for r in rows]
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}


class _TinyLM(torch.nn.Module):
    """Embedding, one MLP, a head; ``forward(input_ids, labels).loss`` as a transformers model returns it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mlp, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 128), torch.nn.Linear(128, 64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        logits = self.head(torch.relu(self.mlp(self.embed(input_ids))))
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))


def test_the_longest_row_comes_from_every_row_not_the_first_1024():
    found = longest_row(_short_then_long())
    assert (found.index, found.length, found.shortest, found.rows) == (1024, LONG, SHORT, 2048)
    assert found.describe() == (
        "row 1,024 of 2,048 is the longest: 32 tokens (shortest 4; a pass over the input_ids of every row)")


def test_a_trial_sized_on_the_whole_dataset_keeps_the_real_loop_over_the_long_rows_within_the_target():
    rows = _short_then_long()
    model = _TinyLM()
    optimizer = torch.optim.AdamW(model.parameters())
    backend = limited_backend("cpu", "1MiB", None)
    make = _batch_maker(rows, longest_row(rows), _pad, None)
    found = find_batch_size(_TrainStep(model, optimizer, make, lambda: torch.autocast("cpu", enabled=False), 1, backend.device),
                            mode="train", register=(model, optimizer), backend=backend, progress=False, max_batch_size=4096)
    assert 1 < found.batch_size < 1024  # the search was bounded by memory, not by its range
    loader = torch.utils.data.DataLoader(rows[1024:], batch_size=found.batch_size, shuffle=True, collate_fn=_pad)

    def real_loop() -> None:  # two plain optimizer steps over batches of long rows only
        for step, batch in enumerate(loader):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == 1:
                break

    peak = get_backend("cpu", memory_limit="1GiB").measure(real_loop, register=(model, optimizer)).peak_bytes
    assert peak <= found.target_bytes


def test_a_datasets_dataset_is_read_from_its_arrow_lengths_through_select_and_shuffle():
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_list(_short_then_long(8, 4)).select([0, 9, 1, 8]).shuffle(seed=1)
    found = longest_row(data)
    assert len(data[found.index]["input_ids"]) == found.length == LONG  # an index of the shuffled view
    assert (found.rows, found.shortest) == (4, SHORT)
    assert "Arrow" in found.source
    by_transform = longest_row(datasets.Dataset.from_list(_short_then_long(8, 4)).with_transform(lambda b: b))
    assert (by_transform.index, by_transform.length) == (8, LONG)  # rows made on access: a pass over them
    assert "a pass over" in by_transform.source
    column = longest_row(datasets.Dataset.from_dict({"text": ["a", "b", "c"], "length": [3, 9, 2]}))
    assert (column.index, column.length) == (1, 9) and "'length' column" in column.source


@pytest.mark.parametrize(
    ("row", "length"),
    [
        pytest.param({"input_ids": [1, 2, 3]}, 3, id="mapping"),
        pytest.param({"text": "no ids"}, 0, id="mapping-without-ids"),
        pytest.param(torch.zeros(5, 2), 5, id="tensor"),
        pytest.param((torch.zeros(7), 1), 7, id="tuple-of-tensor-and-label"),
        pytest.param([1, 2, 3, 4], 4, id="list-of-ids"),
    ],
)
def test_row_length_reads_each_kind_of_row(row, length):
    assert row_length(row) == length


def test_rows_without_lengths_say_so():
    found = longest_row([{"text": "a"}, {"text": "bb"}])
    assert (found.index, found.length) == (0, 0)
    assert "none of the 2 rows has a length" in found.describe() and "make_batch" in found.describe()


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        pytest.param([], r"rows is empty \(len=0\)", id="empty"),
        pytest.param(iter([{"input_ids": [1]}]), r"rows must be an indexable dataset .* got list_iterator", id="iterator"),
    ],
)
def test_bad_rows_are_refused_naming_them(rows, match):
    with pytest.raises(InvalidArgument, match=match):
        longest_row(rows)


def test_the_trainer_integration_logs_what_it_read_on_rank_0(caplog):
    from batchfit.integrations.hf_trainer import _read_lengths

    with caplog.at_level("INFO", logger="batchfit.integrations.hf_trainer"):
        found = _read_lengths(_short_then_long(), "length", "train_dataset", True, None)
    assert found.index == 1024
    assert "train_dataset: row 1,024 of 2,048 is the longest: 32 tokens" in caplog.text and "each trial repeats it" in caplog.text
