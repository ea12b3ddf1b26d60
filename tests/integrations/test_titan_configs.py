"""``--module collective_loader.integrations.titan_configs --config NAME``: every config function of TorchTitan's
model registries, its dataloaders wrapped (``load_once_per_replica``), parsed by TorchTitan's own
``ConfigManager`` as ``torchtitan.train`` does; a wrong name lists the available ones."""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass

import pytest
from torchtitan.config import ConfigManager
from torchtitan.trainer import Trainer

from collective_loader.integrations import titan_configs
from collective_loader.integrations.titan_trainer import CollectiveMesh, TitanTrainer, load_once_per_replica
from collective_loader.integrations.titan_wrap import ReplicaDataLoader, unwrap_dataloader

FAMILIES = {  # a config function of each model family TorchTitan 0.3 ships
    "llama3": "llama3_8b",
    "qwen3": "qwen3_0_6b",
    "qwen3_5": "qwen35_9b",
    "deepseek_v3": "deepseek_v3_16b",
    "gpt_oss": "gpt_oss_20b",
    "kimi_k2_7": "kimi_k2_5",
    "muse_glimmer": "muse_glimmer_30b",
    "flux": "flux_dev",
}


def plain(config) -> str:
    """A config's values (TorchTitan's ``to_dict``), without the addresses in reprs of callables."""
    return re.sub(r" at 0x[0-9a-f]+", "", json.dumps(config.to_dict(), sort_keys=True, default=repr))


def test_every_registry_config_function_is_served_with_its_dataloaders_wrapped():
    names = titan_configs.registry_configs()
    assert {registry.split(".")[2] for registry in names.values()} == set(FAMILIES)
    assert set(FAMILIES.values()) <= set(names)
    served = 0
    for name, registry in sorted(names.items()):
        try:
            stock = getattr(importlib.import_module(registry), name)()
        except Exception as e:  # the stock function's own failure here (torchao, fla, a GPU): ours is the same
            with pytest.raises(type(e), match=re.escape(str(e))):
                getattr(titan_configs, name)()
            continue
        ours = getattr(titan_configs, name)()
        served += 1
        assert isinstance(ours, type(stock)) and issubclass(type(ours)._owner, CollectiveMesh), name
        assert issubclass(type(ours)._owner, type(stock)._owner), name
        assert ours.dataloader._built is None and isinstance(ours.dataloader, type(stock.dataloader)), name
        assert type(ours.dataloader).build.__module__ == ReplicaDataLoader.__module__, name
        assert plain(unwrap_dataloader(ours.dataloader)) == plain(stock.dataloader), name
        if hasattr(stock.validator, "dataloader"):
            assert plain(unwrap_dataloader(ours.validator.dataloader)) == plain(stock.validator.dataloader), name
        assert plain(ours) == plain(stock), name  # nothing else changed
    assert served >= len(FAMILIES) + 20, served


def parse(*args: str):
    return ConfigManager().parse_args(["--training.disable_cuda_graphs", *args])


def test_torchtitans_command_line_takes_the_configs_and_the_users_dataloader_flags():
    module = "collective_loader.integrations.titan_configs"
    config = parse(
        "--module",
        module,
        "--config",
        "qwen3_debugmodel",
        "--dataloader.dataset_path",
        "/data/c4",
        "--dataloader.num_workers",
        "2",
        "--validator.dataloader.dataset",
        "c4_validation",
    )
    assert type(config) is TitanTrainer.Config
    assert type(config.dataloader).__qualname__ == "ReplicaDataLoader[HuggingFaceTextDataLoader.Config]"
    assert (config.dataloader.dataset_path, config.dataloader.num_workers) == ("/data/c4", 2)
    assert config.validator.dataloader.dataset == "c4_validation"
    flux = parse("--module", module, "--config", "flux_debugmodel", "--dataloader.dataset_path", "/data/cc12m")
    assert type(flux).__qualname__ == "Collective[FluxTrainer].Config" and flux.dataloader.dataset_path == "/data/cc12m"
    loaded, _ = ConfigManager()._load_config(["--module", module, "--config", "gpt_oss_debugmodel"])  # tyro aside
    assert type(loaded) is TitanTrainer.Config and type(loaded.dataloader).__name__.startswith("ReplicaDataLoader[")


def test_a_wrong_name_lists_the_config_functions_of_every_family():
    with pytest.raises(ValueError, match="Config function 'llama3_9b' not found") as e:
        parse("--module", "collective_loader.integrations.titan_configs", "--config", "llama3_9b")
    for name in FAMILIES.values():
        assert f"'{name}'" in str(e.value), name


class Mine(Trainer):
    """A Trainer subclass of one's own."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        note: str = ""


def test_the_trainer_is_extended_whatever_its_class():
    config = load_once_per_replica(Trainer.Config())
    assert type(config) is TitanTrainer.Config and load_once_per_replica(config) is config
    mine = load_once_per_replica(Mine.Config(note="kept"))
    assert isinstance(mine, Mine.Config) and mine.note == "kept"
    assert issubclass(type(mine)._owner, Mine) and issubclass(type(mine)._owner, CollectiveMesh)
    with pytest.raises(TypeError, match="is not the config of a TorchTitan Trainer"):
        load_once_per_replica(ReplicaDataLoader.Config())
