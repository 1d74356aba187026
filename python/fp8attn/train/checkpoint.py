"""Model checkpoints of the training comparison (for probes run after training).

A checkpoint is one `torch.save` file holding plain Python data and CPU tensors
(loadable with `weights_only=True`):

  format        "fp8attn.train.checkpoint/1"
  mode          attention mode the model was trained with ("bf16", "fp8-stale", ..., or a
                recipe variant such as "fp8-stale@tile+hadamard": model.parse_mode)
  step          number of optimizer steps taken
  model_config  ModelConfig.to_dict()
  train_config  TrainConfig.to_dict() (may be empty)
  data_root     the prepared corpus directory used for training (str, as given)
  init_fingerprint  fingerprint of the initial weights (same across modes of a run)
  state_dict    the model's parameters, FP32 ("master weights"), on the CPU

No optimizer state is kept (the probes need only the weights; it would triple
the file). Size: 4 bytes per parameter (~5 MB for cpu-tiny, ~200 MB for gpu-50m).

File names (next to the mode's JSONL log): `<mode>.pt` (end of training) and
`<mode>.step<N>.pt` (after N steps, `--save-at N`). The training states of split
runs (`<mode>.state.pt`, with the AdamW state and RNGs, for `compare --resume`)
are a different format: see state.py.
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path

import torch

from .model import ModelConfig, Transformer

FORMAT = "fp8attn.train.checkpoint/1"


def checkpoint_path(run_dir: str | os.PathLike, mode: str, step: int | None = None) -> Path:
    """<run_dir>/<mode>.pt, or <run_dir>/<mode>.step<step>.pt."""
    name = f"{mode}.pt" if step is None else f"{mode}.step{step}.pt"
    return Path(run_dir) / name


def save_checkpoint(path: str | os.PathLike, model: Transformer, *, mode: str, step: int,
                    train_config: dict | None = None, data_root: str | None = None,
                    init_fingerprint: str | None = None, state_dict: dict | None = None,
                    tokenizer_sha1: str | None = None) -> Path:
    """Writes the checkpoint atomically (temp file + rename); returns its path.

    tokenizer_sha1: sha1 of the tokenizer.json the model was trained with (a
    continuation checks it: token ids of another tokenizer mean other strings).

    state_dict: the weights to store (default model.state_dict()); a sharded
    model passes its gathered full state dict here."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    obj = {
        "format": FORMAT, "mode": mode, "step": int(step),
        "model_config": model.cfg.to_dict(), "train_config": dict(train_config or {}),
        "data_root": None if data_root is None else str(data_root),
        "init_fingerprint": init_fingerprint, "tokenizer_sha1": tokenizer_sha1,
        "state_dict": {k: v.detach().to("cpu", copy=True)
                       for k, v in (model.state_dict() if state_dict is None else state_dict).items()},
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)
    return path


def check_intact(path: str | os.PathLike) -> None:
    """ValueError naming the damaged member when a checkpoint's zip CRCs do not match
    (torch.load does not check them: damaged bytes inside a tensor load silently as
    other weights). Reads the whole file once."""
    with zipfile.ZipFile(path) as zf:
        bad = zf.testzip()
    if bad is not None:
        raise ValueError(f"checkpoint {path}: damaged (CRC mismatch in {bad})")


def read_info(path: str | os.PathLike) -> dict:
    """The checkpoint dict without its state_dict (mode, step, model_config, ...), the
    weights memory-mapped, not read (a look at the header before choosing to load).
    FileNotFoundError for a missing file, ValueError for one not of this format."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001  (pickle, zip, EOF errors of a file that is no checkpoint)
        raise ValueError(f"checkpoint {path}: not a readable {FORMAT} file ({type(exc).__name__})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or not isinstance(obj.get("model_config"), dict):
        raise ValueError(f"checkpoint {path}: not an {FORMAT} file")
    return {k: v for k, v in obj.items() if k != "state_dict"}


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu",
                    attn_mode: str | None = None) -> tuple[Transformer, dict]:
    """Rebuilds the model from a checkpoint. Returns (model in eval mode on `device`, info)
    where info is the checkpoint dict without the state_dict.

    attn_mode: switch the attention backend of the loaded model (default: the
    mode it was trained with). Raises ValueError for a file that is not a
    checkpoint of this format, FileNotFoundError for a missing file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    obj = torch.load(path, map_location="cpu", weights_only=True)
    check_intact(path)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path}: not an {FORMAT} file")
    cfg = ModelConfig(**obj["model_config"])
    if attn_mode is not None:
        cfg = ModelConfig(**{**cfg.to_dict(), "attn_mode": attn_mode})
    model = Transformer(cfg)
    model.load_state_dict(obj["state_dict"])
    model.to(device).eval()
    info = {k: v for k, v in obj.items() if k != "state_dict"}
    return model, info
