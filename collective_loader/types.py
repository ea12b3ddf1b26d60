"""The two batch-shaped types every layer names: what a dataset yields, what a step delivers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Sample = Mapping[str, Any]
"""One sample as a dataset yields it: column name -> value (an MDS sample, a dict)."""

Batch = dict[str, Any]
"""One step's batch: key -> tensor, or a nested dict, list or plain value (what the loader yields)."""
