"""The demo's flags: the parser (each of its errors one line on stderr, exit code 2), the grammar
of ``--mesh``, and :class:`DemoArgs`, what every rank is given."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from collective_loader.delivery.config import Delivery
from collective_loader.plan import sharding
from collective_loader.plan.mesh import DEFAULT_PLACEMENT, PLACEMENTS, Placement
from collective_loader.plan.sharding import SplitName
from collective_loader.testing import launch
from collective_loader.text.layouts import INTEGER_TYPES, ColumnLayout
from collective_loader.text.packing import AtEnd

PROG = "python -m collective_loader demo"
SHUFFLE_SEED = 1234  # ours and the naive run's: the same shuffle of the same data
RUNS = {"collective_loader": "rank", "naive": "naive-rank"}  # --remote: run -> prefix of its ranks' client names


class UsageError(ValueError):
    """A flag the demo cannot run with; the message names the flag, what was found, what to give."""


@dataclass(frozen=True)
class DemoArgs:
    dims: tuple[str, ...]
    shape: tuple[int, ...]
    data: str
    samples: int
    batch_size: int
    seq_len: int
    split: SplitName
    delivery: Delivery
    num_workers: int
    placement: Placement = DEFAULT_PLACEMENT  # where the leaders sit (CollectiveLoader's placement=)
    timeout: float = 600.0  # seconds: the local world's limit, and any rank's wait for another after the epoch
    remote: str = ""  # --remote: the dataset's s3:// URL; ``data`` then holds the runs' cache dirs
    layout: ColumnLayout | None = None  # --data with LLM data (the leaders pack it); None: the demo's own data
    at_end: AtEnd = "pad"  # --at-end: the packing's last partial row and batch

    def stream_from(self, run: str) -> dict[str, Any]:
        """StreamingDataset's ``local`` (and ``remote``) for ``run``: with ``--remote``, a cache
        dir of the run's own, so that the naive run downloads for itself rather than finding ours."""
        if not self.remote:
            return {"local": self.data}
        return {"remote": self.remote, "local": os.path.join(self.data, run)}


def first_line(e: BaseException) -> str:
    """The first line of what ``e`` says (its type's name when it says nothing): for a one-line error."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def say_once(message: str) -> int:
    """Print ``message`` as the demo's one error line (under torchrun on rank 0 only, not once
    per rank); the exit code of a usage error, 2."""
    if not launch.under_torchrun() or os.environ["RANK"] == "0":
        print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors one line like the demo's own (no usage block: ``--help`` has it)."""

    def error(self, message: str) -> NoReturn:
        sys.exit(say_once(message))


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``"pp=2,dp=2,tp=2"`` -> ``(("pp", "dp", "tp"), (2, 2, 2))``."""
    try:
        pairs = [item.split("=") for item in text.split(",")]
        return tuple(n.strip() for n, _ in pairs), tuple(int(s) for _, s in pairs)
    except ValueError:
        raise UsageError(f"--mesh wants name=size pairs like pp=2,dp=2,tp=2, got {text!r}") from None


def parser(description: str) -> argparse.ArgumentParser:
    """Every flag of the demo (README.md's options list names each)."""
    p = OneLineParser(prog=PROG, description=description)
    p.add_argument(
        "--mesh", default="pp=2,dp=2,tp=2", help="dims in mesh order, outermost first (default pp=2,dp=2,tp=2)"
    )
    p.add_argument("--data", help="an MDS dataset: the demo's own (tokens and id) or LLM data (default: write one)")
    p.add_argument("--samples", type=int, default=256, help="samples to write when --data is not given")
    text = p.add_argument_group("LLM data (--data with a text column or a tokens column)")
    text.add_argument("--tokenizer", help="a text column: the tokenizer.json (or its directory) the leaders use")
    bos = text.add_mutually_exclusive_group()
    bos.add_argument("--bos-token", help="the tokenizer's BOS token (default: its tokenizer_config.json's bos_token)")
    bos.add_argument("--no-bos", action="store_true", help="add no BOS token before each document")
    eos = text.add_mutually_exclusive_group()
    eos.add_argument("--eos-token", help="the tokenizer's EOS token (default: its tokenizer_config.json's eos_token)")
    eos.add_argument("--no-eos", action="store_true", help="add no EOS token after each document")
    text.add_argument(
        "--token-dtype",
        choices=INTEGER_TYPES,
        help="a tokens column of bytes: the type they were written as (LLM Foundry's token_encoding_type; "
        "int64 when not given)",
    )
    text.add_argument(
        "--at-end",
        choices=("pad", "drop"),
        default="pad",
        help="pad or drop the last partial row and batch of the epoch",
    )
    p.add_argument("--batch-size", type=int, default=4, help="per-replica batch size")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument(
        "--split", choices=sharding.SPLITS, default="zigzag", help="how a sequence is cut over the shard dims"
    )
    p.add_argument("--delivery", choices=("broadcast", "scatter"), default="broadcast")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per leader")
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=DEFAULT_PLACEMENT,
        help="where each replica's leader sits: spread over the pipeline stages (default) or all on the first",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before the local world is stopped; also the longest any rank waits for another "
        "in the demo's own exchanges after the epoch",
    )
    p.add_argument(
        "--mix",
        action="store_true",
        help="three sources of documents tenfold apart in length, mixed on a two-phase schedule counted in tokens "
        "(MixtureSource), beside streaming's Stream(proportion=) mixing; checks every 8-step window",
    )
    p.add_argument(
        "--remote",
        action="store_true",
        help="serve the dataset from a local S3 endpoint (moto) and stream it from there; prints what each "
        "rank fetched",
    )
    return p
