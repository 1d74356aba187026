"""fp8attn.cudnn_fp8_attention: cuDNN's FP8 SDPA as a training op, on the CPU.

* Delayed scaling (TransformerEngine's rule): the history roll, scale = fp8_max *
  2^-margin / max of the window, the first step, NaN / inf / zero / tiny amaxes,
  one update per step under activation checkpointing's recompute, state_dict.
* The autograd op end to end against tests/python/fake_cudnn.py's emulation of
  cuDNN's FP8 graphs: BF16 in / out, O and gradients against SDPA BF16, the scales
  it passes and the amaxes it records, graphs built once per shape, native GQA
  and the repeat fallback, a broken backend refused by the self-check.
* The reasons it gives where it cannot run (CPU, head_dim, frontend, GPU model).
* With the real frontend installed (nvidia-cudnn-frontend): the op's graph variants
  with GQA pass the frontend's validation for sm_90 without a GPU.
* GPU (marked gpu; skipped without CUDA sm_90 and the frontend): the op's O, dQ, dK,
  dV against SDPA BF16 (relative Frobenius error < 0.1).
CPU: ~15 s on 2 cores.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8attn import cudnn_fp8_attention as cfa  # noqa: E402

from fake_cudnn import install_for_training  # noqa: E402

I = cfa.IDX


# ---- delayed scaling ---------------------------------------------------------------

def _hist(rows):
    """history [N, 10] with tensor q's column set to rows (others zero)."""
    h = torch.zeros(len(rows), len(cfa.TENSORS))
    h[:, I["q"]] = torch.tensor(rows, dtype=torch.float32)
    return h


def test_update_rolls_the_history_and_scales_from_the_window_max():
    """TE's order: row 0 holds the step that ended; scale from the max over all rows;
    the history rolls by -1 (row 0 to the end), row 0 zeroed. So the window is the
    last N amaxes, the current one included."""
    n, fmax = 3, cfa.fp8_maxes()
    hist, scale = torch.zeros(n, 10), cfa.initial_scales()
    seen = []
    for step, amax in enumerate([4.0, 2.0, 1.0, 0.5, 0.25]):
        hist[0, I["q"]] = amax
        seen.append(amax)
        hist, scale = cfa.update_scales(hist, scale, fmax)
        assert scale[I["q"]].item() == pytest.approx(448.0 / max(seen[-n:])), step
        assert hist[0].abs().sum() == 0                       # row 0 is free for the next step
        assert hist[-1, I["q"]].item() == amax                # the newest amax sits at the end
    assert hist[:, I["q"]].tolist() == [0.0, 0.5, 0.25]
    # history 1: the most recent amax alone
    h1, s1 = cfa.update_scales(_hist([3.0]), cfa.initial_scales(), fmax)
    assert s1[I["q"]].item() == pytest.approx(448.0 / 3.0) and h1.abs().sum() == 0


def test_margin_zero_and_nonfinite_amaxes():
    fmax, init = cfa.fp8_maxes(), cfa.initial_scales()
    _, s = cfa.update_scales(_hist([2.0]), init, fmax, margin=1)
    assert s[I["q"]].item() == pytest.approx(448.0 / 2.0 / 2.0)           # 2^-margin
    prev = init.clone()
    prev[I["q"]] = 7.0
    for bad in (0.0, float("inf")):                                      # keep the previous scale
        _, s = cfa.update_scales(_hist([bad, 0.0]), prev, fmax)
        assert s[I["q"]].item() == 7.0, bad
    _, s = cfa.update_scales(_hist([float("nan"), 2.0]), prev, fmax)      # NaN ignored (TE's fmaxf)
    assert s[I["q"]].item() == pytest.approx(224.0)
    _, s = cfa.update_scales(_hist([float("nan")]), prev, fmax)          # nothing finite: keep
    assert s[I["q"]].item() == 7.0
    _, s = cfa.update_scales(_hist([1e-45]), prev, fmax)                 # 448 / 1e-45 overflows FP32
    assert s[I["q"]].item() == torch.finfo(torch.float32).max
    # ... and never underflows to 0 (a zero scale is an infinite descale): the largest margin on
    # FP32's largest amax stays at FP32's smallest normal.
    _, s = cfa.update_scales(_hist([torch.finfo(torch.float32).max]), prev, fmax, margin=cfa.MAX_MARGIN)
    assert s[I["q"]].item() == torch.finfo(torch.float32).tiny
    # an inf stays in the window for N steps and freezes the scale while it does
    st = cfa.DelayedScalingState(history_len=2)
    st.record(["q"], torch.tensor([float("inf")]))
    st.update()
    assert st.scale[I["q"]].item() == 1.0
    st.record(["q"], torch.tensor([2.0]))
    st.update()
    assert st.scale[I["q"]].item() == 1.0                                # inf still in the window
    st.record(["q"], torch.tensor([4.0]))
    st.update()
    assert st.scale[I["q"]].item() == pytest.approx(448.0 / 4.0)         # the inf has left it


