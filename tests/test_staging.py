"""Load-side staging: a contiguous CPU tensor target lends its own memory as the destination
(the no-second-copy path) and comes back as itself; a target that cannot take the bytes
directly (non-contiguous, a lazy conjugate or negative bit) gets a fresh buffer that is copied
into it; describe names a target's dtype as the format does."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from safepoint._format import Entry
from safepoint._staging import describe, destination, finish


def _fill(view: memoryview, data: bytes) -> None:
    view[:] = data


def test_a_contiguous_cpu_tensor_is_its_own_destination() -> None:
    target = torch.zeros(4, dtype=torch.float32)
    dest = destination(Entry("tensor", "F32", (4,)), target)
    assert dest.holder is target and dest.target is None
    _fill(dest.view, torch.arange(4, dtype=torch.float32).numpy().tobytes())
    assert finish(Entry("tensor", "F32", (4,)), dest, allow_pickle=False) is target
    assert target.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_targets_that_cannot_take_the_bytes_are_copied_into() -> None:
    real = torch.arange(6, dtype=torch.float32)
    complex_base = torch.complex(torch.zeros(3), torch.zeros(3))
    targets = {
        "transposed": (torch.zeros(3, 2).t(), real.reshape(2, 3)),
        "conj": (complex_base.conj(), torch.complex(real[:3], real[3:])),
        "neg": (torch.complex(torch.zeros(3), torch.zeros(3)).conj().imag,
                real[:3].clone()),
    }
    for name, (target, value) in targets.items():
        entry = Entry("tensor", describe(target, "tensor")[0], tuple(target.shape))
        dest = destination(entry, target)
        assert dest.target is target and dest.holder is not target, name
        _fill(dest.view, value.contiguous().numpy().tobytes())
        assert finish(entry, dest, allow_pickle=False) is target, name
        assert torch.equal(target.resolve_conj().resolve_neg(), value), name


def test_describe_names_dtypes_as_the_format_does() -> None:
    assert describe(torch.zeros(2, 3, dtype=torch.bfloat16), "tensor") == ("BF16", (2, 3))
    assert describe(torch.zeros((), dtype=torch.bool), "tensor") == ("BOOL", ())
    # A dtype the format lacks keeps torch's name, so the mismatch message can show it.
    unknown = SimpleNamespace(dtype=torch.quint8, shape=torch.Size([1]))
    assert describe(unknown, "tensor") == ("quint8", (1,))
    assert describe(7, "value") == (None, None)
