"""One rank of a plain ``env://`` world (no torchrun: rank 0 hosts the job's store), mesh
``(pp, dp)``, that exits right after its loop: no ``close()``, no barrier, no
``destroy_process_group()`` (the loader closes at interpreter exit).

Middle stages start their loop (or, never iterating, close their loader) once rank 0 has left
its own loop (or died), so rank 0 is done first: rank 0 listens on a Unix socket until then, and
each middle stage waits for its connection to it to end. Prints one JSON line: the rank, whether
it is in delivery, the steps it saw and the loader's error, if any.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=6 python plain_env_rank.py --pp 3 --dp 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket

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


def wait_for_rank_0_loop(name: str, timeout: float) -> None:
    """Until rank 0 closes its socket (its loop done, or it died): the connection, pending in its
    backlog, then ends."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)  # a bound for a hang
        try:
            s.connect(name)
            s.recv(1)  # rank 0 never accepts nor sends: b"" or a reset once it has closed
        except (ConnectionRefusedError, ConnectionResetError):  # closed before, or while, we wait
            pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--middle", choices=("iterate", "never"), default="iterate")
    parser.add_argument("--fail-at", type=int, help="replica 0's leader (rank 0) fails at this step")
    parser.add_argument("--kill-at", type=int, help="rank 0 is killed (SIGKILL) after this many steps")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # rank 0's loop is not done while this socket listens (bound before the rendezvous: the
    # other ranks connect after it); abstract (no file), named by the world's port
    rank_0_loop = f"\0collective_loader-plain_env_rank-{os.environ['MASTER_PORT']}"
    listening = None
    if os.environ["RANK"] == "0":
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listening.bind(rank_0_loop)
        listening.listen(64)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))  # env://
    rank = dist.get_rank()
    mesh = ranks.make_mesh(("pp", "dp"), (args.pp, args.dp))
    dp_rank = mesh_place(mesh, rank).dp_rank
    fail_at = args.fail_at if dp_rank == 0 else None
    loader = CollectiveLoader(lambda: _Batches(dp_rank, args.dp, fail_at), mesh, **ranks.KEYS, timeout=args.timeout)
    out = {"rank": rank, "in_delivery": loader.in_delivery, "steps": 0, "error": None}
    try:
        if not loader.in_delivery:
            wait_for_rank_0_loop(rank_0_loop, args.timeout * 4)
        if loader.in_delivery or args.middle == "iterate":
            for _ in loader:
                out["steps"] += 1
                if rank == 0 and out["steps"] == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # the kernel closes the socket too
        else:  # Megatron's middle stages: compute, never touch the loader, close at the end
            loader.close()
    except CollectiveLoaderError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if listening is not None:
            listening.close()  # rank 0's loop is done: the middle stages go on
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
