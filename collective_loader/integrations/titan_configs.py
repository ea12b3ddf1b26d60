"""``--module collective_loader.integrations.titan_configs``: every config function of TorchTitan
0.3's model registries (``torchtitan/models/<family>/config_registry.py``: llama3, qwen3, qwen3_5,
deepseek_v3, gpt_oss, kimi_k2_7, muse_glimmer, flux) under its own name, its dataloaders loaded
once per data-parallel replica (:func:`~.titan_trainer.load_once_per_replica`)::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module collective_loader.integrations.titan_configs --config llama3_8b \\
        --parallelism.pipeline_parallel_degree 2

This module's one job is to serve those names; the config functions for your own configs are in
:mod:`collective_loader.integrations.titan_trainer`.

TorchTitan's ``ConfigManager`` resolves ``--config NAME`` with ``getattr(module, NAME)`` and, for a
name that is not there, lists ``dir(module)``; and one family's registry cannot be imported
everywhere (qwen3_5 needs the ``fla`` package). So the names are read from the registries' source
(:func:`registry_configs`) and served by the module's ``__getattr__``, which imports a family only
when one of its functions is called: a family that fails to import is still listed, and fails,
when chosen, with TorchTitan's own error.
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
from collections.abc import Callable

from torchtitan.trainer import Trainer

from collective_loader.integrations.titan_trainer import load_once_per_replica


@functools.cache
def registry_configs() -> dict[str, str]:
    """Config function name -> its registry module, for every TorchTitan model family: the public
    top-level functions of each ``config_registry.py`` whose parameters all have defaults.

    >>> registry_configs()["llama3_debugmodel"]
    'torchtitan.models.llama3.config_registry'
    """
    import torchtitan.models

    found: dict[str, str] = {}
    root = os.path.dirname(torchtitan.models.__file__)
    for family in sorted(torchtitan.models._supported_models):
        with open(os.path.join(root, family, "config_registry.py")) as f:
            functions = [node for node in ast.parse(f.read()).body if isinstance(node, ast.FunctionDef)]
        for function in functions:
            args = function.args
            every_default = len(args.defaults) == len(args.posonlyargs + args.args) and None not in args.kw_defaults
            if every_default and not function.name.startswith("_"):
                found[function.name] = f"torchtitan.models.{family}.config_registry"
    return found


def __getattr__(name: str) -> Callable[[], Trainer.Config]:
    """``--config <name>``: TorchTitan's config function ``name``, loading once per replica. Its
    registry is imported when the function is called (TorchTitan looks up every listed name)."""
    registry = registry_configs().get(name)
    if registry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return functools.partial(_served, registry, name)


def _served(registry: str, name: str) -> Trainer.Config:
    """``<registry>.<name>()`` with :func:`~.titan_trainer.load_once_per_replica`."""
    return load_once_per_replica(getattr(importlib.import_module(registry), name)())


def __dir__() -> list[str]:
    return sorted(registry_configs())
