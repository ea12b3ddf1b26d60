"""One call for the tokenizers users have: texts -> token ids, with BOS / EOS as configured.

:class:`TextEncoder` takes

* a ``tokenizers.Tokenizer``: batches go through ``encode_batch`` (no special tokens of its own);
  BOS / EOS are the tokens named ``bos_token`` / ``eos_token``;
* a path: a ``tokenizer.json``, or a directory holding one (a Hugging Face assets directory, as
  TorchTitan's ``--hf_assets_path``); BOS / EOS are ``bos_token`` / ``eos_token``, else those its
  ``tokenizer_config.json`` names;
* a ``transformers`` tokenizer (``PreTrainedTokenizerBase``): ``tokenizer(texts,
  add_special_tokens=False)``, BOS / EOS its ``bos_token_id`` / ``eos_token_id``;
* TorchTitan's ``BaseTokenizer``: ``encode(text, add_bos=, add_eos=)`` per text (it knows its own
  BOS / EOS).

The adapter is resolved lazily, where it first encodes (a leader or its DataLoader worker), so a
path is read there only. A BOS / EOS that is asked for and cannot be found raises ``ValueError``
saying what to pass.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


def _is(obj: Any, module: str, name: str) -> bool:
    """Whether ``obj``'s class derives from ``module``'s ``name`` (read from the MRO: nothing imported)."""
    return any(c.__name__ == name and c.__module__.startswith(module) for c in type(obj).__mro__)


def _config_token(directory: str, key: str) -> str | None:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        value = json.load(f).get(key)
    return value.get("content") if isinstance(value, dict) else value


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The ``tokenizers.Tokenizer`` saved at ``path`` (a ``tokenizer.json`` or a directory holding one)."""
    from tokenizers import Tokenizer

    path = os.fspath(path)
    file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise ValueError(f"no tokenizer at {path!r}: pass a tokenizer.json or a directory holding one")
    return Tokenizer.from_file(file)


class TextEncoder:
    """``encoder(texts) -> [[ids], ...]``: each text's token ids, BOS first and EOS last as asked.

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "a": 2, "b": 3}, unk_token="<s>"))
    >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> TextEncoder(tok, add_bos=True, add_eos=True, bos_token="<s>", eos_token="</s>")(["a b", "b"])
    [[0, 2, 3, 1], [0, 3, 1]]
    """

    def __init__(
        self, tokenizer: Any, add_bos: bool, add_eos: bool, bos_token: str | None = None, eos_token: str | None = None
    ) -> None:
        self.tokenizer, self.add_bos, self.add_eos = tokenizer, add_bos, add_eos
        self.bos_token, self.eos_token = bos_token, eos_token
        self._encode: Callable[[list[str]], list[list[int]]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_encode": None}  # resolved again where it is used

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        if self._encode is None:
            self._encode = self._resolve()
        return self._encode(list(texts))

    def _resolve(self) -> Callable[[list[str]], list[list[int]]]:
        tok = self.tokenizer
        if isinstance(tok, (str, os.PathLike)):
            path = os.fspath(tok)
            directory = path if os.path.isdir(path) else os.path.dirname(path)
            bos = self.bos_token or _config_token(directory, "bos_token")
            eos = self.eos_token or _config_token(directory, "eos_token")
            return self._fast(load_tokenizer(path), bos, eos, f"the tokenizer at {path!r}")
        if _is(tok, "torchtitan", "BaseTokenizer"):
            if self.bos_token or self.eos_token:
                raise ValueError("TorchTitan's tokenizer adds its own BOS / EOS: leave out bos_token / eos_token")
            add_bos, add_eos = self.add_bos, self.add_eos
            return lambda texts: [list(tok.encode(t, add_bos=add_bos, add_eos=add_eos)) for t in texts]
        if _is(tok, "transformers", "PreTrainedTokenizerBase"):
            bos_id = self._id("BOS", self.add_bos, self.bos_token, tok.convert_tokens_to_ids, tok.bos_token_id)
            eos_id = self._id("EOS", self.add_eos, self.eos_token, tok.convert_tokens_to_ids, tok.eos_token_id)
            return self._framed(lambda texts: tok(texts, add_special_tokens=False)["input_ids"], bos_id, eos_id)
        if _is(tok, "tokenizers", "Tokenizer"):
            return self._fast(tok, self.bos_token, self.eos_token, "the tokenizers.Tokenizer")
        raise ValueError(
            f"cannot tokenize with a {type(tok).__qualname__}: pass a tokenizers.Tokenizer, a transformers tokenizer, "
            "TorchTitan's BaseTokenizer, or the path of a tokenizer.json"
        )

    def _fast(self, tok: Any, bos: str | None, eos: str | None, what: str) -> Callable[[list[str]], list[list[int]]]:
        bos_id = self._id("BOS", self.add_bos, bos, tok.token_to_id, None, what)
        eos_id = self._id("EOS", self.add_eos, eos, tok.token_to_id, None, what)
        return self._framed(
            lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)], bos_id, eos_id
        )

    @staticmethod
    def _id(
        which: str,
        wanted: bool,
        token: str | None,
        lookup: Callable[[str], Any],
        default: int | None,
        what: str = "the tokenizer",
    ) -> int | None:
        if not wanted:
            return None
        found = lookup(token) if token is not None else default
        if found is None or (token is not None and not isinstance(found, int)):
            name = f"{which.lower()}_token"
            said = f"has no token {token!r}" if token is not None else f"names no {which} token"
            raise ValueError(f"{what} {said}: pass {name}='<its {which} token>', or add_{which.lower()}=False")
        return int(found)

    @staticmethod
    def _framed(
        encode: Callable[[list[str]], list[list[int]]], bos_id: int | None, eos_id: int | None
    ) -> Callable[[list[str]], list[list[int]]]:
        head = [bos_id] if bos_id is not None else []
        tail = [eos_id] if eos_id is not None else []
        return lambda texts: [head + list(ids) + tail for ids in encode(texts)] if texts else []
