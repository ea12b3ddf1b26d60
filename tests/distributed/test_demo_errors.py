"""Every flag the demo cannot run with is found on the launching process, before any rank starts:
one line on stderr naming the flag to give, exit code 2, in seconds. Real data (MDS shards written
by streaming's MDSWriter), a real tokenizer trained offline. Each case goes through the command's
own entry point (``collective_loader.__main__.main``) in this process, with stdout and stderr read
at the file descriptors, so a rank that started would show; two cases run the command line itself
(``python -m collective_loader demo``), which costs a torch import each."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from collective_loader import __main__ as cli
from collective_loader.testing.data import (
    BOS,
    EOS,
    text_documents,
    train_tokenizer,
    write_dataset,
    write_text_documents,
    write_token_documents,
)

PROG = "python -m collective_loader demo: error: "
SECONDS = 60  # a refusal comes before any world; this bounds a 2-core machine shared with other tests


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo_errors")
    texts = text_documents(40, seed=2)
    write_text_documents(str(root / "text"), texts)
    tokenizer = train_tokenizer(texts, str(root / "tok"))
    os.makedirs(root / "plain")  # a tokenizer.json alone: no tokenizer_config.json names its BOS / EOS
    shutil.copy(os.path.join(tokenizer, "tokenizer.json"), root / "plain" / "tokenizer.json")
    rng = np.random.default_rng(0)
    odd = [rng.integers(0, 50000, size=2 * int(n) + 1) for n in rng.integers(0, 40, size=40)]
    write_token_documents(str(root / "int32"), odd, "bytes", "int32")
    write_token_documents(str(root / "int32_even"), [np.append(d, 7) for d in odd], "bytes", "int32")
    write_token_documents(str(root / "uint16"), [d % 30000 + 35000 for d in odd], "bytes", "uint16")
    write_dataset(str(root / "own"), 16, 8)
    from streaming import MDSWriter

    with MDSWriter(out=str(root / "labels"), columns={"label": "int"}) as writer:
        writer.write({"label": 3})
    os.makedirs(root / "empty")
    (root / "notjson").mkdir()
    (root / "notjson" / "index.json").write_text("{")
    (root / "notjson" / "tokenizer.json").write_text("{}")
    names = ("text", "tok", "plain", "int32", "int32_even", "uint16", "own", "labels", "empty", "notjson")
    return {k: str(root / k) for k in names}


def one_line(code: int, out: str, err: str) -> str:
    """Assert a refusal's form (exit 2, one line on stderr, nothing on stdout: no rank started) and
    return its message."""
    assert code == 2, out + err
    assert out == "", out  # a world prints its ranks' log lines; none started
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PROG), err
    return lines[0][len(PROG) :]


def by_command(*args: str, env: dict[str, str] | None = None) -> str:
    """Run ``python -m collective_loader demo args``; the refusal's message."""
    proc = subprocess.run(
        [sys.executable, "-m", "collective_loader", "demo", *args],
        capture_output=True,
        text=True,
        timeout=SECONDS,
        env={**os.environ, **(env or {})},
    )
    return one_line(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def refused(capfd):
    """``refused(*args)``: the demo's entry point given ``demo args`` in this process (argparse's
    own refusals exit through ``SystemExit``); the refusal's message."""

    def run(*args: str) -> str:
        capfd.readouterr()
        try:
            code = cli.main(["demo", *args])
        except SystemExit as e:
            code = e.code
        out, err = capfd.readouterr()
        return one_line(code, out, err)

    return run


def test_data_that_is_not_a_directory(data):
    message = by_command("--data", data["text"] + "/nowhere")
    assert message == f"--data {data['text']}/nowhere: no such directory; give the directory an MDSWriter wrote"


def test_data_without_an_mds_index(data, refused):
    message = refused("--data", data["empty"])
    assert message.startswith(f"--data {data['empty']}: no index.json there"), message
    message = refused("--data", data["notjson"])
    assert message == f"--data {data['notjson']}: its index.json is not an MDS index (no list of shards)"


def test_data_without_a_column_the_demo_reads(data, refused):
    message = refused("--data", data["labels"])
    assert message.startswith(f"--data {data['labels']} has columns {{'label': 'int'}}: the demo reads a text column")


def test_text_without_a_tokenizer(data, refused):
    message = refused("--data", data["text"])
    assert "holds a text column: give --tokenizer PATH" in message, message


def test_a_tokenizer_path_with_no_tokenizer(data, refused):
    message = refused("--data", data["text"], "--tokenizer", data["empty"])
    assert message == f"--tokenizer {data['empty']}: no tokenizer.json there; give one, or the directory holding it"


def test_a_tokenizer_json_the_tokenizers_package_cannot_read(data, refused):
    bad = os.path.join(data["notjson"], "tokenizer.json")
    message = refused("--data", data["text"], "--tokenizer", bad)
    assert message.startswith(f"--tokenizer {bad}: the tokenizers package cannot read it ("), message


def test_a_tokenizer_json_alone_names_no_bos_or_eos(data, refused):
    """The issue's case: a plain tokenizer.json, nothing beside it to name BOS / EOS."""
    plain = os.path.join(data["plain"], "tokenizer.json")
    message = refused("--data", data["text"], "--tokenizer", plain)
    assert message == (
        f"--tokenizer {plain}: names no BOS token and names no EOS token (its special tokens: {BOS}, {EOS}); "
        "give --bos-token TOKEN (or --no-bos) and --eos-token TOKEN (or --no-eos)"
    )
    message = refused("--data", data["text"], "--tokenizer", plain, "--no-bos", "--mesh", "dp=2")
    assert message == (
        f"--tokenizer {plain}: names no EOS token (its special tokens: {BOS}, {EOS}); give --eos-token TOKEN (or --no-eos)"
    )


def test_a_bos_token_the_tokenizer_does_not_have(data, refused):
    message = refused("--data", data["text"], "--tokenizer", data["tok"], "--bos-token", "<s>")
    assert message == (
        f"--tokenizer {data['tok']}: has no token '<s>' (--bos-token) (its special tokens: {BOS}, {EOS}); "
        "give --bos-token TOKEN (or --no-bos)"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bos-token", BOS], "--bos-token sets how --tokenizer frames each document: give --tokenizer PATH too"),
        (["--no-eos", "--data", "{own}"], "--no-eos sets how --tokenizer frames each document"),
        (["--no-bos", "--bos-token", BOS], "argument --bos-token: not allowed with argument --no-bos"),
        (["--tokenizer", "{tok}", "--data", "{int32}"], "--tokenizer is for a text column; --data {int32} has columns"),
        (["--token-dtype", "int32", "--data", "{own}"], "--token-dtype is for token bytes; the tokens of --data"),
        (["--token-dtype", "int33"], "argument --token-dtype: invalid choice: 'int33'"),
    ],
)
def test_text_flags_without_the_data_they_are_for(data, refused, args, message):
    assert refused(*(a.format(**data) for a in args)).startswith(message.format(**data))


