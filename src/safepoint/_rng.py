"""`RNGState`: every global random stream a training step draws from, as a stateful object
whose state dict holds only tensors, arrays and plain values (tree layer).

Python's `random`, NumPy's global generator, torch's CPU generator, every CUDA device's
generator, and any extra `torch.Generator` or `numpy.random.Generator` the caller names.
torch is imported only when the process already uses it, or when a saved state needs it.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from .errors import StateMismatch, UnsupportedLeaf

__all__ = ["RNGState"]

logger = logging.getLogger(__name__)


class RNGState:
    """Captures every global random stream on `state_dict()` and restores them on
    `load_state_dict()`; put one in the state you save.

    Dropout, random augmentation and `torch.randn` draw from these streams, so a resumed run
    continues bit for bit only if they are restored with the weights.

    Args:
        generators: extra named generators (`torch.Generator` or `numpy.random.Generator`)
            to capture and restore with the global ones, e.g. one passed to `torch.randn`.

    Example:
        state = {"model": model, "optim": optimizer, "rng": sp.RNGState()}

    The state dict has keys "python", "numpy", "torch" (when torch is imported), "cuda" (one
    tensor per device; empty when CUDA is unavailable) and "generators". A checkpoint written
    on a CUDA machine restores on one without CUDA: the CUDA streams are skipped with a
    warning.
    """

    #: A checkpoint from a machine without CUDA lacks "cuda" (see `sp.load`'s strict mode),
    #: one from a machine without torch lacks "torch", and one from a machine with another
    #: number of devices holds another number of states; "torch" is restored even when this
    #: object was made before torch was imported (its state dict then lacks it). A named
    #: generator the checkpoint holds but this object lacks is an unexpected key.
    safepoint_optional_keys = ("torch", "cuda")
    safepoint_open_keys = ("torch", "cuda")

    def __init__(self, *, generators: Mapping[str, Any] | None = None) -> None:
        """
        Raises:
            UnsupportedLeaf: `generators` is not a mapping of names to generators, or holds
                one that is neither a torch.Generator nor a numpy.random.Generator (named by
                its key).
        """
        if generators is not None and not isinstance(generators, Mapping):
            raise UnsupportedLeaf(
                f"RNGState generators= is a {type(generators).__qualname__}: pass a dict "
                'naming each generator, e.g. generators={"data": g} (its name is its key in '
                "the checkpoint)",
                path="generators",
            )
        self.generators = dict(generators or {})
        torch = sys.modules.get("torch")
        kinds = (np.random.Generator,) + ((torch.Generator,) if torch is not None else ())
        for name, generator in self.generators.items():
            if not isinstance(generator, kinds):
                raise UnsupportedLeaf(
                    f"RNGState generator {name!r} is a {type(generator).__qualname__}: pass a "
                    "torch.Generator or a numpy.random.Generator (keep a random.Random's "
                    "state yourself, or use the global streams, which RNGState saves)",
                    path=f"generators/{name}",
                )

    def state_dict(self) -> dict[str, Any]:
        """The current state of every stream (copies: later draws do not change it)."""
        version, words, gauss_next = random.getstate()
        state: dict[str, Any] = {
            "python": {
                "version": version,
                "words": np.array(words, dtype=np.uint32),
                "gauss_next": gauss_next,
            },
            "numpy": _numpy_state(),
        }
        torch = sys.modules.get("torch")
        if torch is not None:
            state["torch"] = torch.get_rng_state()
            state["cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        state["generators"] = {
            name: _generator_state(generator) for name, generator in self.generators.items()
        }
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set every stream to `state` (as `state_dict` returned it).

        Raises:
            StateMismatch: a named generator of this object is not in `state`, or is of a
                different kind.
        """
        python = state["python"]
        words = tuple(int(word) for word in np.asarray(python["words"]))
        gauss_next = python["gauss_next"]
        random.setstate((int(python["version"]), words, gauss_next))
        _load_numpy(state["numpy"])
        if "torch" in state:
            import torch

            torch.set_rng_state(_byte_tensor(torch, state["torch"]))
            _load_cuda(torch, list(state.get("cuda", [])))
        saved = state.get("generators", {})
        missing = sorted(set(self.generators) - set(saved))
        if missing:
            raise StateMismatch(
                f"the checkpoint has no state for the generators {missing}: it was saved "
                "without them; restore with the generators it was saved with",
                missing=[f"generators/{name}" for name in missing],
            )
        for name, generator in self.generators.items():
            _load_generator(name, generator, saved[name])


