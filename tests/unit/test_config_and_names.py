"""One config object, one exception base, one meaning per name (issue 28): checked without processes."""

from __future__ import annotations

import dataclasses

import pytest

import collective_loader
from collective_loader import (
    BatchError,
    CollectiveLoaderError,
    ConstructionError,
    DeliveryError,
    LeaderError,
    LoaderConfig,
    errors,
)
from collective_loader.delivery.config import make_config
from collective_loader.errors import ConfigMismatchError, ShardDownloadError, WireError
from collective_loader.plan.mesh import MeshLayout


@pytest.mark.parametrize(
    "error,base",
    [
        (BatchError, ValueError),
        (WireError, ValueError),
        (ConstructionError, ValueError),
        (ConfigMismatchError, ValueError),
        (LeaderError, RuntimeError),
        (ShardDownloadError, RuntimeError),
        (DeliveryError, RuntimeError),
    ],
)
def test_every_error_has_the_one_base_and_keeps_its_builtin_base(error, base):
    assert issubclass(error, CollectiveLoaderError) and issubclass(error, base)


def test_every_exception_the_package_defines_is_under_the_base_and_the_precise_ones_stay_in_errors():
    defined = {e for e in vars(errors).values() if isinstance(e, type) and e.__module__ == errors.__name__}
    exported = {getattr(collective_loader, n) for n in collective_loader.__all__}
    exported_errors = {e for e in exported if isinstance(e, type) and issubclass(e, BaseException)}
    assert all(issubclass(e, CollectiveLoaderError) for e in defined)
    assert exported_errors == {CollectiveLoaderError, BatchError, LeaderError, ConstructionError, DeliveryError}
    # the precise kinds docs/failures.md names, imported from collective_loader.errors
    assert defined - exported_errors == {ConfigMismatchError, WireError, ShardDownloadError}
    assert issubclass(ConfigMismatchError, ConstructionError)


@pytest.mark.parametrize(
    "options,needle",
    [
        ({"delivery": "gather"}, "delivery must be 'broadcast' or 'scatter'"),
        ({"transport": "nvlink"}, "transport must be 'host' or 'device'"),
        ({"prefetch": 0}, "prefetch must be >= 1"),
        ({"prefetch": True}, "prefetch must be >= 1"),
        ({"timeout": -1}, "timeout must be a positive number of seconds"),
        ({"timeout": True}, "timeout must be a positive number of seconds"),
        ({"max_batch_bytes": 0}, "max_batch_bytes must be a positive number of bytes"),
        ({"inputs": "input_ids"}, "inputs must be a sequence of str keys"),
    ],
)
def test_a_config_refuses_a_value_naming_its_field(options, needle):
    with pytest.raises((ValueError, TypeError), match=needle):
        LoaderConfig(**options)


def test_a_config_is_frozen_keyword_only_and_documents_every_field():
    config = LoaderConfig(inputs=["a"], seq_dims={"a": 1})
    assert config.inputs == ("a",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.seq_dims["b"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        LoaderConfig(("a",))  # type: ignore[misc]
    documented = LoaderConfig.__doc__ or ""
    source = __import__("inspect").getsource(LoaderConfig)
    for f in dataclasses.fields(LoaderConfig):
        # each field is followed by its own docstring in the class body
        assert f"{f.name}: " in source and documented, f.name
        after = source.split(f"    {f.name}: ", 1)[1].split("\n", 2)[1]
        assert after.strip().startswith('"""'), f"{f.name} has no docstring"


def test_make_config_takes_a_config_or_keywords_not_both():
    config = LoaderConfig(timeout=5)
    assert make_config(config, {}) is config
    assert make_config(None, {"timeout": 5}) == config
    with pytest.raises(TypeError, match="not both"):
        make_config(config, {"prefetch": 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefech'"):
        make_config(None, {"prefech": 2})


def test_the_fingerprint_names_every_option():
    layout = MeshLayout.build(("pp", "dp"), (2, 2), range(4))
    text = LoaderConfig().fingerprint(layout)
    for f in dataclasses.fields(LoaderConfig):
        if f.name != "roles":  # roles show as the mesh's roles
            assert f"{f.name}=" in text, f.name
    assert LoaderConfig(prefetch=3).fingerprint(layout) != text


def test_no_name_means_two_things_in_the_package():
    """The collisions issue 28 found (two Encoders, three Layouts, two Documents, Plan in the layer
    called plan, Levels and IGNORE_INDEX defined twice): each class, and each of those names, is
    defined once in the package."""
    import ast
    from collections import Counter
    from pathlib import Path

    named = {"Encoder", "Layout", "Documents", "Plan", "Levels", "IGNORE_INDEX"}
    package = Path(collective_loader.__file__).parent
    defined: Counter[str] = Counter()
    for path in package.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                defined[node.name] += 1
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                if isinstance(target, ast.Name) and target.id in named:
                    defined[target.id] += 1
    assert [name for name, n in defined.items() if n > 1] == []
    assert "Plan" not in defined and "Layout" not in defined
