"""Text data for language models: what a leader turns its samples into (token ids, labels, positions)."""

from collective_loader.text.collate import lm_collate

__all__ = ["lm_collate"]
