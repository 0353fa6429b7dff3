"""Builds the C kernels of csrc/ into shared libraries, cached on disk, and loads them.

`library(name, source, defines)` compiles csrc/`source` with the system C compiler ($CC, else `cc`; -O3
-march=native, -fopenmp where torch's parallel backend is OpenMP, whose runtime the kernels then
share) and returns it loaded (ctypes.CDLL); kernels/native.py binds its functions. A build is kept in
the kernel cache dir (`cache_dir()`) under a name keyed by everything the binary depends on: the
sources of csrc/ (all of them: they include each other), the defines, the flags and instruction sets
(SWIFTKV_CPU_MAX_ISA), the compiler (its path, size and time) and this CPU's model and flags (for
-march=native). So a later process loads what an earlier one built instead of compiling again, and a
changed source, compiler or CPU gets a build of its own. A build is written to a temporary file in
the cache dir and renamed into place: processes that build at once each load a complete file.

Within a process each (source, defines, ISA) is resolved once. Without a compiler, or when no build
loads, `library` returns None (one warning per build) and the caller keeps its portable path. A
compiler without OpenMP gets a one-thread build. Where the cache dir cannot be written, the build goes
to a temporary directory for this process only.

`SWIFTKV_CPU_MAX_ISA=avx2` (or `avx512`) builds every kernel for a lesser CPU than this one (no
AVX-512 and no AMX, or no AMX), so that one machine can measure what another kind gets.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
from functools import cache
from pathlib import Path

import torch

from swiftkv_fast import envs
from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",  # vectorized dot products and sums (fp32 reassociation, as in a GEMM)
    "-fno-signed-zeros",
    "-fPIC",
    "-shared",
]

ISA_SWITCH = "SWIFTKV_CPU_MAX_ISA"
# what each setting of ISA_SWITCH turns off, after -march=native
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
ISA_FLAGS = {"native": [], "avx512": _NO_AMX, "avx2": ["-mno-avx512f", *_NO_AMX]}

_lock = threading.Lock()
_built: dict[tuple, ctypes.CDLL | None] = {}  # this process's builds; None: it did not build here
_NOT_BUILT = object()


def max_isa() -> str:
    """The instruction sets the kernels are built for (ISA_SWITCH; default "native")."""
    return envs.SWIFTKV_CPU_MAX_ISA


def kv_bf16(dtype: torch.dtype) -> int | None:
    """The KV_BF16 define for a cache of `dtype` (csrc/common.h): 0 for fp32, 1 for bf16, None for a
    dtype the C kernels do not read."""
    return {torch.float32: 0, torch.bfloat16: 1}.get(dtype)


def compiler_setting() -> str:
    """The compiler as set ($CC, else `cc`), before it is looked up."""
    return envs.CC


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else `cc`; None when not on PATH."""
    return shutil.which(compiler_setting())


def cache_dir() -> Path:
    """Where builds are kept: $SWIFTKV_CACHE/kernels, else $XDG_CACHE_HOME/swiftkv/kernels, else
    ~/.cache/swiftkv/kernels."""
    root = envs.SWIFTKV_CACHE
    if root:
        return Path(root).expanduser() / "kernels"
    xdg = envs.XDG_CACHE_HOME
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "swiftkv" / "kernels"


@cache
def source_digest() -> str:
    """A hash of every file of csrc/ (names and contents)."""
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".c", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@cache
def cpu_identity() -> str:
    """This CPU's model and instruction-set flags, which -march=native compiles for."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in fields:
                    fields[key] = value.strip()
    except OSError:
        pass
    return json.dumps([platform.machine(), platform.processor(), fields], sort_keys=True)


def _compiler_identity(cc: str) -> list:
    try:
        st = os.stat(cc)
        return [os.path.realpath(cc), st.st_size, st.st_mtime_ns]
    except OSError:
        return [cc]


def _openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def library(name: str, source: str, defines: dict[str, int] | None = None) -> ctypes.CDLL | None:
    """csrc/`source` built with `defines` (cached on disk), loaded; None when it cannot be built or
    loaded here (logged once per build and process, under `name`)."""
    path = CSRC / source
    return _resolve(name, source_digest(), defines or {}, lambda tmp: path)


def library_from_text(name: str, text: str, defines: dict[str, int] | None = None) -> ctypes.CDLL | None:
    """A C source given as text (bench/'s probes), built and cached as `library` builds csrc/'s."""
    digest = hashlib.sha256(text.encode()).hexdigest()

    def write(tmp: Path) -> Path:
        src = tmp / f"{name}.c"
        src.write_text(text)
        return src

    return _resolve(name, digest, defines or {}, write)


def _resolve(name, digest, defines, source_in):
    key = (name, digest, max_isa(), compiler_setting(), *sorted(defines.items()))
    lib = _built.get(key, _NOT_BUILT)  # a lock-free look first: every step's ops ask
    if lib is not _NOT_BUILT:
        return lib
    with _lock:
        if key not in _built:
            _built[key] = _build(name, digest, defines, source_in)
        return _built[key]


def _build(name: str, digest: str, defines: dict[str, int], source_in) -> ctypes.CDLL | None:
    what = f"{name} ({', '.join(f'{k}={v}' for k, v in defines.items())})" if defines else name
    cc = compiler()
    if cc is None:
        logger.warning("%s: no C compiler (cc / $CC) found; using the portable torch path", what)
        return None
    flags = [*FLAGS, *ISA_FLAGS[max_isa()], *(f"-D{k}={v}" for k, v in defines.items())]
    variants = [True, False] if _openmp() else [False]
    cache = _writable_cache_dir()

    def cached_path(openmp: bool) -> Path | None:
        if cache is None:
            return None
        key = [name, digest, flags, openmp, _compiler_identity(cc), cpu_identity()]
        h = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20]
        return cache / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{h}.so"

    for openmp in variants:  # an earlier process's build
        path = cached_path(openmp)
        if path is not None and path.exists():
            try:
                lib = ctypes.CDLL(str(path))
                logger.debug("%s: C kernel loaded from %s", what, path)
                return lib
            except OSError:
                pass  # a damaged file: built again below
    errors = []
    for openmp in variants:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"swiftkv-{name}-") as tmp:
            src = source_in(Path(tmp))
            final = cached_path(openmp)
            out = Path(tmp) / f"{name}.so"
            if final is not None:
                fd, out_name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.stem}-", suffix=".so")
                os.close(fd)
                out = Path(out_name)
            cmd = [cc, *flags, *(["-fopenmp"] if openmp else []), str(src), "-o", str(out)]
            try:
                subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
                if final is not None:
                    os.replace(out, final)  # atomic: a reader sees no file or a whole one
                    out = final
                lib = ctypes.CDLL(str(out))  # mapped: a temporary file may go now
            except (OSError, subprocess.SubprocessError) as e:
                errors.append((getattr(e, "stderr", None) or str(e)).strip())
                if final is not None and out != final:
                    out.unlink(missing_ok=True)
                continue
        logger.info(
            "%s: C kernel built in %.2f s (%s, %s)",
            what,
            time.perf_counter() - start,
            os.path.basename(cc),
            "OpenMP" if openmp else "one thread",
        )
        return lib
    logger.warning(
        "%s: the C kernel did not build (%s); using the portable torch path", what, " / ".join(errors)
    )
    return None


def _writable_cache_dir() -> Path | None:
    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None
