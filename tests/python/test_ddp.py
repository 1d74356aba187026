"""Data-parallel training (fp8attn.train.ddp): rank-strided batches, and a 2-process
gloo (CPU) smoke run of the comparison runner under torch.distributed.run:
exit code 0, only rank 0's log/report, finite losses, the logged step-0 loss is
the mean of the single-process losses of shared batches #0 and #1 (so rank 1
really trained on batch #1), and both ranks end with identical parameters that
differ from the initial ones. Runtime: ~30-60 s on 2 cores.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fp8attn
from fp8attn.train import ddp
from fp8attn.train.data import TokenStream
from fp8attn.train.report import read_log

from dist_helpers import TOL_GPU, assert_trains_alike, first_batch_losses, free_port

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

# NOTE: the children must import the same fp8attn this process imported (the
# in-tree package when it holds a build, else the installed one; see conftest.py).
PY_DIR = Path(fp8attn.__file__).resolve().parents[1]
MODES = ("bf16", "fp8-delta_matching")
STEPS = 6


# ---- helpers without a process group -----------------------------------------------


def test_single_process_helpers_are_identity():
    ctx = ddp.context()
    assert ctx == ddp.DistContext() and not ctx.enabled and ctx.is_main
    model = torch.nn.Linear(3, 3)
    assert ddp.wrap_model(model, ctx, torch.device("cpu")) is model
    assert ddp.mean_over_ranks(2.5, ctx, torch.device("cpu")) == 2.5
    assert ddp.gather_strings("abc", ctx) == ["abc"]


def test_rank_batches_are_strided_over_one_order(tmp_path):
    toks = np.random.default_rng(1).integers(0, 500, size=4000).astype(np.uint16)
    toks.tofile(tmp_path / "t.bin")
    ts = TokenStream(tmp_path / "t.bin", seq_len=16)
    single = np.random.Generator(np.random.PCG64(9))
    order = [ts.random_batch(single, 4)[0] for _ in range(6)]          # the shared order
    # One process: exactly the old draw.
    one = np.random.Generator(np.random.PCG64(9))
    assert torch.equal(ddp.rank_batch(ts, one, 4, ddp.DistContext())[0], order[0])
    for rank in range(2):
        ctx = ddp.DistContext(rank=rank, world_size=2, local_world_size=2)
        rng = np.random.Generator(np.random.PCG64(9))
        for step in range(3):
            x, _ = ddp.rank_batch(ts, rng, 4, ctx)
            assert torch.equal(x, order[2 * step + rank]), (rank, step)
    # The ranks see different data (what a missing rank offset would break).
    assert not torch.equal(order[0], order[1])


def _params_with_grads(seed, scale):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((7, 33), (64,), (), (3, 4, 5), (1, 9))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return ps


@pytest.mark.parametrize("scale", [10.0, 1e-3])
def test_clip_grad_norm_is_torchs_clip(scale):
    """ddp.clip_grad_norm returns the total L2 norm and scales the gradients by
    min(1, max_norm / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_ does (up
    to rounding: its norm is float64); below max_norm the gradients stay as they are."""
    ours, ref = _params_with_grads(0, scale), _params_with_grads(0, scale)
    before = [p.grad.clone() for p in ours]
    n_ours = ddp.clip_grad_norm(ours, 1.0)
    n_ref = float(torch.nn.utils.clip_grad_norm_(ref, 1.0))
    assert isinstance(n_ours, float) and n_ours == pytest.approx(n_ref, rel=1e-6)
    for a, b, g0 in zip(ours, ref, before):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
        if n_ours < 1.0:
            assert torch.equal(a.grad, g0)
        else:
            assert not torch.equal(a.grad, g0)


def test_clip_grad_norm_non_finite_scales_nothing():
    ps = _params_with_grads(1, 1.0)
    ps[1].grad[3] = float("nan")
    before = [p.grad.clone() for p in ps]
    assert math.isnan(ddp.clip_grad_norm(ps, 1.0))
    for i, (p, g0) in enumerate(zip(ps, before)):
        assert torch.equal(torch.nan_to_num(p.grad), torch.nan_to_num(g0)), i   # unscaled
    assert ddp.clip_grad_norm([torch.nn.Parameter(torch.zeros(2))], 1.0) == 0.0   # no gradients


def test_clip_norm_rows_do_not_depend_on_sharding():
    """What makes the clip norm of DDP and FSDP2 bitwise equal: the float64 row
    sums of squares of FSDP2's dim-0 shards (torch.chunk, uneven and empty ones
    too), concatenated in rank order, are those of the full gradient, and so is
    their sum. The failure it replaces: combining the shards' FP32 norms (what
    torch.nn.utils.clip_grad_norm_ does on DTensor shards) rounds differently
    from the FP32 norm of the full tensor for some gradients (1-2 ulp; the clip
    factor passes that into every weight, see test_fsdp.py)."""
    g = torch.Generator().manual_seed(3)
    shard_fp32_differs = 0
    for trial in range(40):
        full = torch.randn(int(torch.randint(1, 70, (1,), generator=g)), 48, generator=g)
        ref_rows = ddp._row_sumsq(full)
        for world in (2, 3, 8):
            shards = list(torch.chunk(full, world, dim=0))
            shards += [full[:0]] * (world - len(shards))   # ranks past the last row hold empty shards
            rows = torch.cat([ddp._row_sumsq(t) for t in shards])
            assert torch.equal(rows, ref_rows) and torch.equal(rows.sum(), ref_rows.sum())
        shards = torch.chunk(full, 2, dim=0)
        by_shards = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in shards]))
        shard_fp32_differs += int(not torch.equal(by_shards, torch.linalg.vector_norm(full)))
    assert shard_fp32_differs > 0
    assert torch.equal(ddp._row_sumsq(torch.tensor(3.0)), torch.tensor([9.0], dtype=torch.float64))


# ---- process-group teardown (ddp.shutdown) -------------------------------------------

SHUTDOWN_WORKER = Path(__file__).resolve().parent / "shutdown_worker.py"


def _shutdown_workers(mode: str, world: int = 2, check: bool = True) -> list:
    """shutdown_worker.py MODE on `world` ranks (env:// rendezvous, gloo): each rank's
    (exit status, JSON record or None, stderr, seconds to exit); check: every rank exits 0."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PY_DIR), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append((time.monotonic(), subprocess.Popen([sys.executable, str(SHUTDOWN_WORKER), mode], env=env,
                                                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    outs = []
    try:
        for t0, p in procs:
            out, err = p.communicate(timeout=120)
            lines = out.strip().splitlines()
            outs.append((p.returncode, json.loads(lines[-1]) if lines else None, err, time.monotonic() - t0))
            assert not check or p.returncode == 0, f"rank {len(outs) - 1}: rc {p.returncode}\n{out[-2000:]}\n{err[-3000:]}"
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def _gloo_threads(names: dict) -> int:
    """The gloo and TCPStore threads among {thread name: count} (torch 2.11 names them
    pt_gloo_runloop and pt_tcpstore_uv; 2.15 adds gloo_tcp_loop)."""
    return sum(n for name, n in names.items() if name.startswith(("pt_gloo", "gloo", "pt_tcpstore")))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc/self/task")
def test_shutdown_ends_every_gloo_thread():
    """ddp.shutdown destroys every group the trainer makes (the default group, the
    context-parallel subgroups of ddp.new_group, the groups of a ddp.device_mesh) and
    drops their references: afterwards each rank runs only the threads it ran before
    the init, no gloo thread among them, and torch holds no group. Threads left to the
    interpreter's exit are what aborted a torchrun run now and then (ddp.shutdown's
    NOTE). The control, the previous shutdown (a barrier and
    dist.destroy_process_group() alone), leaves the gloo threads running: the check
    sees them."""
    for _, rec, _, _ in _shutdown_workers("shutdown"):
        assert rec["groups_before"] >= 3, rec                 # default, a CP pair, the mesh's own groups
        assert _gloo_threads(rec["before"]) > 0 or sum(rec["before"].values()) > sum(rec["base"].values()), rec
        assert _gloo_threads(rec["after"]) == 0, rec
        assert sum(rec["after"].values()) <= sum(rec["base"].values()), rec
        assert rec["groups_after"] == 0 and not rec["initialized_after"], rec
    for _, rec, _, _ in _shutdown_workers("default_only"):
        assert not rec["initialized_after"], rec
        assert _gloo_threads(rec["after"]) > 0, rec           # still running at exit: what shutdown prevents
        assert sum(rec["after"].values()) > sum(rec["base"].values()), rec


def test_shutdown_is_bounded_when_a_peer_is_late():
    """A peer that never reaches the barrier cannot hold a rank's exit: rank 0's
    shutdown(timeout_s=1) gives up after 1 s (False, a line on stderr) and the process
    exits cleanly; rank 1, 8 s late, finds rank 0 gone and fails at once (the barrier's
    error, raised after its own teardown), not after gloo's 10-minute timeout."""
    (rc0, rec0, err0, _), (rc1, rec1, err1, t1) = _shutdown_workers("peer_late", check=False)
    assert rc0 == 0 and rec0["ok"] is False and 1.0 <= rec0["wait_s"] < 5.0, (rc0, rec0, err0[-2000:])
    assert "did not finish in 1 s" in err0
    assert rc1 != 0 and rec1 is None and "dist.barrier()" in err1, (rc1, err1[-2000:])   # its barrier failed
    assert t1 < 60, t1


def test_shutdown_without_a_group_is_a_no_op():
    assert not dist.is_initialized()
    assert ddp.shutdown() is True and ddp.shutdown(wait=False) is True
    assert ddp.live_groups() == []


# ---- 2-process smoke run ---------------------------------------------------------------





@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, text_dir):
    out = tmp_path_factory.mktemp("ddp")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PY_DIR), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "-m", "fp8attn.train.compare", "--preset", "smoke", "--modes", ",".join(MODES),
           "--steps", str(STEPS), "--diag-every", "3", "--val-every", "3", "--val-batches", "2",
           "--data-dir", str(out / "data"), "--text-dir", str(text_dir), "--device", "cpu",
           "--no-progress", "--out", str(out / "run")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return out, proc


