"""benchmarks/accuracy_gpu.py (issue #18 item 4's accuracy table) on the CPU.

* The chunked float64 reference (`exact_reference`) equals a dense float64 autograd
  reference to ~1e-13 (O, LSE, dQ, dK, dV; causal and not, GQA, seqlen_q < / > seqlen_k
  with rows that see no key, head_dim_v != head_dim, batch 2, a chunk that does not divide
  seqlen_q), and the error metric catches a wrong gradient (one dK entry off by 1e-6
  relative; dK without the delta term) and a NaN.
* The CPU smoke mode runs end to end in a child process: fp8 errors on Gaussian inputs
  finite, > 0 and < 0.2, the ref-f64 sanity rows 0, cuDNN FP8 n/a with its reason, SDPA
  BF16 below FP8, the speed table's ratios; accuracy.md / accuracy.json written.
* A NaN output shows as nan and makes the exit status 1 (0 with --allow-nan); a variant that
  raises is n/a in its row and the run goes on; the cudnn-fp8 variant's plumbing (LSE from
  the Stats output, GQA by repeated K / V with dK / dV summed per group, the timed graphs)
  against the CPU emulation of cuDNN's FP8 graphs (fake_cudnn.py).
CPU, ~10 s.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8attn

ROOT = Path(__file__).resolve().parents[2]
PY_DIR = Path(fp8attn.__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy_gpu as ag  # noqa: E402
from fake_cudnn import FakeCudnn  # noqa: E402

F64 = torch.float64


def _dense(q, k, v, do, causal, tau):
    """Dense float64 attention by autograd (independent of exact_reference): rows that see
    no key (causal with seqlen_q > seqlen_k) are left out of the softmax and get O = 0,
    LSE = -inf, dQ = 0."""
    B, Hq, Sq, _ = q.shape
    Hkv, Sk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = Hq // Hkv
    n0 = max(0, Sq - Sk) if causal else 0
    qq, kk, vv = (x.detach().to(F64).requires_grad_() for x in (q, k, v))
    s = tau * qq[:, :, n0:] @ kk.repeat_interleave(g, 1).transpose(-1, -2)
    if causal:
        i = torch.arange(n0, Sq)[:, None]
        s = s.masked_fill(torch.arange(Sk)[None, :] > i + Sk - Sq, -math.inf)
    o = torch.cat([torch.zeros(B, Hq, n0, dv, dtype=F64), torch.softmax(s, -1) @ vv.repeat_interleave(g, 1)], 2)
    lse = torch.cat([torch.full((B, Hq, n0), -math.inf, dtype=F64), torch.logsumexp(s, -1).detach()], 2)
    dq, dk, dv_ = torch.autograd.grad(o, (qq, kk, vv), do.to(F64))
    return {"o": o.detach(), "lse": lse, "dq": dq, "dk": dk, "dv": dv_}


def _rand(B, Hq, Hkv, Sq, Sk, d, dv):
    q = torch.randn(B, Hq, Sq, d, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, Sk, d, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, Sk, dv, dtype=torch.bfloat16)
    do = torch.randn(B, Hq, Sq, dv, dtype=torch.bfloat16)
    return q, k, v, do


@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,d,dv,causal,chunk", [
    (1, 1, 1, 64, 64, 16, 16, False, 64),
    (1, 4, 2, 70, 70, 16, 16, True, 16),     # GQA, chunk not dividing 70
    (2, 2, 1, 50, 90, 16, 24, True, 16),     # seqlen_q < seqlen_k (bottom-right), head_dim_v != head_dim
    (1, 2, 1, 90, 50, 16, 16, True, 13),     # seqlen_q > seqlen_k: 40 rows see no key
    (1, 3, 3, 90, 50, 32, 16, False, 7),
])
def test_chunked_reference_equals_dense(B, Hq, Hkv, Sq, Sk, d, dv, causal, chunk):
    q, k, v, do = _rand(B, Hq, Hkv, Sq, Sk, d, dv)
    tau = 0.3
    got = ag.exact_reference(q, k, v, do, causal=causal, softmax_scale=tau, chunk=chunk)
    ref = _dense(q, k, v, do, causal, tau)
    for key in ("o", "dq", "dk", "dv"):
        assert got[key].dtype == F64 and got[key].shape == ref[key].shape, key
        assert ((got[key] - ref[key]).norm() / ref[key].norm()).item() < 1e-13, key
    fin = torch.isfinite(ref["lse"])
    assert torch.equal(torch.isfinite(got["lse"]), fin)
    assert (got["lse"][fin] - ref["lse"][fin]).abs().max().item() < 1e-12
    if causal and Sq > Sk:
        assert not fin[..., :Sq - Sk].any() and (got["o"][..., :Sq - Sk, :] == 0).all()
        assert (got["dq"][..., :Sq - Sk, :] == 0).all()
    # the script's own metric of the reference against itself, and against the dense one
    assert all(e == 0 for e in ag.errors(got, got).values())
    assert all(e < 1e-12 for e in ag.errors(got, ref).values())


def test_error_metric_catches_a_wrong_gradient():
    q, k, v, do = _rand(1, 2, 1, 80, 80, 16, 16)
    tau = 0.25
    ref = ag.exact_reference(q, k, v, do, causal=True, softmax_scale=tau, chunk=32)
    # one dK entry off by 1e-6 relative: far above the reference's 1e-13 agreement
    bad = dict(ref, dk=ref["dk"].clone())
    bad["dk"][0, 0, 5, 3] *= 1 + 1e-6
    e = ag.errors(bad, ref)
    assert e["dk"] > 1e-10 and all(e[key] == 0 for key in ("o", "lse", "dq", "dv"))
    # dK without the delta term (dS = P o dP): a real-looking bug, a large error
    qd, kd, vd, dod = (x[0, :, :, :].to(F64) for x in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), do))
    s = tau * qd @ kd.transpose(-1, -2)
    s = s.masked_fill(torch.ones(80, 80, dtype=torch.bool).triu(1), -math.inf)
    p = torch.softmax(s, -1)
    dk_wrong = (tau * (p * (dod @ vd.transpose(-1, -2))).transpose(-1, -2) @ qd).sum(0, keepdim=True)[None]
    assert ag.errors(dict(ref, dk=dk_wrong), ref)["dk"] > 0.05
    # NaN / inf in an output is a nan / inf error, never a finite number
    nan = dict(ref, dq=ref["dq"].clone(), o=ref["o"].clone())
    nan["dq"][0, 1, 7, 0] = float("nan")
    nan["o"][0, 0, 0, 0] = float("inf")
    e = ag.errors(nan, ref)
    assert math.isnan(e["dq"]) and math.isinf(e["o"])
    assert ag.fmt(e["dq"]) == "nan" and ag.fmt(e["o"]) == "inf" and ag.fmt(None) == "n/a"


def _script(*args, timeout=120):
    env = {"PYTHONPATH": str(PY_DIR), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
           "FP8ATTN_SOURCE_TREE": os.environ.get("FP8ATTN_SOURCE_TREE", "1")}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "accuracy_gpu.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_cpu_smoke_end_to_end(tmp_path):
    proc = _script("--device", "cpu", "--seqlens", "256", "--heads", "2", "--out", str(tmp_path),
                   "--warmup", "1", "--iters", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("versions: torch ")
    info = json.loads((tmp_path / "accuracy.json").read_text())
    md = (tmp_path / "accuracy.md").read_text()
    assert md in proc.stdout
    assert info["settings"]["heads"] == 2 and info["settings"]["heads_kv"] == 1   # GQA by default
    rows = {(r["input"], r["variant"]): r for r in info["rows"]}
    assert len(info["rows"]) == len(ag.INPUTS) * len(ag.VARIANTS)
    for name in ag.FP8_VARIANTS:
        e = rows[("gaussian", name)]["errors"]
        assert rows[("gaussian", name)]["status"] == "ok"
        assert all(isinstance(e[key], float) and 0 < e[key] < 0.2 for key in ag.KEYS), (name, e)
    for kind in ag.INPUTS:
        assert all(x == 0 for x in rows[(kind, "ref-f64")]["errors"].values())
        cu = rows[(kind, "cudnn-fp8")]
        assert cu["status"] == "n/a" and "needs a CUDA GPU" in cu["reason"]
        sd = rows[(kind, "sdpa-bf16")]["errors"]
        assert sd["lse"] is None and sd["o"] < rows[(kind, "row/none")]["errors"]["o"] / 5
    # training-shaped inputs: the rotation lowers the O / dQ / dK error (numerics.md section 10.4)
    for key in ("o", "dq", "dk"):
        assert rows[("training", "row/hadamard")]["errors"][key] < 0.7 * rows[("training", "row/none")]["errors"][key]
    assert "| gaussian | 256 | cudnn-fp8 | n/a | n/a | n/a | n/a | n/a | n/a (" in md
    assert "| gaussian | 256 | ref-f64 | 0 | 0 | 0 | 0 | 0 |" in md
    speed = {r["variant"]: r for r in info["speed"]}
    assert "ref-f64" not in speed and speed["cudnn-fp8"]["ms"] is None and speed["cudnn-fp8"]["reason"]
    assert speed["row/none"]["vs_none"] == 1.0 and speed["tile/both"]["vs_none_of"] == "tile/none"
    assert all(speed[n]["ms"] > 0 and speed[n]["vs_sdpa_bf16"] > 0 for n in ag.FP8_VARIANTS)
    assert "| row/none |" in md and "| 1.00x |" in md


def _small(*extra):
    return ["--device", "cpu", "--seqlens", "64", "--heads", "2", "--head-dim", "64", "--inputs", "gaussian",
            "--speed-seqlen", "0", *extra]


def test_nan_output_fails_the_run(tmp_path, monkeypatch, capsys):
    real = ag.run_fp8attn

    def poisoned(*a, **kw):
        out = real(*a, **kw)
        out["dq"] = out["dq"].clone()
        out["dq"][0, 0, 3, 3] = float("nan")
        return out
    monkeypatch.setattr(ag, "run_fp8attn", poisoned)
    rc = ag.main(_small("--variants", "row/none,ref-f64", "--out", str(tmp_path)))
    out = capsys.readouterr()
    assert rc == 1 and "NaN / inf output" in out.err
    assert "| gaussian | 64 | row/none |" in out.out and " | nan | " in out.out and "NON-FINITE" in out.out
    row = json.loads((tmp_path / "accuracy.json").read_text())["rows"][0]
    assert row["status"] == "non-finite" and row["errors"]["dq"] == "nan" and 0 < row["errors"]["o"] < 0.2
    assert ag.main(_small("--variants", "row/none", "--allow-nan")) == 0


def test_a_variant_that_raises_is_na(monkeypatch, capsys):
    def boom(*a, **kw):
        raise RuntimeError("no kernel for this\nsecond line")
    monkeypatch.setattr(ag, "run_sdpa_bf16", boom)
    assert ag.main(_small("--variants", "sdpa-bf16,tile/none")) == 0
    out = capsys.readouterr().out
    assert "| gaussian | 64 | sdpa-bf16 | n/a | n/a | n/a | n/a | n/a | n/a (RuntimeError: no kernel for this) |" in out
    assert "| gaussian | 64 | tile/none | 0.0" in out


def test_cudnn_fp8_variant_on_the_emulated_frontend(tmp_path, monkeypatch):
    """The cudnn-fp8 rows against fake_cudnn's CPU emulation of the graphs (per-tensor E4M3,
    Stats = the natural-log LSE): GQA 4 query heads on 1 kv head."""
    cf = ag.cudnn_fp8
    fake = FakeCudnn()
    monkeypatch.setitem(cf._STATE, "cudnn", fake)
    monkeypatch.setitem(cf._STATE, "handle", None)
    monkeypatch.setattr(cf, "_GRAPHS", {})
    monkeypatch.setattr(cf, "_GRAPH_ERRORS", {})
    monkeypatch.setattr(cf, "_PREFERRED", [])
    monkeypatch.setattr(ag, "CUDNN_ON_CPU", True)
    rc = ag.main(["--device", "cpu", "--seqlens", "128", "--heads", "4", "--head-dim", "64", "--inputs",
                  "gaussian", "--variants", "cudnn-fp8,row/none", "--speed-seqlen", "128", "--warmup", "0",
                  "--iters", "1", "--out", str(tmp_path)])
    assert rc == 0
    info = json.loads((tmp_path / "accuracy.json").read_text())
    assert info["settings"]["heads_kv"] == 1
    cu, fp8 = info["rows"]
    assert cu["variant"] == "cudnn-fp8" and cu["status"] == "ok" and "graph variant bshd/bounds" in cu["note"]
    e = cu["errors"]
    assert all(0 < e[key] < 0.2 for key in ag.KEYS), e
    # dK / dV summed over the group of 4 (one head's share alone would be ~0.75 off)
    assert e["dk"] < 2 * fp8["errors"]["dk"] and e["dv"] < 2 * fp8["errors"]["dv"]
    assert e["lse"] < 0.05
    speed = {r["variant"]: r for r in info["speed"]}
    assert speed["cudnn-fp8"]["ms"] > 0 and "quantization excluded" in speed["cudnn-fp8"]["note"]
    assert [x[0] for x in fake.executed[-2:]] == ["fwd", "bwd"]


def test_arguments():
    with pytest.raises(SystemExit) as e:
        ag.parse_args(["--variants", "row/none,nope"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        ag.parse_args(["--heads", "8", "--heads-kv", "3"])
    a = ag.parse_args(["--seqlens", "1024,65536,4096"])
    assert a.speed_seqlen == 4096 and a.heads == 8 and a.heads_kv == 2 and a.variants == list(ag.VARIANTS)
    assert ag.parse_args(["--seqlens", "32768"]).speed_seqlen == 32768
    assert ag.parse_args(["--speed-seqlen", "0"]).speed_seqlen == 0
    if not torch.cuda.is_available():
        assert ag.main(["--seqlens", "64"]) == 3
