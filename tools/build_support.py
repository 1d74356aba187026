"""Build-time checks for the fp8attn extension (used by setup.py; tested by
tests/python/test_build.py).

Why: the extension throws C++ exceptions (c10::ValueError ...) that torch's
dispatcher catches and turns into Python errors. That only works when the
extension shares torch's C++ runtime, i.e. links ``libstdc++.so.6``
dynamically. A compiler that links libstdc++ statically (the H200's
``/opt/gcc/bin/g++`` wrapper does, and so does any ``-static-libstdc++``)
gives the extension a second copy of the runtime: on the H200 every argument
error then segfaulted; on a CPU machine the numbers vanish from the error
messages (the copy's streams lack the process's locale facets).

So the build (1) links a tiny C++ shared object with the same compiler object
and link arguments setuptools will link the extension with and reads its ELF
``DT_NEEDED`` entries, (2) if ``libstdc++.so.6`` is missing, adds the
libstdc++ that torch itself runs with (the one mapped into this process) to
the link line and probes again, (3) stops with an error naming the compiler
and what to set when that does not help, and (4) checks the built library's
``DT_NEEDED`` afterwards.
"""
import os
import shutil
import struct
import subprocess
import tempfile

LIBSTDCXX = "libstdc++.so.6"

# Source of the probe: uses what the extension uses from the C++ runtime
# (std::string, streams, exceptions).
_PROBE_SOURCE = r"""
#include <sstream>
#include <stdexcept>
#include <string>
extern "C" int fp8attn_link_probe(int n) {
  try {
    std::ostringstream os;
    os << "probe " << n;
    throw std::invalid_argument(os.str());
  } catch (const std::exception& e) {
    return static_cast<int>(std::string(e.what()).size());
  }
}
"""


class LinkageError(RuntimeError):
    """The extension would not (or does not) link libstdc++.so.6 dynamically."""


def elf_needed(path):
    """DT_NEEDED entries (sonames) of an ELF64 little-endian shared object, in order.

    Reads the section headers, the SHT_DYNAMIC section and the string table it
    links to. Raises ValueError for a file that is not such an ELF object or has
    no dynamic section (a static library has nothing to share).
    """
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path}: not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: only ELF64 little-endian objects are read (class {data[4]}, data {data[5]})")
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(e_shnum):
        # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, sh_addralign, sh_entsize
        sections.append(struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize))
    SHT_DYNAMIC, DT_NULL, DT_NEEDED = 6, 0, 1
    for sec in sections:
        if sec[1] != SHT_DYNAMIC:
            continue
        off, size, link = sec[4], sec[5], sec[6]
        strtab = sections[link][4]
        needed = []
        for pos in range(off, off + size, 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == DT_NULL:
                break
            if tag == DT_NEEDED:
                end = data.index(b"\0", strtab + val)
                needed.append(data[strtab + val:end].decode())
        return needed
    raise ValueError(f"{path}: no dynamic section")


def process_libstdcxx():
    """Path of the libstdc++.so.6 mapped into this process (torch's, once torch is
    imported), else the one torch's libc10.so resolves to (ldd), else None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if os.path.basename(p).startswith(LIBSTDCXX):
                    return os.path.realpath(p)
    except OSError:
        pass
    try:
        import torch

        c10 = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
        out = subprocess.run(["ldd", c10], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if parts and parts[0] == LIBSTDCXX and len(parts) >= 3 and os.path.isfile(parts[2]):
                return os.path.realpath(parts[2])
    except (ImportError, OSError):
        pass
    return None


def _linker_name(compiler):
    # distutils links a C++ target with compiler_cxx's driver and linker_so's (or linker_so_cxx's) flags.
    cxx = getattr(compiler, "compiler_cxx", None) or getattr(compiler, "linker_so_cxx", None) or compiler.linker_so
    return cxx[0] if isinstance(cxx, (list, tuple)) else str(cxx).split()[0]  # the driver, without flags


def probe_needed(compiler, extra_link_args=(), libraries=(), library_dirs=(), workdir=None):
    """Links the probe with ``compiler`` (a distutils/setuptools CCompiler, as
    build_ext has it) the way setuptools links a C++ extension and returns the
    probe's DT_NEEDED entries."""
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="fp8attn-probe-")
    try:
        src = os.path.join(workdir, "fp8attn_link_probe.cpp")
        with open(src, "w") as f:
            f.write(_PROBE_SOURCE)
        objs = compiler.compile([src], extra_postargs=["-fPIC", "-O0"])  # object next to src
        out = os.path.join(workdir, "fp8attn_link_probe.so")
        compiler.link_shared_object(objs, out, libraries=list(libraries), library_dirs=list(library_dirs),
                                    extra_postargs=list(extra_link_args), target_lang="c++")
        return elf_needed(out)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def _other_compilers(current):
    """g++ / c++ on PATH other than the one in use (for the error message)."""
    seen, found = set(), []
    cur = shutil.which(current) or current
    for d in os.environ.get("PATH", "").split(os.pathsep):
        for name in ("g++", "c++"):
            p = os.path.join(d, name)
            if os.path.isfile(p) and os.access(p, os.X_OK):
                real = os.path.realpath(p)
                if real not in seen and real != os.path.realpath(cur):
                    seen.add(real)
                    found.append(p)
    return found


