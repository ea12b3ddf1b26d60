"""What machine a benchmark ran on, for the header of its results."""

from __future__ import annotations

import os
import platform


def machine() -> str:
    """``Linux x86_64, 2 CPU cores (AMD EPYC ...), 24 GiB RAM``."""
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({model}), {ram:.0f} GiB RAM"
