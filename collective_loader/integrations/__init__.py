"""Trainers' own shapes and state formats on top of :class:`~collective_loader.CollectiveLoader`:
TorchTitan (:mod:`.titan`, :mod:`.titan_wrap` for its own dataloaders, :mod:`.titan_configs` for its
Trainer) and Megatron-style ``get_batch`` (:mod:`.megatron`)."""
