"""Full training state of one mode, for exact resume (compare --deadline-s / --resume).

A state file `<run_dir>/<mode>.state.pt` is one `torch.save` file of plain Python
data and CPU tensors (loadable with `weights_only=True`):

  format            "fp8attn.train.state/1"
  mode, step        attention mode; optimizer steps taken (the next step to run)
  init_fingerprint  fingerprint of the initial weights (checked on resume)
  model             the model's state_dict (FP32 master weights, CPU)
  optim             AdamW state_dict (exp_avg, exp_avg_sq, step per parameter: 2x params)
  data_rng          numpy PCG64 bit-generator state of the batch order (JSON string)
  torch_rng, cuda_rng, numpy_rng, python_rng   global RNG states
  acc               trainer accumulators the summary needs: losses, diag_aggs,
                    val_loss, last_gains, last_logits, train_time_s
  train_config, model_config   as in the JSONL meta line (informational)

The lr schedule needs no state of its own: lr_at(step) is a pure function of the
step. Size: 12 bytes per parameter (weights + two AdamW moments): ~0.3 MB for the
smoke preset, ~600 MB for gpu-50m. Written atomically (temp file + rename), by
rank 0 only under DDP (every rank holds identical weights and optimizer state).

The run-level file `<run_dir>/run_config.json` (written by compare.run when a
run starts) records what must not change between the calls of a split run;
`check_run_config` compares it with the resumed command and names the flag.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch

FORMAT = "fp8attn.train.state/1"
RUN_CONFIG = "run_config.json"
RUN_FORMAT = "fp8attn.train.run_config/1"


def state_path(run_dir: str | os.PathLike, mode: str) -> Path:
    """<run_dir>/<mode>.state.pt."""
    return Path(run_dir) / f"{mode}.state.pt"


def _np_global_state() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _set_np_global_state(s: list) -> None:
    name, keys, pos, has_gauss, cached = s
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _py_state_to_list(s) -> list:
    version, internal, gauss = s
    return [version, list(internal), gauss]


def save_state(path: str | os.PathLike, *, mode: str, step: int, init_fingerprint: str,
               model_state: dict, optim_state: dict, data_rng: np.random.Generator, acc: dict,
               train_config: dict, model_config: dict) -> Path:
    """Writes a training state atomically; returns its path.

    model_state / optim_state: state_dicts (tensors are copied to the CPU);
    data_rng: the batch-order generator; acc: the trainer's summary accumulators
    (plain Python data)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def cpu(obj):
        if torch.is_tensor(obj):
            return obj.detach().to("cpu", copy=True)
        if isinstance(obj, dict):
            return {k: cpu(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(cpu(v) for v in obj)
        return obj

    obj = {
        "format": FORMAT, "mode": mode, "step": int(step), "init_fingerprint": init_fingerprint,
        "model": cpu(model_state), "optim": cpu(optim_state),
        "data_rng": json.dumps(data_rng.bit_generator.state),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "numpy_rng": _np_global_state(), "python_rng": _py_state_to_list(random.getstate()),
        "acc": acc, "train_config": dict(train_config), "model_config": dict(model_config),
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)
    return path


def load_state(path: str | os.PathLike, *, mode: str | None = None) -> dict:
    """Reads a state file (CPU tensors). Raises FileNotFoundError for a missing file,
    ValueError (naming `path` / `mode`) for another format or another mode."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"state {path} does not exist")
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"path: {path} is not an {FORMAT} file")
    if mode is not None and obj["mode"] != mode:
        raise ValueError(f"mode: {path} holds mode {obj['mode']!r}, not {mode!r}")
    return obj


def restore_rngs(obj: dict) -> np.random.Generator:
    """Restores the global torch / CUDA / numpy / python RNG states of a loaded state
    and returns the batch-order generator positioned where training stopped."""
    torch.set_rng_state(obj["torch_rng"])
    if obj.get("cuda_rng") and torch.cuda.is_available() and len(obj["cuda_rng"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(obj["cuda_rng"])
    _set_np_global_state(obj["numpy_rng"])
    v, internal, gauss = obj["python_rng"]
    random.setstate((v, tuple(internal), gauss))
    bg = np.random.PCG64()
    bg.state = json.loads(obj["data_rng"])
    return np.random.Generator(bg)


# ---- run-level configuration ---------------------------------------------------------

# Which flag sets each recorded field (for the refusal message).
_TRAIN_FLAGS = {"steps": "--steps", "batch_size": "--batch-size", "seq_len": "--seq-len", "lr": "--lr",
                "warmup": "--warmup", "seed": "--seed", "data_seed": "--data-seed",
                "diag_every": "--diag-every", "val_every": "--val-every", "val_batches": "--val-batches",
                "loss_avg_last": "--steps", "fsdp": "--fsdp", "optimizer": "--optimizer",
                "init_from": "--init-from", "context_parallel": "--context-parallel"}
_MODEL_FLAGS = {"scope": "--scope", "packed": "--packed", "fp8_scaling": "--scaling",
                "fp8_qk_rotation": "--qk-rotation", "fp8_smooth_k": "--smooth-k", "qk_norm": "--no-qk-norm", "rope": "--nope",
                "max_seq_len": "--seq-len", "vocab_size": "--text-dir/--data-dir/--max-mb",
                "activation_checkpointing": "--activation-checkpointing", "arch": "--arch"}
_DATA_KEYS = ("source", "pipeline_version", "vocab_size", "train_tokens", "val_tokens", "train_docs", "val_docs")


def run_config(*, preset: str, modes: list, train_config: dict, model_config: dict, data_meta: dict,
               world_size: int) -> dict:
    """The run-level record that every call of a split run must reproduce."""
    train = {k: train_config[k] for k in train_config
             if k not in ("device", "threads", "progress", "save_final", "save_at")}
    model = {k: v for k, v in model_config.items() if k != "attn_mode"}
    return {"format": RUN_FORMAT, "preset": preset, "modes": list(modes), "train": train, "model": model,
            "data": {k: data_meta.get(k) for k in _DATA_KEYS}, "world_size": int(world_size)}


def write_run_config(run_dir: str | os.PathLike, cfg: dict) -> Path:
    """Writes <run_dir>/run_config.json; returns its path."""
    path = Path(run_dir) / RUN_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=1))
    return path


def read_run_config(run_dir: str | os.PathLike) -> dict | None:
    """The recorded run config of run_dir, or None if there is none."""
    path = Path(run_dir) / RUN_CONFIG
    return json.loads(path.read_text()) if path.is_file() else None


def _field_defaults(section: str) -> dict:
    """Default values of the TrainConfig ("train") or ModelConfig ("model") fields."""
    import dataclasses

    if section == "train":
        from .trainer import TrainConfig as cls
    else:
        from .model import ModelConfig as cls
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def config_mismatches(saved: dict, current: dict) -> list[str]:
    """Human-readable differences 'FLAG: saved X, now Y' between two run configs (empty: same)."""
    out = []
    norm = lambda v: list(v) if isinstance(v, tuple) else v
    if saved.get("format") != current.get("format"):
        out.append(f"run_config.json: format {saved.get('format')!r}, now {current.get('format')!r}")
    for key, flag in (("preset", "--preset"), ("modes", "--modes")):
        if saved.get(key) != current.get(key):
            out.append(f"{flag}: saved {saved.get(key)!r}, now {current.get(key)!r}")
    for section, flags, default in (("train", _TRAIN_FLAGS, "(a TrainConfig default)"),
                                    ("model", _MODEL_FLAGS, "--model")):
        a, b = saved.get(section, {}), current.get(section, {})
        # A field a run recorded before the field existed had its default value then
        # (new options are added off by default): an older run resumes with the default.
        dflt = _field_defaults(section)
        for k in sorted(set(a) | set(b)):
            if norm(a.get(k, dflt.get(k))) != norm(b.get(k, dflt.get(k))):
                out.append(f"{flags.get(k, default)}: {section} field {k} saved {a.get(k)!r}, now {b.get(k)!r}")
    if saved.get("data") != current.get("data"):
        diff = sorted(k for k in set(saved.get("data", {})) | set(current.get("data", {}))
                      if saved.get("data", {}).get(k) != current.get("data", {}).get(k))
        out.append(f"--text-dir/--data-dir/--max-mb: the prepared corpus differs ({', '.join(diff)})")
    if saved.get("world_size") != current.get("world_size"):
        out.append(f"torchrun --nproc_per_node: saved world size {saved.get('world_size')}, "
                   f"now {current.get('world_size')} (the batch order depends on it)")
    return out