def test_ddp_run_exits_cleanly(ddp_run):
    out, proc = ddp_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Rank 0 alone prints the comparison (one report line, one line per mode).
    assert proc.stdout.count("report: ") == 1, proc.stdout
    assert (out / "run" / "report.md").is_file()
    assert sorted(p.name for p in (out / "run").glob("*.jsonl")) == sorted(f"{m}.jsonl" for m in MODES)


@pytest.mark.parametrize("mode", MODES)
def test_ddp_log_and_same_final_parameters(ddp_run, mode):
    out, proc = ddp_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(out / "run" / f"{mode}.jsonl")
    losses = [r["loss"] for r in log["steps"]]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    s = log["summary"]
    assert not s["diverged"] and math.isfinite(s["final_val_loss"])
    assert s["world_size"] == 2
    fps = s["final_fingerprints"]
    assert len(fps) == 2 and fps[0] == fps[1]                  # both ranks hold the same weights
    assert fps[0] != s["init_fingerprint"]                     # ... that training did change
    assert log["meta"]["train"]["batch_size"] * log["meta"]["train"]["seq_len"] * 2 * STEPS \
        == pytest.approx(s["tokens_per_s"] * s["train_time_s"], rel=1e-6)


def test_ddp_step0_loss_is_mean_over_rank_batches(ddp_run):
    """Step 0 runs on the identical initial weights: the logged loss is the mean of
    the losses on shared batches #0 (rank 0) and #1 (rank 1)."""
    out, proc = ddp_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = read_log(out / "run" / "bf16.jsonl")
    per_batch = first_batch_losses(out, log)
    got = log["steps"][0]["loss"]
    assert got == pytest.approx(np.mean(per_batch), rel=1e-5, abs=1e-5), (got, per_batch)
    # Guard: the two batches give distinguishable losses, so rank 1 training on batch #0 would show.
    assert abs(per_batch[0] - per_batch[1]) > 1e-3
    assert json.loads((out / "run" / "summary.json").read_text())["modes"] == list(MODES)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_single_rank_process_group_on_request(tmp_path, text_dir, fsdp):
    # FP8ATTN_DIST=1 under torchrun with one process: a 1-rank group is created and
    # the model is wrapped (DDP / FSDP2), so the distributed path (NCCL on a single
    # GPU; gloo here) runs. Without the variable no group exists (world_size absent).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PY_DIR), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", FP8ATTN_DIST="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "-m", "fp8attn.train.compare", "--preset", "smoke", "--modes", "fp8-delta_matching",
           "--steps", "3", "--diag-every", "0", "--val-every", "3", "--val-batches", "1",
           "--data-dir", str(tmp_path / "data"), "--text-dir", str(text_dir), "--device", "cpu",
           "--no-progress", "--out", str(tmp_path / "run")] + (["--fsdp"] if fsdp else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summ = read_log(tmp_path / "run" / "fp8-delta_matching.jsonl")["summary"]
    assert summ["world_size"] == 1 and len(summ["final_fingerprints"]) == 1, summ
    assert summ["fsdp"] is fsdp
    assert math.isfinite(summ["final_train_loss"])


# ---- split run under DDP (compare --stop-after-steps / --resume) -------------------------


def test_ddp_split_run_equals_uninterrupted(ddp_run, text_dir):
    """2 ranks, stopped after 4 steps (rank 0 writes the states), then resumed: the same
    per-step losses, val losses and final fingerprints (both ranks) as the uninterrupted
    ddp_run (--resume with --fsdp is refused: test_resume.py)."""
    out, proc = ddp_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PY_DIR), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    split = out / "split"

    def launch(*extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               "-m", "fp8attn.train.compare", "--preset", "smoke", "--modes", ",".join(MODES),
               "--steps", str(STEPS), "--diag-every", "3", "--val-every", "3", "--val-batches", "2",
               "--data-dir", str(out / "data"), "--text-dir", str(text_dir), "--device", "cpu",
               "--no-progress", "--out", str(split), *extra]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    p1 = launch("--stop-after-steps", "4")
    assert p1.returncode == 0, p1.stdout[-3000:] + p1.stderr[-3000:]
    assert sorted(p.name for p in split.glob("*.state.pt")) == sorted(f"{m}.state.pt" for m in MODES)
    assert json.loads((split / "summary.json").read_text())["complete"] is False
    p2 = launch("--resume")
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
    timing = {"step_time_s", "tokens_per_s", "train_time_s"}
    strip = lambda r: {k: v for k, v in r.items() if k not in timing}
    for mode in MODES:
        a, b = read_log(out / "run" / f"{mode}.jsonl"), read_log(split / f"{mode}.jsonl")
        assert [strip(r) for r in a["steps"]] == [strip(r) for r in b["steps"]], mode
        assert a["vals"] == b["vals"], mode
        assert b["summary"]["final_fingerprints"] == a["summary"]["final_fingerprints"], mode
    assert not list(split.glob("*.state.pt"))


