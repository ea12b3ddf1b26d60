"""What machine a benchmark ran on and when, for the header of its results, and what one process of it used."""

from __future__ import annotations

import os
import platform
import resource
import sys
import time

import torch


def machine() -> str:
    """``Linux x86_64, 2 CPU cores (AMD EPYC ...), 24 GiB RAM``."""
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores ({model}), {ram:.0f} GiB RAM"


def cpu_seconds(children: bool = False) -> float:
    """User + system CPU seconds of this process (``children``: plus its waited-for children, e.g.
    DataLoader workers that have exited)."""
    used = [resource.getrusage(resource.RUSAGE_SELF)]
    if children:
        used.append(resource.getrusage(resource.RUSAGE_CHILDREN))
    return sum(r.ru_utime + r.ru_stime for r in used)


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run_meta(script: str, start: float, load_before: tuple[float, ...]) -> dict[str, object]:
    """The header every benchmark records: date, machine, versions, the command as run, its
    seconds since ``start`` (``time.time()``) and the load average before and now."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([f"python bench/{script}", *sys.argv[1:]]),
        "seconds": time.time() - start,
        "load_before": " ".join(f"{x:.1f}" for x in load_before),
        "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
