"""Trainers' own shapes and state formats on top of :class:`~collective_loader.CollectiveLoader`.

Here, without TorchTitan installed: :class:`TitanDataLoader` (:mod:`.titan`, a dataloader
TorchTitan's trainer can use in a loop of your own) and Megatron-style ``get_batch``
(:mod:`.megatron`). What imports torchtitan (its Trainer, its own dataloaders) is in the other
``titan_*`` modules; docs/api.md lists their public names.
"""

from collective_loader.integrations.megatron import get_batch, megatron_loader
from collective_loader.integrations.titan import TitanDataLoader

__all__ = ["TitanDataLoader", "get_batch", "megatron_loader"]
