"""The three benchmark workloads, built deterministically inside each worker process.

A workload is a training-state tree of dicts, lists and tuples whose leaves are CPU tensors and
plain Python values, the shape of what `safepoint.save` is given in practice:

- ``W1``: 64 float32 tensors of 4M elements (16 MiB each), 1 GiB: large tensors, pure bandwidth.
- ``W2``: 20,000 small tensors of 256 B to 64 KiB in seven dtypes, about 450 MB: per-tensor
  overhead dominates.
- ``W3``: a GPT-2-small-shaped model (124M float32 parameters) with AdamW state (``exp_avg``,
  ``exp_avg_sq`` and a scalar ``step`` per parameter, two ``param_groups``), about 1.5 GB: a
  realistic mix.

``--quick`` shrinks each one (same structure, fewer or smaller tensors) for a smoke test.

A *source* state holds seeded random values (what a save writes); a *destination* state has the
same tree, shapes and dtypes filled with zeros (what a load writes into). Both are fully touched:
every page is written once, so that the memory is resident before anything is timed and RSS
measured afterwards is the method's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

State = dict[str, Any]
MakeTensor = Callable[[tuple[int, ...], torch.dtype, torch.Generator], torch.Tensor]

W2_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)


@dataclass(frozen=True)
class Sizes:
    """The size knobs of all three workloads; one instance for full runs, one for ``--quick``."""

    w1_tensors: int
    w1_side: int  # W1 tensors are (side, side) float32
    w2_tensors: int
    w2_max_bytes: int
    gpt_vocab: int
    gpt_ctx: int
    gpt_dim: int
    gpt_layers: int


FULL = Sizes(64, 2048, 20_000, 64 * 1024, 50257, 1024, 768, 12)
QUICK = Sizes(64, 128, 2_000, 16 * 1024, 1000, 128, 64, 2)

WORKLOADS = ("W1", "W2", "W3")


def build_state(workload: str, *, quick: bool, source: bool) -> State:
    """Return the workload's state: seeded random values if ``source``, else touched zeros."""
    sizes = QUICK if quick else FULL
    gen = torch.Generator().manual_seed({"W1": 1, "W2": 2, "W3": 3}[workload])
    make: MakeTensor = _random_tensor if source else _zero_tensor
    if workload == "W1":
        return _w1(sizes, make, gen)
    if workload == "W2":
        return _w2(sizes, make, gen)
    if workload == "W3":
        return _w3(sizes, make, gen)
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    """Seeded random values of any dtype (normal for floats, full range for integers)."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).to(torch.bool)
    # Integers over their full range: random bytes reinterpreted.
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64))
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _zero_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    """Zeros written page by page (``torch.zeros`` may map untouched zero pages lazily)."""
    del gen  # same signature as _random_tensor
    return torch.empty(shape, dtype=dtype).fill_(0)


def _w1(sizes: Sizes, make: MakeTensor, gen: torch.Generator) -> State:
    side = sizes.w1_side
    return {
        "model": {
            f"layers.{i:02d}.weight": make((side, side), torch.float32, gen)
            for i in range(sizes.w1_tensors)
        }
    }


def w2_layout(sizes: Sizes) -> list[tuple[torch.dtype, int]]:
    """(dtype, numel) of each W2 tensor.

    Byte sizes are drawn half uniformly and half log-uniformly in [256 B, max]: uniform alone
    averages 33 KiB (660 MB for 20,000), log-uniform alone 11 KiB; the mix gives the ~450 MB
    wanted while keeping many tiny tensors.
    """
    rng = np.random.default_rng(2)
    n, lo, hi = sizes.w2_tensors, 256, sizes.w2_max_bytes
    uniform = rng.uniform(lo, hi, n)
    log_uniform = np.exp(rng.uniform(np.log(lo), np.log(hi), n))
    nbytes = np.where(rng.random(n) < 0.5, uniform, log_uniform)
    layout = []
    for i, size in enumerate(nbytes):
        dtype = W2_DTYPES[i % len(W2_DTYPES)]
        itemsize = torch.empty((), dtype=dtype).element_size()
        layout.append((dtype, max(1, int(size) // itemsize)))
    return layout


def _w2(sizes: Sizes, make: MakeTensor, gen: torch.Generator) -> State:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for i, (dtype, numel) in enumerate(w2_layout(sizes)):
        group = groups.setdefault(f"g{i // 1000:02d}", {})
        group[f"t{i:05d}"] = make((numel,), dtype, gen)
    return {"small": groups}


def gpt2_shapes(sizes: Sizes) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a nanoGPT-style GPT-2 (``lm_head`` tied to ``wte``, so not repeated).

    With the full sizes this is GPT-2 small: 124,439,808 parameters.
    """
    d = sizes.gpt_dim
    shapes: dict[str, tuple[int, ...]] = {}
    shapes["transformer.wte.weight"] = (sizes.gpt_vocab, d)
    shapes["transformer.wpe.weight"] = (sizes.gpt_ctx, d)
    for i in range(sizes.gpt_layers):
        p = f"transformer.h.{i}."
        shapes[p + "ln_1.weight"] = (d,)
        shapes[p + "ln_1.bias"] = (d,)
        shapes[p + "attn.c_attn.weight"] = (3 * d, d)
        shapes[p + "attn.c_attn.bias"] = (3 * d,)
        shapes[p + "attn.c_proj.weight"] = (d, d)
        shapes[p + "attn.c_proj.bias"] = (d,)
        shapes[p + "ln_2.weight"] = (d,)
        shapes[p + "ln_2.bias"] = (d,)
        shapes[p + "mlp.c_fc.weight"] = (4 * d, d)
        shapes[p + "mlp.c_fc.bias"] = (4 * d,)
        shapes[p + "mlp.c_proj.weight"] = (d, 4 * d)
        shapes[p + "mlp.c_proj.bias"] = (d,)
    shapes["transformer.ln_f.weight"] = (d,)
    shapes["transformer.ln_f.bias"] = (d,)
    return shapes


