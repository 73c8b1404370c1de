"""Size a Lightning run's batch from memory on every DDP rank, then train: DistributedBatchSizeFinder.

    python examples/lightning_batch_size.py                         # one process
    python examples/lightning_batch_size.py --devices 2             # Lightning's DDP, 2 CPU processes (gloo)
    python examples/lightning_batch_size.py --devices 2 --memory 12MiB,16MiB   # the ranks' memory differs

A small classifier whose ``LightningDataModule`` builds its ``train_dataloader()`` from
``self.batch_size``, as Lightning's ``BatchSizeFinder`` expects. At ``on_fit_start`` the callback
runs ``training_step``, backward and the optimizer's step at candidate sizes on every rank
(batchfit's ``cpu`` backend: the live-tensor tracker against ``--memory``; ``backend="cuda"`` on
a GPU), agrees on each verdict across the ranks, sets ``datamodule.batch_size`` and training goes
on with it. Each rank prints one line: ``rank R: batch_size=B ...``.
"""

from __future__ import annotations

import argparse
import os
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchfit.integrations.lightning import DistributedBatchSizeFinder

FEATURES, HIDDEN, CLASSES = 256, 512, 10


class Classifier(pl.LightningModule):
    """Two linear layers and a cross-entropy loss; logs its loss as a real module does."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                 nn.Linear(HIDDEN, CLASSES))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)  # silenced during the search; a collective otherwise
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Data(pl.LightningDataModule):
    """Random features and labels; ``batch_size`` is what the finder sets."""

    def __init__(self, batch_size: int = 1) -> None:
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        self.rows = TensorDataset(torch.randn(4096, FEATURES, generator=g), torch.randint(0, CLASSES, (4096,), generator=g))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.rows, batch_size=self.batch_size, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1, help="CPU processes; 2 or more run Lightning's DDP strategy")
    parser.add_argument("--memory", default="16MiB", help="device memory, or one value per rank (comma-separated)")
    parser.add_argument("--fraction", type=float, default=0.8)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps trained afterwards")
    flags = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a small model on shared cores: intra-op threads only contend
    memory = flags.memory.split(",")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning's launcher in the processes it starts
    finder = DistributedBatchSizeFinder(memory[local_rank % len(memory)], target_memory_fraction=flags.fraction,
                                        backend="cpu", max_batch_size=2048, progress=False)
    trainer = pl.Trainer(accelerator="cpu", devices=flags.devices, strategy="ddp" if flags.devices > 1 else "auto",
                         max_steps=flags.steps, callbacks=[finder], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    data = Data()
    trainer.fit(Classifier(), datamodule=data)
    result = finder.result
    sys.stdout.write(f"rank {trainer.global_rank}: batch_size={data.batch_size} peak={result.peak_bytes} "
                     f"target={result.target_bytes} trials={len(result.trials)} world_size={result.world_size} "
                     f"trained_steps={trainer.global_step}\n")  # one write: the ranks share the pipe
    sys.stdout.flush()


if __name__ == "__main__":
    main()
