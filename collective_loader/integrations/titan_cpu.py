"""TorchTitan 0.3's own ``torchtitan.train`` on a machine without an accelerator (gloo, CPUs).

A launcher with TorchTitan's command line: under torchrun, ``-m collective_loader.integrations.titan_cpu``
in place of ``-m torchtitan.train``, every flag unchanged::

    torchrun --nproc-per-node 4 -m collective_loader.integrations.titan_cpu \\
        --module collective_loader.integrations.titan_configs --config llama3_debugmodel \\
        --dataloader.dataset c4_test --dataloader.dataset_path ./my_text --hf_assets_path ./my_tokenizer \\
        --parallelism.pipeline_parallel_degree 2 --training.steps 4

It makes the changes below, each needed only because there is no accelerator, and then runs
``torchtitan.train.main()`` unchanged. None is needed on GPUs, and none touches the data.

- ``torchtitan.tools.utils.device_type = "cpu"`` and a ``device_module`` stand-in
  (:class:`CpuDevice`), set before any other torchtitan module is imported (several copy them at
  import): without an accelerator TorchTitan falls back to ``"cuda"`` and ``torch.cuda``;
- FSDP modules sum their gradients (``set_force_sum_reduction_for_comms(True)``): gloo has no
  ``PREMUL_SUM`` reduction, which FSDP's averaging uses;
- in the config ``--config`` names (:func:`cpu_config`): SDPA instead of FlexAttention in every
  layer (FlexAttention has no CPU backward), ``training.disable_cuda_graphs`` (the Trainer
  refuses pp > 1 without it), and FSDP's parameters in float32
  (``training.mixed_precision_param``: a CPU without bfloat16 instructions converts each bfloat16
  matmul, 60 times slower than float32 on this project's 2-core machine).

SDPA is causal over the whole row, where FlexAttention is block-causal per document: rows packed
from several documents attend across their boundaries here, so losses differ from a GPU run's
(a run whose samples are one document each computes the same).
"""

from __future__ import annotations

import types
from typing import Any

import torch


class CpuDevice(types.SimpleNamespace):
    """What TorchTitan calls on ``device_module`` (``torch.cuda`` on GPUs), answered for the CPU.

    >>> CpuDevice().get_device_name(), CpuDevice().current_device()
    ('cpu', 0)
    """

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


_patched = False


def patch_process() -> None:
    """The process-wide changes (device, FSDP's reduction). Call before any torchtitan module
    but ``torchtitan.tools.utils`` is imported: several copy its device at import. A process that
    imported torchtitan after calling it (a parent that forks ranks) passes the changes on to
    them: later calls do nothing."""
    global _patched
    if _patched:
        return
    _patched = True
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
    """A ``Trainer.Config``'s changes for the CPU (SDPA for FlexAttention, no CUDA graphs, float32
    parameters), in place; returns ``config``. Applied to every config the launcher loads; flags
    still override.

    >>> from torchtitan.models.llama3.config_registry import llama3_debugmodel
    >>> cpu_config(llama3_debugmodel()).training.disable_cuda_graphs
    True
    """
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.training.disable_cuda_graphs = True
    config.training.mixed_precision_param = "float32"
    return config


def main() -> None:
    """``torchtitan.train.main()`` on the CPU: TorchTitan's command line (``sys.argv``), its
    config from ``--module``/``--config`` passed through :func:`cpu_config` before the flags apply."""
    patch_process()
    from torchtitan.config.manager import ConfigManager
    from torchtitan.train import main as train

    load = ConfigManager._load_config

    def load_for_cpu(self: ConfigManager, args: list[str]) -> tuple[object, list[str]]:
        config, rest = load(self, args)
        return cpu_config(config), rest

    ConfigManager._load_config = load_for_cpu  # type: ignore[method-assign]
    train()


if __name__ == "__main__":
    main()
