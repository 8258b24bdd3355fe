"""Read a safepoint checkpoint with json, numpy and crc32c only (no safepoint, no torch): every
tensor, ndarray and alias entry becomes a numpy array, every byte read is checked against its
crc32c. This is the reader in docs/format.md.

    python examples/read_without_safepoint.py CHECKPOINT_DIR
"""

import json
import os
import sys

import crc32c  # pip install crc32c
import numpy as np

NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "C64": "<c8", "C128": "<c16", "I64": "<i8",
         "I32": "<i4", "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2",
         "U8": "u1", "BOOL": "?", "BF16": "<u2", "C32": "<u4",
         "BITS16": "<u2"}  # BF16, C32, F8_*, F4_*, BITS*: raw bits


def read_checkpoint(path):
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        document = f.read()
    m = json.loads(document)
    sealed = document.rfind(b',"manifest_checksum":')  # the last field: crc32c of all before
    if "manifest_checksum" in m and crc32c.crc32c(document[:sealed]) != m["manifest_checksum"]:
        raise ValueError(f"{path}: the manifest is damaged")
    if m["format"] != "safepoint" or m["version"] > 4 or m["checksum"]["algorithm"] != "crc32c":
        raise ValueError(f"{path}: not a checkpoint this reader understands")
    block, files, e, c = m["checksum"]["block_bytes"], m["files"], m["entries"], m["chunks"]
    data = {}  # entry index -> its bytes, chunks concatenated in table order
    columns = (c["entry"], c["file"], c["offset"], c["nbytes"], c["digests"])
    for i, fi, offset, n, digests in zip(*columns, strict=True):
        name = files[fi]["name"]
        if not name.startswith("data/") or ".." in name.split("/") or "\\" in name:
            raise ValueError(f"{name}: outside the checkpoint's data/")
        with open(os.path.join(path, name), "rb") as f:
            f.seek(offset)
            raw = f.read(n)
        if len(raw) != n or digests != [crc32c.crc32c(raw[k : k + block])
                                        for k in range(0, n, block)]:
            raise ValueError(f"{e['path'][i]}: truncated or checksum mismatch in {name}")
        data[i] = data.get(i, b"") + raw
    rows = enumerate(zip(e["path"], e["kind"], e["dtype"], e["shape"], strict=True))
    arrays = {
        path: np.frombuffer(data.get(i, b""), NUMPY.get(dtype, "u1")).reshape(shape)
        for i, (path, kind, dtype, shape) in rows if kind in ("tensor", "ndarray")
    }
    aliases = zip(e["path"], e["kind"], e["value"], strict=True)  # tied tensors, stored once
    return arrays | {path: arrays[of] for path, kind, of in aliases if kind == "alias"}


if __name__ == "__main__":
    for path, array in read_checkpoint(sys.argv[1]).items():
        print(f"{path:40} {array.dtype!s:10} {array.shape}")
