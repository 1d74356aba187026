"""Helpers shared by the torchrun tests (test_ddp.py, test_fsdp.py): a free TCP
port for the rendezvous, and the single-process losses of the first shared
batches, against which a distributed run's step-0 loss is checked."""
from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fp8attn.train.data import TokenStream
from fp8attn.train.model import ModelConfig
from fp8attn.train.trainer import build_model, init_fingerprint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_batch_losses(out: Path, log: dict, n: int = 2) -> list:
    """Losses of the initial model (rebuilt from the log's meta; its fingerprint is
    checked) on batches #0 .. #n-1 of the shared order, one process, no grad."""
    meta, train = log["meta"], log["meta"]["train"]
    model = build_model(ModelConfig(**meta["model"]), train["seed"])
    assert init_fingerprint(model) == meta["init_fingerprint"]
    (data_root,) = [p.parent for p in (out / "data").glob("*/meta.json")]
    ts = TokenStream(data_root / "train.bin", train["seq_len"])
    rng = np.random.Generator(np.random.PCG64(train["data_seed"]))
    with torch.no_grad():
        losses = []
        for _ in range(n):
            x, y = ts.random_batch(rng, train["batch_size"])
            losses.append(float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())))
    return losses
