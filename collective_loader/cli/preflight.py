"""The checks on the launching process, before any rank starts: every flag the demo cannot run
with becomes one :class:`~collective_loader.cli.args.UsageError` naming the flag to give, rather
than the same traceback from every rank at step 0 (or a torchrun world waiting for ranks that
never come). What is checked is the library's own checks, run on the first samples of ``--data``
(plain file reads: no ranks, no shared memory)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from collective_loader.cli.args import DemoArgs, UsageError, first_line, parse_mesh
from collective_loader.plan import sharding
from collective_loader.plan.mesh import DEFAULT_ROLES, MeshLayout
from collective_loader.plan.sharding import SplitName
from collective_loader.text import TextColumn, TokenColumn
from collective_loader.text.layouts import INTEGER_TYPES, ColumnLayout
from collective_loader.text.tokenizer import load_tokenizer

SNIFFED = 64  # samples of --data read here: enough to tell a dtype, few enough to take no time
# No tokenizer has 16 M tokens (the largest have about 256 K): ids beyond are bytes read as too
# wide a type (two ids in one).
MAX_VOCAB = 1 << 24


def preflight(ns: argparse.Namespace, world_size: int | None) -> DemoArgs:
    """The parsed flags checked, as what every rank is given; a UsageError for the first that
    cannot run. ``world_size``: the ranks torchrun started (None when the demo starts its own)."""
    dims, shape = check_mesh(ns.mesh, ns.seq_len, ns.split, world_size)
    mixed = [f for f, v in (("--data", ns.data), ("--remote", ns.remote), ("--tokenizer", ns.tokenizer)) if v]
    if ns.mix and mixed:
        raise UsageError(f"--mix writes and mixes its own three sources: leave out {mixed[0]}")
    if ns.remote:
        check_remote(ns.data, world_size is not None)
    text_flags = [f for f, v in (("--bos-token", ns.bos_token), ("--eos-token", ns.eos_token)) if v]
    text_flags += [f for f, v in (("--no-bos", ns.no_bos), ("--no-eos", ns.no_eos)) if v]
    if ns.tokenizer and ns.token_dtype:
        raise UsageError("give --tokenizer for a text column or --token-dtype for token bytes, not both")
    if text_flags and not ns.tokenizer:
        raise UsageError(f"{text_flags[0]} sets how --tokenizer frames each document: give --tokenizer PATH too")
    if not ns.data and (ns.tokenizer or ns.token_dtype):
        raise UsageError("--tokenizer and --token-dtype read LLM data given with --data DIR")
    layout = None
    if ns.data:
        layout = data_layout(ns.data, ns.tokenizer, ns.token_dtype)
        if isinstance(layout, TextColumn):
            layout = replace(
                layout, add_bos=not ns.no_bos, add_eos=not ns.no_eos, bos_token=ns.bos_token, eos_token=ns.eos_token
            )
            check_tokenizer(layout)
        elif isinstance(layout, TokenColumn):
            check_token_dtype(ns.data, layout, first_samples(ns.data))
    return DemoArgs(
        dims,
        shape,
        ns.data or "",
        ns.samples,
        ns.batch_size,
        ns.seq_len,
        ns.split,
        ns.delivery,
        ns.num_workers,
        ns.placement,
        timeout=ns.timeout,
        layout=layout,
        at_end=ns.at_end,
    )


# --- --mesh and --remote --------------------------------------------------------------------------


def check_mesh(
    text: str, seq_len: int, split: SplitName, world_size: int | None
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The dims and sizes of ``--mesh text``, or a UsageError saying what to change.
    ``world_size``: the ranks torchrun started (None when the demo starts its own world)."""
    dims, shape = parse_mesh(text)
    unknown = [n for n in dims if n not in DEFAULT_ROLES]
    if unknown:
        raise UsageError(f"--mesh {text}: dim {unknown[0]!r} is not one of {', '.join(DEFAULT_ROLES)}")
    try:
        roles = MeshLayout.build(dims, shape, range(math.prod(shape))).roles
    except ValueError as e:
        raise UsageError(f"--mesh {text}: {e}") from None
    if world_size is not None and math.prod(shape) != world_size:
        raise UsageError(
            f"--mesh {text}: the mesh has {math.prod(shape)} ranks, the world {world_size}; give sizes whose product "
            "is the number of ranks torchrun starts"
        )
    shard = [(n, size) for n, size, role in zip(dims, shape, roles) if role == "shard"]
    need = sharding.divisor([(size, 0) for _, size in shard], split)
    if seq_len % need:
        over = " x ".join(f"{n}={size}" for n, size in shard)
        raise UsageError(
            f"--mesh {text}: --seq-len {seq_len} cannot be split over {over} by the {split} split; "
            f"use a multiple of {need}"
        )
    return dims, shape


def check_remote(data: str | None, torchrun: bool) -> None:
    """A UsageError saying why ``--remote`` cannot run with these options or here."""
    if torchrun:
        raise UsageError(
            "--remote serves its S3 endpoint from the demo process that starts the ranks, and under torchrun no "
            "such process exists: run python -m collective_loader demo --remote"
        )
    if data:
        raise UsageError("--remote uploads the demo's own dataset; leave out --data")
    if importlib.util.find_spec("moto") is None:
        raise UsageError("--remote needs moto's S3 server: pip install -e '.[s3]'")


# --- --data -----------------------------------------------------------------------------------------


