"""Text data for language models: what a leader turns its samples into (token ids, labels, positions).

* :mod:`~collective_loader.text.layouts`: where a sample's tokens are (LLM Foundry's MDS
  layouts): :class:`TokenColumn` (bytes of a dtype, or an integer ndarray), :class:`TextColumn`;
* :mod:`~collective_loader.text.tokenizer`: :class:`TextEncoder`, one call over the tokenizers users have;
* :mod:`~collective_loader.text.packing`: :class:`Packing`, the :class:`Packer` and the batch of
  packed rows with its document boundaries;
* :mod:`~collective_loader.text.balance`: :class:`Balance`, packed rows placed over the
  data-parallel replicas by attention cost;
* :mod:`~collective_loader.text.rows`: :class:`PackedRows`, a packing leader's epoch and its cursor;
* :mod:`~collective_loader.text.resume`: the hand-over that makes a resume exact;
* :mod:`~collective_loader.text.collate`: :func:`lm_collate` for rows written whole;
* :mod:`~collective_loader.text.mixture`: a mixture's :class:`MixtureSchedule` (its ``MixtureSchedule.Phase`` list) and
  the :class:`~collective_loader.text.mixture.Allocation` that names each packed row's source.
"""

from collective_loader.text.balance import Balance
from collective_loader.text.collate import lm_collate
from collective_loader.text.layouts import TextColumn, TokenColumn
from collective_loader.text.mixture import MixtureSchedule
from collective_loader.text.packing import Packing

__all__ = [
    "Balance",
    "MixtureSchedule",
    "Packing",
    "TextColumn",
    "TokenColumn",
    "lm_collate",
]
