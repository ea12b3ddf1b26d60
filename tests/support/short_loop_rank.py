"""One rank of a job whose loop ends within milliseconds: a loop of two steps, ``close()``,
``destroy_process_group()``, exit, with nothing in between (no barrier). Prints ``done`` and the
values it received.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=2 python short_loop_rank.py host
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import CollectiveLoader


def main(transport: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    batches = [{"x": torch.full((2, 4), step), "y": torch.full((2,), step)} for step in range(2)]
    loader = CollectiveLoader(batches, mesh, inputs=("x",), labels=("y",), transport=transport)
    seen = [int(batch["x"][0, 0]) for batch in loader]
    loader.close()
    dist.destroy_process_group()
    print("done", seen, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
