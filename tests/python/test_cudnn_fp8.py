"""benchmarks/cudnn_fp8.py (the cuDNN FP8 baseline of bench_gpu.py) on the CPU.

* The scale / calibration / self-check / fallback logic runs end to end against
  a CPU emulation of cuDNN's per-tensor FP8 SDPA contract (FakeCudnn below:
  descale inputs, P quantized with scale_s, O / dP / dQ / dK / dV quantized with
  their scales, amax before scaling). A correct emulation passes the self-check;
  one that drops scale_o, or ignores the causal mask, or has a wrong backward
  only (dK scale dropped, mask ignored in the backward), is reported "bad" with
  no number (the failure the check guards against), and a variant the backend
  refuses falls through to the next one. The timed callables execute the checked
  graphs on the checked buffers (the fake counts executes).
* bench_gpu.markdown keeps the table parseable by test_docs_benchmarks.table_ratios
  (with "bad" / "n/a" cells), and old tables without the new columns still parse.
* When the cuDNN frontend is importable (pip install nvidia-cudnn-frontend), the
  real graphs of every variant pass the frontend's C++ validation for SM 9.0
  without a GPU (deviceless lowering), and SM 8.0 is refused.
CPU, a few seconds.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cudnn_fp8 as cf  # noqa: E402


from fake_cudnn import FakeCudnn  # noqa: E402  (tests/python/fake_cudnn.py: the CPU emulation)


@pytest.fixture
def fake(monkeypatch):
    """Install a FakeCudnn as the module's cudnn (fresh caches); yields a setter for bugs."""
    def install(**kw):
        monkeypatch.setitem(cf._STATE, "cudnn", FakeCudnn(**kw))
        monkeypatch.setitem(cf._STATE, "handle", None)
        monkeypatch.setattr(cf, "_GRAPHS", {})
        monkeypatch.setattr(cf, "_GRAPH_ERRORS", {})
        monkeypatch.setattr(cf, "_PREFERRED", [])
    return install


def _inputs(b=1, h=2, s=256, d=32):
    return [torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(4)]


def _time(fn, warmup, iters):
    fn()
    return 1.0


@pytest.mark.parametrize("causal", [False, True])
def test_emulated_cudnn_passes_the_self_check(fake, causal):
    fake()
    q, k, v, do = _inputs()
    res = cf.run(q, k, v, do, causal, _time, tol=0.1)
    assert (res.fwd_status, res.bwd_status) == ("ok", "ok"), res.reasons
    assert res.fwd_ms == res.bwd_ms == 1.0
    assert res.fwd_variant == res.bwd_variant == cf.VARIANTS[0].label()
    # FP8 (E4M3) error levels: a few percent, not zero (the emulation really quantizes)
    for n in ("O", "dQ", "dK", "dV"):
        assert 0.005 < res.info[n] < 0.08, (n, res.info[n])


def test_dropped_output_scale_is_bad_not_a_number(fake):
    fake(bugs={"drop_scale_o"})
    q, k, v, do = _inputs()
    res = cf.run(q, k, v, do, False, _time, tol=0.1)
    assert res.fwd_status == "bad" and res.fwd_ms is None and res.bwd_ms is None
    assert res.info["O"] > 0.5
    assert len(res.reasons) == len(cf.VARIANTS)


@pytest.mark.parametrize("bug,causal", [("drop_scale_dk", False), ("bwd_ignores_mask", True)])
def test_backward_only_bug_is_bad_not_a_number(fake, bug, causal):
    """A correct forward and a wrong backward: the forward is timed, the backward
    self-check reports "bad" and gives no number (without the backward check the
    wrong backward would be timed as "ok")."""
    fake(bugs={bug})
    q, k, v, do = _inputs()
    res = cf.run(q, k, v, do, causal, _time, tol=0.1)
    assert (res.fwd_status, res.bwd_status) == ("ok", "bad"), res.reasons
    assert res.fwd_ms == 1.0 and res.bwd_ms is None and res.bwd_variant is None
    wrong = "dK" if bug == "drop_scale_dk" else "dQ"
    assert res.info[wrong] > 0.3, res.info
    assert all("bwd self-check" in r for r in res.reasons), res.reasons
    assert len(res.reasons) == len(cf.VARIANTS)


