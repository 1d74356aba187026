"""Helpers shared by the torchrun tests (test_ddp.py, test_fsdp.py): a free TCP
port for the rendezvous, the single-process losses of the first shared
batches, against which a distributed run's step-0 loss is checked, and the
per-step comparison of two runs that should train identically (DDP vs FSDP2)."""
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


# Tolerances of assert_trains_alike (relative). On the CPU (gloo, 2 ranks, one
# thread per rank) DDP and FSDP2 train bit for bit alike: the averaged gradients
# are equal (a sum of two addends, a division by 2) and the trainer's clip norm
# (ddp.clip_grad_norm) does not depend on the sharding (test_fsdp.py's docstring
# has the measurement of what differed before: torch's clip norm on DTensor
# shards, 1 ulp, grown by flipped BF16/E4M3 roundings to 1.2e-4 in a loss by
# step 3). So TOL_CPU = 0. On GPUs, atomics in the kernels and NCCL's reduction
# order change the last bits of each step's gradient, and the same flipped
# roundings grow that; TOL_GPU leaves a factor 10 below what a 1-rank run of the
# test_ddp.py GPU command (the gradient of one rank's batch only: what a broken
# gradient sync logs) misses by on the CPU: 37% in the step-0 grad_norm and 2.0%
# in the step-1 loss (bf16 and fp8 alike; 0.2% - 1.4% at steps 2, 3).
TOL_CPU = 0.0
TOL_GPU = 1e-3


def assert_trains_alike(a: dict, b: dict, rel: float, what: str = "") -> None:
    """Two training logs (read_log) of the same command, same batches, same
    initial weights: the step-0 grad_norm (the first averaged gradient) and the
    losses of every step (steps 1..N follow updates, so they see the gradient
    sync; step 0 precedes any) agree within `rel`."""
    sa, sb = a["steps"], b["steps"]
    assert len(sa) == len(sb) >= 2, (what, len(sa), len(sb))
    ga, gb = sa[0]["grad_norm"], sb[0]["grad_norm"]
    assert abs(ga - gb) <= rel * abs(gb), f"{what}: step-0 grad_norm {ga} vs {gb} (rel {rel})"
    la, lb = [r["loss"] for r in sa], [r["loss"] for r in sb]
    bad = [i for i, (x, y) in enumerate(zip(la, lb)) if not abs(x - y) <= rel * abs(y)]
    assert not bad, f"{what}: losses differ at steps {bad} (rel {rel}): {la} vs {lb}"
