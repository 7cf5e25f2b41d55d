"""Old name of the per-key path's public names: they live in flexdma.perkey (its contract is
flexdma/perkey/contract.py). Kept so `flexdma.topk.*` keeps working."""

from .perkey import *  # noqa: F401,F403  (the names of flexdma.perkey.__all__)
from .perkey import __all__  # noqa: F401
