"""collective_loader: one loader per data-parallel replica, delivery over DeviceMesh subgroups.

The package in layers (each imports only from the layers below it; ``tests/unit/test_layering.py``):

* :mod:`~collective_loader.plan`: mesh roles and places, routing, sequence splits, the wire format
  (pure: no process groups);
* :mod:`~collective_loader.delivery`: process groups, agreements, one step of the protocol, the
  epoch's transfer thread;
* :class:`CollectiveLoader` (:mod:`~collective_loader.loader`): builds the settings once; iteration,
  state, close;
* sources: :mod:`~collective_loader.streaming` (mosaicml-streaming on the leaders only) and
  :mod:`~collective_loader.text` (language-model batches);
* :mod:`~collective_loader.integrations`: TorchTitan, Megatron-style ``get_batch``;
* :mod:`~collective_loader.testing` and :mod:`~collective_loader.cli`: invariant checks, local
  worlds, a local S3 endpoint, the main job.
"""

import logging

from collective_loader.delivery.config import LoaderConfig
from collective_loader.delivery.source_protocol import Source
from collective_loader.errors import BatchError, CollectiveLoaderError, ConstructionError, DeliveryError, LeaderError
from collective_loader.loader import CollectiveLoader
from collective_loader.plan.balanced_documents import BalancedDocuments
from collective_loader.plan.documents import PerDocument
from collective_loader.plan.mesh import mesh_place
from collective_loader.plan.schedules import stage_style_of
from collective_loader.plan.split import Split

# nothing is printed unless the application configures logging
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "BalancedDocuments",
    "BatchError",
    "CollectiveLoader",
    "CollectiveLoaderError",
    "ConstructionError",
    "DeliveryError",
    "LeaderError",
    "LoaderConfig",
    "PerDocument",
    "Source",
    "Split",
    "mesh_place",
    "stage_style_of",
]
