"""Tokenizing and packing text on the leaders vs on every rank.

    python bench/packing.py            # bench/results/packing.{json,md}
    python bench/packing.py --quick    # a small corpus, one round: bench/results/packing_quick.* (git-ignored)

(Run times: bench/README.md.)

Real text: the docstrings of Python's standard library (English technical prose,
documents of a few words to a few pages), with pydoc's topic pages; a real BPE tokenizer: byte-level
BPE with a 32,000-token vocabulary trained on that text with the ``tokenizers`` package. The text is
written as an MDS ``text`` column (LLM Foundry's layout), shuffled by streaming.

An 8-rank gloo world on ``(dp, pp, tp) = (2, 2, 2)``, one epoch, rows of ``SEQ_LEN + 1`` tokens,
4 rows per replica per step, documents with BOS / EOS:

* *leaders, N workers*: ``StreamingSource(layout=TextColumn(tokenizer), packing=Packing(...))`` on
  the two leaders, tokenizing in the leader's process (0 workers) or in 2 DataLoader workers, and
  ``CollectiveLoader`` delivering inputs to the first stage and labels to the last;
* *every rank tokenizes*: every rank builds ``StreamingDataset`` with ``replication = pp x tp`` (the 4
  ranks of a replica are adjacent in this mesh order) and tokenizes and packs the same documents
  itself, with the same code (:class:`collective_loader.text.rows.PackedRows`).

Per rank: CPU seconds of its process and of its DataLoader workers (``RUSAGE_CHILDREN``, counted once
they have exited: the workers are forked and joined before the figure is read), and the epoch's
wall time. Tokens per second: tokens of documents in the rows a replica trained on, over the
slowest rank's epoch time. The padding share is the share of token slots of the delivered rows that
hold padding. Each variant runs in a world of its own, ``ROUNDS`` rounds, the order reversed every
other round; medians over rounds.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from harness import (  # bench/harness.py: run as python bench/<name>.py
    Run,
    cpu_seconds,
    keep,
    rank_table,
    runs_of,
    worlds_in_rounds,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

from collective_loader import CollectiveLoader
from collective_loader.plan.mesh import MeshLayout
from collective_loader.streaming import StreamingSource
from collective_loader.streaming.cleanup import release
from collective_loader.testing import launch
from collective_loader.testing.data import train_tokenizer, write_text_documents
from collective_loader.text import Packing, TextColumn
from collective_loader.text.layouts import DocumentCollate
from collective_loader.text.rows import PackedRows

MESH = (("dp", "pp", "tp"), (2, 2, 2))
REPLICATION = 4  # pp x tp
SEQ_LEN, ROWS, DOCS_PER_BATCH = 1024, 4, 16
NOTE = (
    "Tokens trained: with collective_loader the replicas step together and the epoch ends where the first leader "
    "runs out of rows (the other leader's remaining rows are not trained in that epoch); with every rank tokenizing, "
    "each "
    "replica runs to its own end (ranks of a DP group would then disagree on the step count, which is why "
    "TorchTitan loops its text datasets)."
)
REPEAT = 4  # the full run reads the corpus 4 times over (in one shuffled epoch), so that tokenizing outweighs start-up
# the ranks are spawned (launch.run), and a spawned process's DataLoader workers are spawned too by
# default: each imports torch, streaming and transformers again (about 5 CPU s each, measured here);
# torchrun's ranks fork theirs, as these do
WORKER_KWARGS: dict[str, Any] = {"multiprocessing_context": "fork"}
VARIANTS = ("leaders_0_workers", "leaders_2_workers", "every_rank_tokenizes")


@dataclass(frozen=True)
class Settings:
    data: str
    tokenizer: str
    out: str
    documents: int
    characters: int
    rounds: int


def corpus(max_chars: int) -> list[str]:
    """Docstrings of the standard library and pydoc's topic pages, in a fixed order."""
    import pydoc_data.topics

    docs = list(pydoc_data.topics.topics.values())
    for root in [sysconfig.get_paths()["stdlib"]]:
        for here, dirs, files in os.walk(root):  # dirs sorted in place: the same order every run
            dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "site-packages", "__pycache__"))
            for name in sorted(f for f in files if f.endswith(".py")):
                try:
                    with open(os.path.join(here, name), encoding="utf-8") as f:
                        tree = ast.parse(f.read())
                except (SyntaxError, UnicodeDecodeError, ValueError):
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        doc = ast.get_docstring(node)
                        if doc and len(doc) > 20:
                            docs.append(doc)
    np.random.default_rng(0).shuffle(docs)
    out, total = [], 0
    for doc in docs:
        if total >= max_chars:
            break
        out.append(doc)
        total += len(doc)
    return out