def test_timed_callable_executes_the_checked_graph(fake):
    """What time_fn times must execute the graph that passed the self-check, on
    that check's buffers: one execute of the right kind per call (a launcher that
    returns `lambda: None`, or runs another graph, is caught here)."""
    fake()
    cudnn = cf._STATE["cudnn"]
    timed = []

    def time_fn(fn, warmup, iters):
        before = len(cudnn.executed)
        last_kind, last_pack = cudnn.executed[-1]          # the final, checked execute of run_fwd / run_bwd
        fn()
        fn()
        new = cudnn.executed[before:]
        assert [kind for kind, _ in new] == [last_kind] * 2, new
        for _, pack in new:
            assert pack.keys() == last_pack.keys() and all(pack[n] is last_pack[n] for n in pack)
        timed.append(last_kind)
        return 2.0

    q, k, v, do = _inputs()
    res = cf.run(q, k, v, do, True, time_fn, tol=0.1)
    assert (res.fwd_status, res.bwd_status) == ("ok", "ok"), res.reasons
    assert timed == ["fwd", "bwd"] and res.fwd_ms == res.bwd_ms == 2.0
    # host_us runs the same callables (5 executes each)
    n_fwd = sum(1 for kind, _ in cudnn.executed if kind == "fwd")
    n_bwd = sum(1 for kind, _ in cudnn.executed if kind == "bwd")
    assert n_fwd == 2 + 2 + 5 and n_bwd == 3 + 2 + 5   # calibration(s) + check, timed, host_us


def test_refused_variant_falls_through(fake):
    fake(refuse={"bounds"})  # the backend refuses the first variant's causal right_bound=0
    q, k, v, do = _inputs()
    res = cf.run(q, k, v, do, True, _time, tol=0.1)
    assert (res.fwd_status, res.bwd_status) == ("ok", "ok"), res.reasons
    assert res.fwd_variant == res.bwd_variant == cf.VARIANTS[1].label()
    assert "right_bound refused" in res.reasons[0]


def test_ignored_causal_mask_is_bad(fake):
    fake(refuse={"bounds"}, bugs={"ignore_flag_mask"})  # what builds computes non-causal attention
    q, k, v, do = _inputs()
    res = cf.run(q, k, v, do, True, _time, tol=0.1)
    assert (res.fwd_status, res.bwd_status) == ("bad", "n/a") and res.fwd_ms is None
    assert res.info["O"] > 0.3


def test_probe_reports_the_first_working_variant(fake, capsys):
    fake(refuse={"bounds"})
    assert cf.probe((1, 2, 128, 32), device="cpu", time_fn=_time) == 0
    out = capsys.readouterr().out
    assert f"FIRST WORKING causal=False: fwd {cf.VARIANTS[0].label()}, bwd {cf.VARIANTS[0].label()}" in out
    assert f"FIRST WORKING causal=True: fwd {cf.VARIANTS[1].label()}, bwd {cf.VARIANTS[1].label()}" in out
    assert "fwd build error (full):" in out and "right_bound refused" in out
    fake(bugs={"drop_scale_o"})
    assert cf.probe((1, 2, 128, 32), device="cpu", time_fn=_time) == 2


def test_missing_frontend_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setitem(cf._STATE, "cudnn", None)
    monkeypatch.setitem(cf._STATE, "why", "import cudnn failed (ModuleNotFoundError: No module named 'cudnn')")
    res = cf.run(*_inputs(), False, _time)
    assert (res.fwd_status, res.bwd_status, res.fwd_ms) == ("n/a", "n/a", None)
    assert "import cudnn failed" in cf.reason(res)


def test_quantize_scale_contract():
    x = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16) * 3
    for layout in ("bshd", "bhsd"):
        payload, descale = cf.quantize(x, layout)
        assert list(payload.stride()) == cf._strides(layout, 1, 2, 8, 16)
        assert math.isclose(descale, x.abs().amax().float().item() / 448.0, rel_tol=1e-6)
        assert payload.float().abs().max().item() == 448.0
        assert cf.rel_fro(payload.float() * descale, x) < 0.05
    assert cf.scale_from_amax(0.0) == 1.0 and cf.scale_from_amax(float("nan")) == 1.0


# ---- bench_gpu's table ------------------------------------------------------------

def test_bench_table_parses_with_the_cudnn_fp8_columns():
    pytest.importorskip("fp8attn")
    import bench_gpu
    from test_docs_benchmarks import DOC, sections, table_ratios

    base = {"B": 2, "H": 16, "S": 8192, "d": 128, "cudnn_fwd": 600.0, "cudnn_bwd": 500.0, "flash_fwd": 300.0,
            "flash_bwd": 250.0, "fp8_fwd": 450.0,
            **{f"fp8_bwd_{m}": 250.0 for m in bench_gpu.MODES}}
    rows = [dict(base, causal=False, cudnn_fp8_fwd=900.0, cudnn_fp8_bwd=None,
                 cudnn_fp8_status={"fwd": "ok", "bwd": "bad"}),
            dict(base, causal=True, cudnn_fp8_fwd=None, cudnn_fp8_bwd=None,
                 cudnn_fp8_status={"fwd": "n/a", "bwd": "n/a"})]
    info = {"gpu": "G", "driver": "D", "torch": "T", "cudnn": 1, "date": "now", "cudnn_fp8": {"cudnn_frontend": "1.32.0"}}
    md = bench_gpu.markdown(rows, info)
    cols = table_ratios(md)
    assert cols["cuDNN fp8 fwd"] == [1.5]          # 900 / 600; the n/a row has no ratio
    assert cols["fp8 fwd"] == [0.75, 0.75] and cols["fp8 bwd DM"] == [0.5, 0.5]
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len({ln.count("|") for ln in table}) == 1   # every row has the header's cell count
    assert "| bad |" in table[2] and table[3].count("| n/a |") >= 2
    # the dated sections of docs/benchmarks.md (older tables, no cuDNN fp8 columns) still parse
    old = [table_ratios(sec) for _, sec in sections(DOC.read_text())]
    assert sum(1 for c in old if c.get("fp8 bwd DM")) >= 3


