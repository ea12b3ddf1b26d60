"""Test-only: TorchTitan 0.3's own ``torchtitan.train`` on a CPU machine, with gloo.

Run as a script under torchrun, it makes the process-wide adjustments below and then calls
``torchtitan.train.main()`` unchanged::

    torchrun --nproc-per-node 4 tests/support/titan_cpu.py --module titan_trainer_configs --config ours \\
        --dataloader.dataset_path /tmp/mds --dataloader.record /tmp/run/rec --dump_folder /tmp/run \\
        --parallelism.pipeline_parallel_degree 2

The config-level adjustments are :func:`cpu_config`, which the test configs apply. Every one is
needed only because there is no accelerator (or no tokenizer file) here; none is needed on GPUs:

- ``torchtitan.tools.utils.device_type = "cpu"`` and a ``device_module`` stand-in, set before any
  other torchtitan module is imported (several copy them at import): without an accelerator
  TorchTitan falls back to ``"cuda"`` and ``torch.cuda``;
- FSDP modules sum their gradients (``set_force_sum_reduction_for_comms(True)``): gloo has no
  ``PREMUL_SUM`` reduction;
- SDPA instead of FlexAttention in every layer: FlexAttention has no CPU backward. Each sample
  is one document here, so causal SDPA computes what block-causal FlexAttention would;
- ``training.disable_cuda_graphs`` (the Trainer refuses pp > 1 without it);
- a tokenizer that does nothing: the wheel ships no tokenizer files, and the data are tokens.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.tokenizer import (
    BaseTokenizer,  # imports no module that reads the device
)


class CpuDevice(types.SimpleNamespace):
    """What TorchTitan calls on ``device_module`` (``torch.cuda`` on GPUs), answered for the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def set_device(self, device: Any) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        return types.SimpleNamespace(name="cpu", total_memory=1 << 40)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}


def patch_process() -> None:
    """The process-wide adjustments; call before any torchtitan module but ``tools.utils`` is imported."""
    import torchtitan.tools.utils as utils

    utils.device_type, utils.device_module = "cpu", CpuDevice()
    import torchtitan.distributed.fsdp as fsdp

    fully_shard = fsdp.fully_shard

    def fully_shard_summing(module: Any, *args: Any, **kwargs: Any) -> Any:
        sharded = fully_shard(module, *args, **kwargs)
        for each in sharded if isinstance(sharded, list) else [sharded]:  # a list shards as one unit
            each.set_force_sum_reduction_for_comms(True)
        return sharded

    fsdp.fully_shard = fully_shard_summing


def cpu_config(config: Any) -> Any:
    """The config-level adjustments (SDPA, no CUDA graphs, a do-nothing tokenizer), in place."""
    from torchtitan.models.common.attention import (
        FlexAttention,
        ScaledDotProductAttention,
    )

    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.training.disable_cuda_graphs = True
    config.tokenizer = NoTokenizer.Config()
    return config


class NoTokenizer(BaseTokenizer):
    """The Trainer always builds a tokenizer; these data are token ids already."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError("the data are token ids already")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError("the data are token ids already")

    def get_vocab_size(self) -> int:
        raise NotImplementedError("the model config holds the vocabulary size")


if __name__ == "__main__":
    patch_process()
    from torchtitan.train import main

    main()