def test_first_step_and_record():
    st = cfa.DelayedScalingState()
    assert st.history_len == cfa.DEFAULT_HISTORY_LEN == 1024 and st.margin == 0   # TE's defaults
    want = torch.ones(10)
    want[I["s"]] = 448.0                                 # P <= 1 a priori; every other scale starts at 1
    assert torch.equal(st.scale, want) and st.amax_history.abs().sum() == 0
    st.record(cfa.FWD_TENSORS, torch.tensor([2.0, 4.0, 8.0, 0.5, 3.0]))
    st.record(cfa.FWD_TENSORS, torch.tensor([1.0, 5.0, 8.0, 0.25, 3.0]))   # a recompute: max, not overwrite
    assert st.amax_history[0, :5].tolist() == [2.0, 5.0, 8.0, 0.5, 3.0]
    st.update(cfa.fp8_maxes("e5m2"))
    got = dict(zip(cfa.TENSORS, st.scale.tolist()))
    assert got["q"] == pytest.approx(224.0) and got["s"] == pytest.approx(896.0)
    assert got["dO"] == 1.0 and got["dQ"] == 1.0         # no backward amax yet: unchanged
    assert cfa.fp8_maxes("e5m2")[I["dO"]] == 57344.0 and cfa.fp8_maxes("e5m2")[I["dP"]] == 448.0
    with pytest.raises(ValueError, match="history_len"):
        cfa.DelayedScalingState(history_len=0)
    with pytest.raises(ValueError, match="margin"):
        cfa.DelayedScalingState(margin=-1)
    # Upper bounds (break test, 2026-12-04): margin 200 gave scale 0 / descale inf (NaN training),
    # a history of 1e13 rows a bare allocator error.
    with pytest.raises(ValueError, match=r"margin must be an int in \[0, 64\]"):
        cfa.DelayedScalingState(margin=cfa.MAX_MARGIN + 1)
    with pytest.raises(ValueError, match="history_len must be an int in"):
        cfa.DelayedScalingState(history_len=cfa.MAX_HISTORY_LEN + 1)
    cfa.DelayedScalingState(history_len=1, margin=cfa.MAX_MARGIN)  # the bounds themselves are fine


def test_state_dict_round_trip_and_history_resize():
    st = cfa.DelayedScalingState(history_len=4)
    for a in (1.0, 2.0, 3.0):
        st.record(["q", "dV"], torch.tensor([a, 10 * a]))
        st.update()
    sd = st.state_dict()
    assert set(sd) == {"amax_history", "scale"}
    other = cfa.DelayedScalingState(history_len=4)
    other.load_state_dict(sd)
    assert torch.equal(other.amax_history, st.amax_history) and torch.equal(other.scale, st.scale)
    short = cfa.DelayedScalingState(history_len=2)        # the newest rows that fit, row 0 kept
    short.load_state_dict(sd)
    assert short.amax_history[:, I["q"]].tolist() == [0.0, 3.0] and torch.equal(short.scale, st.scale)
    long = cfa.DelayedScalingState(history_len=6)
    long.load_state_dict(sd)
    assert long.amax_history[:, I["q"]].tolist() == [0.0, 0.0, 0.0, 1.0, 2.0, 3.0]


# ---- the op against the emulated cuDNN -------------------------------------------------

@pytest.fixture
def fake(monkeypatch):
    """An installer of FakeCudnn(bugs=..., refuse=...) as the frontend (fresh caches; the CPU
    counts as a capable device)."""
    return lambda **kw: install_for_training(monkeypatch, cfa, **kw)


