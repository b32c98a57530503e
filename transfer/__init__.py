"""TransferMesh: topology-aware, versioned, bucketed weight sync from the trainer to the engines (mesh.py: the
driver's side, endpoints.py: the actors', one module per transport). The recipe's `transfer:` section is
stages/transfer_config.py: this package reads it, imports none. The names below are loaded on first use
(PEP 562), so importing the package imports neither torch nor Ray.
"""
from __future__ import annotations

import importlib

_WHERE = {"TRANSPORTS": "config", "Receiver": "endpoints", "Sender": "endpoints",
          "TransferError": "errors", "Layout": "layout", "checksum": "layout",
          "TransferMesh": "mesh", "Route": "routes", "plan_route": "routes", "Party": "topology",
          "format_table": "topology"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"transfer.{_WHERE[name]}"), name)