# ---- the real frontend, deviceless ----------------------------------------------------

def _lowered_validate(monkeypatch, cudnn, declare, shape, causal, var, sm):
    from cudnn import _pygraph
    monkeypatch.setattr(_pygraph.pygraph, "_backend_handle_for_lowering", lambda self, kw: None)
    g, _ = declare(cudnn, shape, causal, var, sm_version=sm)
    g.validate()
    g._lower_to_cpp().validate()


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_real_frontend_validates_every_variant_for_sm90(monkeypatch, kind):
    cudnn = pytest.importorskip("cudnn")
    if not hasattr(getattr(cudnn, "pygraph", None), "sdpa_fp8") or not hasattr(cudnn, "_pygraph"):
        pytest.skip("not the cuDNN frontend with the python graph IR (nvidia-cudnn-frontend >= 1.32)")
    declare = cf.declare_fwd if kind == "fwd" else cf.declare_bwd
    for var in cf.VARIANTS:
        for causal in (False, True):
            _lowered_validate(monkeypatch, cudnn, declare, (2, 16, 8192, 128), causal, var, 90)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError):  # FP8 attention needs Hopper
        _lowered_validate(monkeypatch, cudnn, declare, (2, 16, 8192, 128), True, cf.VARIANTS[0], 80)


def test_backward_fallback_skips_forward_runs_of_variants_without_a_backward(fake, monkeypatch):
    fake()
    built = []
    real = cf._built

    def spy(kind, shape, causal, var):
        if kind == "bwd" and var.layout == "bshd" and var.do_type == "e4m3":
            built.append((kind, var))
            return f"{kind} build: fake refusal"
        built.append((kind, var))
        return real(kind, shape, causal, var)
    monkeypatch.setattr(cf, "_built", spy)
    res = cf.run(*_inputs(), False, _time, tol=0.1)
    assert (res.fwd_status, res.bwd_status) == ("ok", "ok"), res.reasons
    assert res.fwd_variant == cf.VARIANTS[0].label() and res.bwd_variant == cf.VARIANTS[2].label()
    # variant 1 (bshd, no backward): its backward is asked first and its forward never built
    assert ("fwd", cf.VARIANTS[1]) not in built and ("bwd", cf.VARIANTS[1]) in built


def test_bound_fwd_bwd_executes_forward_then_backward(monkeypatch):
    # The benchmarks' timed cuDNN calls (bench_window_gpu / bench_varlen_gpu): fwd() runs the
    # forward graph once and returns O; step() runs forward then backward with the packs and
    # workspaces bound once, returning the gradient buffers; without a backward, step is None.
    calls = []

    class G:
        def __init__(self, name):
            self.name = name

        def execute(self, pack, ws, handle=None):
            calls.append((self.name, pack, ws.numel(), handle))

    class B:
        def __init__(self, name, workspace):
            self.graph, self.workspace = G(name), workspace

    monkeypatch.setattr(cf, "_handle", lambda: "h")
    o, grads = torch.zeros(2), (torch.ones(1), torch.ones(2), torch.ones(3))
    fwd, step = cf.bound_fwd_bwd(B("f", 0), {"f": 1}, o, B("b", 7), {"b": 2}, grads)
    assert fwd() is o and calls == [("f", {"f": 1}, 1, "h")]
    calls.clear()
    assert step() is grads
    assert calls == [("f", {"f": 1}, 1, "h"), ("b", {"b": 2}, 7, "h")]
    fwd_only, none = cf.bound_fwd_bwd(B("f", 3), {}, o)
    assert none is None and fwd_only() is o


def test_frontend_names_why_it_is_missing(monkeypatch):
    monkeypatch.setattr(cf, "load", lambda: None)
    monkeypatch.setitem(cf._STATE, "why", "no wheel")
    with pytest.raises(RuntimeError, match="cuDNN frontend unavailable: no wheel"):
        cf.frontend()
