"""The demo with one rank failing after the epoch: ``failing_demo.py PHASE RANK [demo options]``.

PHASE is ``report`` (rank RANK's report raises: only rank 0 reports) or ``naive`` (rank RANK's
collate raises inside the naive run, between streaming's barriers). Run under torchrun (one node,
or two with ``nodes.py``); every rank must then end with a non-zero exit, not wait.
"""

import os
import sys

from collective_loader.cli import main, naive, run


def failing(real, rank: int):
    def call(*args, **kwargs):
        if int(os.environ["RANK"]) == rank:
            raise KeyError("injected by failing_demo.py")
        return real(*args, **kwargs)

    return call


if __name__ == "__main__":
    phase, rank = sys.argv[1], int(sys.argv[2])
    if phase == "report":
        run.report = failing(run.report, rank)  # as run.after_epoch looks it up
    elif phase == "naive":
        naive.lm_collate = failing(naive.lm_collate, rank)  # as naive.naive_ids looks it up
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    sys.exit(main.main(sys.argv[3:]))
