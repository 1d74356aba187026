"""Real-text data pipeline for the training comparison.

Source: the Linux kernel documentation shipped in Debian's `linux-doc-6.1`
package (reStructuredText/plain text, ~25 MB once decompressed, written by the
kernel community, not by this project). Pipeline, each step skipped when its
output already exists:

1. download  `apt-get download linux-doc-6.1` into `<data_dir>/cache/` (the only
   network access; `apt-get update` is run once if the download fails as root);
2. extract   the `Documentation/**/*.rst[.gz]` and `*.txt[.gz]` members of the
   .deb (translations/ excluded) straight from its data tarball, decompressed,
   into `<data_dir>/cache/linux-doc-6.1/` (no system-wide install, no dpkg needed);
3. split     documents into train/val by a hash of their relative path
   (~1.5 % val), documents ordered by that hash (deterministic, independent of
   file-system order); the corpus is capped at `max_mb` MB;
4. tokenizer a byte-level BPE (HF `tokenizers`) trained on the first
   `tokenizer_train_mb` MB of the train split, saved as `tokenizer.json`;
5. encode    both splits to uint16 token files `train.bin`/`val.bin`, documents
   separated by the `<|endoftext|>` token (id 0).

Alternative source (no network): a directory of text files, given by
`text_dir=` / `--text-dir` or the env var `FP8ATTN_TEXT_DIR`; every regular
file that is not binary (no NUL byte) is used, `.gz` files decompressed.

CLI: `python -m fp8attn.train.data --data-dir data --vocab-size 4096`.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEB_PACKAGE = "linux-doc-6.1"
DOC_PREFIX = f"./usr/share/doc/{DEB_PACKAGE}/Documentation/"
EOT = "<|endoftext|>"
VAL_PER_MILLE = 15          # ~1.5 % of documents go to val
PIPELINE_VERSION = 1        # bump when the output of steps 3-5 changes


def _log(msg: str) -> None:
    print(f"[data] {msg}", flush=True)


# ----------------------------------------------------------------------------
# 1-2. Source documents
# ----------------------------------------------------------------------------

def _download_deb(cache: Path) -> Path:
    """Returns the path of the cached linux-doc .deb, downloading it with apt if missing."""
    debs = sorted(cache.glob(f"{DEB_PACKAGE}_*.deb"))
    if debs:
        return debs[-1]
    if shutil.which("apt-get") is None:
        raise RuntimeError(
            f"fp8attn.train.data: apt-get not found, cannot download the Debian package "
            f"{DEB_PACKAGE}. Put a {DEB_PACKAGE}_*.deb into {cache}, or point FP8ATTN_TEXT_DIR "
            f"(or --text-dir) at a directory of text files instead.")
    cache.mkdir(parents=True, exist_ok=True)

    def attempt() -> subprocess.CompletedProcess:
        return subprocess.run(["apt-get", "download", "-q", DEB_PACKAGE], cwd=cache,
                              capture_output=True, text=True)

    _log(f"downloading {DEB_PACKAGE} (~37 MB) with apt-get download")
    res = attempt()
    if res.returncode != 0 and os.geteuid() == 0:
        # NOTE: a fresh container has empty apt lists; one update fixes that.
        _log("apt-get download failed; running apt-get update once and retrying")
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True)
        res = attempt()
    debs = sorted(cache.glob(f"{DEB_PACKAGE}_*.deb"))
    if res.returncode != 0 or not debs:
        raise RuntimeError(
            f"fp8attn.train.data: `apt-get download {DEB_PACKAGE}` failed "
            f"(exit {res.returncode}): {res.stderr.strip()[-500:]}\n"
            f"Fix: run `apt-get update` (as root), or place the .deb in {cache}, or set "
            f"FP8ATTN_TEXT_DIR / --text-dir to a directory of text files.")
    return debs[-1]


def _deb_data_tar(deb: Path) -> tarfile.TarFile:
    """Opens the data.tar.* member of a .deb (an `ar` archive) as a tarfile."""
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise RuntimeError(f"fp8attn.train.data: {deb} is not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(blob):
        header = blob[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        start = pos + 60
        if name.startswith("data.tar"):
            return tarfile.open(fileobj=io.BytesIO(blob[start:start + size]), mode="r:*")
        pos = start + size + (size & 1)   # ar members are 2-byte aligned
    raise RuntimeError(f"fp8attn.train.data: no data.tar member in {deb}")


def _wanted_doc(member_name: str) -> str | None:
    """Relative output path (decompressed) for a wanted Documentation member, else None."""
    if not member_name.startswith(DOC_PREFIX):
        return None
    rel = member_name[len(DOC_PREFIX):]
    if rel.startswith("translations/"):
        return None   # NOTE: non-English text would dominate a small byte-level vocab
    base = rel[:-3] if rel.endswith(".gz") else rel
    if not (base.endswith(".rst") or base.endswith(".txt")):
        return None
    return base


def extract_linux_doc(data_dir: Path) -> Path:
    """Downloads (if needed) and extracts the kernel documentation; returns the text root."""
    cache = data_dir / "cache"
    out = cache / DEB_PACKAGE
    marker = out / ".extracted"
    if marker.exists():
        return out
    deb = _download_deb(cache)
    _log(f"extracting Documentation text from {deb.name}")
    if out.exists():
        shutil.rmtree(out)
    n = 0
    with _deb_data_tar(deb) as tar:
        for m in tar:
            if not m.isfile():
                continue
            rel = _wanted_doc(m.name)
            if rel is None:
                continue
            raw = tar.extractfile(m).read()
            if m.name.endswith(".gz"):
                raw = gzip.decompress(raw)
            dst = out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(raw)
            n += 1
    if n == 0:
        raise RuntimeError(f"fp8attn.train.data: no Documentation text found in {deb}")
    marker.write_text(f"{n}\n")
    _log(f"extracted {n} documents into {out}")
    return out


def _read_text(path: Path) -> str | None:
    """Decoded text of a file (gunzipped when .gz); None for binary files."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except OSError:
            return None
    if b"\x00" in raw:
        return None
    return raw.decode("utf-8", errors="replace")