def libstdcxx_link_args(compiler, extra_link_args=(), libraries=(), library_dirs=(), libstdcxx=None, log=print,
                        workdir=None):
    """The link arguments to add so the extension links libstdc++.so.6 dynamically:
    [] when the compiler already does, else [path of torch's libstdc++.so.6]
    (verified by a second probe). Raises LinkageError, naming the compiler, the
    DT_NEEDED found and what to set, when neither links it dynamically.
    ``libstdcxx`` overrides the library tried (default: process_libstdcxx()); ``workdir``
    keeps the probe's files (default: a temporary folder)."""
    needed = probe_needed(compiler, extra_link_args, libraries, library_dirs, workdir)
    linker = _linker_name(compiler)
    if LIBSTDCXX in needed:
        log(f"fp8attn build: {linker} links {LIBSTDCXX} dynamically")
        return []
    lib = libstdcxx if libstdcxx is not None else process_libstdcxx()
    tried = ""
    if lib:
        fixed = probe_needed(compiler, list(extra_link_args) + [lib], libraries, library_dirs, workdir)
        if LIBSTDCXX in fixed:
            log(f"fp8attn build: {linker} links libstdc++ statically (DT_NEEDED {needed}); "
                f"linking torch's {lib} explicitly")
            return [lib]
        tried = f"; with {lib} added to the link line: {fixed}"
    others = ", ".join(_other_compilers(linker)) or "none found on PATH"
    raise LinkageError(
        f"fp8attn: the C++ linker {linker!r} links libstdc++ statically (a test library's DT_NEEDED: "
        f"{needed}{tried}); an extension with its own C++ runtime crashes when it throws through torch. "
        f"Build with a compiler that links {LIBSTDCXX} dynamically, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc "
        f"(other compilers on PATH: {others}).")


def check_linkage(path):
    """Raises LinkageError unless the built library ``path`` needs libstdc++.so.6."""
    needed = elf_needed(path)
    if LIBSTDCXX not in needed:
        raise LinkageError(
            f"fp8attn: {path} does not link {LIBSTDCXX} dynamically (DT_NEEDED {needed}): it carries its own "
            "C++ runtime and would crash on its first error. Rebuild with CXX=/usr/bin/g++ CC=/usr/bin/gcc.")
    return needed


ISOLATED_MARKERS = ("pip-build-env-", "/build-env-", "/builds-v0/")


def isolated_build_torch(torch_file):
    """True when ``torch_file`` (torch.__file__) lies in an isolated PEP 517 build
    environment (pip's pip-build-env-*, pypa/build's build-env-*, uv's builds-v0)."""
    return any(m in torch_file for m in ISOLATED_MARKERS)
