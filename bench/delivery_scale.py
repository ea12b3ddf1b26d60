"""Delivery as the world and the mesh grow, and delivery to shard ranks: ``bench/delivery.py``'s
scale, layout and shard parts (its results file's last three sections and ``delivery_scale.png``).

* Scale: constructor time and 1 KiB step time on 2 to 16 ranks (:func:`scale_main`); groups and
  collectives per step from the layout code for meshes up to pp=16, dp=128, cp=2, tp=4 (no
  processes, :func:`layout_row`).
* Shard ranks: sequences split over cp, delivered by broadcast-then-slice and by scatter, on
  8-rank meshes ``pp=2,cp=2,tp=2`` and ``cp=4,tp=2``, token-sized (64 KiB) and large (16 MiB)
  batches; both loaders (and their process groups) built once per world (:func:`shard_main`).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from epochs import (  # bench/epochs.py: run as python bench/<name>.py
    LABELS,
    LOADERS,
    TIMEOUT,
    loader_epochs,
    median_p50,
    p50_p95,
    per_role,
    ratio,
    slowest_steps,
    stats_per_step,
    summary,
)
from harness import Repeat, gather, in_rounds, keep, size, table
from torch.distributed.device_mesh import init_device_mesh

from collective_loader import CollectiveLoader
from collective_loader.plan.mesh import MeshLayout, group_count

if TYPE_CHECKING:
    from delivery import Settings

SCALE_MESHES = {2: (1, 1, 2), 4: (2, 1, 2), 8: (2, 2, 2), 16: (4, 2, 2)}  # world -> (pp, dp, tp)
LAYOUT_MESHES = (  # (pp, dp, cp, tp)
    (1, 1, 1, 8),
    (3, 2, 2, 2),
    (1, 8, 1, 8),
    (2, 4, 1, 8),
    (4, 8, 2, 4),
    (8, 32, 2, 4),
    (16, 64, 2, 4),
    (16, 128, 2, 4),
)


# --- the scale worlds -----------------------------------------------------------------------


def scale_main(s: Settings) -> int:
    """Rank entry of a scale world: constructor time and 1 KiB step time for both prefetch settings."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", SCALE_MESHES[world], mesh_dim_names=("pp", "dp", "tp"))
    ids = torch.randint(0, 32000, (2, 32))  # 512 bytes of inputs and 512 of labels: 1 KiB per step
    source = Repeat({"input_ids": ids, "labels": ids.roll(-1, 1)})
    record: dict[str, Any] = {"kind": "scale", "world": world, "shape": SCALE_MESHES[world], "steps": s.max_steps}

    def run(options: dict[str, Any]) -> dict[str, Any]:
        dist.barrier()
        start = time.perf_counter()
        loader = CollectiveLoader(source, mesh, inputs=("input_ids",), labels=("labels",), timeout=TIMEOUT, **options)
        built = max(gather(time.perf_counter() - start))
        record["group_count"] = loader.group_count
        stats = gather(stats_per_step(loader, source))
        steps = slowest_steps(loader_epochs(loader, source), s.max_steps)
        loader.close()
        return {"construct": built, "steps": steps, "stats": stats}

    record["rounds"] = in_rounds({name: (lambda o=o: run(o)) for name, o in LOADERS.items()}, s.rounds)
    if dist.get_rank() == 0:
        keep(s.out, record)
        print(f"scale: {world} ranks done", flush=True)
    return 0


# --- the shard worlds: broadcast or scatter ----------------------------------------------------

SHARD_MODES = ("broadcast", "scatter")


def shard_batch(nbytes: int) -> dict[str, torch.Tensor]:
    """4 sequences of int64 tokens, ``input_ids`` and ``labels``: about ``nbytes`` together."""
    seq = max(64, nbytes // (2 * 4 * 8) // 64 * 64)
    ids = torch.randint(0, 32000, (4, seq))
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}


def shard_main(args: tuple[Settings, tuple[str, ...], tuple[int, ...]]) -> int:
    """Rank entry of a shard world: sequences split over cp (zigzag), delivered by broadcast-then-
    slice and by scatter, every payload in rounds. Both loaders, and so their process groups, are
    built once per world."""
    s, dims, shape = args
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    source = Repeat({})
    loaders = {
        mode: CollectiveLoader(
            source,
            mesh,
            inputs=("input_ids",),
            labels=("labels",),
            seq_dims={"input_ids": 1, "labels": 1},
            split="zigzag",
            delivery=mode,
            timeout=TIMEOUT,
        )
        for mode in SHARD_MODES
    }
    for nbytes, n in s.shard_payloads:
        source.batch = shard_batch(nbytes)
        runs = {
            mode: (lambda mode=mode, n=n: slowest_steps(loader_epochs(loaders[mode], source), n)) for mode in loaders
        }
        record = {"kind": "shard", "dims": dims, "shape": shape, "payload": nbytes, "steps": n}
        record["rounds"] = in_rounds(runs, s.rounds)
        if dist.get_rank() == 0:
            keep(s.out, record)
            print(f"shard: {dict(zip(dims, shape))}, {size(nbytes)} done", flush=True)
    for loader in loaders.values():
        loader.close()
    return 0


# --- layout table (no processes) ------------------------------------------------------------