def _numpy_state() -> dict[str, Any]:
    """The state of NumPy's global stream: for its default bit generator, MT19937, as every
    version saved it (`keys`, `pos`, `has_gauss`, `cached_gaussian`); for another one set by
    `np.random.set_bit_generator`, NumPy's own dict of it (`bit_generator`, `state`, the
    cached Gaussian in `has_gauss` and `gauss`), its 128-bit ints as `_plain` keeps them."""
    state = np.random.get_state(legacy=False)
    if state["bit_generator"] != "MT19937":
        return cast("dict[str, Any]", _plain(state))
    return {
        "keys": np.array(state["state"]["key"], dtype=np.uint32),
        "pos": int(state["state"]["pos"]),
        "has_gauss": int(state["has_gauss"]),
        "cached_gaussian": float(state["gauss"]),
    }


def _load_numpy(saved: Mapping[str, Any]) -> None:
    """Set NumPy's global stream to `saved`, in either layout `_numpy_state` makes.

    Raises:
        StateMismatch: the global stream's bit generator is not the one `saved` is for (its
            state does not fit).
    """
    try:
        if "keys" in saved:
            np.random.set_state((
                "MT19937", np.asarray(saved["keys"], dtype=np.uint32), int(saved["pos"]),
                int(saved["has_gauss"]), float(saved["cached_gaussian"]),
            ))
        else:
            np.random.set_state(_native(saved))
    except ValueError as exc:
        name = saved.get("bit_generator", "MT19937")
        here = np.random.get_state(legacy=False)["bit_generator"]
        raise StateMismatch(
            f"the checkpoint holds NumPy's global stream as a {name} bit generator, which "
            f"does not fit the global one here ({here}): call "
            f"np.random.set_bit_generator(np.random.{name}()) before the load, as the saved "
            f"run did ({exc})",
            mismatched=["numpy"],
        ) from exc


def _byte_tensor(torch: Any, value: Any) -> Any:
    """A CPU uint8 tensor of an RNG state, from the tensor or array a load produced."""
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))


def _load_cuda(torch: Any, states: list[Any]) -> None:
    if not states:
        return
    if not torch.cuda.is_available():
        logger.warning(
            "the checkpoint holds the RNG state of %d CUDA devices, but CUDA is unavailable "
            "here: skipped (GPU random streams will differ from the saved run's)", len(states)
        )
        return
    count = torch.cuda.device_count()
    if count != len(states):
        logger.warning(
            "the checkpoint holds the RNG state of %d CUDA devices and %d are visible: "
            "restoring the first %d", len(states), count, min(count, len(states))
        )
    for device, value in enumerate(states[:count]):
        torch.cuda.set_rng_state(_byte_tensor(torch, value), device)


def _generator_state(generator: Any) -> Any:
    if isinstance(generator, np.random.Generator):
        return {"numpy": _plain(generator.bit_generator.state)}
    return {"torch": generator.get_state()}  # the only other kind __init__ takes


def _load_generator(name: str, generator: Any, saved: Mapping[str, Any]) -> None:
    if isinstance(generator, np.random.Generator) and "numpy" in saved:
        generator.bit_generator.state = _native(saved["numpy"])
        return
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(generator, torch.Generator) and "torch" in saved:
        generator.set_state(_byte_tensor(torch, saved["torch"]))
        return
    raise StateMismatch(
        f"generator {name!r} is a {type(generator).__qualname__} but the checkpoint saved "
        f"a {next(iter(saved), 'nothing')} generator under that name: restore with the same "
        "kind of generator",
        mismatched=[f"generators/{name}"],
    )


def _plain(value: Any) -> Any:
    """A NumPy bit generator's state with Python ints too large for JSON as uint64 arrays
    (PCG64 holds 128-bit integers): `[high, low]` words tagged by the key `"u128"`."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, int) and not isinstance(value, bool) and 2**63 <= value < 2**128:
        return {"u128": np.array([value >> 64, value & (2**64 - 1)], dtype=np.uint64)}
    return value


def _native(value: Any) -> Any:
    """The inverse of `_plain`."""
    if isinstance(value, Mapping):
        if set(value) == {"u128"}:
            high, low = (int(word) for word in np.asarray(value["u128"]))
            return (high << 64) | low
        return {key: _native(item) for key, item in value.items()}
    return value
