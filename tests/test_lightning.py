"""``batchfit.integrations.lightning``: BatchSizeFinder's role under Lightning's DDP, every rank agreeing.

The second tier: Lightning loads in seconds and the DDP check starts two processes.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from batchfit.errors import InvalidArgument
from multirank import scaled
from script_helpers import load_script

# Lightning is imported by the tests that run, not at collection: the first tier deselects them all
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="needs batchfit[lightning]"),
]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_batch_size.py"
LINE = re.compile(r"rank (\d): batch_size=(\d+) .*? world_size=(\d+) trained_steps=(\d+)")


@pytest.fixture(scope="module")
def lit() -> SimpleNamespace:
    """Lightning, the callback and the example's module and datamodule, imported once."""
    pl = pytest.importorskip("pytorch_lightning")
    from batchfit.integrations.lightning import DistributedBatchSizeFinder

    return SimpleNamespace(pl=pl, Finder=DistributedBatchSizeFinder,
                           example=load_script(EXAMPLE, "lightning_batch_size_example"))


def _example(*flags: str) -> list[tuple[int, ...]]:
    done = subprocess.run([sys.executable, str(EXAMPLE), *flags], capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(tuple(map(int, m.groups())) for m in LINE.finditer(done.stdout))


def test_lightning_ddp_on_two_processes_trains_with_one_agreed_batch_size(lit):
    # rank 0 has 12 MiB, rank 1 16 MiB: every rank takes the size that fits rank 0, then trains 3 steps
    two = _example("--devices", "2", "--memory", "12MiB,16MiB")
    assert two == [(0, two[0][1], 2, 3), (1, two[0][1], 2, 3)]
    alone = {m: _search(lit, m).result.batch_size for m in ("12MiB", "16MiB")}  # one process each, as the example
    assert alone["12MiB"] == two[0][1]
    assert alone["16MiB"] > two[0][1]  # without agreement rank 1 would have chosen more


def _search(lit: SimpleNamespace, memory: str, **trainer: object):
    finder = lit.Finder(memory, backend="cpu", max_batch_size=2048, progress=False)
    _fit(lit, finder, data=lit.example.Data(), trainer=trainer)
    return finder


def _seen(lit: SimpleNamespace, weights: dict[str, torch.Tensor], seen: dict[str, object]):
    """A callback run after the finder at on_fit_start: what the model and optimizer look like then."""

    class Seen(lit.pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            now = pl_module.state_dict()
            seen["same_weights"] = all(torch.equal(weights[k], now[k]) for k in weights)
            seen["optimizer_state"] = len(trainer.optimizers[0].state)
            seen["grads"] = [p.grad for p in pl_module.parameters() if p.grad is not None]
            seen["log_is_lightnings"] = "log" not in vars(pl_module)

    return Seen()


def _fit(lit: SimpleNamespace, finder, model=None, data=None, trainer=None, **fit) -> dict[str, object]:
    torch.manual_seed(0)
    model = model or lit.example.Classifier()
    seen: dict[str, object] = {}
    callback = _seen(lit, {k: v.clone() for k, v in model.state_dict().items()}, seen)
    options = {"max_steps": 1, **(trainer or {})}
    run = lit.pl.Trainer(accelerator="cpu", devices=1, callbacks=[finder, callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **options)
    run.fit(model, datamodule=data, **fit)
    return seen


def test_the_search_sets_the_datamodule_and_leaves_weights_and_optimizer_as_found(lit):
    data = lit.example.Data()
    finder = lit.Finder("16MiB", backend="cpu", max_batch_size=2048, progress=False)
    seen = _fit(lit, finder, data=data)
    result = finder.result
    assert data.batch_size == finder.optimal_batch_size == result.batch_size
    assert result.peak_bytes <= result.target_bytes < result.next_peak_bytes  # size + 1 measured over the target
    assert seen == {"same_weights": True, "optimizer_state": 0, "grads": [], "log_is_lightnings": True}


def test_the_real_fit_loop_at_the_size_found_peaks_within_the_target(lit):
    # Lightning's own fit loop (its fetcher, closure, logging; 2 steps) measured by the same tracker
    from batchfit.memory import get_backend

    data = lit.example.Data()
    model = lit.example.Classifier()
    finder = lit.Finder("16MiB", backend="cpu", max_batch_size=2048, progress=False)
    _fit(lit, finder, model=model, data=data, trainer={"max_steps": 0})
    fit = lit.pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    real = get_backend("cpu", memory_limit="1GiB").measure(lambda: fit.fit(model, datamodule=data), register=(model,))
    assert data.batch_size == finder.result.batch_size
    assert real.peak_bytes <= finder.result.target_bytes
    assert abs(real.peak_bytes - finder.result.peak_bytes) <= 64  # the trial is the loop's step, to a few bytes


def test_accumulation_keeps_gradients_beside_the_next_forward(lit):
    plain = _search(lit, "16MiB").result
    accumulating = _search(lit, "16MiB", accumulate_grad_batches=4).result
    at = {t.batch_size: t.peak_bytes for t in accumulating.trials}
    largest = max(t.batch_size for t in plain.trials if t.batch_size in at)  # small sizes peak in the optimizer step
    assert at[largest] > next(t.peak_bytes for t in plain.trials if t.batch_size == largest)
    assert accumulating.batch_size < plain.batch_size


def test_the_largest_candidate_is_the_dataset_length(lit):
    data = lit.example.Data()
    data.rows = torch.utils.data.TensorDataset(*(t[:40] for t in data.rows.tensors))
    finder = lit.Finder("64MiB", backend="cpu", progress=False)
    _fit(lit, finder, data=data)
    assert finder.result.max_batch_size == 40 and finder.result.capped_by_max_batch_size


@pytest.mark.parametrize(
    ("case", "match"),
    [
        pytest.param("no-attribute", r"batch_arg_name='batch_size' is not an attribute", id="no-attribute"),
        pytest.param("manual", r"needs automatic_optimization=True", id="manual"),
        pytest.param("loaders", r"passed to trainer.fit directly; move them into a LightningDataModule", id="loaders"),
    ],
)
def test_what_it_cannot_search_is_refused_naming_the_fix(lit, case, match):
    model, data, fit = lit.example.Classifier(), lit.example.Data(), {}
    if case == "no-attribute":
        del data.batch_size
    elif case == "manual":
        model.automatic_optimization = False
    else:
        model.batch_size = 4
        fit, data = {"train_dataloaders": data.train_dataloader()}, None
    with pytest.raises(InvalidArgument, match=match):
        _fit(lit, lit.Finder("16MiB", backend="cpu", progress=False), model=model, data=data, **fit)


def _token_rows(short: int, long: int) -> list[dict]:
    # the first rows hold 4 tokens, the rest 32 (issue 40: the long rows come after the first batches)
    g = torch.Generator().manual_seed(3)
    lengths = [4] * short + [32] * long
    return [{"input_ids": torch.randint(0, 64, (n,), generator=g).tolist()} for n in lengths]


def _pad(rows: list[dict]) -> torch.Tensor:
    width = max(len(r["input_ids"]) for r in rows)
    return torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows])


def _token_model(lit: SimpleNamespace):
    class TokenLM(lit.pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.mlp, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 128), torch.nn.Linear(128, 64)

        def training_step(self, batch, batch_idx):
            logits = self.head(torch.relu(self.mlp(self.embed(batch))))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    return TokenLM()


def _token_data(lit: SimpleNamespace, rows: list[dict]):
    class Rows(lit.pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size, self.rows = 1, rows

        def train_dataloader(self):  # in order: the first batches hold only short rows
            return torch.utils.data.DataLoader(self.rows, batch_size=self.batch_size, shuffle=False, collate_fn=_pad)

    return Rows()


def test_long_rows_after_the_first_batch_are_sized_and_the_real_fit_loop_peaks_within_the_target(lit):
    from batchfit.memory import get_backend

    model, data = _token_model(lit), _token_data(lit, _token_rows(1024, 1024))
    finder = lit.Finder("1MiB", backend="cpu", max_batch_size=1024, progress=False)
    _fit(lit, finder, model=model, data=data, trainer={"max_steps": 0})
    assert (finder.rows.index, finder.rows.length, finder.rows.shortest, finder.rows.rows) == (1024, 32, 4, 2048)
    assert 1 < finder.result.batch_size < 1024  # bounded by memory, not by the range
    long_only = _token_data(lit, _token_rows(0, 1024))
    long_only.batch_size = finder.result.batch_size
    fit = lit.pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    real = get_backend("cpu", memory_limit="1GiB").measure(lambda: fit.fit(model, datamodule=long_only),
                                                           register=(model,))
    assert real.peak_bytes <= finder.result.target_bytes


def test_rows_of_one_length_or_unread_keep_the_first_batch(lit):
    finder = lit.Finder("16MiB", backend="cpu", max_batch_size=2048, progress=False)
    _fit(lit, finder, data=lit.example.Data())
    assert finder.rows is None  # a TensorDataset is not read unless read_lengths=True
    finder = lit.Finder("16MiB", backend="cpu", max_batch_size=2048, progress=False, read_lengths=True)
    _fit(lit, finder, data=lit.example.Data())
    assert finder.rows is not None and not finder.rows.varies  # one length: the first batch, as before
    with pytest.raises(InvalidArgument, match=r"read_lengths must be None, True or False, but got read_lengths='yes'"):
        lit.Finder("16MiB", read_lengths="yes")