# ---- 2 GPUs: NCCL, DDP and FSDP2 with the CUDA kernels ---------------------------------

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2 \
    and getattr(fp8attn._lib, "HAS_CUDA_KERNELS", False)


GPU_STEPS = 4  # NOTE: two torchruns; step 1 already shows a broken sync (dist_helpers.TOL_GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs and the CUDA kernels")
def test_two_gpus_ddp_and_fsdp_train_the_same(tmp_path, text_dir):
    """torchrun on 2 GPUs (NCCL): DDP and FSDP2 each train bf16 and FP8
    Delta-Matching (head_dim 64: a CUDA kernel head_dim, smoke preset). Per step
    they must train the same: the step-0 grad_norm (the averaged gradient) and
    the losses of steps 1..N (after updates) agree within TOL_GPU, which a 1-rank
    run of this command (one rank's gradient only, as a broken sync gives) misses
    by 10x (loss) and 400x (grad_norm) on the CPU (dist_helpers.py; the CPU twin
    is test_fsdp.py::test_fsdp_trains_like_ddp). Also: the DDP ranks end with the
    same weights, changed by training (FSDP's fingerprints are of gathered
    parameters, equal by construction)."""
    logs = {}
    for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
        out = tmp_path / name
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PY_DIR), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               "-m", "fp8attn.train.compare", "--preset", "smoke", "--model", "head_dim=64",
               "--modes", ",".join(MODES), "--steps", str(GPU_STEPS), "--val-every", str(GPU_STEPS),
               "--val-batches", "1", "--data-dir", str(tmp_path / "data"), "--text-dir", str(text_dir),
               "--device", "cuda", "--no-progress", "--no-save", "--out", str(out)] + extra
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        logs[name] = {m: read_log(out / f"{m}.jsonl") for m in MODES}
    for name, per_mode in logs.items():
        for mode, log in per_mode.items():
            s = log["summary"]
            losses = [r["loss"] for r in log["steps"]]
            assert len(losses) == GPU_STEPS and all(math.isfinite(v) for v in losses), (name, mode)
            assert s["world_size"] == 2 and not s["diverged"] and s["fsdp"] is (name == "fsdp"), (name, mode)
            fps = s["final_fingerprints"]
            assert len(fps) == 2 and fps[0] == fps[1], (name, mode)   # both ranks hold the same weights
            assert fps[0] != s["init_fingerprint"], (name, mode)      # ... that training changed
    for mode in MODES:
        assert_trains_alike(logs["fsdp"][mode], logs["ddp"][mode], TOL_GPU, f"{mode}: FSDP vs DDP")


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_forced_one_rank_group_initializes_for_every_device_choice(device):
    """FP8ATTN_DIST=1 under a 1-process torchrun environment: init_from_env makes a
    1-rank group for --device auto as for cpu. Guards the fault of 2026-12-07: an
    `import torch.distributed.nn.functional` inside init_from_env made `torch` a local
    name, so the torch.cuda calls before it raised UnboundLocalError on every path that
    reached them (--device auto here; --device cuda on the GPU) while --device cpu,
    which short-circuits past them, passed."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "torch.cuda.is_available = lambda: False\n"   # the gloo path of 'auto' on any machine
        "from fp8attn.train import ddp\n"
        f"ctx = ddp.init_from_env({device!r})\n"
        "assert ctx.enabled and ctx.world_size == 1 and dist.get_backend() == 'gloo', ctx\n"
        "ddp.shutdown()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, FP8ATTN_DIST="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               PYTHONPATH=os.pathsep.join([str(PY_DIR), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
