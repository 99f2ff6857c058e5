"""A PyTorch Lightning script as its docs write one (no ptops in it): a LightningModule, a
LightningDataModule-free DataLoader, DDP on CPU, a ModelCheckpoint every epoch, and a restart that
resumes from the last one (`ckpt_path="last"`). `torchrun --nproc-per-node 2 lightning_train.py`
runs it (Lightning picks up torchrun's environment)."""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self, lr=0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batches", type=int, default=4, help="batches per epoch and rank")
    p.add_argument("--ckpt-dir", default="lightning-ckpt")
    args = p.parse_args()

    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batches * 8 * 2, 16, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :1] * 2.0), batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=args.epochs,
        callbacks=[ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, every_n_epochs=1)],
        enable_progress_bar=False,
        logger=False,
    )
    trainer.fit(Regressor(), data, ckpt_path="last")


if __name__ == "__main__":
    main()