def _qkv(b=1, hq=4, hkv=2, s=64, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g).bfloat16()
    k, v = (torch.randn(b, hkv, s, d, generator=g).bfloat16() for _ in range(2))
    do = torch.randn(b, hq, s, d, generator=g).bfloat16()
    return q, k, v, do


def _run(q, k, v, do, state):
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    o = cfa.cudnn_fp8_attention(qg, kg, vg, state)
    o.backward(do)
    return o, (qg.grad, kg.grad, vg.grad)


def _sdpa(q, k, v, do):
    qr, kr, vr = (x.clone().float().requires_grad_(True) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(qr, kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1),
                                       is_causal=True)
    o.backward(do.float())
    return o, (qr.grad, kr.grad, vr.grad)


@pytest.mark.parametrize("hkv", [4, 2])
def test_op_matches_sdpa_after_the_first_steps(fake, hkv):
    f = fake()
    q, k, v, do = _qkv(hkv=hkv)
    st = cfa.DelayedScalingState(history_len=16)
    for _ in range(3):                   # step 1 uses scale 1; by step 3 every scale is from amaxes
        o, grads = _run(q, k, v, do, st)
    ref_o, ref_g = _sdpa(q, k, v, do)
    assert o.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    assert grads[1].shape == k.shape
    errs = [cfa.rel_fro(o, ref_o)] + [cfa.rel_fro(g, r) for g, r in zip(grads, ref_g)]
    assert all(0.005 < e < 0.1 for e in errs), errs          # FP8 error levels, not zero
    plan = cfa.plan_for(1, 4, hkv, 64, 128, device="cpu")
    assert plan.gqa == ("none" if hkv == 4 else "native") and plan.var == cfa.TRAIN_VARIANTS[0]
    assert all(v <= cfa.DEFAULT_TOL for v in plan.check.values())
    # K / V were declared with their own head count (native GQA), once per shape and kind
    assert {(kind, tuple(kd)) for kind, _, kd in f.built} == {("fwd", (1, hkv, 64, 128)), ("bwd", (1, hkv, 64, 128))}
    n_built = len(f.built)
    _run(q, k, v, do, st)
    assert len(f.built) == n_built                           # cached: no rebuild
    _run(*_qkv(s=32, hkv=hkv), st)
    assert len(f.built) == n_built + 2                       # a new shape builds once