def layout_row(pp: int, dp: int, cp: int, tp: int) -> dict[str, Any]:
    """Groups and collectives per step of a mesh, from the layout code.

    A leader runs one all-reduce among the leaders (when there are several), then one message
    collective per delivery group (first and last stage; steady state: batch sizes repeat); a
    receiver takes part in its own group's collective. Without every_stage keys the middle stages
    are outside delivery: no collective (one store read per prefetch window if they iterate)."""
    layout = MeshLayout.build(("pp", "dp", "cp", "tp"), (pp, dp, cp, tp), range(pp * dp * cp * tp))
    named = [name for name, _ in layout.replica_groups()[0].all()]
    per_group = {name: 1 for name in named if name != "middle"}
    return {
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "tp": tp,
        "gpus": pp * dp * cp * tp,
        "groups": group_count(layout.dp_size, layout.pp_size),
        "leader": int(len(layout.leaders()) > 1) + sum(per_group.values()),
        "receiver": {**per_group, **({"middle": 0} if "middle" in named else {})},
    }


# --- report ---------------------------------------------------------------------------------


def sections(results: dict[str, Any]) -> list[str]:
    """The report's scale, layout and shard sections (``results``: ``bench/delivery.py``'s)."""
    return [
        "## Scale",
        "",
        (
            "Constructor time (slowest rank, `CollectiveLoader(...)` alone) and 1 KiB step time (512 B of inputs "
            "to the first stage, 512 B of labels to the last) as the world grows. These worlds run 2 to 16 processes "
            f"on {os.cpu_count()} cores, so times past 2 ranks measure oversubscription as much as the loader. The "
            "stats column counts the message collectives of the delivery groups per rank role; the leaders' "
            "all-reduce (dp > 1) is not in `stats()`."
        ),
        "",
        *scale_table(results["scale"]),
        "### Groups and collectives per step, from the layout code",
        "",
        (
            "No processes: `layout.group_count(dp, pp)` and `MeshLayout(...).replica_groups()`. Derivation: a "
            "leader does 1 all-reduce among leaders (when dp > 1), plus one message collective per delivery group: "
            "first stage and last stage (with pp = 1 they are one group); middle stages, without every_stage keys, "
            "are outside delivery (0 collectives); a receiver "
            "does 1. That is the steady state, while batch sizes repeat: a batch larger than the previous one on "
            "its channel costs one more collective. None of this grows with tp or cp."
        ),
        "",
        *layout_table(results["layout"]),
        "## Broadcast or scatter for shard ranks",
        "",
        (
            'Sequences split over cp (`split="zigzag"`): 4 sequences of int64 `input_ids` and `labels`, inputs to '
            'the first stage, labels to the last; the loader with `delivery="broadcast"` (every rank of a delivery '
            'group gets the whole batch and slices its own piece) and with `delivery="scatter"` (each rank is sent '
            "its piece), default prefetch, no compute. Both loaders are built once per world and take turns in "
            "rounds; step times of the slowest rank as above, and their mean, medians over rounds."
        ),
        "",
        *shard_table(results["shard"]),
    ]


def scale_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        rd = r["rounds"]
        built = {n: statistics.median(x["construct"] for x in rd[n]) * 1e3 for n in LOADERS}
        steps = {n: [x["steps"] for x in rd[n]] for n in LOADERS}
        pp, dp, tp = r["shape"]
        derived = layout_row(pp, dp, 1, tp)
        receivers = ", ".join(f"{name} {k}" for name, k in derived["receiver"].items())
        out.append(
            (
                r["world"],
                tuple(r["shape"]),
                r["group_count"],
                f"{built['loader_p1']:.1f} / {built['loader_default']:.1f} ms",
                p50_p95(steps["loader_p1"]),
                p50_p95(steps["loader_default"]),
                per_role(rd["loader_p1"][0]["stats"]),
                f"leader {derived['leader']}, {receivers}",
            )
        )
    header = (
        "ranks | mesh (pp, dp, tp) | groups | constructor p=1 / default (median) | step p=1 p50 (p95) | "
        "step default p50 (p95) | collectives per step, measured (stats) | from the layout code"
    )
    return table(header, out)


def layout_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        recv = r["receiver"]
        last = recv.get("last", "(= first)" if r["pp"] == 1 else "-")
        groups = (r["gpus"], r["pp"], r["dp"], r["cp"], r["tp"], r["groups"], r["leader"])
        out.append((*groups, recv.get("first", "-"), last, recv.get("middle", "-")))
    header = (
        "GPUs | pp | dp | cp | tp | groups (`group_count`) | leader | first-stage receiver | "
        "last-stage receiver | middle-stage receiver"
    )
    return table(header, out)


def shard_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        rd = r["rounds"]
        mesh = ",".join(f"{d}={k}" for d, k in zip(r["dims"], r["shape"]))
        mean = [statistics.median(summary(x)["mean"] for x in rd[m]) * 1e3 for m in SHARD_MODES]
        out.append(
            (
                mesh,
                size(r["payload"]),
                r["steps"],
                *(p50_p95(rd[m]) for m in SHARD_MODES),
                *(f"{x:.3f}" for x in mean),
                f"{ratio(rd, 'scatter', 'broadcast'):.2f}",
            )
        )
    header = (
        "mesh | payload | steps | broadcast p50 (p95) | scatter p50 (p95) | broadcast mean | scatter mean | "
        "scatter / broadcast (p50)"
    )
    return table(header, out)


def plot_scale(plt: Any, scale: list[dict[str, Any]], path: str) -> None:
    """Constructor time and 1 KiB step time vs world size."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    worlds = [r["world"] for r in scale]
    for name in LOADERS:
        built = [statistics.median(x["construct"] for x in r["rounds"][name]) * 1e3 for r in scale]
        step = [median_p50([x["steps"] for x in r["rounds"][name]]) for r in scale]
        axes[0].plot(worlds, built, marker="o", label=LABELS[name])
        axes[1].plot(worlds, step, marker="o", label=LABELS[name])
    axes[0].set(xlabel="ranks", ylabel="constructor ms (slowest rank)", title="CollectiveLoader(...)")
    axes[1].set(xlabel="ranks", ylabel="ms per step (p50)", title="1 KiB batch")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
