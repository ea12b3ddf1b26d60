"""``--module collective_loader.titan_configs``: the command line TorchTitan users already have.

The code is in :mod:`collective_loader.integrations.titan_configs`; this module hands on its
names, including the config functions it makes on demand (``--config llama3_8b``, ...).
"""

from collective_loader.integrations.titan_configs import *  # noqa: F403
from collective_loader.integrations.titan_configs import __all__, __dir__, __getattr__  # noqa: F401
