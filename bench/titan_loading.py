"""TorchTitan's stock text loader, wrapped (``load_once_per_replica``) against unwrapped: CPU and memory per rank.

    python bench/titan_loading.py           # bench/results/titan_loading.{json,md}
    python bench/titan_loading.py --quick   # small, one round: bench/results/titan_loading_quick.* (git-ignored)

(Run times: bench/README.md.)

A 4-rank gloo world on TorchTitan's own data-loading mesh (``ParallelDims`` of pp=2 x dp_shard=2,
``get_optional_mesh(["pp", "batch", "cp", "tp"])``), the way TorchTitan's Trainer feeds a pipeline:
every rank builds TorchTitan's ``HuggingFaceTokenizer`` (a byte-level BPE of ``VOCAB`` tokens
trained here with ``tokenizers`` on Python's standard library sources, saved as ``tokenizer.json``)
and calls ``next()`` once per micro-batch (``local_batch_size`` = 1 sequence of ``seq_len`` tokens):

* *unwrapped*: every rank builds TorchTitan's ``HuggingFaceTextDataLoader`` (its dataset loaded
  with ``datasets`` from a local JSON-lines file, each document tokenized and packed) for its
  dp_rank, as TorchTitan does: both pipeline stages of a replica tokenize the same documents;
* *wrapped*: ``wrap_dataloader`` of the same config: the same loader on each replica's leader only,
  every micro-batch delivered to the other stage over gloo.

Per rank: CPU seconds (user + system, the whole process, so the wrapped loader's transfer thread is
counted) and peak RSS, both total and *added* by the data path (above what the rank had after
importing torch, torchtitan and datasets, joining the world, building the mesh and the tokenizer).
The ``datasets`` cache is built before the worlds start, so neither variant pays for it. The
variants alternate, in fresh worlds (peak RSS is per process), ``--rounds`` times; medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from typing import Any

import harness  # bench/harness.py: run as python bench/<name>.py
import torch.distributed as dist

from collective_loader import mesh_place
from collective_loader.testing import launch

PP, DP = 2, 2
VARIANTS = ("unwrapped", "wrapped")


@dataclasses.dataclass(frozen=True)
class Settings:
    documents: int  # of DOC_CHARS characters, from the standard library's sources
    vocab: int  # BPE vocabulary
    seq_len: int
    micro_batches: int  # next() calls per rank
    rounds: int
    root: str = ""  # the tokenizer and the dataset (set at run time)


DOC_CHARS = 4000
FULL = Settings(documents=6000, vocab=32000, seq_len=2048, micro_batches=400, rounds=2)
QUICK = Settings(documents=1500, vocab=8000, seq_len=2048, micro_batches=100, rounds=1)


def corpus(count: int) -> list[str]:
    """``count`` documents of real text: Python's standard library sources (not site-packages), cut in pieces."""
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, subfolders, files in os.walk(stdlib):
        subfolders[:] = [d for d in subfolders if d != "site-packages"]
        paths += [os.path.join(folder, name) for name in files if name.endswith(".py")]
    docs: list[str] = []
    for path in sorted(paths):
        with open(path, errors="replace") as f:
            text = f.read()
        docs += [text[i : i + DOC_CHARS] for i in range(0, len(text) - DOC_CHARS // 4, DOC_CHARS)]
        if len(docs) >= count:
            return docs[:count]
    raise RuntimeError(f"the standard library holds fewer than {count} documents of {DOC_CHARS} characters")


def prepare(s: Settings) -> None:
    """The tokenizer (``s.root/tokenizer``), the dataset (``s.root/text``) and its warm ``datasets`` cache."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = corpus(s.documents)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        docs,
        trainers.BpeTrainer(
            vocab_size=s.vocab,
            special_tokens=["<|bos|>", "<|eos|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    os.makedirs(f"{s.root}/tokenizer")
    tokenizer.save(f"{s.root}/tokenizer/tokenizer.json")
    with open(f"{s.root}/tokenizer/tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}, f)
    os.makedirs(f"{s.root}/text")
    with open(f"{s.root}/text/train.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    register(s)
    load_local(f"{s.root}/text")


def load_local(path: str) -> Any:
    from datasets import load_dataset

    return load_dataset(path, split="train", cache_dir=os.path.join(os.path.dirname(path), "hf_cache"))


def register(s: Settings) -> None:
    """The dataset in TorchTitan's ``DATASETS``, as its docs describe for custom datasets."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS["bench_text"] = DatasetConfig(
        path=f"{s.root}/text", loader=load_local, sample_processor=lambda x: x["text"]
    )


def rank_main(args: tuple[Settings, str, str]) -> int:
    s, variant, out = args
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend (size-1 dims)
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from collective_loader.integrations.titan_wrap import wrap_dataloader

    register(s)
    parallel_dims.device_type = "cpu"
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=DP, cp=1, tp=1, pp=PP, ep=1, world_size=PP * DP)
    dims.build_mesh()
    mesh = dims.get_optional_mesh(["pp", "batch", "cp", "tp"], include_singleton_axes=True)
    place = mesh_place(mesh, dist.get_rank())
    tokenizer = HuggingFaceTokenizer(tokenizer_path=f"{s.root}/tokenizer")  # the Trainer builds it on every rank
    gc.collect()
    dist.barrier()
    cpu0, rss0, wall0 = harness.cpu_seconds(), harness.rss_bytes(), time.perf_counter()
    config = HuggingFaceTextDataLoader.Config(dataset="bench_text")
    if variant == "wrapped":
        config = wrap_dataloader(config, mesh=mesh)
    loader = config.build(
        dp_world_size=DP, dp_rank=place.dp_rank, tokenizer=tokenizer, seq_len=s.seq_len, local_batch_size=1
    )
    tokens = 0
    for step, (input_dict, labels) in enumerate(loader, 1):  # noqa: B007  the last input_dict is kept
        tokens += labels.numel()
        if step == s.micro_batches:
            break
    wall = time.perf_counter() - wall0
    record = {
        "rank": dist.get_rank(),
        "leader": place.is_leader,
        "stage": place.pp_rank,
        "cpu": harness.cpu_seconds() - cpu0,
        "cpu_total": harness.cpu_seconds(),
        "rss_start": rss0,
        "peak_rss": harness.peak_rss_bytes(),
        "wall": wall,
        "tokens": tokens,
        "last": int(input_dict["input"].sum()),
    }
    if variant == "wrapped":
        loader.close()
    harness.keep(out, {"variant": variant, **record})
    return 0


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def markdown(meta: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    s = meta["settings"]
    lines = [
        f"TorchTitan's mesh pp=2 x dp_shard=2 (4 ranks, 2 replicas). `HuggingFaceTextDataLoader` on {s['documents']} "
        f"documents of {DOC_CHARS} characters (Python's standard library sources), a byte-level BPE of {s['vocab']} "
        f"tokens, seq_len {s['seq_len']}, one sequence per micro-batch, {s['micro_batches']} micro-batches per rank, "
        f"no DataLoader workers. Medians over {s['rounds']} round(s) of fresh worlds; *added* is what the data path "
        "adds to a rank that has imported torch, torchtitan and datasets, joined the world and built the mesh and "
        "the tokenizer (every rank builds the tokenizer: TorchTitan's Trainer does).",
        "",
        "| | CPU s added (sum of 4 ranks) | CPU s added, busiest rank | CPU s whole processes (sum) "
        "| peak RSS added (sum) | peak RSS whole processes (sum) | wall s (slowest rank) |",
        "|---|---|---|---|---|---|---|",
    ]
    summary: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        mine = [r["ranks"] for r in runs if r["variant"] == variant]

        def med(fn: Any, mine: list = mine) -> float:
            return statistics.median(fn(ranks) for ranks in mine)

        summary[variant] = {
            "cpu": med(lambda rs: sum(r["cpu"] for r in rs)),
            "busiest": med(lambda rs: max(r["cpu"] for r in rs)),
            "cpu_total": med(lambda rs: sum(r["cpu_total"] for r in rs)),
            "rss_added": med(lambda rs: sum(r["peak_rss"] - r["rss_start"] for r in rs)),
            "peak_rss": med(lambda rs: sum(r["peak_rss"] for r in rs)),
            "wall": med(lambda rs: max(r["wall"] for r in rs)),
        }
        m = summary[variant]
        lines.append(
            f"| {variant} | {m['cpu']:.1f} | {m['busiest']:.1f} | {m['cpu_total']:.1f} | "
            f"{mib(m['rss_added'])} MiB | {mib(m['peak_rss'])} MiB | {m['wall']:.1f} |"
        )
    w, u = summary["wrapped"], summary["unwrapped"]
    lines.append(
        f"| wrapped / unwrapped | {w['cpu'] / u['cpu']:.2f} | {w['busiest'] / u['busiest']:.2f} | "
        f"{w['cpu_total'] / u['cpu_total']:.2f} | {w['rss_added'] / u['rss_added']:.2f} | "
        f"{w['peak_rss'] / u['peak_rss']:.2f} | {w['wall'] / u['wall']:.2f} |"
    )
    lines += [
        "",
        "Per rank (first round): CPU s added / peak RSS added (MiB) / peak RSS (MiB); L = the replica's leader",
        "",
    ]
    cells = {}
    for variant in VARIANTS:
        ranks = next(r["ranks"] for r in runs if r["variant"] == variant)
        cells[variant] = [
            f"{r['cpu']:.1f} / {mib(r['peak_rss'] - r['rss_start'])} / {mib(r['peak_rss'])}"
            f"{' L' if variant == 'wrapped' and r['leader'] else ''}"
            for r in ranks
        ]
    lines += harness.rank_table("variant", cells)
    same = all(len({r["last"] for r in run["ranks"] if r["rank"] % DP == d}) == 1 for run in runs for d in range(DP))
    lines += [
        f"Every rank of a replica ended on the same micro-batch in every run: {'yes' if same else 'NO'}; "
        f"tokens per rank: {runs[0]['ranks'][0]['tokens']}.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small dataset and vocabulary, one round")
    parser.add_argument("--rounds", type=int, help="rounds of both variants (default: 2, --quick 1)")
    args = parser.parse_args(argv)
    name = "titan_loading_quick" if args.quick else "titan_loading"
    run = harness.Run("titan_loading.py", argv)
    tmp = tempfile.mkdtemp(prefix="cl_titan_loading_")
    try:
        s = dataclasses.replace(QUICK if args.quick else FULL, root=tmp)
        if args.rounds:
            s = dataclasses.replace(s, rounds=args.rounds)
        prepare(s)
        out = os.path.join(tmp, "records")
        code = harness.worlds_in_rounds(
            VARIANTS, s.rounds, lambda v, r: launch.run(rank_main, (s, v, out), PP * DP, timeout=1800)
        )
        if code:
            return code
        runs = [{"variant": ranks[0]["variant"], "ranks": ranks} for ranks in harness.runs_of(out)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta = run.meta(settings=dataclasses.asdict(s) | {"root": None})
    title = "TorchTitan's text loader: wrapped (load once per replica) vs unwrapped (gloo, this machine)"
    run.write(name, title, {"meta": meta, "runs": runs}, markdown(meta, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