def dataset_columns(path: str) -> dict[str, str]:
    """Column name -> MDS encoding of the dataset at ``path`` (its index.json's first shard)."""
    if not os.path.isdir(path):
        raise UsageError(f"--data {path}: no such directory; give the directory an MDSWriter wrote")
    index = os.path.join(path, "index.json")
    try:
        with open(index) as f:
            shards = json.load(f)["shards"]
    except FileNotFoundError:
        raise UsageError(
            f"--data {path}: no index.json there, so no MDS dataset; give the directory an MDSWriter wrote"
        ) from None
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"--data {path}: its index.json is not an MDS index (no list of shards)") from None
    if not shards:
        raise UsageError(f"--data {path}: the dataset has no shards")
    return dict(zip(shards[0]["column_names"], shards[0]["column_encodings"]))


def data_layout(path: str, tokenizer: str | None, token_dtype: str | None) -> ColumnLayout | None:
    """How the demo reads ``--data``: ``None`` for its own data (``tokens`` ndarray rows with an
    ``id``), else the layout of LLM data, or a UsageError saying what to pass."""
    columns = dataset_columns(path)
    if columns.get("text") == "str":
        if not tokenizer:
            raise UsageError(
                f"--data {path} holds a text column: give --tokenizer PATH (a tokenizer.json or its directory)"
            )
        return TextColumn(tokenizer)
    encoding = columns.get("tokens", "")
    if tokenizer:
        raise UsageError(f"--tokenizer is for a text column; --data {path} has columns {columns}")
    if encoding == "bytes":
        return TokenColumn(dtype=token_dtype)  # int64 when none is given, as LLM Foundry reads them
    if encoding.startswith("ndarray"):
        if token_dtype:
            raise UsageError(f"--token-dtype is for token bytes; the tokens of --data {path} are {encoding}")
        return None if "id" in columns else TokenColumn()
    raise UsageError(
        f"--data {path} has columns {columns}: the demo reads a text column (str), a tokens column (bytes or "
        "ndarray), or its own data (tokens ndarray and id)"
    )


def first_samples(path: str, n: int = SNIFFED) -> list[dict[str, Any]]:
    """The first ``n`` samples of the MDS dataset at ``path``, decoded (plain file reads)."""
    from streaming import LocalDataset

    try:
        dataset = LocalDataset(path)
        return [dataset[i] for i in range(min(n, len(dataset)))]
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--data {path}: its shards cannot be read ({type(e).__name__}: {first_line(e)})") from None


# --- LLM data: the tokenizer, the token bytes' type ------------------------------------------------


def check_tokenizer(layout: TextColumn) -> None:
    """A UsageError unless ``layout``'s tokenizer loads and finds the BOS / EOS it is to add: the
    library's own checks (whose words are the API's), in flags."""
    path = layout.tokenizer
    try:
        tokenizer = load_tokenizer(path)
    except ValueError:
        raise UsageError(
            f"--tokenizer {path}: no tokenizer.json there; give one, or the directory holding it"
        ) from None
    except Exception as e:  # the tokenizers package raises plain Exceptions for a file it cannot parse
        raise UsageError(f"--tokenizer {path}: the tokenizers package cannot read it ({first_line(e)})") from None
    found, give = [], []
    for which, wanted, token in (("bos", layout.add_bos, layout.bos_token), ("eos", layout.add_eos, layout.eos_token)):
        if not wanted or _encodes(replace(layout, add_bos=which == "bos", add_eos=which == "eos")):
            continue
        found.append(f"has no token {token!r} (--{which}-token)" if token else f"names no {which.upper()} token")
        give.append(f"--{which}-token TOKEN (or --no-{which})")
    if found:
        special = sorted(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
        has = f"its special tokens: {', '.join(special)}" if special else "it has no special tokens"
        raise UsageError(f"--tokenizer {path}: {' and '.join(found)} ({has}); give {' and '.join(give)}")


def _encodes(layout: TextColumn) -> bool:
    """Whether ``layout``'s encoder finds its BOS / EOS (the library's check: ValueError if not)."""
    try:
        layout.encoder()([""])
    except ValueError:
        return False
    return True


def check_token_dtype(path: str, layout: TokenColumn, samples: Sequence[Mapping[str, Any]]) -> None:
    """A UsageError unless the token bytes of ``samples`` read as ids of ``layout``'s dtype (the
    library's check) that a vocabulary can hold; it names the ``--token-dtype`` they do read as."""
    if not any(isinstance(s[layout.column], (bytes, bytearray, memoryview)) for s in samples):
        return  # an ndarray column says its own type
    given = layout.dtype or "int64"
    bad = next((i for i, s in enumerate(samples) if not _fits(layout, s)), None)
    if bad is None:
        return
    what = samples[bad][layout.column]
    size = f"{len(what)} bytes" if isinstance(what, (bytes, bytearray, memoryview)) else type(what).__name__
    try:
        read = f"reads as {given} ids up to {layout.read(samples[bad]).max()}, beyond any vocabulary"
    except ValueError:
        read = f"does not read as {given} token ids"
    found = f"--data {path}: sample {bad}'s {layout.column} ({size}) {read}"
    widest_first = sorted(INTEGER_TYPES, key=lambda t: -np.dtype(t).itemsize)  # signed before unsigned
    fit = next((t for t in widest_first if all(_fits(TokenColumn(layout.column, t), s) for s in samples)), None)
    if fit is None:
        raise UsageError(f"{found}, nor as any of {', '.join(INTEGER_TYPES)}: check how the column was written")
    ids = np.concatenate([TokenColumn(layout.column, fit).read(s) for s in samples])
    raise UsageError(
        f"{found}; the first {len(samples)} samples read as {fit} (ids {ids.min()} to {ids.max()}): "
        f"give --token-dtype {fit}"
    )


def _fits(layout: TokenColumn, sample: Mapping[str, Any]) -> bool:
    """Whether ``sample`` reads as ``layout``'s ids (the library's check) below :data:`MAX_VOCAB`."""
    try:
        ids = layout.read(sample)
    except ValueError:
        return False
    return not len(ids) or int(ids.max()) < MAX_VOCAB
