"""One field of /proc/cpuinfo: the CPU's name and flags, where the system has that file."""

from __future__ import annotations

CPUINFO = "/proc/cpuinfo"


def cpuinfo_field(*names: str, path: str = CPUINFO) -> str | None:
    """The value of the first line whose key is one of `names` (e.g. "flags", "model name"), or
    None where there is none or the file cannot be read (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in names:
                    return value.strip()
    except OSError:
        pass
    return None
