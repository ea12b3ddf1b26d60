"""The demo with one rank failing after the epoch: ``failing_demo.py PHASE RANK [demo options]``.

PHASE is ``report`` (rank RANK's report raises: only rank 0 reports) or ``naive`` (rank RANK's
collate raises inside the naive run, between streaming's barriers). Run under torchrun (one node,
or two with ``nodes.py``); every rank must then end with a non-zero exit, not wait.
"""

import os
import sys

from collective_loader import demo


def failing(real, rank: int):
    def call(*args, **kwargs):
        if int(os.environ["RANK"]) == rank:
            raise KeyError("injected by failing_demo.py")
        return real(*args, **kwargs)

    return call


if __name__ == "__main__":
    phase, rank = sys.argv[1], int(sys.argv[2])
    if phase == "report":
        demo.report = failing(demo.report, rank)
    elif phase == "naive":
        demo.lm_collate = failing(demo.lm_collate, rank)
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    sys.exit(demo.main(sys.argv[3:]))
