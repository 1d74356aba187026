"""The build's libstdc++ linkage probe, remedy and check (tools/build_support.py).

An extension that carries its own copy of libstdc++ (a compiler that links it
statically, as the H200's /opt/gcc/bin/g++ wrapper does) cannot throw through
torch: on the H200 every argument error segfaulted; on this CPU machine the
numbers vanish from the error messages. A g++ wrapper adding -static-libstdc++
simulates that compiler here; the probe links a tiny library (about a second),
no extension build. The GPU test checks a natively built library in a child
process (a segfault fails the test instead of killing pytest).
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import fp8attn  # noqa: F401  (registers torch.ops.fp8attn)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import build_support as bs  # noqa: E402

# The distribution's compiler (links libstdc++ dynamically; on the H200 the g++ first on
# PATH is the /opt/gcc wrapper that does not), else the g++ on PATH.
GXX = "/usr/bin/g++" if os.access("/usr/bin/g++", os.X_OK) else shutil.which("g++")
GCC = "/usr/bin/gcc" if os.access("/usr/bin/gcc", os.X_OK) else (shutil.which("gcc") or GXX)
needs_gxx = pytest.mark.skipif(GXX is None, reason="needs g++")


def _compiler(monkeypatch, cxx, cc):
    """A distutils compiler set up as build_ext sets it up, with CXX / CC from the environment."""
    import setuptools  # noqa: F401  (provides distutils on Python >= 3.12)
    from distutils.ccompiler import new_compiler
    from distutils.sysconfig import customize_compiler

    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv("CC", cc)
    monkeypatch.delenv("LDSHARED", raising=False)
    c = new_compiler()
    customize_compiler(c)
    return c


@pytest.fixture()
def static_wrapper(tmp_path):
    """g++ / gcc wrappers that link libstdc++ statically (the H200's compiler, simulated)."""
    paths = []
    for name, real in (("g++", GXX), ("gcc", GCC)):
        p = tmp_path / "simcc" / name
        p.parent.mkdir(exist_ok=True)
        p.write_text(f"#!/bin/sh\nexec {real} -static-libstdc++ \"$@\"\n")
        p.chmod(0o755)
        paths.append(str(p))
    return paths


def _probe_so(compiler, tmp_path, extra=()):
    bs.probe_needed(compiler, extra, workdir=str(tmp_path))
    return str(tmp_path / "fp8attn_link_probe.so")


def test_elf_needed_matches_readelf():
    path = fp8attn._lib.LIBRARY_PATH
    needed = bs.elf_needed(path)
    assert "libc10.so" in needed
    if shutil.which("readelf"):
        out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
        want = [line.split("[")[1].split("]")[0] for line in out.splitlines() if "(NEEDED)" in line]
        assert needed == want
    with pytest.raises(ValueError, match="not an ELF"):
        bs.elf_needed(os.path.join(ROOT, "setup.py"))


def test_built_library_links_libstdcxx_dynamically():
    """The library the suite runs against passes the post-build check."""
    assert "libstdc++.so.6" in bs.check_linkage(fp8attn._lib.LIBRARY_PATH)


@needs_gxx
def test_probe_keeps_a_compiler_that_links_libstdcxx_dynamically(monkeypatch, tmp_path):
    c = _compiler(monkeypatch, GXX, GCC)
    assert "libstdc++.so.6" in bs.probe_needed(c, workdir=str(tmp_path))
    assert bs.libstdcxx_link_args(c, log=lambda m: None) == []


@needs_gxx
def test_probe_detects_and_fixes_static_libstdcxx(monkeypatch, tmp_path, static_wrapper):
    c = _compiler(monkeypatch, *static_wrapper)
    so = _probe_so(c, tmp_path)
    assert "libstdc++.so.6" not in bs.elf_needed(so)          # the fault: its own C++ runtime
    with pytest.raises(bs.LinkageError, match="does not link libstdc"):
        bs.check_linkage(so)                                    # the post-build check rejects it
    msgs = []
    extra = bs.libstdcxx_link_args(c, log=msgs.append)
    lib = bs.process_libstdcxx()
    assert lib and extra == [lib]                               # torch's own libstdc++, found in this process
    assert "statically" in msgs[0] and lib in msgs[0]
    (tmp_path / "fixed").mkdir()
    fixed = _probe_so(c, tmp_path / "fixed", extra)
    assert "libstdc++.so.6" in bs.check_linkage(fixed)


@needs_gxx
def test_probe_stops_when_it_cannot_fix(monkeypatch, static_wrapper):
    """No usable libstdc++.so.6 to add: the build stops, naming the compiler and what to set."""
    c = _compiler(monkeypatch, *static_wrapper)
    libm = [p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/usr/lib64/libm.so.6") if os.path.exists(p)]
    if not libm:
        pytest.skip("no libm.so.6 at a known path")
    with pytest.raises(bs.LinkageError) as e:
        bs.libstdcxx_link_args(c, libstdcxx=libm[0], log=lambda m: None)
    msg = str(e.value)
    assert static_wrapper[0] in msg and "DT_NEEDED" in msg and "CXX=" in msg


def test_error_messages_keep_their_numbers():
    """The CPU symptom of a second C++ runtime: streamed numbers vanish from
    c10 error messages ("got " instead of "got 3-D ..."). Fails on a library
    linked with -static-libstdc++."""
    q = torch.randn(2, 4, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"got 3-D with shape \[4, 16, 64\]"):
        torch.ops.fp8attn.fwd(q[0], q, q, 0.125, False, "fp8", 128)
    with pytest.raises(ValueError, match="got 7"):
        torch.ops.fp8attn.fwd(q, q, q, 0.125, False, "fp8", 7)


def test_isolated_build_markers():
    assert bs.isolated_build_torch("/tmp/pip-build-env-abc123/overlay/lib/python3.12/site-packages/torch/__init__.py")
    assert bs.isolated_build_torch("/tmp/build-env-x7/lib/python3.12/site-packages/torch/__init__.py")
    assert not bs.isolated_build_torch(torch.__file__)


@pytest.mark.parametrize("fake", ["isolated", "missing"])
def test_setup_refuses_an_isolated_build(tmp_path, fake):
    """setup.py stops at once (before any compile) when torch comes from an isolated
    build environment or is missing there, telling the user --no-build-isolation."""
    site = tmp_path / "pip-build-env-test" / "site"
    (site / "torch").mkdir(parents=True)
    body = "__version__ = '9.9.9'\n" if fake == "isolated" else "raise ImportError('no torch here')\n"
    (site / "torch" / "__init__.py").write_text(body)
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "--version"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "pip install --no-build-isolation ." in r.stderr
    if fake == "isolated":
        assert "9.9.9" in r.stderr and "isolated build environment" in r.stderr


_CHILD = textwrap.dedent("""
    import torch, fp8attn
    from build_support import check_linkage
    print("DT_NEEDED", check_linkage(fp8attn._lib.LIBRARY_PATH))
    ops = torch.ops.fp8attn
    q = torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
    for name, call, want in (
        ("rank", lambda: ops.fwd(q[0], q, q, 0.125, False, "fp8", 128), "got 3-D"),
        ("head_dim", lambda: ops.fwd(q, q[..., :32], q[..., :32], 0.125, False, "fp8", 128), "got 32"),
        ("softmax_scale", lambda: ops.fwd(q, q, q, float("nan"), False, "fp8", 128), "softmax_scale"),
    ):
        try:
            call()
            print(name, "NO ERROR")
        except (ValueError, NotImplementedError) as e:
            print(name, type(e).__name__, "ok" if want in str(e) else "WRONG MESSAGE", str(e)[:160])
""")


@pytest.mark.gpu
def test_cuda_bad_argument_raises_in_a_child_process():
    """A natively built (or carried) CUDA library raises on bad arguments
    instead of crashing the process (issue 16, item 1)."""
    if not torch.cuda.is_available() or not fp8attn._lib.HAS_CUDA_KERNELS:
        pytest.skip("needs a CUDA GPU and fp8attn built with CUDA kernels")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(fp8attn.__file__)), os.path.join(ROOT, "tools")]))
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"child died with rc {r.returncode} (a segfault is -11):\n{out[-3000:]}"
    assert "libstdc++.so.6" in r.stdout, out
    lines = [line for line in r.stdout.splitlines() if line.split()[0] in ("rank", "head_dim", "softmax_scale")]
    assert len(lines) == 3, out
    for line in lines:
        assert line.split()[1] == "ValueError" and line.split()[2] == "ok", out
