"""megatron-core (0.16 and 0.19) on CPU ranks (gloo): the stand-ins for its hard-coded CUDA calls, in one place.

Megatron-core's pipeline schedules and their point-to-point layer allocate a few tensors on the
GPU unconditionally, whatever the model's device. On a CPU-only machine those calls raise, so
``use_cpu()`` points exactly them at the CPU, in this process only, and changes nothing else:

* ``pipeline_parallel/schedules.py``: ``torch.zeros([], dtype=torch.int, device="cuda")``, the
  token counter of every schedule (``total_num_tokens``); ``schedules.torch`` becomes a view of
  ``torch`` whose ``zeros`` makes ``device="cuda"`` the CPU.
* ``pipeline_parallel/p2p_communication.py``: the receive buffers (``torch.empty(...,
  device=torch.cuda.current_device())``) and the shape messages; ``p2p_communication.torch``
  becomes a view of ``torch`` whose ``cuda.current_device()`` is ``"cpu"``.
* ``utils.py``: ``GlobalMemoryBuffer.get_tensor``, the buffer the local attention
  (``DotProductAttention``) computes its scores into, on ``torch.cuda.current_device()``;
  ``utils.torch`` becomes the same view.

What needs no stand-in, because megatron-core has a switch for it (set by the caller):
``TransformerConfig(batch_p2p_sync=False)`` skips the ``torch.cuda.synchronize()`` after each
batched send/receive; ``use_cpu_initialization=True`` builds the weights on the CPU;
``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)`` seeds a tracker that does
not read CUDA's RNG; an explicit attention mask keeps the local attention off fused CUDA kernels.

Example (each rank, before its first schedule call)::

    megatron_cpu.use_cpu()
    forward_backward = get_forward_backward_func()
"""

from __future__ import annotations

import types
from typing import Any

import torch


class _View(types.SimpleNamespace):
    """``module`` with the names given here replaced; every other name is the module's own."""

    def __init__(self, module: types.ModuleType, **replaced: Any) -> None:
        super().__init__(**replaced)
        self._module = module

    def __getattr__(self, name: str) -> Any:  # only for names not replaced
        return getattr(self._module, name)


def _zeros_off_cuda(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
    return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


def use_cpu() -> None:
    """Point megatron-core's hard-coded CUDA tensors at the CPU in this process (idempotent)."""
    from megatron.core import utils
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    schedules.torch = _View(torch, zeros=_zeros_off_cuda)
    p2p_communication.torch = utils.torch = _View(torch, cuda=_View(torch.cuda, current_device=lambda: "cpu"))
