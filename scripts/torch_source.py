"""Where `scripts/setup` installs torch from, printed as pip arguments, one per line.

A plain `pip install torch` from PyPI is the CUDA build, several GB of CUDA libraries a machine
without an NVIDIA GPU never uses. So:

- `BATCHER_TORCH_INDEX_URL` set: that index (`pypi` for PyPI's default build);
- pip configured with its own index or wheel folder (a mirror, an air-gapped box): that
  configuration, untouched, since the user chose where packages come from;
- an NVIDIA GPU visible: PyPI's default (CUDA) build;
- else PyTorch's CPU wheel index.

Standard library only: it runs before torch exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH = "torch==2.13.0"
_PIP_SOURCE_KEYS = ("index-url", "extra-index-url", "find-links")


def has_cuda_device() -> bool:
    """An NVIDIA GPU the driver lists (no torch needed to ask)."""
    if os.path.isdir("/proc/driver/nvidia/gpus") and os.listdir("/proc/driver/nvidia/gpus"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def pip_config_lines(python: str) -> list[str]:
    try:
        out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                             text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.splitlines()


def pip_has_own_source(env: Mapping[str, str], config_lines: Sequence[str]) -> bool:
    if any(env.get(f"PIP_{k.upper().replace('-', '_')}") for k in _PIP_SOURCE_KEYS):
        return True
    return any(line.split("=", 1)[0].rsplit(".", 1)[-1] in _PIP_SOURCE_KEYS
               for line in config_lines if "=" in line)


def choose(env: Mapping[str, str], cuda: bool, config_lines: Sequence[str]) -> list[str]:
    """The pip install arguments for torch."""
    override = env.get("BATCHER_TORCH_INDEX_URL")
    if override is not None and override.strip():
        url = override.strip()
        return [TORCH] if url == "pypi" else [TORCH, "--index-url", url]
    if pip_has_own_source(env, config_lines) or cuda:
        return [TORCH]
    return [TORCH, "--index-url", CPU_INDEX]


def main() -> int:
    python = sys.argv[1] if len(sys.argv) > 1 else sys.executable
    print("\n".join(choose(os.environ, has_cuda_device(), pip_config_lines(python))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
