"""The small C kernels of `cpu_kernels.c`, built once per machine and loaded with ctypes.

Built with the system's C compiler into the cache folder, for this CPU (`-march=native`), keyed by
the source, the compiler, the flags and the CPU's feature flags, so a cache folder shared by unlike
machines keeps one library per kind of CPU. Where there is no compiler, a library built ahead for
any CPU of the architecture (`build_portable`, as the container image does) is used. Each user of
a function checks it against torch before use and falls back to torch's ops where it cannot load
or does not agree (`int4_unpack.py`, `fused_decode.py`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from batcher.system.cpuinfo import cpuinfo_field

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# Reassociation lets the compiler vectorize the dot products and sums; no kernel here handles
# infinities or NaNs on purpose. (Not -ffast-math: a library built with it may switch the whole
# process's floating point to flush denormals.)
_MATH = ["-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-ffinite-math-only"]
# The second where the compiler lacks -march=native.
_FLAGS = (["-O3", "-march=native", *_MATH], ["-O3", *_MATH])
NO_COMPILER = "no C compiler (cc or $CC)"


def library(build_dir: Path) -> ctypes.CDLL:
    """The library for this machine, built into `build_dir` if not there yet. Raises OSError,
    subprocess.SubprocessError or RuntimeError where it can be neither built nor found."""
    return ctypes.CDLL(str(_build(build_dir)))


def _build(build_dir: Path) -> Path:
    source = SOURCE.read_bytes()
    cc = _compiler()
    failure = NO_COMPILER
    if cc:
        key = hashlib.sha256(source + cc.encode() + repr(_FLAGS).encode()
                             + _cpu_signature().encode()).hexdigest()[:16]
        try:
            return _compile(cc, build_dir / f"cpu_kernels-{key}.so", _FLAGS)
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:  # e.g. no C headers
            failure = str(exc)
    portable = _portable_path(build_dir, source)
    if portable.is_file():
        return portable
    raise RuntimeError(f"{failure}, and no library built ahead")


def build_portable(build_dir: Path) -> Path:
    """Build the library for any CPU of this architecture (no -march=native), for machines that
    will have no compiler: a container image builds it in its build stage."""
    cc = _compiler()
    if not cc:
        raise RuntimeError(NO_COMPILER)
    return _compile(cc, _portable_path(build_dir, SOURCE.read_bytes()), (_FLAGS[1],))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _portable_path(build_dir: Path, source: bytes) -> Path:
    key = hashlib.sha256(source + repr(_FLAGS[1]).encode()
                         + platform.machine().encode()).hexdigest()[:16]
    return build_dir / f"cpu_kernels-portable-{key}.so"


def _compile(cc: str, lib: Path, flag_sets: tuple[list[str], ...]) -> Path:
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    error = ""
    for flags in flag_sets:
        fd, tmp = tempfile.mkstemp(dir=lib.parent, prefix=".cpu_kernels-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, lib)  # atomic: a concurrent build's copy is as good
                return lib
        finally:
            if os.path.exists(tmp):  # a failed build, or a compiler that could not run
                os.unlink(tmp)
        error = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    raise RuntimeError(f"{cc} failed: {error}")


def _cpu_signature() -> str:
    """What a -march=native build depends on."""
    return f"{platform.machine()}|{cpuinfo_field('flags', 'Features') or ''}"