def test_op_passes_the_delayed_scales_and_records_the_amaxes(fake):
    f = fake()
    q, k, v, do = _qkv(hkv=4)
    st = cfa.DelayedScalingState(history_len=4)
    st.scale.copy_(torch.tensor([2.0, 4.0, 8.0, 400.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0]))
    before = st.scale.clone()
    cfa.plan_for(1, 4, 4, 64, 128, device="cpu")            # build + self-check first
    f.executed.clear()
    _run(q, k, v, do, st)
    (kf, pf), (kb, pb) = f.executed
    assert (kf, kb) == ("fwd", "bwd")
    sc = dict(zip(cfa.TENSORS, before.tolist()))
    for n in ("q", "k", "v", "s"):
        assert pf["descale_" + n].item() == pytest.approx(1 / sc[n])
    assert pf["scale_s"].item() == 400.0 and pf["scale_o"].item() == 16.0
    for n in ("dQ", "dK", "dV", "dP"):
        assert pb["scale_" + n].item() == sc[n]
    assert pb["descale_o"].item() == pytest.approx(1 / 16.0) and pb["descale_dO"].item() == pytest.approx(1 / 32.0)
    # the payloads are x * scale (saturating)
    assert torch.equal(pf["q"].float(), (q.float() * 2.0).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    # the step's amaxes went to the end of the history (rolled once), the scales follow them
    last = dict(zip(cfa.TENSORS, st.amax_history[-1].tolist()))
    assert st.amax_history[:-1].abs().sum() == 0
    assert last["q"] == q.abs().max().item() and last["dO"] == do.abs().max().item()
    assert last["o"] == pytest.approx(pf["Amax_O"].item()) and last["dP"] == pytest.approx(pb["amax_dP"].item())
    assert 0 < last["s"] <= 1.0                              # Amax_S declared (TRAIN_VARIANTS[0])
    assert st.scale[I["q"]].item() == pytest.approx(448 / last["q"])
    # no_grad or eval: the scales are used, the state is left alone
    snap = (st.amax_history.clone(), st.scale.clone())
    with torch.no_grad():
        cfa.cudnn_fp8_attention(q, k, v, st)
    st.eval()
    _run(q, k, v, do, st)
    assert torch.equal(st.amax_history, snap[0]) and torch.equal(st.scale, snap[1])


def test_one_update_per_step_under_activation_checkpointing(fake):
    from torch.utils.checkpoint import checkpoint
    fake()
    q, k, v, do = _qkv(hkv=2)
    st_a, st_b = cfa.DelayedScalingState(history_len=4), cfa.DelayedScalingState(history_len=4)
    _run(q, k, v, do, st_a)
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    o = checkpoint(lambda a, b, c: cfa.cudnn_fp8_attention(a, b, c, st_b) * 1.0, qg, kg, vg, use_reentrant=False)
    o.backward(do)      # forward twice (the recompute), one update
    assert torch.equal(st_a.amax_history, st_b.amax_history) and torch.equal(st_a.scale, st_b.scale)
    assert st_b.amax_history[:-1].abs().sum() == 0


def test_gqa_falls_back_to_repeated_kv(fake):
    for kw in ({"refuse": {"gqa"}}, {"bugs": {"gqa_first_head_only"}}):
        fake(**kw)
        q, k, v, do = _qkv(hkv=2)
        st = cfa.DelayedScalingState(history_len=16)
        for _ in range(3):
            o, grads = _run(q, k, v, do, st)
        plan = cfa.plan_for(1, 4, 2, 64, 128, device="cpu")
        assert plan.gqa == "repeat", kw
        ref_o, ref_g = _sdpa(q, k, v, do)
        assert grads[1].shape == k.shape and cfa.rel_fro(grads[1], ref_g[1]) < 0.1, kw
        assert cfa.rel_fro(grads[2], ref_g[2]) < 0.1 and cfa.rel_fro(o, ref_o) < 0.1


def test_broken_backend_is_refused_with_the_reason(fake):
    fake(bugs={"drop_scale_o"})
    q, k, v, do = _qkv(hkv=4)
    with pytest.raises(cfa.CudnnFP8Unavailable, match="self-check vs SDPA BF16"):
        cfa.cudnn_fp8_attention(q, k, v, cfa.DelayedScalingState())
    why = cfa.unavailable_reason("cpu", 128, shape=(1, 4, 4, 64, 128))
    assert why.startswith("no cuDNN FP8 SDPA graph built and passed the self-check at B 1, Hq 4")
    assert why.count("[") == len(cfa.TRAIN_VARIANTS)           # every variant tried, each named
    fake(refuse={"bounds"}, bugs={"ignore_flag_mask"})           # what builds ignores the causal mask
    with pytest.raises(cfa.CudnnFP8Unavailable, match="right_bound refused"):
        cfa.plan_for(1, 4, 4, 64, 128, device="cpu")


# ---- availability --------------------------------------------------------------------

def test_bad_arguments_name_themselves():
    """Bad inputs to the op are errors naming the argument (break test, 2026-12-04: zero kv
    heads gave a bare ZeroDivisionError, a list q an AttributeError), checked before the
    availability check so they read the same on every machine."""
    st = cfa.DelayedScalingState(history_len=2)
    x = torch.randn(1, 2, 8, 128)
    with pytest.raises(TypeError, match="argument 'q' must be a torch.Tensor, got list"):
        cfa.cudnn_fp8_attention([1.0], x, x, st)
    with pytest.raises(TypeError, match="argument 'state' must be a DelayedScalingState, got NoneType"):
        cfa.cudnn_fp8_attention(x, x, x, None)
    empty = torch.randn(1, 0, 8, 128)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv >= 1"):
        cfa.cudnn_fp8_attention(x, empty, empty, st)
    with pytest.raises(ValueError, match="S >= 1"):
        z = torch.randn(1, 2, 0, 128)
        cfa.cudnn_fp8_attention(z, z, z, st)
    with pytest.raises(TypeError, match="head_dim must be an int"):
        cfa.unavailable_reason("cpu", "128")


def test_unavailable_reasons(monkeypatch):
    monkeypatch.setitem(cfa._STATE, "cudnn", None)
    monkeypatch.setitem(cfa._STATE, "why", "import cudnn failed (ModuleNotFoundError: No module named 'cudnn')")
    why = cfa.unavailable_reason("cpu", 64, packed=True, context_parallel=2)
    parts = why.split("; ")
    assert parts[0] == "needs a CUDA GPU (this run is on cpu)"
    assert parts[1].startswith("head_dim 64: cuDNN's FP8 SDPA backward supports head_dim 128 only")
    assert parts[2].startswith("--packed") and parts[3].startswith("--context-parallel")
    assert parts[4].startswith("no cuDNN frontend: import cudnn failed") and "pip install nvidia-cudnn-frontend" in why
    assert cfa.unavailable_reason("cpu", 128).split("; ")[0] == "needs a CUDA GPU (this run is on cpu)"
    with pytest.raises(cfa.CudnnFP8Unavailable, match="fp8-cudnn: needs a CUDA GPU"):
        cfa.cudnn_fp8_attention(*_qkv()[:3], cfa.DelayedScalingState())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "A100")
    assert cfa.device_reason("cuda:0") == "cuDNN's FP8 SDPA backward runs on sm_90 (Hopper) only, this GPU (A100) is sm_80"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert cfa.device_reason("cuda:0") is None


