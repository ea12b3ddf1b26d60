"""Trainers' own shapes and state formats on top of :class:`~collective_loader.CollectiveLoader`:
TorchTitan (:mod:`.titan`, :mod:`.titan_configs`) and Megatron-style ``get_batch`` (:mod:`.megatron`)."""
