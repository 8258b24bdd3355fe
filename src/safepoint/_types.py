"""Aliases and small protocols shared by every layer (no logic, stdlib only)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

#: A `/`-joined path of a value in a state tree, e.g. ``model/layer1.0.weight``.
StatePath = str

#: A skeleton node as it is stored in the manifest: a leaf path (str) or a one-key dict
#: ``{"dict": [[key, node], ...]}``, ``{"list": [...]}``, ``{"tuple": [...]}``,
#: ``{"stateful": node}``.
Node = Any


@runtime_checkable
class Stateful(Protocol):
    """Anything that saves and restores itself through a state dict (modules, optimizers,
    schedulers, grad scalers, data loaders, the user's own classes)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...
