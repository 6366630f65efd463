"""A small byte-level transformer language model on Python's own standard library sources (no download).

The corpus is the machine's standard library: the ``.py`` files directly under ``sysconfig.get_paths()["stdlib"]``,
in sorted order, concatenated until :data:`CORPUS_BYTES` bytes. It differs between Python versions, so every user
of it records :func:`corpus_info` (the Python version, the files' count and the corpus's sha256). The corpus is cut
into windows of ``context + 1`` bytes; every :data:`HELD_OUT_EVERY`-th window is held out (validation), the others
train. A sample is ``(x, y)`` with ``x`` the window's first ``context`` bytes and ``y`` the next byte of each.

:class:`ByteTransformer` is a pre-norm causal transformer written with plain tensor operations (no fused kernel), so
``torch.func.vmap`` batches it over partitions in the emulator; :class:`StdlibLM` trains the same model in Lightning
with AdamW, and :class:`StdlibDataModule` serves the same windows.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
from functools import lru_cache
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_pgc.examples.digits import TensorDataModule, log_train_loss

__all__ = [
    "CORPUS_BYTES",
    "HELD_OUT_EVERY",
    "ByteTransformer",
    "StdlibDataModule",
    "StdlibLM",
    "corpus_info",
    "lm_tensors",
    "stdlib_corpus",
]

#: bytes of standard library source in the corpus (the first files in sorted order, the last one cut)
CORPUS_BYTES: int = 1 << 20
#: every this-many-th window of the corpus is held out for validation
HELD_OUT_EVERY: int = 16


def _files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    return [os.path.join(root, f) for f in sorted(os.listdir(root)) if f.endswith(".py")]


@lru_cache(maxsize=4)
def stdlib_corpus(budget: int = CORPUS_BYTES) -> bytes:
    """The first ``budget`` bytes of the standard library's top-level ``.py`` files, in sorted order.

    Raises:
        ValueError: the standard library holds fewer bytes than ``budget``.
    """
    out = bytearray()
    for path in _files():
        with open(path, "rb") as fh:
            out += fh.read()
        if len(out) >= budget:
            return bytes(out[:budget])
    raise ValueError(f"the standard library under {sysconfig.get_paths()['stdlib']} has {len(out)} < {budget} bytes")


def corpus_info(budget: int = CORPUS_BYTES) -> dict[str, Any]:
    """What a result must record about the corpus: Python's version, the byte budget and the corpus's sha256."""
    data = stdlib_corpus(budget)
    return {
        "python": sys.version.split()[0],
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "source": "sorted top-level .py files of sysconfig.get_paths()['stdlib']",
    }


def lm_tensors(context: int = 32, budget: int = CORPUS_BYTES) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``x_train, y_train, x_val, y_val`` (int64, ``[windows, context]``): the corpus cut in windows of
    ``context + 1`` bytes, every :data:`HELD_OUT_EVERY`-th one held out."""
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    data = torch.frombuffer(bytearray(stdlib_corpus(budget)), dtype=torch.uint8).to(torch.int64)
    windows = data[: (len(data) // (context + 1)) * (context + 1)].reshape(-1, context + 1)
    held = torch.arange(len(windows)) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    train, val = windows[~held], windows[held]
    return train[:, :-1].contiguous(), train[:, 1:].contiguous(), val[:, :-1].contiguous(), val[:, 1:].contiguous()


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)  # [3, b, h, t, d/h]
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class ByteTransformer(nn.Module):
    """A pre-norm causal transformer over bytes: ``[b, t]`` int64 -> logits ``[b, t, 256]``."""

    def __init__(self, context: int = 32, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")
        self.context = context
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.Sequential(*[_Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[-1]
        if t > self.context:
            raise ValueError(f"sequence of {t} bytes is longer than the context ({self.context})")
        return self.head(self.ln(self.blocks(self.embed(x) + self.pos[:t])))


def lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Mean next-byte cross-entropy (nats) over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class StdlibDataModule(TensorDataModule):
    """The corpus's training and held-out windows (the same on every rank)."""

    def __init__(self, batch_size: int = 8, context: int = 32, num_workers: int = 0) -> None:
        super().__init__(batch_size, num_workers)
        self.context = context

    def load(self) -> tuple[TensorDataset, TensorDataset]:
        x, y, xv, yv = lm_tensors(self.context)
        return TensorDataset(x, y), TensorDataset(xv, yv)


class StdlibLM(pl.LightningModule):
    """:class:`ByteTransformer` trained with AdamW (``lr``, ``betas = (beta1, beta2)``, ``weight_decay``); logs
    ``train_loss`` and ``val_loss`` (next-byte cross-entropy, nats)."""

    def __init__(
        self,
        lr: float = 3e-3,
        beta1: float = 0.9,
        beta2: float = 0.99,
        weight_decay: float = 0.01,
        context: int = 32,
        width: int = 32,
        heads: int = 4,
        layers: int = 2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = ByteTransformer(context, width, heads, layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = lm_loss(self(x), y)
        log_train_loss(self, loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", lm_loss(self(x), y), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        return torch.optim.AdamW(
            self.parameters(), lr=h["lr"], betas=(h["beta1"], h["beta2"]), weight_decay=h["weight_decay"]
        )
