"""One rank of a plain ``env://`` world (no torchrun: rank 0 hosts the job's store), mesh
``(pp, dp)``, that exits right after its loop: no ``close()``, no barrier, no
``destroy_process_group()`` (the loader closes at interpreter exit).

Middle stages are slower than the others (``--pace`` seconds a step, or as long in all when they
never iterate), so rank 0 is done first. Prints one JSON line: the rank, whether it is in
delivery, the steps it saw and the loader's error, if any.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=6 python plain_env_rank.py --pp 3 --dp 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time

import ranks
import torch
import torch.distributed as dist

from collective_loader import CollectiveLoader, CollectiveLoaderError, mesh_place

STEPS = 6  # batches per replica


class _Batches:
    def __init__(self, dp_rank: int, dp_size: int, fail_at: int | None) -> None:
        self.dp_rank, self.dp_size, self.fail_at = dp_rank, dp_size, fail_at

    def __iter__(self):
        for step, batch in enumerate(ranks.id_batches(self.dp_rank, self.dp_size, 2 * STEPS * self.dp_size, 2, 8)):
            if step == self.fail_at:
                raise OSError("disk on fire")
            yield batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--middle", choices=("iterate", "never"), default="iterate")
    parser.add_argument("--pace", type=float, default=0.4, help="seconds a middle stage spends on a step")
    parser.add_argument("--fail-at", type=int, help="replica 0's leader (rank 0) fails at this step")
    parser.add_argument("--kill-at", type=int, help="rank 0 is killed (SIGKILL) after this many steps")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))  # env://
    rank = dist.get_rank()
    mesh = ranks.make_mesh(("pp", "dp"), (args.pp, args.dp))
    dp_rank = mesh_place(mesh, rank).dp_rank
    fail_at = args.fail_at if dp_rank == 0 else None
    loader = CollectiveLoader(lambda: _Batches(dp_rank, args.dp, fail_at), mesh, **ranks.KEYS, timeout=args.timeout)
    out = {"rank": rank, "in_delivery": loader.in_delivery, "steps": 0, "error": None}
    try:
        if loader.in_delivery or args.middle == "iterate":
            for _ in loader:
                out["steps"] += 1
                if not loader.in_delivery:
                    time.sleep(args.pace)
                if rank == 0 and out["steps"] == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
        else:  # Megatron's middle stages: compute, never touch the loader, close at the end
            time.sleep(args.pace * STEPS)
            loader.close()
    except CollectiveLoaderError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
