"""Export checkpoints to, and import them from, `torch.save` files, safetensors files and
archives (API layer): where users arrive from and go to.

- A `.pt` export is `torch.save` of the loaded tree (nested as it was saved, numpy arrays as
  tensors so that `torch.load(weights_only=True)` reads it back); a `.pt` import is
  `torch.load(weights_only=True)`, and anything that needs full unpickling is refused unless
  `allow_pickle=True`.
- A `.safetensors` file is a flat str -> tensor mapping: an export names each tensor by its
  `/`-joined path (`model/layer1.0.weight`) and keeps plain values (ints, floats, str, bool,
  None) as JSON in the header's metadata under `safepoint.values`; an import nests keys at `/`
  again (keys without `/`, as Hugging Face writes them, stay flat) and restores those values.
- A `.tar` (`.tar.gz`, `.tar.bz2`, `.tar.xz`) file is the whole checkpoint as it was saved,
  in one file (see `_archive`).

Output files are written to a temporary name, fsynced, then renamed into place, so a crash
never leaves a half-written export under the real name.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import contextlib
import errno
import importlib
import importlib.util
import io
import json
import logging
import mmap
import os
import pickle
import pickletools
import re
import struct
import uuid
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._api import CheckpointInfo, info, load, save
from ._archive import SUFFIXES as ARCHIVE_SUFFIXES
from ._archive import pack, unpack
from ._format import Manifest, decode_float, encode_value
from ._leaves import (
    NDARRAY,
    TENSOR,
    VALUE,
    Pickled,
    flag,
    is_ndarray,
    is_tensor,
    is_uninitialized,
)
from ._staging import host_array, tensor_entry
from ._storage_local import fsync_dir, makedirs_durable, no_directory
from ._tree import Flat, escape_key, flatten, join
from .errors import (
    CheckpointNotFound,
    CorruptCheckpoint,
    PickleNotAllowed,
    SafepointError,
    StateMismatch,
    StorageError,
    UnsupportedLeaf,
)
from .storage import mapped_errors, split_url

__all__ = [
    "STATE_DICT_METADATA",
    "ExportReport",
    "collect_state_dict_versions",
    "export_checkpoint",
    "import_checkpoint",
    "state_dict_versions",
    "storable",
    "with_state_dict_metadata",
]

logger = logging.getLogger(__name__)

#: Suffixes read and written as safetensors; every other accepted one is a torch.save file.
SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: The safetensors metadata key holding plain values, as JSON {path: value}.
VALUES_KEY = "safepoint.values"

#: Stored natively (a bytearray as the format's `bytes` kind), so never pickled.
_PLAIN_TYPES = (type(None), bool, int, float, str, bytes, bytearray)
_ESCAPED = re.compile("%(25|2F)")


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What `sp.export_checkpoint` wrote.

    Attributes:
        out: the file written.
        paths: the exported entries' `/`-joined paths (relative to `strip_prefix`).
        nbytes: size of the file.
    """

    out: str
    paths: list[str]
    nbytes: int


def storable(value: Any, *, pickle_objects: bool) -> tuple[Any, list[str]]:
    """`value` as a tree `sp.save` stores without complaint, and the paths of what it cannot.

    Tensors, arrays, plain values and dicts (str or int keys), lists and tuples of them are kept;
    dict, list and tuple subclasses (torch.Size, namedtuples) become dicts, lists and tuples,
    as `sp.save` stores them.
    Anything else (objects, sets, dicts with other keys) is wrapped in `sp.Pickled` when
    `pickle_objects`, else left as is and its path listed.

    Returns:
        (the tree, the paths that only pickle could store).
    """
    refused: list[str] = []
    return _storable(value, "", pickle_objects, refused), refused


def _storable(value: Any, path: str, pickle_objects: bool, refused: list[str]) -> Any:
    if is_tensor(value) or is_ndarray(value):
        # One the format has no place for (a sparse or quantized tensor, an array of str)
        # is pickled too, or left for the save to refuse by its path.
        return Pickled(value) if pickle_objects and not _stored_as_is(value, path) else value
    if type(value) in _PLAIN_TYPES:
        return value
    if isinstance(value, dict) and all(type(key) in (str, int) for key in value):
        return {
            key: _storable(child, join(path, key), pickle_objects, refused)
            for key, child in value.items()
        }
    if isinstance(value, list | tuple):
        return (list if isinstance(value, list) else tuple)(
            _storable(child, join(path, index), pickle_objects, refused)
            for index, child in enumerate(value)
        )
    if pickle_objects:
        return Pickled(value)
    refused.append(path or "<root>")
    return value


def _stored_as_is(value: Any, path: str) -> bool:
    """Whether a save stores the tensor or array `value` without pickle (a lazy module's
    parameter not materialized yet is the save's to refuse, with its own message)."""
    if is_uninitialized(value):
        return True
    try:
        tensor_entry(value, path) if is_tensor(value) else host_array(value, path)
    except UnsupportedLeaf:
        return False
    return True


def _require(module: str, *also: str) -> Any:
    """Import `module` (torch or safetensors), which only interchange needs, once the
    packages `also` names are there too (each missing one is named at once, not after the
    first is installed).

    Raises:
        SafepointError: a package is not installed; says what to install.
    """
    packages = [name.split(".")[0] for name in (module, *also)]
    missing = [package for package in packages if importlib.util.find_spec(package) is None]
    try:
        if missing:
            raise ImportError(missing)
        return importlib.import_module(module)
    except ImportError as exc:
        missing = missing or [module.split(".")[0]]
        raise SafepointError(
            f"export and import of this file format need {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install "
            f"{' '.join(missing)}" + (" (or safepoint[safetensors])"
                                      if "safetensors" in missing else "")
        ) from exc


def _local_file(name: str | os.PathLike[str], doing: str) -> str:
    """`name` (a path, `~/x.pt` or a file:// URL) as a local path.

    Raises:
        SafepointError: `name` is a URL of another scheme: the file is written or read
            where this process runs, and `s3://b/x.tar` would have been a local directory
            named `s3:`.
    """
    scheme, rest = split_url(os.fspath(name))
    if scheme and scheme != "file":
        raise SafepointError(
            f"{name}: {doing} a local file, not a {scheme}:// URL: give a local path and move "
            f"the file with your storage's tools, or `safepoint cp` the checkpoint itself "
            f"to {scheme}://"
        )
    return os.path.expanduser(rest)  # "~/x.pt" as the checkpoint URLs take it


def _kind_of_file(name: str) -> str:
    lower = name.lower()
    if lower.endswith(SAFETENSORS_SUFFIXES):
        return "safetensors"
    if lower.endswith(TORCH_SUFFIXES):
        return "torch"
    if lower.endswith(tuple(ARCHIVE_SUFFIXES)):
        return "archive"
    raise SafepointError(
        f"{name}: cannot tell the file format from its name; name it *.safetensors, "
        f"{', '.join('*' + s for s in TORCH_SUFFIXES)} for a torch.save file, or "
        f"{', '.join('*' + s for s in ARCHIVE_SUFFIXES)} for an archive of the checkpoint"
    )


