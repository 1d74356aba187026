"""The custom ops behind varlen_attention (fp8attn::varlen_fwd / varlen_bwd).

(1) varlen_attention is bit-identical to per-sequence `attention` calls: O, LSE,
    dQ, dK, dV and the diagnostics records. (2) torch.compile(fullgraph=True)
    traces it (forward and backward) and matches eager; cu_seqlens values change
    without a recompile; bad values still raise naming the argument. (3)
    torch.library.opcheck on both ops. Small shapes; CPU, and (2) also on CUDA
    where a GPU with the CUDA kernels exists.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fp8attn
from fp8attn import varlen as _varlen
from test_varlen import LENS_K, LENS_Q, assert_equals_per_sequence, cu, make_packed, run_per_sequence, run_varlen

# ---- (1) bitwise equality with per-sequence attention, records included -----------

CASES = [
    # lens_q, lens_k, hq, hkv, d, dv, tails, dtype, options
    (LENS_Q, LENS_K, 4, 2, 32, 16, (3, 4), torch.float32,
     dict(causal=True, precision="fp8", block_size=32, delta_mode="delta_matching")),
    (LENS_Q, LENS_K, 4, 2, 32, 16, (3, 4), torch.float32,
     dict(causal=False, precision="fp8", block_size=32, delta_mode="matched_do")),
    (LENS_Q, LENS_K, 4, 2, 24, 12, (2, 3), torch.float64, dict(causal=True, precision="exact")),
    ([17, 64, 3], [30, 64, 3], 6, 2, 64, 64, (0, 0), torch.bfloat16,
     dict(causal=True, block_size=64, delta_mode="stale", grad_format="e5m2")),
]


def _records_per_sequence(q, k, v, cq, ck, dout, **kw):
    with fp8attn.diagnostics.record(keep_raw=True) as rec:
        ref = run_per_sequence(q, k, v, cq, ck, dout, **kw)  # one backward per sequence, in order
    return ref, rec.records


def _assert_same_records(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g, w = dict(g), dict(w)
        g_raw, w_raw = g.pop("raw"), w.pop("raw")
        assert g == w  # layer, options, shape and every statistic (Python floats, ==)
        assert g_raw.keys() == w_raw.keys()
        assert all(torch.equal(g_raw[n], w_raw[n]) for n in g_raw)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_bitwise_equal_to_per_sequence_attention_with_records(case):
    lens_q, lens_k, hq, hkv, d, dv, (tail_q, tail_k), dtype, kw = CASES[case]
    q, k, v = make_packed(lens_q, lens_k, hq=hq, hkv=hkv, d=d, dv=dv, tail_q=tail_q, tail_k=tail_k, dtype=dtype)
    cq, ck = cu(lens_q), cu(lens_k, torch.int64)
    dout = torch.randn(q.shape[0], hq, dv, dtype=dtype)
    with fp8attn.diagnostics.record(keep_raw=True) as rec:
        out, lse, dq, dk, dv_ = run_varlen(q, k, v, cq, ck, dout, layer_name="packed", **kw)
    ref, ref_records = _records_per_sequence(q, k, v, cq, ck, dout, layer_name="packed", **kw)
    assert_equals_per_sequence((out, lse, dq, dk, dv_), ref, cq, ck)
    a, c = cq.tolist(), ck.tolist()
    # Outside every sequence: O = 0, LSE = -inf, zero gradients.
    assert (out[a[-1]:] == 0).all() and torch.isneginf(lse[:, a[-1]:]).all() and (dq[a[-1]:] == 0).all()
    assert (dk[c[-1]:] == 0).all() and (dv_[c[-1]:] == 0).all()
    # One record per sequence with >= 1 query and >= 1 key, in sequence order.
    nonempty = [(lq, lk) for lq, lk in zip(lens_q, lens_k) if lq and lk]
    assert [(r["shape"]["seqlen_q"], r["shape"]["seqlen_k"]) for r in rec.records] == nonempty
    assert all(r["layer"] == "packed" and r["shape"]["batch"] == 1 for r in rec.records)
    _assert_same_records(rec.records, ref_records)
    if kw.get("delta_mode") == "stale":
        assert max(r["eps_absmax"] for r in rec.records) > 0  # real statistics, not all zero


def test_records_comparison_sees_a_different_sequence():
    """Guard for the record check above: the records of a different split of the
    same tokens (other cu_seqlens) differ, so equal records are informative."""
    lens_q, lens_k = [20, 12], [20, 12]
    q, k, v = make_packed(lens_q, lens_k, hq=2, hkv=2, d=16)
    dout = torch.randn(q.shape[0], 2, 16)
    with fp8attn.diagnostics.record(keep_raw=True) as rec:
        run_varlen(q, k, v, cu([16, 16]), cu([16, 16]), dout, delta_mode="stale", block_size=32)
    _, ref_records = _records_per_sequence(q, k, v, cu(lens_q), cu(lens_k), dout, delta_mode="stale",
                                           block_size=32)
    with pytest.raises(AssertionError):
        _assert_same_records(rec.records, ref_records)


def test_diagnostics_off_gives_no_records_and_empty_diag():
    lens = [5, 7]
    q, k, v = make_packed(lens, lens, hq=2, hkv=1, d=16)
    cq = cu(lens)
    out, lse, _ = torch.ops.fp8attn.varlen_fwd(q, k, v, cq, cq, None, None, 0.25, True, "fp8", 32,
                                            "delta_matching", "e4m3", None)
    args = (torch.randn_like(out), q, k, v, out, lse, cq, cq, 0.25, True, "fp8", "stale", 32, "e4m3")
    *_, diag_off = torch.ops.fp8attn.varlen_bwd(*args, False)
    *grads_on, diag_on = torch.ops.fp8attn.varlen_bwd(*args, True)
    assert diag_off.shape == (0,) and diag_on.shape == (4, 2, 12) and diag_on.dtype == torch.float32
    grads_off = torch.ops.fp8attn.varlen_bwd(*args, False)[:3]
    assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
    assert diag_on[1].abs().max() > 0  # eps of the stale mode


# ---- (2) torch.compile(fullgraph=True) ---------------------------------------------


def _step(q, k, v, cq, ck):
    block_size = 128 if q.is_cuda else 32  # NOTE: the CUDA kernels take block_size 128 only
    out, lse = fp8attn.varlen_attention(q, k, v, cq, ck, causal=True, block_size=block_size, delta_mode="stale",
                                        return_lse=True, layer_name="packed")
    return (out.float() ** 2).sum(), lse


HAS_CUDA_KERNELS = torch.cuda.is_available() and getattr(fp8attn._lib, "HAS_CUDA_KERNELS", False)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not HAS_CUDA_KERNELS, reason="needs a CUDA GPU and the CUDA kernels")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compile_fullgraph_matches_eager(dtype, device):
    # NOTE: backend="aot_eager" traces forward and backward through the fake
    # kernels as inductor would, without inductor's slow C++ codegen. On the old
    # code (cu_seqlens.tolist() in Python) fullgraph=True raised here. On CUDA
    # the ops run the FP8 kernels (head_dim 64: a supported kernel head_dim).
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA kernels take BF16 / FP16 inputs")
    torch._dynamo.reset()
    d = 64 if device == "cuda" else 32
    q, k, v = make_packed(LENS_Q, LENS_K, hq=4, hkv=2, d=d, tail_q=3, tail_k=4, dtype=dtype)
    cq, ck = cu(LENS_Q), cu(LENS_K, torch.int64)
    q, k, v, cq, ck = (t.to(device) for t in (q, k, v, cq, ck))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_step, fullgraph=True, backend=counter)
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    loss_c, lse_c = compiled(qc, kc, vc, cq, ck)
    loss_c.backward()
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    loss_e, lse_e = _step(qe, ke, ve, cq, ck)
    loss_e.backward()
    assert counter.frame_count == 1
    assert torch.equal(loss_c, loss_e) and torch.equal(lse_c, lse_e)
    for a, b in ((qc.grad, qe.grad), (kc.grad, ke.grad), (vc.grad, ve.grad)):
        assert torch.equal(a, b) and a.abs().sum() > 0
    # Other cu_seqlens values (same batch): the same graph, no recompile, and
    # still equal to eager (the values are read inside the op, not guarded on).
    lens_q2, lens_k2 = [33, 9, 0, 70, 40, 5], [33, 0, 12, 45, 40, 21]
    cq2, ck2 = cu(lens_q2).to(device), cu(lens_k2, torch.int64).to(device)
    assert not torch.equal(cq2, cq)
    qc.grad = qe.grad = None
    loss_c2, _ = compiled(qc, kc, vc, cq2, ck2)
    loss_c2.backward()
    loss_e2, _ = _step(qe, ke, ve, cq2, ck2)
    loss_e2.backward()
    assert counter.frame_count == 1
    assert torch.equal(loss_c2, loss_e2) and not torch.equal(loss_c2, loss_c)
    assert torch.equal(qc.grad, qe.grad)
    torch._dynamo.reset()


def test_compile_fullgraph_bad_values_raise_naming_the_argument():
    torch._dynamo.reset()
    q, k, v = make_packed([3, 4], [5, 2], hq=2, hkv=2, d=8)
    compiled = torch.compile(lambda q, k, v, cq, ck, m: fp8attn.varlen_attention(q, k, v, cq, ck, m),
                             fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, cu([3, 4]), cu([5, 2]), None),
                       fp8attn.varlen_attention(q, k, v, cu([3, 4]), cu([5, 2])))
    with pytest.raises(ValueError, match="'cu_seqlens_q'.*non-decreasing"):
        compiled(q, k, v, torch.tensor([0, 4, 3], dtype=torch.int32), cu([5, 2]), None)
    with pytest.raises(ValueError, match="'cu_seqlens_k'.*exceeds total_k"):
        compiled(q, k, v, cu([3, 4]), torch.tensor([0, 5, 8], dtype=torch.int32), None)
    with pytest.raises(ValueError, match="'max_seqlen_q'.*4"):
        compiled(q, k, v, cu([3, 4]), cu([5, 2]), 3)
    torch._dynamo.reset()


def test_host_read_of_cu_seqlens_breaks_fullgraph():
    """Guard: the failure the ops avoid. Reading cu_seqlens values in Python
    (what varlen_attention did before, here the ops' own checker) is a graph
    break, which fullgraph=True turns into an error (torch >= 2.15 raises it as a
    UserError about the data-dependent guard, older torch as Unsupported)."""
    torch._dynamo.reset()
    q = torch.randn(7, 2, 8)
    fn = torch.compile(lambda q, cq: q * len(_varlen._spans(cq, cq, q.shape[0], q.shape[0])),
                       fullgraph=True, backend="eager")
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        fn(q, cu([3, 4]))
    torch._dynamo.reset()


def test_compiled_backward_records_nothing():
    # As for `attention` (diagnostics.py): the traced backward is fixed, so a
    # compiled varlen backward takes no records; eager records one per sequence.
    torch._dynamo.reset()
    lens = [6, 9]
    q, k, v = make_packed(lens, lens, hq=2, hkv=2, d=16)
    cq = cu(lens)
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    with fp8attn.diagnostics.record() as rec:
        compiled(q.clone().requires_grad_(), k, v, cq, cq)[0].backward()
        assert rec.records == []
        _step(q.clone().requires_grad_(), k, v, cq, cq)[0].backward()
    assert len(rec.records) == 2
    torch._dynamo.reset()


# ---- (3) opcheck ---------------------------------------------------------------------


def _fwd_args(requires_grad):
    lens_q, lens_k = [5, 0, 9, 3], [7, 4, 9, 0]
    q, k, v = make_packed(lens_q, lens_k, hq=4, hkv=2, d=16, dv=8, tail_q=2, tail_k=1)
    q, k, v = (t.requires_grad_(requires_grad) for t in (q, k, v))
    return (q, k, v, cu(lens_q), cu(lens_k, torch.int64), 9, None, 0.25, True, "fp8", 32, "stale", "e4m3", None)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_varlen_fwd(requires_grad):
    # All of opcheck's default tests, test_aot_dispatch_dynamic included (it
    # compiles the op with dynamic shapes and, with requires_grad, its backward).
    torch.library.opcheck(torch.ops.fp8attn.varlen_fwd.default, _fwd_args(requires_grad))


@pytest.mark.parametrize("diagnostics", [False, True])
def test_opcheck_varlen_bwd(diagnostics):
    q, k, v, cq, ck, *_ = _fwd_args(False)
    out, lse, _ = torch.ops.fp8attn.varlen_fwd(*_fwd_args(False))
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.fp8attn.varlen_bwd.default,
                          (dout, q, k, v, out, lse, cq, ck, 0.25, True, "fp8", "stale", 32, "e4m3", diagnostics))
