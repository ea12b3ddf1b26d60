"""collective_loader: one loader per data-parallel replica, delivery over DeviceMesh subgroups."""

from collective_loader.errors import (
    BatchError,
    ConfigMismatchError,
    ConstructionError,
    DeliveryError,
    LeaderError,
    WireError,
)
from collective_loader.loader import CollectiveLoader
from collective_loader.plan.mesh import mesh_place

__all__ = [
    "BatchError",
    "CollectiveLoader",
    "ConfigMismatchError",
    "ConstructionError",
    "DeliveryError",
    "LeaderError",
    "WireError",
    "mesh_place",
]