def _new_file_mode() -> int:
    """The permission bits a new file gets in this process: 0o666 less the umask, which is
    read from /proc where it can be (setting it to read it is not thread-safe)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _write_atomically(out: str, write: Callable[[str], object]) -> int:
    """Have `write` create a temporary file beside `out`, fsync it, rename it into place;
    returns its size."""
    directory = os.path.dirname(os.path.abspath(out))
    # Not `out` plus a suffix: a valid name of 240 characters would grow past NAME_MAX.
    tmp = os.path.join(directory, f".safepoint-{uuid.uuid4().hex[:16]}.tmp")
    with mapped_errors(out, "writing"):
        try:
            makedirs_durable(directory)
        except FileNotFoundError as exc:
            raise no_directory(out, exc) from exc
        if not os.path.isdir(directory):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", directory)
        try:
            try:
                write(tmp)
            except Exception as exc:
                if isinstance(exc, SafepointError) or (
                        isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError)):
                    raise  # CheckpointNotFound too: it is a FileNotFoundError of the source
                # torch.save and safetensors report a failed write as RuntimeError or their
                # own error; a directory that takes no new file (/proc) gives ENOENT, which
                # here is no missing checkpoint.
                raise StorageError(
                    f"writing {out} failed: {type(exc).__name__}: {str(exc)[:300]}; check "
                    "the path, permissions and free space", url=out,
                ) from exc
            os.chmod(tmp, _new_file_mode())  # safetensors makes its file 0600
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, out)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        fsync_dir(directory)
        return os.path.getsize(out)


def _subtree(tree: Any, prefix: str, url: str, keys: Sequence[str] | None) -> Any:
    """The container at path `prefix` in `tree`, what `keys` (the caller's, if any)
    selected of the checkpoint at `url`."""
    node = tree
    for part in prefix.strip("/").split("/"):
        if isinstance(node, dict):
            matches = [key for key in node if escape_key(key) == part]
            if matches:
                node = node[matches[0]]
                continue
        elif isinstance(node, list | tuple) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
            continue
        node = None
        break
    if not isinstance(node, dict | list | tuple):
        among = f" among the entries keys={list(keys)} selects" if keys is not None else ""
        raise StateMismatch(
            f"strip_prefix {prefix!r} is not a container{among} in {url}: give a path prefix "
            "such as 'model/' (see `safepoint info`)"
            + (", and keys that select it, or no keys" if keys is not None else ""),
            url=url,
        )
    return node


def export_checkpoint(
    url: str,
    out: str | os.PathLike[str],
    *,
    keys: Sequence[str] | None = None,
    strip_prefix: str | None = None,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> ExportReport:
    """Write the checkpoint at `url` (or the part `keys` selects) as a `torch.save` file or a
    safetensors file, or the whole checkpoint as an archive, chosen by `out`'s suffix.

    Args:
        url: the checkpoint.
        out: a local file (a path or file:// URL): `*.safetensors`, or `*.pt`, `*.pth`,
            `*.bin`, `*.ckpt`, or an archive `*.tar`, `*.tar.gz` (`*.tgz`), `*.tar.bz2`,
            `*.tar.xz`: the checkpoint's files byte for byte, every block checked on the way,
            the manifest last, so that `tar -x` into a directory gives the checkpoint.
            Replaced atomically if it exists.
        keys: path prefixes or globs to export (`["model/"]` for weights only, as Composer's
            weights-only checkpoints); everything when None (always, for an archive).
        strip_prefix: export the subtree under this path (`"model/"`), named relative to it, so
            that `model.load_state_dict(safetensors.torch.load_file(out))` works; implies
            `keys=[strip_prefix]` when `keys` is None.
        allow_pickle: load pickled entries (a `.pt` export can hold them; safetensors cannot).
        storage_options: options for the checkpoint's storage backend.

    Returns:
        what was written.

    Raises:
        CheckpointNotFound: nothing committed at `url`.
        StateMismatch: `keys` or `strip_prefix` select nothing.
        UnsupportedLeaf: a safetensors export met bytes, pickled entries, or tensors or arrays
            of a dtype safetensors lacks (a torch bits dtype, complex128...): select others
            with `keys`, or export to `.pt`.
        PickleNotAllowed: the selection holds pickled entries and `allow_pickle` is False.
        CorruptCheckpoint: a block failed its checksum, or a data file is missing.
        FormatVersionError: `url` was written by a newer format.
        SafepointError: `keys` or `strip_prefix` were given for an archive, or `out` is a
            URL of a remote scheme.
        StorageError: writing `out` failed (nothing is left under its name).
    """
    out = _local_file(out, "export writes")
    kind = _kind_of_file(out)
    if kind == "archive":
        return _export_archive(url, out, keys, strip_prefix, storage_options)
    chosen = keys
    if keys is None and strip_prefix is not None:
        keys = [strip_prefix]
    tree = load(url, keys=keys, allow_pickle=allow_pickle, storage_options=storage_options)
    if strip_prefix is not None:
        tree = _subtree(tree, strip_prefix, url, chosen)
    if kind == "torch":
        torch = _require("torch")
        tensors = _weights_only_readable(tree)
        versions = state_dict_versions(info(url, storage_options=storage_options).metadata)
        if versions:  # so that modules load their state dicts as the versions they are
            tensors = with_state_dict_metadata(tensors, (strip_prefix or "").strip("/"),
                                               versions)
        nbytes = _write_atomically(out, lambda tmp: torch.save(tensors, tmp))
        return ExportReport(out, list(_flat_leaves(tree).leaves), nbytes)
    return _export_safetensors(url, out, tree)


#: The key, in a checkpoint's metadata "lightning" dict, of its state dicts' `_metadata`
#: (the Lightning plugin records it; a `.pt` export gives it back as `torch.save` had it).
STATE_DICT_METADATA = "state_dict_metadata"


def state_dict_versions(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The `_metadata` of the state dicts of a checkpoint with `metadata`, by the dict's
    path, as the Lightning plugin records it (None: none recorded)."""
    lightning = metadata.get("lightning")
    versions = lightning.get(STATE_DICT_METADATA) if isinstance(lightning, dict) else None
    return versions if isinstance(versions, dict) and versions else None


def collect_state_dict_versions(value: Any) -> dict[str, Any]:
    """The `_metadata` of every dict in `value` that has one (a module's state dict: each
    submodule's `version`), by the dict's path, as `state_dict_versions` gives it back; only
    dicts that a save stores as dicts (str or int keys), looked for as `storable` looks. One
    that JSON cannot hold as it is is left out, with a warning: that state dict loads back as
    if from the oldest version."""
    found: dict[str, Any] = {}
    for path, mapping in _stored_dicts(value, ""):
        metadata = getattr(mapping, "_metadata", None)
        if metadata is None:
            continue
        try:
            kept = json.loads(json.dumps(metadata, allow_nan=False)) == metadata
        except (TypeError, ValueError, RecursionError):
            kept = False
        if kept:
            found[path] = metadata
        else:
            logger.warning(
                "the state dict at %s has a _metadata that JSON cannot hold (%.200r): it is "
                "not saved, and modules that read their version from it load that state dict "
                "as the oldest format; keep it to dicts of str keys and JSON values",
                path or "<root>", metadata)
    return found


def _stored_dicts(value: Any, path: str) -> Iterator[tuple[str, dict[Any, Any]]]:
    """Every dict in `value` that a save stores as a dict, with its path."""
    if isinstance(value, dict) and all(type(key) in (str, int) for key in value):
        yield path, value
        for key, child in value.items():
            yield from _stored_dicts(child, join(path, key))
    elif isinstance(value, list | tuple):
        for index, child in enumerate(value):
            yield from _stored_dicts(child, join(path, index))


def _with_versions(metadata: dict[str, Any], versions: dict[str, Any], src: str) -> dict[str, Any]:
    """The checkpoint metadata `metadata` with the state dicts' `versions` recorded where
    `state_dict_versions` finds them (the caller's own record there is kept)."""
    lightning = metadata.get("lightning", {})
    if not isinstance(lightning, dict):
        logger.warning(
            "%s: the metadata's 'lightning' entry is not a dict, so the _metadata (module "
            "versions) of its state dicts is not recorded; a .pt export or the Lightning "
            "plugin gives those state dicts back without it", src)
        return metadata
    return {**metadata, "lightning": {STATE_DICT_METADATA: versions, **lightning}}


def with_state_dict_metadata(value: Any, path: str, versions: dict[str, Any]) -> Any:
    """`value`, loaded from `path`, with each dict whose path `versions` names made an
    `OrderedDict` carrying that `_metadata` (a plain dict takes no attribute)."""
    if isinstance(value, dict):
        for key, child in value.items():
            value[key] = with_state_dict_metadata(child, join(path, key), versions)
        if path not in versions:
            return value
        restored: Any = OrderedDict(value)
        restored._metadata = OrderedDict(versions[path])
        return restored
    if type(value) in (list, tuple):
        return type(value)(with_state_dict_metadata(child, join(path, index), versions)
                           for index, child in enumerate(value))
    return value


def _export_archive(
    url: str, out: str, keys: Sequence[str] | None, strip_prefix: str | None,
    storage_options: dict[str, Any] | None,
) -> ExportReport:
    if keys is not None or strip_prefix is not None:
        raise SafepointError(
            f"{out}: an archive holds the whole checkpoint {url} as it was saved; export a "
            "selection (keys=, strip_prefix=; --keys, --strip-prefix) to a .safetensors or .pt "
            "file instead"
        )
    packed: list[Manifest] = []

    def write(tmp: str) -> None:
        with open(tmp, "wb") as file:
            packed.append(pack(url, file, out, storage_options))

    nbytes = _write_atomically(out, write)
    return ExportReport(out, list(packed[0].entries), nbytes)


def _flat_leaves(tree: Any) -> Flat:
    """A loaded tree flattened, unpickled objects as `sp.Pickled` leaves."""
    return flatten(storable(tree, pickle_objects=True)[0])


class _EmptyBytes:
    """What a `.pt` export pickles for b"": torch.save pickles b"" as a call of the global
    `bytes`, which `torch.load(weights_only=True)` refuses, and this as
    `_codecs.encode("", "latin1")`, which it allows (other bytes pickle so), giving b"" back."""

    def __reduce__(self) -> tuple[Callable[..., bytes], tuple[str, str]]:
        return codecs.encode, ("", "latin1")


_EMPTY_BYTES = _EmptyBytes()


def _tensor_of(array: Any) -> Any:
    """The NumPy array (or scalar) `array` as a CPU tensor: a copy in native byte order, since
    `torch.from_numpy` refuses another (a big-endian array loads back big-endian).

    Raises:
        TypeError: torch has no dtype for the array's.
    """
    return _require("torch").from_numpy(np.array(array, dtype=array.dtype.newbyteorder("=")))


def _weights_only_readable(value: Any) -> Any:
    """`value` as `torch.save` must get it for `torch.load(weights_only=True)` to read it back:
    numpy arrays (and scalars) as tensors (torch.save would pickle them) and b"" as
    `_EmptyBytes`. An array of a dtype torch has no tensor for (str, datetime64, object: a
    pickled entry, exported with `allow_pickle`) is kept as it is, for torch.save to pickle."""
    if is_ndarray(value):
        try:
            return _tensor_of(value)
        except TypeError:  # a NumPy dtype torch has no tensor for
            return value
    if type(value) is bytes and not value:
        return _EMPTY_BYTES
    if isinstance(value, dict):
        return {key: _weights_only_readable(child) for key, child in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_weights_only_readable(child) for child in value)
    return value


def _export_safetensors(url: str, out: str, tree: Any) -> ExportReport:
    torch = _require("torch", "safetensors")
    safetensors_torch = _require("safetensors.torch")
    save_file = safetensors_torch.save_file
    # The dtypes this safetensors writes (not torch's bit containers, complex128, ...).
    storable = getattr(safetensors_torch, "_SIZE", None)
    flat = _flat_leaves(tree)
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    refused = []
    exported: set[int] = set()
    for path, kind in flat.kinds.items():
        leaf = flat.leaves[path]
        if kind == NDARRAY:
            try:
                leaf = _tensor_of(leaf)
            except TypeError:  # a NumPy dtype torch has no tensor for
                refused.append(path)
                continue
        if kind in (TENSOR, NDARRAY) and (
                str(leaf.dtype).startswith("torch.bits")
                or (storable is not None and leaf.dtype not in storable)
                # It stores each element's two 4-bit values as two along the last
                # dimension, which a 0-d tensor lacks.
                or (str(leaf.dtype) == "torch.float4_e2m1fn_x2" and leaf.dim() == 0)):
            refused.append(path)  # safetensors has no dtype for it
        elif kind in (TENSOR, NDARRAY):
            # Tied weights come back as one tensor under two paths; safetensors refuses
            # shared memory, so the second path gets a copy (as a state dict names both).
            # It refuses non-contiguous tensors too: a tensor saved with its strides
            # (channels_last) is written in row-major order, as safetensors stores every one.
            tensors[path] = (leaf.clone(memory_format=torch.contiguous_format)
                             if id(leaf) in exported else leaf.contiguous())
            exported.add(id(leaf))
        elif kind == VALUE:
            values[path] = leaf
        else:
            refused.append(path)
    if refused:
        raise UnsupportedLeaf(
            f"{url} holds entries safetensors cannot store (bytes, pickled, tensors of a "
            "dtype it lacks, such as a torch bits dtype or complex128, or a 0-d "
            "float4_e2m1fn_x2, whose two values it stores along a last dimension): "
            f"{refused[:5]}; select tensors with keys= (--keys), or export to a .pt file",
            path=refused[0],
        )
    metadata = {"format": "pt"}
    if values:
        # Non-finite floats spelled as the manifest spells them: JSON has no NaN, and a
        # NaN's sign and payload stay.
        metadata[VALUES_KEY] = json.dumps(
            {path: encode_value(value) for path, value in values.items()}, allow_nan=False)
    nbytes = _write_atomically(out, lambda tmp: save_file(tensors, tmp, metadata))
    return ExportReport(out, list(flat.leaves), nbytes)


def import_checkpoint(
    src: str | os.PathLike[str],
    url: str,
    *,
    allow_pickle: bool = False,
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CheckpointInfo:
    """Save the contents of a `torch.save` file or a safetensors file as a checkpoint at `url`,
    or commit the checkpoint an archive holds there as it was saved (same save id and
    metadata; every block checked before the manifest is published).

    A torch file is read with `torch.load(weights_only=True)`: containers, tensors and plain
    values only. With `allow_pickle=True` it is fully unpickled (which runs code from the file:
    only for files you trust) and objects safepoint cannot store natively become `sp.Pickled`
    entries (loading them then needs `allow_pickle=True` too).

    Args:
        src: a local file (a path or file:// URL): a `*.safetensors` file, a `*.pt`,
            `*.pth`, `*.bin`, `*.ckpt` torch file, or an archive that `export_checkpoint`
            wrote (`*.tar`, `*.tar.gz`, ...).
        url: where to save the checkpoint.
        allow_pickle: allow full unpickling of a torch file.
        overwrite: replace a committed checkpoint at `url`.
        metadata: JSON-able user metadata; `imported_from` (the file's name) is added. Not
            for an archive, which keeps its own.
        storage_options: options for the checkpoint's storage backend.

    Returns:
        what was committed.

    Raises:
        CheckpointNotFound: no file at `src`.
        PickleNotAllowed: the torch file needs full unpickling and `allow_pickle` is False.
        CorruptCheckpoint: `src` is not a readable file of its kind (for an archive: holds
            anything but the checkpoint's files, or bytes that fail their checksums; nothing
            is committed then; for a safetensors file: its `safepoint.values` metadata is not
            an object of path -> plain value, or names a tensor's path).
        FormatVersionError: an archive's checkpoint was written by a newer format.
        UnsupportedLeaf: the torch file's root is not a dict, or its lists, tuples and dicts
            nest too deeply to store.
        CheckpointExists: `url` holds a committed checkpoint and `overwrite` is False.
        SafepointError: `src` is a URL of a remote scheme, `metadata` was given for an
            archive (it keeps its own), or, with `allow_pickle`, the torch file pickles a
            class that cannot be found here.
    """
    src = _local_file(src, "import reads")
    allow_pickle = flag("allow_pickle", allow_pickle, src)
    kind = _kind_of_file(src)
    if not os.path.isfile(src):
        if os.path.isdir(src):
            raise CheckpointNotFound(
                f"{src} is a directory, not a file to import: a safepoint checkpoint (such as "
                "one the Lightning plugin saved as last.ckpt) needs no import, load it as it "
                "is (sp.load, `safepoint info`)", url=src)
        raise CheckpointNotFound(f"no file at {src}" + (
            " (something that is not a regular file is there: a FIFO, a socket or a device)"
            if os.path.exists(src) else "") + ": check the path", url=src)
    if kind == "archive":
        if metadata is not None:
            raise SafepointError(
                f"{src}: an archive is imported as it was saved, with its own metadata; "
                "import it without metadata=, or load and save it again with new metadata"
            )
        return unpack(src, url, overwrite=overwrite, storage_options=storage_options)
    versions: dict[str, Any] = {}
    if kind == "safetensors":
        state = _read_safetensors(src)
    else:
        state, versions = _read_torch(src, allow_pickle)
    recorded = {**(metadata or {}), "imported_from": os.path.basename(src)}
    if versions:  # an export, or the Lightning plugin's load, gives them back
        recorded = _with_versions(recorded, versions, src)
    try:
        return save(url, state, metadata=recorded,
                    overwrite=overwrite, storage_options=storage_options)
    except RecursionError as exc:  # a tree `storable` walked, but too deep for `sp.save`
        raise _too_deep(src) from exc


def _too_deep(src: str) -> UnsupportedLeaf:
    return UnsupportedLeaf(
        f"{src} nests lists, tuples or dicts too deeply for safepoint to store (deeper than "
        "Python's recursion limit allows); flatten that structure before importing it",
        path="<root>",
    )


def _blob_call_refused(
    src: str, name: str, args: str, how: str = "calls"
) -> PickleNotAllowed:
    return PickleNotAllowed(
        f"{src} {how} {name} with arguments ({args[:100]}), which torch.save never writes "
        "and which could allocate any amount of memory; pass allow_pickle=True "
        "(--allow-pickle) only if you trust its author",
        url=src,
    )


#: The pickles torch.load reads before a legacy (not zip) torch.save file's raw data: the
#: magic number, the protocol version, the system info, the state, the storage keys.
_LEGACY_PICKLES = 5
#: Globals as `_check_pickle`'s stack names them: the dotted path torch's reader looks up
#: (`_global_name`).
_BYTES = frozenset({"builtins.bytes"})
_BYTEARRAY = frozenset({"builtins.bytearray"})
#: What `_codecs.encode(str, "latin1")` gives in `_check_blob_calls`'s stack: bytes.
_ENCODED = ("call", "_codecs.encode")
#: `_rebuild_from_type_v2(func, new_type, args, state)` runs `func(*args)`: torch.save only
#: writes one of torch's `_rebuild_` functions there (`Tensor.__reduce_ex__`).
_REBUILD_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"
_REBUILD_PREFIX = "torch._utils._rebuild_"
#: `_rebuild_device_tensor_from_cpu_tensor(data, dtype, device, ...)` runs
#: `data.to(dtype, device)`: of an expanded view (stride 0, one element stored) in another
#: dtype it makes every element (GiBs from a file of 1 KiB). torch.save writes these only for
#: xla, mtia, maia and privateuse1 tensors, which a CPU import has no device for: refused.
_DEVICE_REBUILDS = frozenset({"torch._utils._rebuild_device_tensor_from_cpu_tensor",
                              "torch._utils._rebuild_device_tensor_from_numpy"})
#: How torch's tensor and storage classes end (`torch.Tensor`, `torch.FloatTensor`,
#: `torch.cuda.sparse.LongTensor`, `torch.storage.UntypedStorage`, ...; `_tensor_class`).
_TENSOR_SUFFIXES = ("Tensor", "Storage")
#: A str literal of the pickle in that stack (its text kept only when short: a codec's or a
#: global's name).
_TEXT = "text"
_SHORT_TEXT = 200
#: What a str literal is read from (torch reads the three 8-bit ones as str too).
_STR_OPCODES = frozenset({"UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8",
                          "STRING", "BINSTRING", "SHORT_BINSTRING"})
#: The opcodes that build an object of a class without calling it: `cls.__new__(cls, *args)`.
_NEWOBJ_OPCODES = frozenset({"NEWOBJ", "NEWOBJ_EX"})
#: Allowed globals of torch's reader that iterate their argument: `set(t)` of a stride-0 view
#: of a one-element storage makes n Python objects (GiBs from a file of 1 KiB). torch.save
#: calls them with no argument (OrderedDict) or one list, tuple or dict written in the pickle.
_ITERATING = frozenset({"torch.Size", "builtins.set", "builtins.frozenset",
                        "collections.Counter", "collections.OrderedDict"})
#: What `_check_pickle`'s stack holds for a list, dict or set written in the pickle (a
#: tuple written there is the tuple of its items).
_LIST = ("literal", "list")
_DICT = ("literal", "dict")
_SET = ("literal", "set")
_LITERALS = {"EMPTY_LIST": _LIST, "LIST": _LIST, "EMPTY_DICT": _DICT, "DICT": _DICT,
             "EMPTY_SET": _SET, "FROZENSET": _SET}
#: The int literals of a pickle, kept in `_check_pickle`'s stack below `_LARGE`.
_INT_OPCODES = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"})
_LARGE = 1 << 63
#: The opcodes that fill the list, dict or set below their items, which stays on the stack.
_FILLING = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS"})


def _encodes_text(args: object) -> bool:
    """Whether `_check_pickle`'s stack item `args` is what torch.save passes `_codecs.encode`:
    a str literal and "latin1"."""
    return (type(args) is tuple and len(args) == 2 and type(args[0]) is tuple
            and args[0][:1] == (_TEXT,) and args[1] in ((_TEXT, "latin1"), (_TEXT, "latin-1")))


def _check_blob_calls(src: str) -> None:
    """Refuse a `.pt` whose pickles call the globals that make bytes other than as torch.save
    does, before torch reads it: `bytes()` (its b""), `bytearray()` or
    `bytearray(_codecs.encode(str, "latin1"))`, and `_codecs.encode` on a str literal with
    "latin1". torch's weights_only reader allows `bytearray` and `_codecs.encode` itself (and
    `bytes` here, for b""): `bytes(100 << 30)` allocates 100 GiB, and
    `_codecs.encode(x, "hex")` nested doubles its bytes at each level (40 levels, 2 TiB, in a
    few hundred bytes). The pickles are read as opcodes, nothing run, tracking only which
    stack items are those globals, str literals, `_codecs.encode` calls and tuples of them.

    Raises:
        PickleNotAllowed: another call of `bytes`, `bytearray` or `_codecs.encode`.
        CorruptCheckpoint: a pickle torch would read is not a well-formed one, or the zip
            holds a member torch.save never writes (`_check_members`).
    """
    with open(src, "rb") as file:
        if file.read(4) == b"PK\x03\x04":  # torch.save's zip format: its .pkl members
            try:
                with zipfile.ZipFile(file) as archive:
                    members = archive.infolist()
                    _check_members(src, members)
                    for entry in members:
                        if entry.filename.lower().endswith(".pkl"):
                            with archive.open(entry) as member:  # this entry, not its name's
                                _check_pickle(src, member)
            except (zipfile.BadZipFile, OSError, EOFError) as exc:
                raise _unreadable(src, _first_line(exc)) from exc
            return
        if os.fstat(file.fileno()).st_size:
            # A map reads no more than the file holds, whatever length an opcode claims.
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                storages: dict[str, _Storage] = {}
                start = 0
                for _ in range(_LEGACY_PICKLES):
                    start = mapped.tell()
                    _check_pickle(src, mapped, storages)
                _check_legacy_data(src, mapped, storages, mapped[start:mapped.tell()])


@dataclass(frozen=True)
class _Storage:
    """A storage persistent id of a legacy (not zip) torch file, in `_check_pickle`'s stack:
    torch allocates it uninitialized at the size the id declares (`nbytes`), then fills it
    from the data section; a tensor on it resizes it to whatever its size needs."""

    key: str
    nbytes: int
    element_size: int
    root: bool = True


#: torch's rebuilds of a tensor on a storage: `(storage, offset, size, stride, ...)`.
_STORAGE_REBUILDS = frozenset({f"torch._utils._rebuild_{name}" for name in
                               ("tensor", "tensor_v2", "tensor_v3", "qtensor")})


def _unreadable(src: str, why: str, then: str = "") -> CorruptCheckpoint:
    """The error for `src`, which is no torch.save file torch's reader would read (`why`),
    and what to do (`then`, else: damaged or not torch.save's)."""
    return CorruptCheckpoint(
        f"{src} is not a readable torch.save file ({why}); "
        + (then or "it is damaged or was not written by torch.save: copy it again whole, or "
           "save it again with torch.save"),
        url=src,
    )


def _element_size(class_name: object) -> int | None:
    """The element size of the storage class a legacy storage id names ("torch.FloatStorage"),
    None if it is no typed storage class of torch."""
    if type(class_name) is not str or not class_name.startswith("torch.") \
            or not class_name.endswith("Storage"):
        return None
    torch = _require("torch")
    found: Any = torch
    with warnings.catch_warnings():  # TypedStorage is deprecated
        warnings.simplefilter("ignore")
        for part in class_name.split(".")[1:]:
            found = getattr(found, part, None)
        dtype = getattr(found, "dtype", None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


def _legacy_storage(src: str, pid: object, storages: dict[str, _Storage]) -> _Storage:
    """The storage a legacy persistent id `pid` (`_check_pickle`'s stack item) gives, as
    torch's reader makes it: ('storage', class, key, location, numel, view metadata), the
    first id of a key making its storage, a view (key, offset, numel) a part of it."""
    parts = pid if type(pid) is tuple and len(pid) == 6 else (None,) * 6
    kind, class_name, key, _, numel, view = parts
    element_size = _element_size(class_name)
    key_text = _text_of(key)
    if (_text_of(kind) != "storage" or element_size is None or key_text is None
            or type(numel) is not int or numel < 0):
        raise _unreadable(src, f"a storage id torch.save never writes: {pid!r:.200}")
    # One dict of roots and views by key, as torch's: the first id of a key makes it.
    root = storages.setdefault(key_text, _Storage(key_text, numel * element_size, element_size))
    if view is None:
        return root
    view_key, offset, view_numel = view if type(view) is tuple and len(view) == 3 else (None,) * 3
    view_text = _text_of(view_key)
    if (view_text is None or type(offset) is not int or type(view_numel) is not int
            or offset < 0 or view_numel < 0
            or (offset + view_numel) * element_size > root.nbytes):
        raise _unreadable(src, f"a storage view beyond its storage: {pid!r:.200}")
    return storages.setdefault(
        view_text, _Storage(view_text, view_numel * element_size, element_size, root=False))


def _check_storage_rebuild(src: str, function: object, args: object) -> None:
    """Refuse, in a legacy torch file, a rebuild of a tensor on a storage whose offset, size
    and stride reach past what its storage id declares: torch resizes the storage to fit
    (memory never filled from the file, any amount of it)."""
    if function == _REBUILD_FROM_TYPE and type(args) is tuple and len(args) > 2:
        function, args = args[0], args[2]
    if function not in _STORAGE_REBUILDS:
        return
    storage, offset, size, stride = (
        args[:4] if type(args) is tuple and len(args) >= 4 else (None,) * 4)
    ints = (type(size) is tuple and type(stride) is tuple and len(size) == len(stride)
            and all(type(n) is int and n >= 0 for n in (offset, *size, *stride)))
    if not isinstance(storage, _Storage) or not ints:
        raise _unreadable(src, f"a tensor rebuild torch.save never writes: {args!r:.200}")
    assert isinstance(offset, int) and isinstance(size, tuple) and isinstance(stride, tuple)
    if all(size):  # torch needs no storage for a tensor without elements
        needed = offset + 1 + sum((n - 1) * step for n, step in zip(size, stride, strict=True))
        if needed * storage.element_size > storage.nbytes:
            raise _unreadable(
                src, f"a tensor of size {size!r:.100} reaching past its storage "
                f"{storage.key!r:.100} of {storage.nbytes} bytes")


class _KeysUnpickler(pickle.Unpickler):
    """Reads the storage keys of a legacy torch file: a list of str, no global."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global {module}.{name} in the storage keys")


def _check_legacy_data(
    src: str, mapped: mmap.mmap, storages: dict[str, _Storage], keys_pickle: bytes
) -> None:
    """Refuse a legacy torch file whose data section does not hold each storage its state
    declares: torch fills only the storages its keys list (a storage left out keeps whatever
    memory it was given), each from a count of elements and that many elements."""
    try:
        keys = _KeysUnpickler(io.BytesIO(keys_pickle)).load()
    except Exception as exc:  # a damaged pickle raises many kinds
        raise _unreadable(src, f"unreadable storage keys: {_first_line(exc)}") from exc
    roots = {name: storage for name, storage in storages.items() if storage.root}
    if type(keys) is not list or not all(type(key) is str and key in roots for key in keys):
        raise _unreadable(src, f"storage keys {keys!r:.200} other than its storages'")
    missing = sorted(set(roots) - set(keys))
    if missing:
        raise _unreadable(src, f"no data for its storages {missing[:5]!r:.200}")
    position = mapped.tell()
    for key in keys:
        storage = roots[key]
        header = mapped[position:position + 8]
        count = struct.unpack("<q", header)[0] if len(header) == 8 else None
        position += 8 + storage.nbytes
        if count is None or count * storage.element_size != storage.nbytes \
                or position > len(mapped):
            raise _unreadable(
                src, f"the data of storage {key!r:.100} is not the {storage.nbytes} bytes "
                "its id declares")


def _check_members(src: str, members: list[zipfile.ZipInfo]) -> None:
    """Refuse a torch zip holding two members of one name, or a member not stored as it is,
    as torch.save never writes them. Of two members of one name, zipfile opens the last,
    torch's reader (miniz, by a binary search, ignoring case) may read another, which the scan
    would never see. A compressed member inflates to any size (a data.pkl holding a bytes
    literal, a tensor's record: 512 MiB of zeros deflate to 0.5 MiB), in the scan's memory or
    torch's, before anything could check it; stored, it is no larger than the file."""
    if any(entry.filename.split("/")[1:] == ["constants.pkl"] for entry in members):
        raise _unreadable(
            src, "it is a TorchScript archive (torch.jit.save), which holds code",
            "load it with torch.jit.load if you trust it, then torch.save its state_dict() "
            "and import that")
    seen: set[str] = set()
    for entry in members:
        name = entry.filename.lower()
        if name in seen:
            raise _unreadable(src, f"its zip holds the member {entry.filename[:200]!r} more "
                                   "than once")
        seen.add(name)
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != entry.compress_size:
            raise _unreadable(
                src, f"its zip member {entry.filename[:200]!r} is not stored uncompressed "
                f"(zip method {entry.compress_type}, {entry.compress_size} bytes stored for "
                f"{entry.file_size}), which torch.save never writes",
                "safepoint imports torch files as torch.save writes them, every member "
                "stored uncompressed: if you trust the file, torch.load it and torch.save "
                "it again")


def _check_pickle(src: str, pickled: Any, storages: dict[str, _Storage] | None = None) -> None:
    """`_check_blob_calls` for the one pickle at `pickled`'s position; for a legacy torch
    file, with the storages its persistent ids declare collected in `storages`
    (`_legacy_storage`) and the tensors rebuilt on them checked (`_check_storage_rebuild`)."""
    stack: list[object] = []
    marks: list[int] = []
    memo: dict[object, object] = {}
    try:
        for opcode, arg, _ in pickletools.genops(pickled):
            if opcode.name == "MARK":
                marks.append(len(stack))
                continue
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                memo[len(memo) if arg is None else arg] = stack[-1]
                continue
            if opcode.name in ("GET", "BINGET", "LONG_BINGET", "DUP"):
                stack.append(stack[-1] if opcode.name == "DUP" else memo[arg])
                continue
            before = opcode.stack_before
            items: list[object] = []
            if pickletools.markobject in before:
                items = stack[marks.pop():]
                del stack[len(stack) - len(items):]
                before = before[: before.index(pickletools.markobject)]
            if len(before) > len(stack):
                raise ValueError(f"{opcode.name} finds too few items on the stack")
            popped = stack[len(stack) - len(before):]
            del stack[len(stack) - len(before):]
            value: object = None
            if opcode.name == "GLOBAL":  # pickletools gives "module name"
                value = _global_name(*str(arg).partition(" ")[::2])
            elif opcode.name == "STACK_GLOBAL":  # the global named by the two str below it
                module, name = map(_text_of, popped)
                if module is not None and name is not None:
                    value = _global_name(module, name)
            elif opcode.name in _STR_OPCODES:
                value = (_TEXT, arg if isinstance(arg, str) and len(arg) <= _SHORT_TEXT else None)
            elif opcode.name in ("EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
                value = tuple(items or popped)
            elif opcode.name in _INT_OPCODES:
                value = arg if type(arg) is int and abs(arg) < _LARGE else None
            elif opcode.name == "BINPERSID" and storages is not None:
                value = _legacy_storage(src, popped[0], storages)
            elif opcode.name in _LITERALS:
                value = _LITERALS[opcode.name]
            elif opcode.name in _FILLING:  # the container stays what it was
                value = popped[0]
            elif opcode.name in ("REDUCE", "INST", "OBJ"):  # a call: function(*args)
                function, args = (
                    popped if opcode.name == "REDUCE"
                    else (arg, tuple(items)) if opcode.name == "INST"
                    else (items[0], tuple(items[1:]))
                )
                _check_call(src, function, args)
                if storages is not None:
                    _check_storage_rebuild(src, function, args)
                value = ("call", function)
            elif opcode.name in _NEWOBJ_OPCODES:  # cls.__new__(cls, *args), no call of cls
                _check_newobj(src, popped[0], popped[1:])
            elif opcode.name == "BUILD":  # the object below its state, given that state
                _check_build(src, popped[0], popped[1])
                value = popped[0]
            stack.extend([value] * len(opcode.stack_after))
    except (ValueError, IndexError, KeyError) as exc:
        raise _unreadable(src, _first_line(exc)) from exc


def _global_name(module: str, name: str) -> str:
    """The dotted path torch's weights-only reader looks a global up by (after pickle's
    Python 2 renames), however a pickle splits it: "torch" "_utils._rebuild_tensor_v2" is
    "torch._utils._rebuild_tensor_v2" too."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def _tensor_class(name: object) -> bool:
    """Whether `_check_pickle`'s stack item `name` is one of torch's tensor or storage
    classes, all allowed by its weights-only reader: `torch.Tensor(n)` allocates n
    uninitialized floats. torch.save never calls or builds one (its tensors are `_rebuild_`
    calls on the file's storages)."""
    return type(name) is str and name.startswith("torch.") and name.endswith(_TENSOR_SUFFIXES)


def _text_of(item: object) -> str | None:
    """The text of `_check_pickle`'s stack item `item` if it is a short str literal."""
    if type(item) is tuple and len(item) == 2 and item[0] == _TEXT and type(item[1]) is str:
        return item[1]
    return None


def _literal_container(item: object) -> bool:
    """Whether `_check_pickle`'s stack item `item` is a tuple, list, dict or set written in
    the pickle (not a call's result, a str or a persistent id)."""
    if item in (_LIST, _DICT, _SET):
        return True
    return type(item) is tuple and item[:1] not in (("call",), (_TEXT,), ("literal",))


def _literal_tuple(item: object) -> bool:
    """Whether `_check_pickle`'s stack item `item` is a tuple written in the pickle: what
    torch's reader may splat (`func(*args)`), its items no more than the pickle wrote."""
    return type(item) is tuple and item[:1] not in (("call",), (_TEXT,), ("literal",))


def _iterates_only_literals(args: object) -> bool:
    """Whether `args` of an `_ITERATING` global are as torch.save writes them: none, or one
    tuple, list, dict or set written in the pickle."""
    return type(args) is tuple and (args == () or (len(args) == 1
                                                   and _literal_container(args[0])))


def _check_call(src: str, function: object, args: object) -> None:
    """Refuse a call of the global `function` (as `_check_pickle`'s stack names it) with
    `args` unless torch.save writes it so: a tuple written in the pickle for `args` (torch's
    reader runs `function(*args)`, and of a stride-0 view of n elements on one stored one
    that makes n tensor objects)."""
    if not _literal_tuple(args):
        raise _blob_call_refused(src, str(function)[:200], repr(args))
    if function in _ITERATING and not _iterates_only_literals(args):
        raise _blob_call_refused(src, str(function), repr(args))
    if function in _BYTES and args != ():
        raise _blob_call_refused(src, "bytes", repr(args))
    if function in _BYTEARRAY and args not in ((), (_ENCODED,)):
        raise _blob_call_refused(src, "bytearray", repr(args))
    if function == _ENCODED[1] and not _encodes_text(args):
        raise _blob_call_refused(src, "_codecs.encode", repr(args))
    if _tensor_class(function):
        raise _blob_call_refused(src, str(function)[:200], repr(args))
    if function in _DEVICE_REBUILDS:
        raise _blob_call_refused(src, str(function), repr(args))
    if function == _REBUILD_FROM_TYPE:  # runs args[0](*args[2]): any allowed global, bytes(n)
        func, inner = (args[0], args[2]) if type(args) is tuple and len(args) > 2 else (None,) * 2
        if (not (type(func) is str and func.startswith(_REBUILD_PREFIX))
                or func in _DEVICE_REBUILDS or not _literal_tuple(inner)):
            raise _blob_call_refused(src, _REBUILD_FROM_TYPE, repr(args))


def _check_newobj(src: str, cls: object, args: list[object]) -> None:
    """Refuse `cls.__new__(cls, *args)` (NEWOBJ, NEWOBJ_EX) of a global whose calls
    `_check_call` restricts: `bytes.__new__(bytes, n)` allocates n bytes,
    `torch.Tensor.__new__(torch.Tensor, n)` 4·n, and torch.save never builds any of them so;
    and any `cls` but with a tuple written in the pickle for `args` (keyword arguments: a dict
    written there), which torch's reader splats."""
    if not args or not _literal_tuple(args[0]) or (len(args) > 1 and args[1] != _DICT):
        raise _blob_call_refused(src, str(cls)[:200], ", ".join(map(repr, args)), how="builds")
    if _tensor_class(cls):
        raise _blob_call_refused(src, str(cls)[:200], ", ".join(map(repr, args)), how="builds")
    if cls in _ITERATING and (len(args) != 1 or not _iterates_only_literals(args[0])):
        raise _blob_call_refused(src, str(cls), ", ".join(map(repr, args)), how="builds")
    for name, restricted in (("bytes", _BYTES), ("bytearray", _BYTEARRAY),
                             ("_codecs.encode", {_ENCODED[1]})):
        if cls in restricted:
            raise _blob_call_refused(src, name, ", ".join(map(repr, args)), how="builds")


def _check_build(src: str, inst: object, state: object) -> None:
    """Refuse BUILD (`_check_pickle`) with a state torch.save never writes: torch's reader
    iterates or splats it (`OrderedDict().__dict__.update(state)`, `tensor.set_(*state)`,
    `obj.__dict__.update(state)`), and of a stride-0 view of n elements on one stored one
    that makes n tensor objects. torch.save writes a dict written in the pickle (a state
    dict's `_metadata` on its OrderedDict, an object's `__dict__`), or `(dict, slots dict)`;
    files of old torch a tuple written there as the state of a tensor or parameter one of
    torch's `_rebuild_` functions made (`set_(*state)`, `__setstate__(state)`)."""
    function = inst[1] if type(inst) is tuple and len(inst) == 2 and inst[0] == "call" else None
    if state == _DICT or (type(state) is tuple and _literal_tuple(state) and len(state) == 2
                          and all(item in (None, _DICT) for item in state)):
        return
    if (type(function) is str and _literal_tuple(state) and function not in _DEVICE_REBUILDS
            and (function.startswith(_REBUILD_PREFIX) or function == _REBUILD_FROM_TYPE)):
        return
    raise PickleNotAllowed(
        f"{src} sets the state of {str(function or inst)[:200]} to {state!r:.100}, which "
        "torch.save never writes and which could allocate any amount of memory; pass "
        "allow_pickle=True (--allow-pickle) only if you trust its author",
        url=src,
    )


#: The global an UnpicklingError of torch's weights-only reader names: "Unsupported global:
#: GLOBAL argparse.Namespace was not ...", "unsupported GLOBAL os.stat_result whose module os
#: is blocked" (os, posix, sys and nt are refused outright).
_REFUSED_GLOBAL = re.compile(r"GLOBAL (\S+)")


def _read_torch(src: str, allow_pickle: bool) -> tuple[Any, dict[str, Any]]:
    """The tree a torch file holds, as `sp.save` stores it, and the `_metadata` of its state
    dicts by path (`collect_state_dict_versions`)."""
    torch = _require("torch")
    try:
        allowed = getattr(torch.serialization, "safe_globals", None)  # torch 2.5 and later
        if not allow_pickle:
            _check_blob_calls(src)
        # `bytes` is how torch.save pickles b"": allowed, its calls checked above.
        with allowed([bytes]) if allowed else contextlib.nullcontext():
            loaded = torch.load(src, map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as exc:
        needs = _REFUSED_GLOBAL.search(str(exc))
        if allow_pickle or not needs:
            raise _unreadable(src, _first_line(exc), "" if allow_pickle else (
                "if it is a pickle you trust, allow_pickle=True (--allow-pickle) may read "
                "it")) from exc
        raise PickleNotAllowed(
            f"{src} holds objects that torch.load(weights_only=True) refuses (the global "
            f"{needs[1][:200]}): loading them runs code from the file; pass "
            "allow_pickle=True (--allow-pickle) only if you trust its author",
            url=src,
        ) from exc
    except (ImportError, AttributeError) as exc:
        if not allow_pickle:  # torch's weights-only reader imports nothing: damage
            raise _unreadable(src, _first_line(exc)) from exc
        raise SafepointError(
            f"{src} pickles an object whose class cannot be found here ({_first_line(exc)}): "
            "install or import the module that defines it, then import the file again",
            url=src,
        ) from exc
    except SafepointError:
        raise
    except Exception as exc:  # what a damaged pickle raises varies: UnicodeDecodeError, ...
        raise _unreadable(src, _first_line(exc)) from exc
    if not isinstance(loaded, dict):
        raise UnsupportedLeaf(
            f"{src} holds a {type(loaded).__name__}, not a dict: import needs a dict at the "
            "root (save {'model': obj.state_dict()} rather than the object)",
            path="<root>",
        )
    try:
        versions = collect_state_dict_versions(loaded)
        state, refused = storable(loaded, pickle_objects=allow_pickle)
    except RecursionError as exc:
        raise _too_deep(src) from exc
    if refused:
        raise UnsupportedLeaf(
            f"{src} holds values safepoint stores only with pickle, at {refused[:5]}: convert "
            "them, or pass allow_pickle=True (--allow-pickle) to store them as pickled entries",
            path=refused[0],
        )
    _check_growth(src, state)
    return state, versions


#: A checkpoint stores every tensor dense: an expanded view (stride 0) torch.save writes as
#: its few stored bytes grows to its whole size. An import refuses a file whose tensors would
#: grow it past this many times its size (plus `_GROWTH_SLACK`): a hostile file of a kilobyte
#: can declare views of any size over one stored element.
_GROWTH_FACTOR = 64
_GROWTH_SLACK = 64 << 20


def _check_growth(src: str, state: Any) -> None:
    """Refuse to import `src` when its tensors, stored dense, would take far more bytes than
    the file holds (see `_GROWTH_FACTOR`).

    Raises:
        UnsupportedLeaf: naming the largest tensor.
    """
    leaves = flatten(state).leaves
    sizes = {path: leaf.numel() * leaf.element_size()
             for path, leaf in leaves.items() if is_tensor(leaf)}
    limit = _GROWTH_FACTOR * os.path.getsize(src) + _GROWTH_SLACK
    if sum(sizes.values()) > limit:
        largest = max(sizes, key=sizes.__getitem__)
        raise UnsupportedLeaf(
            f"{src} holds tensors that take {sum(sizes.values())} bytes stored dense, more "
            f"than {_GROWTH_FACTOR} times the file's size (the tensor at {largest!r}, "
            f"{sizes[largest]} bytes, is an expanded view of fewer stored bytes): a file "
            "can declare views of any size, so import refuses it; if you trust the file, "
            "torch.load it and make its tensors what a checkpoint should hold (.contiguous() "
            "or the few bytes to expand again), then sp.save them",
            path=largest,
        )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _read_safetensors(src: str) -> dict[str, Any]:
    _require("torch", "safetensors")  # safetensors reads into torch tensors (framework="pt")
    safetensors = _require("safetensors")
    safe_open, SafetensorError = safetensors.safe_open, safetensors.SafetensorError
    try:
        with safe_open(src, framework="pt") as file:
            header = file.metadata() or {}
            flat: dict[str, Any] = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
        values = json.loads(header.get(VALUES_KEY, "{}"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"{src} is not a readable safetensors file: {exc}",
                                url=src) from exc
    except RecursionError as exc:
        raise CorruptCheckpoint(
            f"{src} is not a readable safetensors file: its {VALUES_KEY!r} metadata is nested "
            "too deeply; remove that metadata entry (or export the file again)",
            url=src,
        ) from exc
    for key, value in _header_values(values, src).items():
        if key in flat:
            raise CorruptCheckpoint(
                f"{src}: key {key!r} is both a tensor and a value in the {VALUES_KEY!r} "
                "metadata, and one would silently replace the other; remove one of them",
                url=src,
            )
        flat[key] = value
    return _nest(flat, src)


def _header_values(values: Any, src: str) -> dict[str, Any]:
    """The `safepoint.values` metadata, checked and decoded: a JSON object of path -> plain
    value, as `export_checkpoint` writes it, a non-finite float spelled as the manifest
    spells it ({"float": "nan"}, with its "bits" for another NaN) or, as exports wrote it
    before, a bare NaN or Infinity token.

    Raises:
        CorruptCheckpoint: it is anything else (a list, a number, a nested object, ...).
    """
    if not isinstance(values, dict):
        raise CorruptCheckpoint(
            f"{src} is not a readable safetensors file: its {VALUES_KEY!r} metadata is a JSON "
            f"{_json_type(values)}, not an object of path -> value; remove that metadata "
            "entry (or export the file again)",
            url=src,
        )
    for key, value in values.items():
        number = decode_float(value) if type(value) is dict else None
        if number is not None:
            values[key] = number
        elif type(value) not in _HEADER_VALUE_TYPES:
            raise CorruptCheckpoint(
                f"{src} is not a readable safetensors file: its {VALUES_KEY!r} metadata holds "
                f"a JSON {_json_type(value)} at {key!r}, where only null, booleans, numbers, "
                'strings and non-finite floats ({"float": "nan"}) belong; remove that '
                "metadata entry (or export the file again)",
                url=src,
            )
    return values


#: What `export_checkpoint` puts in the `safepoint.values` metadata (plain VALUE leaves).
_HEADER_VALUE_TYPES = (type(None), bool, int, float, str)


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _unescape(part: str) -> str:
    if part == "%":  # the empty key (see `_tree.join`)
        return ""
    return _ESCAPED.sub(lambda m: "%" if m[1] == "25" else "/", part)


def _nest(flat: dict[str, Any], src: str) -> dict[str, Any]:
    """Nested dicts from `/`-joined keys (escaped as safepoint paths are)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, name = (_unescape(part) for part in key.split("/"))
        node = root
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        if not isinstance(node, dict) or name in node:
            raise CorruptCheckpoint(
                f"{src}: key {key!r} clashes with another key that is its prefix; rename one",
                url=src,
            )
        node[name] = value
    return root
