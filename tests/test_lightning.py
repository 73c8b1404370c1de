"""``batchfit.integrations.lightning``: BatchSizeFinder's role under Lightning's DDP, every rank agreeing.

The second tier: Lightning loads in seconds and the DDP check starts two processes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from batchfit.errors import InvalidArgument  # noqa: E402
from batchfit.integrations.lightning import DistributedBatchSizeFinder  # noqa: E402
from multirank import scaled  # noqa: E402
from script_helpers import load_script  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_batch_size.py"
LINE = re.compile(r"rank (\d): batch_size=(\d+) .*? world_size=(\d+) trained_steps=(\d+)")
example = load_script(EXAMPLE, "lightning_batch_size_example")


def _example(*flags: str) -> list[tuple[int, ...]]:
    done = subprocess.run([sys.executable, str(EXAMPLE), *flags], capture_output=True, text=True, timeout=scaled(240))
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(tuple(map(int, m.groups())) for m in LINE.finditer(done.stdout))


def test_lightning_ddp_on_two_processes_trains_with_one_agreed_batch_size():
    # rank 0 has 12 MiB, rank 1 16 MiB: every rank takes the size that fits rank 0, then trains 3 steps
    two = _example("--devices", "2", "--memory", "12MiB,16MiB")
    assert two == [(0, two[0][1], 2, 3), (1, two[0][1], 2, 3)]
    alone = {m: _search(m).result.batch_size for m in ("12MiB", "16MiB")}  # one process each, as the example
    assert alone["12MiB"] == two[0][1]
    assert alone["16MiB"] > two[0][1]  # without agreement rank 1 would have chosen more


def _search(memory: str) -> DistributedBatchSizeFinder:
    finder = DistributedBatchSizeFinder(memory, backend="cpu", max_batch_size=2048, progress=False)
    _fit(finder, data=example.Data())
    return finder


class _Seen(pl.Callback):
    """Runs after the finder at on_fit_start: what the model and optimizer look like then."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights
        self.seen: dict[str, object] = {}

    def on_fit_start(self, trainer, pl_module):
        now = pl_module.state_dict()
        self.seen["same_weights"] = all(torch.equal(self.weights[k], now[k]) for k in self.weights)
        self.seen["optimizer_state"] = len(trainer.optimizers[0].state)
        self.seen["grads"] = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.seen["log_is_lightnings"] = "log" not in vars(pl_module)


def _fit(finder: DistributedBatchSizeFinder, model=None, data=None, **fit) -> _Seen:
    torch.manual_seed(0)
    model = model or example.Classifier()
    seen = _Seen({k: v.clone() for k, v in model.state_dict().items()})
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[finder, seen], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=data, **fit)
    return seen


def test_the_search_sets_the_datamodule_and_leaves_weights_and_optimizer_as_found():
    data = example.Data()
    finder = DistributedBatchSizeFinder("16MiB", backend="cpu", max_batch_size=2048, progress=False)
    seen = _fit(finder, data=data)
    result = finder.result
    assert data.batch_size == finder.optimal_batch_size == result.batch_size
    assert result.peak_bytes <= result.target_bytes < result.next_peak_bytes  # size + 1 measured over the target
    assert seen.seen == {"same_weights": True, "optimizer_state": 0, "grads": [], "log_is_lightnings": True}


def test_the_largest_candidate_is_the_dataset_length():
    data = example.Data()
    data.rows = torch.utils.data.TensorDataset(*(t[:40] for t in data.rows.tensors))
    finder = DistributedBatchSizeFinder("64MiB", backend="cpu", progress=False)
    _fit(finder, data=data)
    assert finder.result.max_batch_size == 40 and finder.result.capped_by_max_batch_size


class _Manual(example.Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class _NoSize(example.Data):
    def __init__(self):
        super().__init__()
        del self.batch_size


@pytest.mark.parametrize(
    ("model", "data", "fit", "match"),
    [
        pytest.param(None, _NoSize, {}, r"batch_arg_name='batch_size' is not an attribute", id="no-attribute"),
        pytest.param(_Manual, example.Data, {}, r"needs automatic_optimization=True", id="manual"),
    ],
)
def test_what_it_cannot_search_is_refused_naming_the_fix(model, data, fit, match):
    finder = DistributedBatchSizeFinder("16MiB", backend="cpu", progress=False)
    with pytest.raises(InvalidArgument, match=match):
        _fit(finder, model=model() if model else None, data=data(), **fit)


def test_dataloaders_passed_to_fit_are_refused():
    model = example.Classifier()
    model.batch_size = 4
    loader = example.Data().train_dataloader()
    with pytest.raises(InvalidArgument, match=r"passed to trainer.fit directly; move them into a LightningDataModule"):
        _fit(DistributedBatchSizeFinder("16MiB", backend="cpu", progress=False), model=model, train_dataloaders=loader)