def _w3(sizes: Sizes, make: MakeTensor, gen: torch.Generator) -> State:
    shapes = gpt2_shapes(sizes)
    model = {name: make(shape, torch.float32, gen) for name, shape in shapes.items()}
    optim_state = {
        i: {
            "step": make((), torch.float32, gen),
            "exp_avg": make(shape, torch.float32, gen),
            "exp_avg_sq": make(shape, torch.float32, gen),
        }
        for i, shape in enumerate(shapes.values())
    }
    # nanoGPT's two AdamW groups: weight decay on matrices only.
    decay = [i for i, shape in enumerate(shapes.values()) if len(shape) >= 2]
    no_decay = [i for i, shape in enumerate(shapes.values()) if len(shape) < 2]
    group = {
        "lr": 6e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "amsgrad": False,
        "foreach": None,
        "maximize": False,
        "capturable": False,
        "differentiable": False,
        "fused": None,
    }
    param_groups = [
        {**group, "weight_decay": 0.1, "params": decay},
        {**group, "weight_decay": 0.0, "params": no_decay},
    ]
    return {"model": model, "optim": {"state": optim_state, "param_groups": param_groups}}


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every leaf in tree order; paths are ``/``-joined keys."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}{key}/")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from leaves(value, f"{prefix}{index}/")
    else:
        yield prefix.rstrip("/"), tree


def tensor_leaves(state: State) -> dict[str, torch.Tensor]:
    """The tensors of a state, flat, keyed by path (the safetensors layout)."""
    return {path: leaf for path, leaf in leaves(state) if isinstance(leaf, torch.Tensor)}


def tensor_bytes(state: State) -> int:
    """Payload size: the sum of the tensors' bytes (what MB/s is computed from)."""
    return sum(t.nbytes for t in tensor_leaves(state).values())
