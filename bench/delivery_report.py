"""The report of ``bench/delivery.py``: its tables, its targets, its markdown and the payload plot
(the scale, layout and shard sections: ``delivery_scale.py``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from delivery_scale import sections
from epochs import LABELS, MIXED, SKIP, median_p50, p50_p95, per_role, ratio, summary
from harness import KIB, MIB, size, table

BUFFERS = ("reused", "fresh_freed", "fresh_kept")


def delivery_tables(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for n_tensors in sorted({r["n_tensors"] for r in rows}):
        dtypes = ", ".join(str(d).removeprefix("torch.") for d in MIXED[:n_tensors])
        mine = [(r, r["rounds"]) for r in rows if r["n_tensors"] == n_tensors]
        plural = "s" if n_tensors > 1 else ""
        lines += [f"### {n_tensors} tensor{plural} ({dtypes}): vs the limit", ""]
        lines += table(
            "payload | wire bytes | steps | loader p=1 | loader default | loader device | raw broadcast | "
            "raw header + payload | p=1 / raw | default / raw | device / raw | p=1 / raw header + payload | "
            "collectives per step (stats)",
            [
                (
                    size(r["payload"]),
                    r["wire_bytes"],
                    r["steps"],
                    *(p50_p95(rd[v]) for v in ("loader_p1", "loader_default", "loader_device", "raw", "raw_pair")),
                    *(f"{ratio(rd, v, 'raw'):.2f}" for v in ("loader_p1", "loader_default", "loader_device")),
                    f"{ratio(rd, 'loader_p1', 'raw_pair'):.2f}",
                    per_role(r["stats"]["loader_p1"]),
                )
                for r, rd in mine
            ],
        )
        lines += [
            f"### {n_tensors} tensor{plural}: vs the per-tensor pattern ({n_tensors + 1} collectives per step)",
            "",
        ]
        lines += table(
            "payload | per-tensor | loader p=1 | loader default | per-tensor / p=1 | per-tensor / default",
            [
                (
                    size(r["payload"]),
                    *(p50_p95(rd[v]) for v in ("per_tensor", "loader_p1", "loader_default")),
                    f"{ratio(rd, 'per_tensor', 'loader_p1'):.2f}",
                    f"{ratio(rd, 'per_tensor', 'loader_default'):.2f}",
                )
                for r, rd in mine
            ],
        )
    return lines


def profile_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        prof = r["rounds"]["profile"]
        med = {k: median_p50([p[k] for p in prof]) for k in prof[0]}
        loader, raw = median_p50(r["rounds"]["loader_p1"]), median_p50(r["rounds"]["raw"])
        phases = (med["pack"], med["message"], med["unpack"], med["step"], loader, raw)
        out.append(
            (f"{r['n_tensors']} t", size(r["payload"]), *(f"{x:.3f}" for x in phases), f"{loader - med['step']:+.3f}")
        )
    header = (
        "batch | payload | leader pack | leader message bcast | receiver unpack | rebuilt step | "
        "loader p=1 step | raw broadcast | loader p=1 - rebuilt"
    )
    return table(header, out)


def overlap_summary(r: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per run: mean and p95 exposed wait, as a fraction of the synchronous delivery time."""
    sync = r["overlap"]["sync_delivery"]
    return {
        name: {
            "mean": statistics.median(summary(w)["mean"] for w in waits) / sync,
            "p95": statistics.median(summary(w)["p95"] for w in waits) / sync,
        }
        for name, waits in r["overlap"]["waits"].items()
    }


PREFETCH = {"loader_p1": "1", "loader_default": "default (2)", "loader_device": "default (2), device"}