# ---- the real frontend, deviceless ---------------------------------------------------------

@pytest.mark.parametrize("h_kv", [8, 2])
def test_real_frontend_validates_the_train_variants_with_gqa(monkeypatch, h_kv):
    cudnn = pytest.importorskip("cudnn")
    if not hasattr(getattr(cudnn, "pygraph", None), "sdpa_fp8") or not hasattr(cudnn, "_pygraph"):
        pytest.skip("not the cuDNN frontend with the python graph IR (nvidia-cudnn-frontend >= 1.32)")
    from cudnn import _pygraph
    monkeypatch.setattr(_pygraph.pygraph, "_backend_handle_for_lowering", lambda self, kw: None)
    for var in cfa.TRAIN_VARIANTS:
        for declare in (cfa.declare_fwd, cfa.declare_bwd):
            g, t = declare(cudnn, (2, 8, 1024, 128), True, var, h_kv=h_kv, sm_version=90)
            g.validate()
            g._lower_to_cpp().validate()
    g, _ = cfa.declare_bwd(cudnn, (2, 8, 1024, 64), True, cfa.TRAIN_VARIANTS[0], h_kv=h_kv, sm_version=90)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="128"):   # the head_dim-128-only backward
        g.validate()
        g._lower_to_cpp().validate()


# ---- GPU --------------------------------------------------------------------------------

def _gpu_ready():
    """None where the GPU tests can run (CUDA sm_90 and the frontend), else why not."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return cfa.unavailable_reason("cuda", 128)


@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [8, 2])
def test_gpu_op_matches_sdpa_bf16(hkv):
    why = _gpu_ready()
    if why:
        pytest.skip(f"fp8-cudnn: {why}")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(7)
    b, hq, s, d = 2, 8, 1024, 128
    q = torch.randn(b, hq, s, d, device=dev, generator=g).bfloat16()
    k, v = (torch.randn(b, hkv, s, d, device=dev, generator=g).bfloat16() for _ in range(2))
    do = torch.randn(b, hq, s, d, device=dev, generator=g).bfloat16()
    st = cfa.DelayedScalingState(history_len=16).to(dev)
    for _ in range(3):
        o, grads = _run(q, k, v, do, st)
    ref_o, ref_g = _sdpa(q, k, v, do)
    errs = {"O": cfa.rel_fro(o, ref_o), **{n: cfa.rel_fro(x, r) for n, x, r in zip(("dQ", "dK", "dV"), grads, ref_g)}}
    plan = cfa.plan_for(b, hq, hkv, s, d, device=dev)
    print("fp8-cudnn op:", plan.info(), "errors after 3 steps:", errs)
    assert all(e < 0.1 for e in errs.values()), errs
    assert torch.isfinite(st.scale).all() and (st.amax_history[-1] > 0).all()