def collect_documents(root: Path) -> list[tuple[str, str]]:
    """All text documents under root as (relative path, text); symlink duplicates removed.

    Order: by SHA-1 of the relative path (deterministic pseudo-random order, so a
    size cap samples every part of the tree rather than the first directories).
    """
    seen: set[str] = set()
    docs = []
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name.startswith("."):
            continue
        real = os.path.realpath(p)
        if real in seen:
            continue
        seen.add(real)
        text = _read_text(p)
        if text is None or not text.strip():
            continue
        docs.append((p.relative_to(root).as_posix(), text))
    docs.sort(key=lambda d: _path_hash(d[0]))
    return docs


def _path_hash(rel: str) -> bytes:
    return hashlib.sha1(rel.encode()).digest()


def split_documents(docs: list[tuple[str, str]], max_bytes: int):
    """Caps the corpus at max_bytes (in hash order) and splits it by path hash.

    Returns (train_docs, val_docs). A document is val iff
    int(sha1(path)[:4]) % 1000 < VAL_PER_MILLE; if that leaves val empty (tiny
    corpora), the first document in hash order goes to val.
    """
    kept, total = [], 0
    for rel, text in docs:
        if total >= max_bytes:
            break
        kept.append((rel, text))
        total += len(text.encode("utf-8"))
    if len(kept) < 2:
        raise RuntimeError(f"fp8attn.train.data: need at least 2 documents, found {len(kept)}")
    is_val = [int.from_bytes(_path_hash(r)[:4], "big") % 1000 < VAL_PER_MILLE for r, _ in kept]
    if not any(is_val):
        is_val[0] = True
    if all(is_val):
        is_val[-1] = False
    train = [d for d, v in zip(kept, is_val) if not v]
    val = [d for d, v in zip(kept, is_val) if v]
    return train, val


# ----------------------------------------------------------------------------
# 4-5. Tokenizer and token files
# ----------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int, max_bytes: int):
    """Byte-level BPE trained on the first max_bytes of texts; id 0 is <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 257 <= vocab_size <= 65535:
        raise ValueError(f"vocab_size must be in [257, 65535] (uint16 token files), got {vocab_size}")
    sample, n = [], 0
    for t in texts:
        if n >= max_bytes:
            break
        sample.append(t)
        n += len(t)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample, trainer)
    return tok


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    """Token ids (uint16) of the documents, each followed by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    parts = []
    for enc in tok.encode_batch(texts):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


@dataclass
class PreparedData:
    """Paths of a prepared corpus directory (tokenizer.json, train.bin, val.bin, meta.json)."""
    root: Path

    @property
    def tokenizer_path(self) -> Path:
        return self.root / "tokenizer.json"

    def tokenizer_sha1(self) -> str:
        """sha1 of tokenizer.json's bytes (which tokenizer the token ids belong to)."""
        return hashlib.sha1(self.tokenizer_path.read_bytes()).hexdigest()

    @property
    def train_path(self) -> Path:
        return self.root / "train.bin"

    @property
    def val_path(self) -> Path:
        return self.root / "val.bin"

    @property
    def meta(self) -> dict:
        return json.loads((self.root / "meta.json").read_text())