def test_token_bytes_of_int32_without_token_dtype(data, refused):
    """The issue's case: int32 bytes read as the default int64 (odd lengths: no whole number)."""
    message = refused("--data", data["int32"], "--mesh", "dp=2")
    assert re.fullmatch(
        rf"--data {data['int32']}: sample \d+'s tokens \(\d+ bytes\) does not read as int64 token ids; the first 40 "
        r"samples read as int32 \(ids \d+ to \d+\): give --token-dtype int32",
        message,
    ), message


def test_token_bytes_of_int32_that_read_as_int64_beyond_any_vocabulary(data, refused):
    """Even lengths: the bytes read as int64 without an error, two ids in each, the library
    accepts them; no vocabulary holds such ids."""
    message = refused("--data", data["int32_even"], "--mesh", "dp=2")
    assert re.fullmatch(
        rf"--data {data['int32_even']}: sample 0's tokens \(\d+ bytes\) reads as int64 ids up to \d+, beyond any "
        r"vocabulary; the first 40 samples read as int32 \(ids \d+ to \d+\): give --token-dtype int32",
        message,
    ), message


def test_token_bytes_of_uint16_given_a_type_that_does_not_fit(data, refused):
    """Ids of 35000-64999 as uint16, read as int16: negative ids, which the library refuses."""
    message = refused("--data", data["uint16"], "--token-dtype", "int16")
    assert re.fullmatch(
        rf"--data {data['uint16']}: sample \d+'s tokens \(\d+ bytes\) does not read as int16 token ids; "
        r"the first 40 samples read as uint16 \(ids \d+ to \d+\): give --token-dtype uint16",
        message,
    ), message


def test_remote_whose_endpoint_cannot_be_reached(data):
    """A proxy in the environment that nothing answers at: the endpoint this process serves is out
    of reach of its own clients (and so of every rank)."""
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
    env = {"HTTP_PROXY": dead, "http_proxy": dead, "NO_PROXY": "", "no_proxy": ""}
    message = by_command("--remote", "--mesh", "dp=2", env=env)
    assert re.fullmatch(
        r"--remote: the local S3 endpoint http://127\.0\.0\.1:\d+ cannot be reached from here \(.+\); "
        r"check HTTP_PROXY / NO_PROXY for 127\.0\.0\.1",
        message,
    ), message


# --- a bad --mesh, or --remote where it cannot run: one line, exit code 2, no rank started ----------

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--mesh", "foo=2"], {}, r"--mesh foo=2: dim 'foo' is not one of"),
        (["--mesh", "pp2"], {}, r"--mesh wants name=size pairs like pp=2,dp=2,tp=2, got 'pp2'"),
        (["--mesh", "dp=2,dp=2"], {}, r"--mesh dp=2,dp=2: mesh dim names must be unique"),
        (["--mesh", "dp=0"], {}, r"--mesh dp=0: mesh dims must have size >= 1"),
        (
            ["--mesh", "cp=3"],
            {},
            r"--mesh cp=3: --seq-len 64 cannot be split over cp=3 by the zigzag split; use a multiple of 6",
        ),
        # under torchrun (its environment, one process): the mesh must match the world it started
        (
            ["--mesh", "pp=2,dp=2,tp=2"],
            {**TORCHRUN_ENV, "WORLD_SIZE": "4"},
            r"--mesh pp=2,dp=2,tp=2: the mesh has 8 ranks, the world 4",
        ),
        # the endpoint lives in the process that starts the ranks: torchrun has none
        (["--remote"], TORCHRUN_ENV, r"--remote serves its S3 endpoint from the demo process that starts the ranks"),
        (["--remote", "--data", "/nonexistent"], {}, r"--remote uploads the demo's own dataset; leave out --data"),
    ],
)
def test_a_bad_mesh_or_remote_in_one_line_before_any_rank_starts(refused, monkeypatch, args, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert re.match(message, refused(*args))
