"""What users already write keeps working after the package moved into layers: the top-level names,
``collective_loader.streaming.StreamingSource`` and ``--module collective_loader.titan_configs``."""

from __future__ import annotations

import importlib


def test_top_level_names():
    import collective_loader

    for name in ("CollectiveLoader", "mesh_place", "Place", "MeshLayout", "LeaderError", "ShardDownloadError"):
        assert hasattr(collective_loader, name), name
    from collective_loader import CollectiveLoader, Place, mesh_place  # noqa: F401


def test_streaming_source_path():
    from collective_loader.streaming import StreamingSource, lm_collate
    from collective_loader.streaming.source import StreamingSource as moved
    from collective_loader.text import lm_collate as text_collate

    assert StreamingSource is moved and lm_collate is text_collate


def test_titan_configs_module_path_serves_the_integration():
    """TorchTitan resolves ``--module collective_loader.titan_configs --config NAME`` by importing
    the module and looking the name up on it."""
    shim = importlib.import_module("collective_loader.titan_configs")
    real = importlib.import_module("collective_loader.integrations.titan_configs")
    assert shim.TitanTrainer is real.TitanTrainer and shim.with_collective_loader is real.with_collective_loader
    config = shim.llama3_debugmodel()
    assert type(config).__qualname__ == "TitanTrainer.Config"