def prepare(data_dir: str | os.PathLike = "data", vocab_size: int = 4096, max_mb: float = 32.0,
            tokenizer_train_mb: float = 4.0, text_dir: str | os.PathLike | None = None) -> PreparedData:
    """Runs the pipeline (idempotent) and returns the prepared corpus directory.

    data_dir: root for cache/ and the prepared corpora. vocab_size: BPE vocab
    (<= 65535). max_mb: corpus cap in MB of UTF-8 text. tokenizer_train_mb:
    tokenizer training sample. text_dir: alternative source directory (default:
    env FP8ATTN_TEXT_DIR, else the linux-doc package).
    Raises RuntimeError with a fix when the source cannot be obtained.
    """
    data_dir = Path(data_dir)
    source = "text_dir"
    if not text_dir and os.environ.get("FP8ATTN_TEXT_DIR"):
        text_dir, source = os.environ["FP8ATTN_TEXT_DIR"], "environment variable FP8ATTN_TEXT_DIR"
    text_dir = text_dir or None
    if text_dir is not None:
        src_root = Path(text_dir).resolve()
        if not src_root.is_dir():
            raise RuntimeError(f"fp8attn.train.data: {source}: {src_root} is not a directory "
                               "(expected a directory of text files)")
        src_name = "textdir-" + hashlib.sha1(str(src_root).encode()).hexdigest()[:8]
    else:
        src_root, src_name = None, DEB_PACKAGE
    out = data_dir / f"{src_name}-bpe{vocab_size}-{max_mb:g}mb"
    prepared = PreparedData(out)
    if (out / "meta.json").exists():
        return prepared

    t0 = time.time()
    if src_root is None:
        src_root = extract_linux_doc(data_dir)
    docs = collect_documents(src_root)
    train_docs, val_docs = split_documents(docs, int(max_mb * 1e6))
    train_texts = [t for _, t in train_docs]
    val_texts = [t for _, t in val_docs]
    _log(f"{src_name}: {len(train_docs)} train / {len(val_docs)} val documents, "
         f"{sum(map(len, train_texts)) / 1e6:.1f} / {sum(map(len, val_texts)) / 1e6:.2f} M chars")

    out.mkdir(parents=True, exist_ok=True)
    if prepared.tokenizer_path.exists():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(prepared.tokenizer_path))
    else:
        tok = train_tokenizer(train_texts, vocab_size, int(tokenizer_train_mb * 1e6))
        tok.save(str(prepared.tokenizer_path))
    for texts, path in ((train_texts, prepared.train_path), (val_texts, prepared.val_path)):
        if not path.exists():
            ids = encode_documents(tok, texts)
            tmp = path.with_suffix(".tmp")
            ids.tofile(tmp)
            tmp.rename(path)
    meta = {
        "source": src_name, "source_root": str(src_root), "pipeline_version": PIPELINE_VERSION,
        "vocab_size": tok.get_vocab_size(), "eot_id": tok.token_to_id(EOT),
        "train_docs": len(train_docs), "val_docs": len(val_docs),
        "train_tokens": int(prepared.train_path.stat().st_size // 2),
        "val_tokens": int(prepared.val_path.stat().st_size // 2),
        "val_paths": [r for r, _ in val_docs][:50],
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    _log(f"prepared {out}: {meta['train_tokens'] / 1e6:.2f} M train / "
         f"{meta['val_tokens'] / 1e6:.3f} M val tokens in {time.time() - t0:.1f} s")
    return prepared


# ----------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------

class TokenStream:
    """A uint16 token file sampled as [batch, seq_len] next-token-prediction batches."""

    def __init__(self, path: str | os.PathLike, seq_len: int):
        self.tokens = np.fromfile(path, dtype=np.uint16)
        self.seq_len = seq_len
        if len(self.tokens) < seq_len + 2:
            raise ValueError(f"{path}: {len(self.tokens)} tokens is too few for seq_len {seq_len}")

    def _window(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        chunk = torch.from_numpy(self.tokens[idx].astype(np.int64))
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def random_batch(self, rng: np.random.Generator, batch: int):
        """(x, y) int64 [batch, seq_len]; windows start at rng-drawn offsets."""
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=batch)
        return self._window(starts)

    def fixed_batches(self, n_batches: int, batch: int):
        """n_batches deterministic (x, y) batches at evenly spaced offsets (for val loss)."""
        n = n_batches * batch
        hi = len(self.tokens) - self.seq_len - 1
        starts = np.linspace(0, hi, num=n).astype(np.int64)
        return [self._window(starts[i * batch:(i + 1) * batch]) for i in range(n_batches)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", default="data")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--max-mb", type=float, default=32.0)
    ap.add_argument("--tokenizer-train-mb", type=float, default=4.0)
    ap.add_argument("--text-dir", default=None, help="use text files from this directory instead")
    a = ap.parse_args(argv)
    p = prepare(a.data_dir, a.vocab_size, a.max_mb, a.tokenizer_train_mb, a.text_dir)
    print(p.root)


if __name__ == "__main__":
    main()