def overlap_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        sync = r["overlap"]["sync_delivery"]
        sync_mean = statistics.median(summary(x)["mean"] for x in r["rounds"]["loader_p1"])
        for name, frac in overlap_summary(r).items():
            variant, factor = name.split(" x")
            out.append(
                (
                    size(r["payload"]),
                    f"{sync * 1e3:.3f} ms",
                    f"{sync_mean * 1e3:.3f} ms",
                    f"{factor} x sync = {int(factor) * sync * 1e3:.3f} ms",
                    PREFETCH[variant],
                    f"{frac['mean'] * sync * 1e3:.3f} ms",
                    f"{frac['mean']:.1%}",
                    f"{frac['p95']:.1%}",
                )
            )
    header = (
        "payload | sync delivery (p=1 p50) | its mean | compute / step | prefetch | exposed wait, mean | "
        "mean / sync | p95 / sync"
    )
    return table(header, out)


def buffer_table(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        ms = {mode: statistics.median(r[mode]) * 1e3 for mode in BUFFERS}
        out.append(
            (
                size(r["payload"]),
                *(f"{ms[mode]:.2f} ms" for mode in BUFFERS),
                f"{ms['fresh_freed'] / ms['reused']:.1f}",
                f"{ms['fresh_kept'] / ms['reused']:.1f}",
            )
        )
    header = "payload | buffer allocated once | fresh, freed each step | fresh, kept | freed / once | kept / once"
    return table(header, out)


def targets(delivery: list[dict[str, Any]]) -> list[str]:
    """One line per target: met or missed, with the measured ratios."""

    def line(name: str, values: list[tuple[str, float]], ok: Callable[[float], bool]) -> str:
        if not values:
            return f"- {name}: not measured in this run"
        verdict = "met" if all(ok(v) for _, v in values) else "MISSED"
        return f"- {name}: **{verdict}** ({', '.join(f'{k} {v:.2f}' for k, v in values)})"

    def ratios(pick: Callable[[dict], bool], num: str, den: str) -> list[tuple[str, float]]:
        return [(f"{r['n_tensors']}t {size(r['payload'])}", ratio(r["rounds"], num, den)) for r in delivery if pick(r)]

    waits = [
        (f"{size(r['payload'])} {name}", frac["mean"])
        for r in delivery
        if "overlap" in r
        for name, frac in overlap_summary(r).items()
    ]
    return [
        line(
            "loader (p=1) <= 1.15x raw broadcast at >= 1 MiB",
            ratios(lambda r: r["payload"] >= MIB, "loader_p1", "raw"),
            lambda v: v <= 1.15,
        ),
        line(
            "loader (p=1) <= 2x raw broadcast at 1 KiB",
            ratios(lambda r: r["payload"] == KIB, "loader_p1", "raw"),
            lambda v: v <= 2,
        ),
        line(
            "per-tensor / loader (p=1) >= 3 for 6 small tensors (<= 16 KiB)",
            ratios(lambda r: r["n_tensors"] == 6 and r["payload"] <= 16 * KIB, "per_tensor", "loader_p1"),
            lambda v: v >= 3,
        ),
        line(
            "exposed wait (mean) <= 10% of synchronous delivery when compute >= delivery time",
            waits,
            lambda v: v <= 0.10,
        ),
        "",
    ]


def markdown(results: dict[str, Any]) -> list[str]:
    """The report's body, under the title and header ``harness.Run.write`` adds."""
    meta = results["meta"]
    delivery = results["delivery"]
    return [
        (
            "Every figure compared is measured side by side in one world: each variant runs one epoch in turn, "
            f"{meta['rounds']} rounds, the order rotating each round. A step's time is the slowest rank's time "
            f"between two consecutive batches (first {SKIP} steps of each epoch left out); p50 (p95) in ms, each the "
            "median over rounds; ratios are medians over rounds of the per-round ratio of p50s. No compute, no "
            "loading: the source yields one pre-built batch. `gc.collect()` runs before every epoch, outside the "
            "timed steps."
        ),
        "",
        "## Targets",
        "",
        *targets(delivery),
        "## Delivery vs raw broadcast and vs the per-tensor pattern",
        "",
        (
            "Mesh (dp, tp) = (1, 4): one leader, three receivers, one delivery group of 4 ranks. *raw broadcast*: "
            "one `dist.broadcast` of the batch's tensor bytes per step over a `dist.new_group` of the same 4 ranks, "
            "into a buffer allocated once (the transport's limit). *raw header + payload*: a 64-byte broadcast then "
            "that one, both into buffers allocated once (the floor of the earlier protocol that sent a header then a payload). *per-tensor*: "
            "Megatron's `get_batch_on_this_tp_rank` pattern, one int64 broadcast of the shapes then one broadcast "
            "per tensor into fresh tensors (n + 1 collectives). *loader p=1*: `prefetch=1`, the synchronous "
            "delivery time; *loader default*: `prefetch=2`. Collectives per step come from `loader.stats()` "
            "(difference of a 2- and a 6-step epoch)."
        ),
        "",
        *delivery_tables(delivery),
        "## Where a step's time goes",
        "",
        (
            "One synchronous steady-state step rebuilt in the benchmark from the package's pieces (`wire.encode`, "
            "`Encoded.write` into a `BufferPool` buffer, `Header.read`, `wire.decode`) and one "
            "`dist.broadcast` over the raw group, timed by phase with `time.perf_counter` (p50 ms, median over rounds, run in "
            "the same rotation as the variants above). *rebuilt step* is the slowest rank's whole step; the last "
            "column is what the loader adds on top (its transfer thread, queue hand-off, routing)."
        ),
        "",
        *profile_table(delivery),
        (
            "What a fresh buffer costs: writing a payload into a `torch.empty(n)` made each step (what the leader's "
            "pack did before `BufferPool`; receivers received into one) vs into a buffer allocated once (what the "
            "raw broadcast and the pool do). "
            "A fresh buffer is either freed at once (the loader's, once the loop drops the batch) or kept until the "
            "end (a loop that holds on to its batches). Worker thread, one torch thread, in the parent process after "
            "the worlds ended; median of 10 copies, median over rounds."
        ),
        "",
        *buffer_table(results["buffers"]),
        "## Overlap",
        "",
        (
            "The training loop sleeps a fixed time per step: 1x and 2x the synchronous delivery time (the p=1 p50 "
            "above, measured just before in the same world). The exposed wait is the time spent inside `next(it)`, "
            "slowest rank per step, over the synchronous delivery time. 6-tensor batches."
        ),
        "",
        *overlap_table([r for r in delivery if "overlap" in r]),
        *sections(results),
    ]


def plot_payloads(plt: Any, delivery: list[dict[str, Any]], path: str) -> None:
    """p50 per step vs payload for every variant, and the ratios to raw broadcast."""
    kinds = sorted({r["n_tensors"] for r in delivery})
    fig, axes = plt.subplots(2, len(kinds), figsize=(6 * len(kinds), 8), squeeze=False)
    variants = ("loader_p1", "loader_default", "loader_device", "raw", "raw_pair", "per_tensor")
    for col, n_tensors in enumerate(kinds):
        rows = [r for r in delivery if r["n_tensors"] == n_tensors]
        x = [r["payload"] for r in rows]
        for v in variants:
            y = [median_p50(r["rounds"][v]) for r in rows]
            axes[0][col].loglog(x, y, marker="o", label=LABELS[v])
            if v != "raw":
                ratios = [ratio(r["rounds"], v, "raw") for r in rows]
                axes[1][col].semilogx(x, ratios, marker="o", label=f"{LABELS[v]} / raw broadcast")
        for target in (1.15, 2.0):
            axes[1][col].axhline(target, color="grey", linestyle=":", linewidth=1)
        axes[0][col].set(title=f"{n_tensors} tensor(s), 4 ranks, gloo", ylabel="ms per step (p50)")
        axes[1][col].set(xlabel="payload (bytes)", ylabel="ratio to raw broadcast (p50)")
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