# --- one rank -----------------------------------------------------------------------------------


def trained(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(tokens of documents, token slots) in a batch of rows: a row's tokens are the labels that
    are not ignored, plus its first token."""
    labels = batch["labels"]
    real = (labels != -100).sum(1)
    return int((real + (real > 0)).sum()), labels.numel() + labels.shape[0]


def rank_main(args: tuple[Settings, str]) -> int:
    s, variant = args
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", MESH[1], mesh_dim_names=MESH[0])
    layout, packing = TextColumn(s.tokenizer), Packing(SEQ_LEN)
    dist.barrier()
    cpu0, start = cpu_seconds(children=True), time.perf_counter()
    tokens = slots = steps = 0
    if variant == "every_rank_tokenizes":
        from collective_loader.streaming.indexed import IndexedDataset  # a StreamingDataset giving sample indices

        dataset = IndexedDataset(
            local=s.data, batch_size=DOCS_PER_BATCH, shuffle=True, shuffle_seed=3, replication=REPLICATION
        )
        loader = DataLoader(dataset, batch_size=DOCS_PER_BATCH, collate_fn=DocumentCollate(layout))
        rows = PackedRows(packing, ROWS, 0, (1, 1))
        for batch in rows.rows(iter(loader), lambda: 0):
            t, n = trained(batch)
            tokens, slots, steps = tokens + t, slots + n, steps + 1
        wall = time.perf_counter() - start
        dist.barrier()
        release(dataset)
        stats: dict[str, int] = rows.stats
    else:
        workers = int(variant.split("_")[1])
        source = StreamingSource(
            mesh,
            local=s.data,
            batch_size=ROWS,
            shuffle=True,
            shuffle_seed=3,
            layout=layout,
            packing=packing,
            documents_per_batch=DOCS_PER_BATCH,
            num_workers=workers,
            dataloader_kwargs=WORKER_KWARGS if workers else None,
        )
        loader_ = CollectiveLoader(source, mesh, inputs=("input_ids", "position_ids"), labels=("labels",))
        for batch in loader_:
            if "labels" in batch:
                t, n = trained(batch)
                tokens, slots = tokens + t, slots + n
            steps += 1
        wall = time.perf_counter() - start
        stats = loader_.source.stats() if loader_.source is not None else {}
        loader_.close()  # joins the DataLoader workers: their CPU is in RUSAGE_CHILDREN from here
    record = {
        "rank": rank,
        "cpu": cpu_seconds(children=True) - cpu0,
        "wall": wall,
        "tokens": tokens,
        "slots": slots,
        "steps": steps,
        "stats": stats,
    }
    keep(s.out, {"variant": variant, **record})
    return 0


# --- the parent ---------------------------------------------------------------------------------


def summarize(records: list[dict[str, Any]], variant: str) -> dict[str, Any]:
    # tokens a replica trained on: counted on its last stage, one rank per replica (tp peers hold copies)
    layout = {r["rank"]: (r["rank"] // REPLICATION) for r in records}
    per_replica: dict[int, dict[str, int]] = {}
    for r in records:
        if r["tokens"] and layout[r["rank"]] not in per_replica:
            per_replica[layout[r["rank"]]] = {"tokens": r["tokens"], "slots": r["slots"]}
    tokens = sum(v["tokens"] for v in per_replica.values())
    slots = sum(v["slots"] for v in per_replica.values())
    wall = max(r["wall"] for r in records)
    return {
        "variant": variant,
        "cpu_total": sum(r["cpu"] for r in records),
        "cpu_max": max(r["cpu"] for r in records),
        "cpu_per_rank": [round(r["cpu"], 2) for r in sorted(records, key=lambda r: r["rank"])],
        "wall": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "padding": 1 - tokens / max(slots, 1),
        "steps": max(r["steps"] for r in records),
    }


def report(s: Settings, runs: list[dict[str, Any]], quick: bool) -> list[str]:
    med = {
        v: {
            k: statistics.median(r[k] for r in runs if r["variant"] == v)
            for k in ("cpu_total", "cpu_max", "wall", "tokens_per_s", "padding", "tokens")
        }
        for v in VARIANTS
    }
    naive = med["every_rank_tokenizes"]
    lines = [
        "Absolute times move with the load; CPU seconds much less.",
        "",
        f"Mesh (dp, pp, tp) = (2, 2, 2): 8 ranks, 2 replicas. One epoch of {s.documents} documents "
        f"({s.characters / 1e6:.2f} M characters of docstrings and pydoc topics"
        + ("" if quick else f", the corpus {REPEAT} times over")
        + ") in an MDS `text` column, byte-level "
        f"BPE (32,000 tokens, trained on the same text), BOS/EOS per document, rows of {SEQ_LEN} + 1 tokens, {ROWS} rows "
        f"per replica per step, {DOCS_PER_BATCH} documents per DataLoader batch. Medians over {s.rounds} round(s).",
        "",
        "| set-up | CPU s, all ranks | CPU s, busiest rank | wall s per epoch | tokens trained | tokens/s | "
        "padding | CPU vs every rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in VARIANTS:
        m = med[v]
        lines.append(
            f"| {v.replace('_', ' ')} | {m['cpu_total']:.1f} | {m['cpu_max']:.1f} | {m['wall']:.1f} | {m['tokens']:.0f} | "
            f"{m['tokens_per_s']:.0f} | {100 * m['padding']:.2f}% | {m['cpu_total'] / naive['cpu_total']:.2f} |"
        )
    leaders = list(MeshLayout.build(MESH[0], MESH[1], range(8)).leaders())
    lines += [
        "",
        NOTE,
        "",
        f"CPU seconds per rank (first round; ranks {leaders} lead, with their DataLoader workers):",
        "",
    ]
    firsts = {v.replace("_", " "): next(r for r in runs if r["variant"] == v)["cpu_per_rank"] for v in VARIANTS}
    return lines + rank_table("set-up", {v: [f"{c:.1f}" for c in cpu] for v, cpu in firsts.items()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small corpus, one round")
    ns = p.parse_args(argv)
    run = Run("packing.py", argv)
    tmp = tempfile.mkdtemp(prefix="bench_packing_")
    try:
        texts = corpus(400_000) if ns.quick else corpus(10**8) * REPEAT  # the whole corpus: 2.3 M characters
        np.random.default_rng(1).shuffle(texts)
        data, out = os.path.join(tmp, "text"), os.path.join(tmp, "records")
        write_text_documents(data, texts, shard_bytes=1 << 20)
        tokenizer = train_tokenizer(texts, os.path.join(tmp, "tokenizer"), vocab_size=32000)
        s = Settings(data, tokenizer, out, len(texts), sum(map(len, texts)), 1 if ns.quick else 2)
        code = worlds_in_rounds(VARIANTS, s.rounds, lambda v, r: launch.run(rank_main, (s, v), 8, timeout=1800))
        if code:
            return code
        runs = [summarize(ranks, ranks[0]["variant"]) for ranks in runs_of(out)]
        results = {
            "meta": run.meta(settings=asdict(s) | {"data": None, "tokenizer": None, "out": None}),
            "seq_len": SEQ_LEN,
            "rows": ROWS,
            "runs": runs,
        }
        title = "Tokenizing and packing on the leaders vs on every rank (gloo, this machine)"
        run.write("packing_quick" if ns.quick else "packing", title, results, report(s, runs, ns.quick))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
