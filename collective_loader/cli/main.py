"""``python -m collective_loader demo``: parse the flags, check them on this process
(:mod:`~collective_loader.cli.preflight`), then start the world: a local one of gloo ranks, or
this process's rank under torchrun, or a local one streaming from ``--remote``'s endpoint."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import replace

from collective_loader.cli.args import UsageError, parser, say_once
from collective_loader.cli.mix import mix_main, write_sources
from collective_loader.cli.preflight import preflight
from collective_loader.cli.run import rank_main
from collective_loader.cli.s3 import run_remote
from collective_loader.testing import launch
from collective_loader.testing.data import write_dataset

DESCRIPTION = (
    "One epoch of a StreamingDataset on a 4-D-capable mesh, checked, beside the naive set-up of streaming#827."
)


def main(argv: list[str] | None = None) -> int:
    """The demo's exit code: 0 if every check passed, 1 if one failed, 2 for a flag it cannot run with."""
    ns = parser(DESCRIPTION).parse_args(argv)
    torchrun = launch.under_torchrun()
    if not torchrun:
        launch.start_fork_server()
    try:
        a = preflight(ns, int(os.environ["WORLD_SIZE"]) if torchrun else None)
        if ns.remote:
            return run_remote(a, ns.timeout)
    except UsageError as e:
        return say_once(str(e))
    if ns.mix:
        if torchrun:  # the ranks write the sources themselves, one copy per node
            return launch.run(mix_main, a, math.prod(a.shape), ns.timeout)
        out = tempfile.mkdtemp(prefix="collective_loader_mix_")
        try:
            write_sources(out)
            return launch.run(mix_main, replace(a, data=out), math.prod(a.shape), ns.timeout)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    if ns.data or torchrun:  # under torchrun the ranks write the dataset themselves
        return launch.run(rank_main, a, math.prod(a.shape), ns.timeout)
    out = tempfile.mkdtemp(prefix="collective_loader_demo_")
    try:
        write_dataset(out, ns.samples, ns.seq_len)
        return launch.run(rank_main, replace(a, data=out), math.prod(a.shape), ns.timeout)
    finally:
        shutil.rmtree(out, ignore_errors=True)
