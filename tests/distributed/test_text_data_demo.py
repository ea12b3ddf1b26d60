"""``python -m collective_loader demo --data DIR`` on LLM data as LLM Foundry writes it: a text column
with a tokenizer path, token bytes with their dtype; the checks pass on the packed rows and the
packing figures are printed. What the demo refuses (a text column without a tokenizer, ...):
test_demo_errors.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from collective_loader.testing.data import (
    BOS,
    EOS,
    text_documents,
    train_tokenizer,
    write_text_documents,
    write_token_documents,
)

FIGURES = re.compile(
    r"replica (\d): (\d+) documents, (\d+) rows, (\d+) tokens, (\d+) carried over into a next row, "
    r"padding ([\d.]+)% of the token slots"
)


@pytest.fixture(scope="module")
def llm_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo_llm")
    texts = text_documents(120, seed=4)
    write_text_documents(str(root / "text"), texts)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, size=int(n)) for n in rng.integers(1, 90, size=120)]
    write_token_documents(str(root / "bytes"), docs, "bytes", "uint16")
    os.makedirs(root / "plain")  # a tokenizer.json alone: its BOS / EOS come from the demo's flags
    shutil.copy(os.path.join(train_tokenizer(texts, str(root / "tok")), "tokenizer.json"), root / "plain")
    return {
        "text": str(root / "text"),
        "tokenizer": str(root / "plain" / "tokenizer.json"),
        "bytes": str(root / "bytes"),
    }


def demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "collective_loader", "demo", *args], capture_output=True, text=True, timeout=240
    )


def test_demo_packs_a_text_column_with_a_tokenizer(llm_data):
    """A tokenizer.json with nothing beside it to name BOS / EOS: --bos-token and --eos-token do."""
    proc = demo(
        *("--data", llm_data["text"], "--tokenizer", llm_data["tokenizer"], "--bos-token", BOS, "--eos-token", EOS),
        *("--mesh", "pp=2,dp=2", "--seq-len", "32"),
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "all checks passed" in out and out.count("[ok]") == 5, out
    figures = FIGURES.findall(out)
    assert [f[0] for f in figures] == ["0", "1"], out
    assert all(int(rows) > 0 and int(tokens) > 0 for _, _, rows, tokens, *_ in figures), out


@pytest.mark.slow  # 40-60 s here; the text case covers the packing path by default
def test_demo_packs_token_bytes_of_a_dtype_over_cp(llm_data):
    proc = demo(
        "--data",
        llm_data["bytes"],
        "--token-dtype",
        "uint16",
        "--mesh",
        "dp=2,cp=2",
        "--seq-len",
        "32",
        "--at-end",
        "drop",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout and "padding 0.0%" in proc.stdout, proc.stdout
