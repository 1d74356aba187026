"""--init-from (issue #22 item 4): a run continues from trained weights with a fresh
optimizer, at a new seq_len, peak LR and RoPE base (a long-context continuation)."""
from pathlib import Path

import pytest
import torch

from fp8attn.train import compare
from fp8attn.train.checkpoint import checkpoint_path, load_checkpoint
from fp8attn.train.report import read_log
from fp8attn.train.trainer import init_fingerprint

MODES = "bf16,fp8-delta_matching"


def _argv(text_dir, root, out, *extra, steps=8):
    return ["--preset", "smoke", "--device", "cpu", "--modes", MODES, "--steps", str(steps), "--diag-every", "0",
            "--val-batches", "1", "--text-dir", str(text_dir), "--data-dir", str(root / "data"), "--no-progress",
            "--out", str(out), *extra]


@pytest.fixture(scope="module")
def base(tmp_path_factory, text_dir):
    root = tmp_path_factory.mktemp("init_from")
    compare.run(compare.parse_args(_argv(text_dir, root, root / "short")))
    return root


def test_continuation_starts_from_each_modes_weights(base, text_dir):
    out = base / "long"
    compare.run(compare.parse_args(_argv(text_dir, base, out, "--init-from", str(base / "short"), "--seq-len", "128",
                                         "--lr", "3e-3", "--model", "rope_base=40000", steps=3)))
    for mode in MODES.split(","):
        short, _ = load_checkpoint(checkpoint_path(base / "short", mode))
        la, lb = read_log(base / "short" / f"{mode}.jsonl"), read_log(out / f"{mode}.jsonl")
        # the continuation's initial weights are the short run's final ones
        assert lb["summary"]["init_fingerprint"] == init_fingerprint(short)
        assert lb["meta"]["train"]["seq_len"] == 128 and lb["meta"]["model"]["rope_base"] == 40000
        assert lb["meta"]["model"]["max_seq_len"] >= 128
        # it starts where the short run ended, far below a fresh model's first loss
        first_short, last_short = la["steps"][0]["loss"], la["steps"][-1]["loss"]
        first_long = lb["steps"][0]["loss"]
        assert first_long < last_short + 0.5 * (first_short - last_short), (first_short, last_short, first_long)
    assert "each mode from its own checkpoint" in (out / "report.md").read_text()


def test_one_checkpoint_for_every_mode(base, text_dir):
    ck = checkpoint_path(base / "short", "bf16")
    out = base / "from_file"
    compare.run(compare.parse_args(_argv(text_dir, base, out, "--init-from", str(ck), steps=2)))
    fps = {read_log(out / f"{m}.jsonl")["summary"]["init_fingerprint"] for m in MODES.split(",")}
    assert fps == {init_fingerprint(load_checkpoint(ck)[0])}


def test_init_from_refuses_a_missing_checkpoint_or_another_architecture(base, text_dir, tmp_path):
    with pytest.raises(SystemExit, match="--init-from: no checkpoint .*bf16.pt"):
        compare.run(compare.parse_args(_argv(text_dir, base, tmp_path / "x", "--init-from", str(tmp_path), steps=2)))
    # Another architecture: a SystemExit naming the fields before any training (it was a
    # ValueError traceback out of the first mode's training; the library still raises it).
    with pytest.raises(SystemExit, match="--init-from: .*bf16.pt has another architecture: d_model 64 -> 32"):
        compare.run(compare.parse_args(_argv(text_dir, base, tmp_path / "y", "--init-from", str(base / "short"),
                                             "--model", "d_model=32", steps=2)))
    assert not (tmp_path / "y").exists()


def test_init_from_takes_older_checkpoints_and_names_incomplete_ones(base, text_dir, tmp_path):
    """A checkpoint that predates a ModelConfig field (here arch / gdn_ratio, added after
    --init-from) continues: missing fields read as their defaults, as load_checkpoint
    reads them (it was refused as "arch None -> 'gqa'", a break test of 2026-12-03);
    init_std is init-only and may change; a file without model_config is a SystemExit."""
    obj = torch.load(checkpoint_path(base / "short", "bf16"), weights_only=True)
    old = dict(obj, model_config={k: v for k, v in obj["model_config"].items() if k not in ("arch", "gdn_ratio")})
    torch.save(old, tmp_path / "old.pt")
    compare.run(compare.parse_args(_argv(text_dir, base, tmp_path / "o", "--init-from", str(tmp_path / "old.pt"),
                                         "--model", "init_std=0.02", steps=1)))
    assert read_log(tmp_path / "o" / "bf16.jsonl")["summary"]["init_fingerprint"] == \
        init_fingerprint(load_checkpoint(checkpoint_path(base / "short", "bf16"))[0])
    torch.save({k: v for k, v in obj.items() if k != "model_config"}, tmp_path / "x.pt")
    with pytest.raises(SystemExit, match="holds no model_config"):
        compare.run(compare.parse_args(_argv(text_dir, base, tmp_path / "z", "--init-from", str(tmp_path / "x.pt"),
                                             steps=1)))


def test_init_from_refuses_another_tokenizer_and_damaged_bytes(base, text_dir, tmp_path):
    """Two silent continuations of a break test (2026-12-03), now refused before any
    training: (1) a checkpoint of another tokenizer with the same vocab_size (byte-level
    BPE pads every corpus to the size asked, so only the tokenizer's sha1, stored in the
    checkpoint, tells); (2) bytes damaged inside a tensor (torch.load does not check the
    zip CRCs: the run trained from other weights)."""
    ck = checkpoint_path(base / "short", "bf16")
    obj = torch.load(ck, weights_only=True)
    from fp8attn.train.data import PreparedData
    assert obj["tokenizer_sha1"] == PreparedData(Path(obj["data_root"])).tokenizer_sha1()
    torch.save(dict(obj, tokenizer_sha1="0" * 40), tmp_path / "other_tok.pt")
    with pytest.raises(SystemExit, match="another tokenizer"):
        compare.run(compare.parse_args(_argv(text_dir, base, tmp_path / "a", "--init-from",
                                             str(tmp_path / "other_tok.pt"), steps=1)))
    raw = bytearray(ck.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 64] = bytes(b ^ 0x5A for b in raw[mid:mid + 64])
    (tmp_path / "damaged.pt").write_bytes(bytes(raw))
    with pytest.raises(SystemExit, match="--init-from: checkpoint .*damaged .CRC mismatch"):
        compare.run(compare.parse_args(_argv(text_dir, base, tmp_path / "b", "--init-from",
                                             str(tmp_path / "damaged.pt"), steps=1)))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match="damaged .CRC mismatch"):   # the library's loader too (probe, retrieval)
        load_checkpoint(tmp_path / "damaged.pt")
