"""Distributed coordination (engine layer): the ranks of a collective `save` or `load`, the
exchange that makes every rank reach the same outcome, and the sharded save itself.

A collective save runs in two exchanges, each a gather to rank 0 and a broadcast back:

  1. every rank describes its leaves (paths, dtypes, shapes, which piece of a global tensor it
     holds); rank 0 checks that the trees agree, that the URL may be written, and decides who
     writes what (`_plan.plan_writers`: every piece once, replicated data spread over ranks);
  2. every rank writes and fsyncs its own data file and reports its chunks; only when all
     succeeded does rank 0 assemble and publish the one global manifest. In an incremental
     save (`Increment`) a rank writes only the blocks of its pieces that the previous commit
     does not hold and reports chunks in that commit's files too; rank 0 links those files
     into the new checkpoint before it publishes.

A failure anywhere in either exchange is broadcast, so every rank raises (`DistributedError`
naming the failing ranks and causes; the same error everywhere when rank 0 refused, e.g.
`CheckpointExists`), removes its own data file, and nothing is committed. A rank that dies
makes the others' next collective call fail the same way. The same code runs in a group of
one rank. Only small objects cross processes (descriptions, plans, chunk records, the
manifest's JSON): the bytes go to storage from the rank that holds them.

Also here: the one all-reduce `sp.Run` takes at each step boundary (`Group.maximum`), and the
priming of optimizers without state before a load into DTensor parameters.

torch is imported only when a process group is in use.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import pickle
import sys
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, TypeVar

from ._checksum import DEFAULT_ALGORITHM, checksum_function
from ._commit import discard_unless_committed, raise_out_of_space
from ._engine import IOOptions, write_file
from ._format import (
    BLOCK_BYTES,
    DATA_DIR,
    DTYPES,
    Box,
    Chunk,
    Entry,
    data_file_name,
    element_count,
    overlapping_pair,
)
from ._incremental import Increment, Piece, piece
from ._leaves import (
    BYTES,
    PICKLE,
    SHARDED,
    TENSOR,
    VALUE,
    Shard,
    is_dtensor,
    piece_of,
    same_value,
)
from ._plan import Held, WriteItem, plan_layout, plan_writers
from ._snapshot import Snapshot, Stager
from ._staging import HostLeaf, describe, host_leaf, tensor_entry
from ._tree import Flat, leaf_paths, merge_skeletons
from ._types import Node, StatePath
from .errors import DistributedError, SafepointError, UnsupportedLeaf
from .storage import Storage

__all__ = ["Group", "Primed", "SavePlan", "alike", "check_same_url", "exchange", "group_for",
           "prime_optimizers", "raise_together", "save_pieces", "unprime"]

logger = logging.getLogger(__name__)

#: A replicated tensor of at least this many bytes is cut into slabs written by different
#: ranks; smaller ones are whole, each on the least loaded rank holding it.
SPLIT_BYTES = 16 << 20

_digest = checksum_function(DEFAULT_ALGORITHM)
_T = TypeVar("_T")


class Group:
    """The ranks taking part in one collective call: a torch.distributed process group, or
    this process alone (`process_group` None), for which every collective is the identity."""

    def __init__(self, process_group: Any = None, *, solo: bool = False) -> None:
        self.pg = process_group
        self.solo = solo
        if solo:
            self.rank, self.size = 0, 1
            return
        dist = sys.modules["torch.distributed"]
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        if self.rank < 0:  # torch's handle for a rank outside the group
            raise SafepointError(
                f"process_group does not include this process (global rank "
                f"{dist.get_rank()}): make the call only on the group's ranks, pass the "
                "group this rank belongs to, or pass dist=False for a local call"
            )

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0; None elsewhere."""
        if self.solo:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        self._collective("gather_object", obj, out, group=self.pg, group_dst=0)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        if self.solo:
            return obj
        box = [obj]
        self._collective("broadcast_object_list", box, group=self.pg, group_src=0)
        return box[0]

    def private(self) -> Group:
        """A new group of the same ranks, for collectives from a background thread that must
        never interleave with the caller's own collectives (a collective call on every rank).

        It is a gloo group of its own on the default group's store, under a name that rank 0
        draws and sends the others: torch's `new_group` would need every rank of the job
        for a subgroup's group, or name it after a count of the groups each rank belongs
        to, which differs between the ranks of a subgroup whose ranks are in other groups
        too (pipeline stages and a group of their leaders), so they would never meet."""
        if self.solo:
            return self
        dist = sys.modules["torch.distributed"]
        torch = sys.modules["torch"]
        pg = self.pg if self.pg is not None else dist.group.WORLD
        try:  # the caller's timeout, not torch's default of 30 minutes
            timeout = pg._get_backend(torch.device("cpu")).options._timeout
        except (AttributeError, RuntimeError):  # a group without a CPU backend
            timeout = dist.default_pg_timeout
        name = self.broadcast(uuid.uuid4().hex if self.rank == 0 else None)
        store = dist.PrefixStore(f"safepoint/{name}/",
                                 dist.distributed_c10d._get_default_store())
        return _Private(self._collective("ProcessGroupGloo", store, self.rank, self.size,
                                         timeout), self.rank, self.size)

    def maximum(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of `values` over the ranks (one small all-reduce), so
        that every rank takes the same decision (e.g. to save now) when any rank wants it."""
        if self.solo:
            return list(values)
        torch = sys.modules["torch"]
        dist = sys.modules["torch.distributed"]
        device = "cuda" if dist.get_backend(self.pg) == "nccl" else "cpu"
        tensor = torch.tensor(list(values), dtype=torch.int64, device=device)
        self._collective("all_reduce", tensor, op=dist.ReduceOp.MAX, group=self.pg)
        return [int(v) for v in tensor.tolist()]

    def _collective(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._call(name, *args, **kwargs)
        except Exception as exc:
            raise DistributedError(
                f"a collective call among {self.size} ranks failed on rank {self.rank} "
                f"({type(exc).__name__}: {exc}): another rank probably died or timed out; "
                "restart the job, it resumes from the last committed checkpoint",
                failures={self.rank: f"{type(exc).__name__}: {exc}"},
            ) from exc


    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(sys.modules["torch.distributed"], name)(*args, **kwargs)


class _Private(Group):
    """The group `Group.private` makes: a gloo backend of its own, which torch's object
    collectives do not know (they look a group up among those `new_group` made), so its
    objects cross as pickled bytes through the backend's own gather and broadcast, as
    torch's do."""

    def __init__(self, backend: Any, rank: int, size: int) -> None:
        self.pg, self.solo, self.rank, self.size = backend, False, rank, size

    def gather(self, obj: Any) -> list[Any] | None:
        torch = sys.modules["torch"]
        data = _as_tensor(pickle.dumps(obj))
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._collective("allgather", [sizes], [torch.tensor([len(data)])])
        longest = max(int(size) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(data)] = data
        out = [[torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]]
        options = sys.modules["torch.distributed"].GatherOptions()
        options.rootRank = 0
        self._collective("gather", out if self.rank == 0 else [], [padded], options)
        if self.rank != 0:
            return None
        return [pickle.loads(got[:int(size)].numpy().tobytes())
                for got, size in zip(out[0], sizes, strict=True)]

    def broadcast(self, obj: Any) -> Any:
        torch = sys.modules["torch"]
        options = sys.modules["torch.distributed"].BroadcastOptions()
        options.rootRank = 0
        data = _as_tensor(pickle.dumps(obj)) if self.rank == 0 else None
        size = torch.tensor([0 if data is None else len(data)])
        self._collective("broadcast", [size], options)
        if data is None:
            data = torch.empty(int(size), dtype=torch.uint8)
        self._collective("broadcast", [data], options)
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.pg, name)(*args, **kwargs).wait()


def _as_tensor(data: bytes) -> Any:
    """`data` as a uint8 tensor (sharing its memory), to be sent to other ranks."""
    torch = sys.modules["torch"]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)

def group_for(process_group: Any, dist: bool | None) -> Group:
    """The ranks of a call: `dist=False` keeps it local; otherwise it is collective over
    `process_group` (the default group when None) once torch.distributed is initialised.

    Raises:
        SafepointError: `dist=True` or a `process_group` without an initialised
            torch.distributed.
    """
    torch_dist = sys.modules.get("torch.distributed")
    ready = torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized()
    if dist is False:
        return Group(solo=True)
    if not ready:
        if dist or process_group is not None:
            missing = importlib.util.find_spec("torch") is None
            raise SafepointError(
                "a collective call needs torch.distributed, and torch is not installed: pip "
                "install torch, or pass dist=False" if missing else
                "a collective call needs torch.distributed: call "
                "torch.distributed.init_process_group() first, or pass dist=False"
            )
        return Group(solo=True)
    return Group(process_group)


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _call_site(frame: Any) -> tuple[str, int, int]:
    """A label of the line `frame` is at, the same in every process running the same code:
    its function's name, the line where that function starts and the line itself, not its
    file (the same code may be installed at other paths on other nodes), and not its
    `co_qualname`, which Python 3.10 lacks."""
    code = frame.f_code
    return code.co_name, code.co_firstlineno, frame.f_lineno


def exchange(
    group: Group,
    local: Callable[[], Any],
    decide: Callable[[list[Any]], Any],
    *,
    what: str,
    consequence: str,
    done: str | None = None,
    undo: Callable[[], None] | None = None,
) -> Any:
    """Run `local()` on every rank, then `decide(results)` on rank 0 with every rank's result
    in rank order, and return rank 0's decision on every rank. `done` says what `decide` did
    that stays done (a save's commit), for rank 0's error when the other ranks die before
    they hear of it. `undo` removes what `local` left (a save's data file) when the call
    fails, on a rank that can tell whether `decide` did anything: rank 0, which decides (its
    `undo` must keep what a `decide` that finished made: its broadcast can fail after), a
    rank whose `local` failed (rank 0 goes on only when every `local` succeeded), and a
    rank that heard rank 0's decision. A rank whose own collective call failed first (a
    peer died; the group's timeout ran out while rank 0 was still deciding) cannot tell, so
    it leaves what `local` left to the next call's tidying.

    Raises:
        DistributedError: `local` raised on some rank (every rank raises it, naming the ranks
            and causes; the failing rank's error is its `__cause__`). In a group of one, the
            error itself.
        SafepointError: `decide` raised it on rank 0 (every rank raises the same error).
    """
    error: BaseException | None = None
    # Where the exchange is called from: ranks at different places (one restoring while
    # another saves, a setting that differs by rank) would read each other's messages.
    site = _call_site(sys._getframe(1))
    knows = group.rank == 0  # whether this rank can tell if `decide` did anything
    try:
        try:
            mine: tuple[str, Any, tuple[str, int, int], str] = ("ok", local(), site, what)
        except BaseException as exc:
            knows = True  # rank 0 goes on only when every rank's `local` succeeded
            if group.solo or not isinstance(exc, Exception):
                raise
            error, mine = exc, ("error", _cause(exc), site, what)
        gathered = group.gather(mine)
        decision: tuple[str, Any] | None = None
        if gathered is not None:
            failures = {rank: body for rank, (status, body, _, _) in enumerate(gathered)
                        if status != "ok"}
            astray = {rank: f"it was {doing} while rank 0 was {what}"
                      for rank, (_, _, there, doing) in enumerate(gathered) if there != site}
            if failures:
                decision = ("failed", (failures, consequence))
            elif astray:
                decision = ("failed", (astray, "the ranks are out of step: every rank must "
                                               "make the same safepoint calls in the same "
                                               "order, with the same options"))
            else:
                try:
                    decision = ("ok", decide([body for _, body, _, _ in gathered]))
                except Exception as exc:
                    if group.solo:
                        raise
                    shared = exc if isinstance(exc, SafepointError) else SafepointError(
                        f"{what} failed on rank 0: {_cause(exc)}"
                    )
                    decision = ("raise", shared)
        try:
            decision = group.broadcast(decision)
        except DistributedError as exc:
            if done is None or decision is None or decision[0] != "ok":
                raise
            raise DistributedError(
                f"{what}: rank 0 finished but the other ranks could not be told ({exc}); "
                f"{done}",
                failures=exc.failures,
            ) from exc
        knows = True
        assert decision is not None
        status, body = decision
        if status == "ok":
            return body
        if status == "raise":
            raise body
        failed, said = body
        lines = "; ".join(f"rank {rank}: {cause}" for rank, cause in sorted(failed.items()))
        raise DistributedError(
            f"{what} failed on {len(failed)} of {group.size} ranks ({lines}); {said}",
            failures=failed,
        ) from error
    except BaseException:
        if undo is not None and knows:
            undo()
        elif undo is not None:
            logger.warning("%s: rank %d could not learn whether rank 0 finished; what it "
                           "wrote stays, for the next save there (or a manager's gc) to "
                           "remove if rank 0 did not", what, group.rank)
        raise


def raise_together(group: Group, error: BaseException, *, what: str, consequence: str) -> NoReturn:
    """Raise `error`, which this rank met before a collective call's first exchange, on every
    rank: this rank takes part in that exchange with it (alone, it would leave the others
    waiting out the group's timeout)."""

    def fail() -> None:
        raise error

    if not group.solo:
        exchange(group, fail, lambda _: None, what=what, consequence=consequence)
    raise error


# -- sharded save ---------------------------------------------------------------------------------


class _Leaf(NamedTuple):
    """What a rank tells rank 0 about one of its leaves (a tuple: thousands of them are
    pickled per save, and a tuple pickles several times faster than a dataclass)."""

    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    box: Box | None = None
    nbytes: int = 0
    device: str | None = None
    scalar: bool = False
    value: Any = None
    strides: tuple[int, ...] | None = None
    dtensor: bool = False
    big_endian: bool = False


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Rank 0's decision after the first exchange of a save.

    Attributes:
        save_id: the save's id (names every rank's data file).
        tree: the merged skeleton.
        writes: per rank, the `(path, box)` pieces it writes.
        leaves: path -> its description (from the lowest rank holding it), in tree order.
    """

    save_id: str
    tree: Node
    writes: list[list[tuple[StatePath, Box | None]]]
    leaves: dict[StatePath, _Leaf]


def _describe(flat: Flat, hosts: dict[StatePath, HostLeaf]) -> dict[StatePath, _Leaf]:
    leaves = {}
    for path, kind in flat.kinds.items():
        value = flat.leaves[path]
        if kind == VALUE:
            leaves[path] = _Leaf(VALUE, value=value if type(value) in _STORED
                                 else _as_stored(value))
        elif kind == SHARDED:
            tensor, offsets, global_shape = piece_of(value, path)
            dtype = describe(tensor, TENSOR)[1]
            box = (offsets, tuple(tensor.shape)) if offsets is not None else None
            leaves[path] = _Leaf(SHARDED, dtype, global_shape, box,
                                 dtensor=not isinstance(value, Shard))
        elif kind == TENSOR:
            shape = tuple(value.shape)
            strides = None if value.is_contiguous() else tensor_entry(value, path).strides
            leaves[path] = _Leaf(TENSOR, describe(value, TENSOR)[1], shape,
                                 ((0,) * len(shape), shape), device=str(value.device),
                                 strides=strides)
        else:
            host = hosts[path] = host_leaf(value, kind, path)
            entry = host.entry
            box = ((0,) * len(entry.shape), entry.shape) if entry.shape is not None else None
            # Bytes, pickles and NumPy scalars are plain values too, saved once: rank 0
            # compares their digests (arrays, as tensors, are taken as replicated). Equal
            # objects can pickle to other bytes in other processes (a set's order follows
            # the string-hash seed), so a small pickle travels along, to be compared
            # unpickled when the digests differ.
            digest: Any = (_digest(host.data) if kind in (BYTES, PICKLE) or entry.scalar
                           else None)
            if kind == PICKLE:
                digest = (digest, bytes(host.data) if len(host.data) <= _COMPARED_PICKLE_BYTES
                          else None)
            leaves[path] = _Leaf(kind, entry.dtype, entry.shape, box, len(host.data),
                                 scalar=entry.scalar, value=digest, big_endian=entry.big_endian)
    return leaves


#: The types of the plain values a manifest holds.
_STORED = frozenset({type(None), bool, int, float, str})


def _layout(leaf: _Leaf) -> str:
    """How a leaf is stored, as a refusal names it: "ndarray I32[4] (big-endian)", "value
    (str)", "bytes value"."""
    if leaf.kind == VALUE:
        return f"value ({type(leaf.value).__name__})"
    if leaf.dtype is None:
        return f"{leaf.kind} value"
    order = " (big-endian)" if leaf.big_endian else ""
    return f"{leaf.kind} {leaf.dtype}{list(leaf.shape or ())}{order}"


def _as_stored(value: Any) -> Any:
    """A plain value of a subclass of int, float or str (an IntEnum member) as the manifest
    stores it, of the base type: that is what a group compares and rank 0 commits, and it
    pickles in every process, where the subclass may not (one defined in a function). The
    base type's own conversion keeps every bit (a NaN's payload) and ignores the subclass's
    `__str__` (a `(str, Enum)` member's is its name)."""
    for base in (int, float, str):
        if isinstance(value, base):
            return getattr(base, f"__{base.__name__}__")(value)
    return value


def _plan(
    described: list[tuple[Node, dict[StatePath, _Leaf]]], world_size: int
) -> SavePlan:
    tree = merge_skeletons([skeleton for skeleton, _ in described])
    holders: dict[StatePath, list[tuple[int, _Leaf]]] = {}
    for rank, (_, leaves) in enumerate(described):
        for path, leaf in leaves.items():
            holders.setdefault(path, []).append((rank, leaf))
    held: list[Held] = []
    first: dict[StatePath, _Leaf] = {}
    for path, ranks in holders.items():
        leaf = first[path] = ranks[0][1]
        for rank, other in ranks[1:]:
            if ((other.kind, other.dtype, other.shape, other.big_endian)
                    != (leaf.kind, leaf.dtype, leaf.shape, leaf.big_endian)):
                raise UnsupportedLeaf(
                    f"{path!r} is a {_layout(leaf)} on rank {ranks[0][0]} but a "
                    f"{_layout(other)} on rank {rank}: a plain leaf must be the same on every "
                    "rank (it is saved once); wrap values that differ per rank in sp.PerRank, "
                    "pieces of one tensor in sp.Shard",
                    path=path,
                )
        for rank, other in ranks[1:]:
            if not (same_value(leaf.value, other.value) or _same_pickled(leaf, other)):
                shown = ((f"{_short(leaf.value)} on rank {ranks[0][0]} but "
                          f"{_short(other.value)}") if leaf.kind == VALUE else
                         f"{leaf.kind} on rank {ranks[0][0]} with other bytes than")
                raise UnsupportedLeaf(
                    f"{path!r} is {shown} on rank {rank}: a plain value is saved once, so it "
                    "must be the same on every rank; wrap a value that differs per rank (a "
                    "data position, a rank's counter) in sp.PerRank",
                    path=path,
                )
        if leaf.kind == VALUE:
            continue
        pieces: dict[Box | None, list[int]] = {}
        for rank, other in ranks:
            pieces.setdefault(other.box, []).append(rank)
        if leaf.kind == SHARDED:
            pieces.pop(None, None)  # ranks outside a 0-dim DTensor's mesh, holding none of it
            _check_tiling(path, leaf.shape or (), [box for box in pieces if box is not None],
                          dtensor=any(other.dtensor for _, other in ranks))
        itemsize = DTYPES[leaf.dtype].itemsize if leaf.dtype in DTYPES else leaf.nbytes
        # Slabs are rows in row-major order: a tensor laid out otherwise (channels_last) is
        # written whole, in its own layout, so that it loads with its strides.
        splittable = leaf.kind == SHARDED or (leaf.kind == TENSOR and not leaf.strides)
        for box, owners in pieces.items():
            held.append(Held(path, box, itemsize, tuple(owners), splittable=splittable))
    writes = plan_writers(held, world_size, split_bytes=SPLIT_BYTES)
    ordered = {path: first[path] for path in leaf_paths(tree)}
    return SavePlan(uuid.uuid4().hex, tree, writes, ordered)


def alike(values: Sequence[_T], *, differ: str, fix: str, url: str,
          label: Callable[[_T], str]) -> _T:
    """The value every rank passed (as rank 0 decides in an exchange, so that every rank
    raises alike).

    Raises:
        DistributedError: the ranks' `values` differ: `differ`, the values rank by rank,
            and `fix`; each rank's failure is its value's `label`.
    """
    if len(set(values)) > 1:
        raise DistributedError(
            f"{differ} ({list(values)}, rank by rank): {fix}", url=url,
            failures={rank: label(value) for rank, value in enumerate(values)})
    return values[0]


def check_same_url(urls: Sequence[str | None], *, verb: str, consequence: str) -> None:
    """Refuse a collective save or load (`verb`: "saves", "loads") whose ranks name different
    checkpoints (a step counter that drifted between ranks): a save would commit a manifest
    naming files that are not beside it, a load would read rank 0's manifest and each
    rank's data from its own URL."""
    for rank, other in enumerate(urls[1:], start=1):
        if other != urls[0]:
            raise DistributedError(
                f"rank 0 {verb} {urls[0]} but rank {rank} {verb} {other}: every rank must "
                f"pass the same URL (or manager step) to a collective call; {consequence}. "
                "Derive the step from a counter every rank advances alike, or broadcast "
                "rank 0's",
                url=urls[0],
            )


#: The largest pickle a rank sends rank 0 whole, to be compared unpickled (see `_describe`).
_COMPARED_PICKLE_BYTES = 1 << 20


def _same_pickled(a: _Leaf, b: _Leaf) -> bool:
    """Whether two ranks' pickled leaves, of other bytes, hold equal objects. They are this
    job's own pickles, made by this save on its ranks, so unpickling them runs nothing that
    the job did not hand over itself."""
    if a.kind != PICKLE or a.value[1] is None or b.value[1] is None:
        return False
    try:
        return same_value(pickle.loads(a.value[1]), pickle.loads(b.value[1]))
    except Exception:  # an object that cannot be rebuilt or compared here: not the same
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_tiling(path: StatePath, shape: tuple[int, ...], boxes: list[Box], *,
                  dtensor: bool) -> None:
    """Refuse pieces that overlap without being equal, or leave part of the tensor out. The
    pieces of a `dtensor` come from its placements, not from offsets the user passed: those
    fail to tile it when the save's group leaves out ranks of its mesh."""
    pair = overlapping_pair(boxes)
    covered = sum(element_count(box[1]) for box in boxes)
    if pair is not None or covered != element_count(shape):
        problem = (f"pieces at {list(boxes[pair[0]][0])} and {list(boxes[pair[1]][0])} overlap"
                   if pair is not None else
                   f"the pieces hold {covered} of its {element_count(shape)} elements")
        fix = ("the DTensor's mesh holds ranks outside this save's group, which hold the "
               "rest: save over the ranks of its mesh (pass a process_group that includes "
               "every rank of the mesh, or none for the default group)" if dtensor else
               "every element must be in exactly one distinct piece (ranks holding equal "
               "pieces share them): fix the offsets passed to sp.Shard")
        raise UnsupportedLeaf(
            f"the pieces of {path!r} (global shape {list(shape)}) do not tile it: {problem}; "
            f"{fix}",
            path=path,
        )


def _narrowed(flat: Flat, path: StatePath, box: Box | None) -> Any:
    """`box` of this rank's tensor (or piece of a global tensor) at `path`, as a view."""
    value = flat.leaves[path]
    if flat.kinds[path] == SHARDED:
        tensor, base, _ = piece_of(value, path)
        assert base is not None  # a rank writes only pieces it holds
    else:
        tensor, base = value, (0,) * value.dim()
    assert box is not None
    for dim, (start, size, origin) in enumerate(zip(box[0], box[1], base, strict=True)):
        if start != origin or size != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start - origin, size)
    return tensor.detach()


def _piece(flat: Flat, hosts: dict[StatePath, HostLeaf], path: StatePath,
           box: Box | None) -> HostLeaf:
    """The bytes of `box` of this rank's leaf at `path`."""
    if flat.kinds[path] not in (TENSOR, SHARDED):
        return hosts[path]
    return host_leaf(_narrowed(flat, path, box), TENSOR, path)


def _source(flat: Flat, hosts: dict[StatePath, HostLeaf], path: StatePath,
            box: Box | None) -> tuple[str, Any]:
    """The kind and value a `Stager` copies for `box` of this rank's leaf at `path`: a view
    of the tensor's piece, or the bytes its host leaf already holds."""
    if flat.kinds[path] not in (TENSOR, SHARDED):
        return BYTES, hosts[path].data
    return TENSOR, _narrowed(flat, path, box)


#: What a rank reports once its data file is durable: the file, its size, one record per chunk
#: of its pieces (path, box, file, offset, nbytes, digests), and in an incremental save each
#: piece's block hashes and the previous commit's files its chunks point into, with sizes.
_Report = tuple[
    str, int, list[tuple[StatePath, Box | None, str, int, int, tuple[int, ...]]],
    dict[Piece, tuple[str, ...]], dict[str, int],
]


def save_pieces(
    group: Group,
    storage: Storage,
    prepare: Callable[[], Flat],
    *,
    check: Callable[[], None],
    commit: Callable[[str, dict[StatePath, Entry], dict[str, int], Node,
                      dict[StatePath, tuple[str, ...]]], Any],
    options: IOOptions,
    url: str,
    agreed: str | None = None,
    stager: Stager | None = None,
    increment: Increment | None = None,
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """Save every rank's state as one checkpoint: the two exchanges described above.
    `prepare()` runs on every rank first and flattens its state; `check()` runs on rank 0
    before anything is written (it raises to refuse the save, e.g. a committed checkpoint
    without overwrite); `commit(save_id, entries, files, tree, hashes)` runs on rank 0 after
    every rank's data is durable (and, with an `increment`, the shared files are linked) and
    returns what every rank returns (the manifest); without `agreed`, only once rank 0 sees
    every rank's data file in `storage` (see `_check_seen`; a rank other than 0 with nothing
    to write writes an empty marker file in place of one, which rank 0 removes once seen).
    `increment` must have the same previous commit on every rank. Every rank must pass the
    same `agreed` (default: `url`; the step's name where each node saves into its own
    directory), else the save is refused.

    The first exchange runs now. Returned: `finish`, the second exchange (write and commit),
    and `stage`, which the caller runs while `finish` runs in another thread when a `stager`
    is given: it copies the pieces this rank writes into the stager's buffers (within its
    budget, streaming when they are larger: `stage` returns once the last part is staged),
    so the caller may change the state once it returns. `group` must then be one that no
    other thread uses (see `Group.private`). Without a stager `stage` does nothing and
    `finish` writes straight from the state. A failed `stage` stops `finish`, which reports
    the failure to every rank (and a failed write stops `stage`).

    Raises:
        DistributedError: a rank failed; nothing committed, and every rank that learned so
            removed its data file. A rank whose collective call failed while rank 0 was
            still committing (the group's timeout ran out) cannot tell whether rank 0
            committed, so it keeps its file: the next save there, or a manager's `gc`,
            removes it if no manifest names it.
    """
    hosts: dict[StatePath, HostLeaf] = {}
    flats: list[Flat] = []

    def describe_mine() -> tuple[str, Node, dict[StatePath, _Leaf]]:
        flats.append(prepare())
        return agreed or url, flats[0].skeleton, _describe(flats[0], hosts)

    consequence = (f"nothing was committed at {url} (a previous checkpoint there stays "
                   "intact): fix the cause on that rank and save again")

    def decide_plan(described: list[tuple[str, Node, dict[StatePath, _Leaf]]]) -> SavePlan:
        check_same_url([where for where, _, _ in described], verb="saves",
                       consequence="nothing was written")
        check()
        return _plan([(skeleton, leaves) for _, skeleton, leaves in described], group.size)

    plan: SavePlan = exchange(group, describe_mine, decide_plan, what=f"saving {url}",
                              consequence=consequence)
    flat = flats[0]
    name = data_file_name(plan.save_id, group.rank, 0)
    mine = plan.writes[group.rank]
    snapshot: Snapshot | None = None
    failure: Exception | None = None
    if stager is not None and mine:
        try:
            sources = [_source(flat, hosts, path, box) for path, box in mine]
            snapshot = stager.snapshot({str(n): value for n, (_, value) in enumerate(sources)},
                                       {str(n): kind for n, (kind, _) in enumerate(sources)},
                                       aliases=False)
        except Exception as exc:  # reported in the exchange, so that every rank learns it
            failure = exc

    def stage() -> None:
        if snapshot is not None:
            snapshot.stage()
        if stager is not None:  # staged (or nothing of it to write here): the caller's again
            hosts.clear()  # the views of the state's bytes, which would keep it from resizing

    def write() -> _Report:
        if failure is not None:
            raise failure
        if not mine:
            if agreed is None and group.rank:
                # A marker in place of a data file, for rank 0 to see (`_check_seen`): the
                # only proof that this rank writes where rank 0 does (a small state's data
                # all goes to rank 0, a state of plain values has none). Rank 0 removes it.
                try:
                    storage.write(name, ())
                except BaseException as exc:
                    raise_out_of_space(storage, exc, plan.save_id)
                    raise
            return name, 0, [], {}, {}
        if snapshot is not None:
            items = snapshot.layout
            stream: Iterable[tuple[WriteItem, memoryview]] = snapshot.stream()
        else:
            pieces = [_piece(flat, hosts, path, box) for path, box in mine]
            items, _ = plan_layout((str(n), len(p.data)) for n, p in enumerate(pieces))
            stream = [(item, pieces[n].data) for n, item in enumerate(items)]
        keys = {str(n): piece(path, box, plan.leaves[path].shape)
                for n, (path, box) in enumerate(mine)}
        if increment is not None:
            stream = increment.stream(stream, name, keys)
        try:
            size, digests = write_file(storage, name, stream, block_bytes=BLOCK_BYTES,
                                       checksum=checksum_function(DEFAULT_ALGORITHM),
                                       options=options)
        except BaseException as exc:
            if snapshot is not None:
                snapshot.abort(exc)  # the caller's `stage` stops waiting for the writer
            raise_out_of_space(storage, exc, plan.save_id)
            raise
        if increment is None:
            chunked = {item.path: (Chunk(name, item.offset, item.nbytes,
                                         tuple(digests[item.path])),) for item in items}
            return name, size, _records(mine, chunked), {}, {}
        hashes = {keys[key]: hashed for key, hashed in increment.hashes().items()}
        return (name, size, _records(mine, increment.chunks(digests)), hashes,
                increment.shared())

    def decide_commit(reports: list[_Report]) -> Any:
        files = {file: size for file, size, records, _, _ in reports if records}
        chunks: dict[StatePath, list[Chunk]] = {}
        hashes: dict[Piece, tuple[str, ...]] = {}
        shared: dict[str, int] = {}
        for _, _, records, hashed, linked in reports:
            for path, box, file, offset, nbytes, digests in records:
                chunks.setdefault(path, []).append(Chunk(file, offset, nbytes, digests, box))
            hashes.update(hashed)
            shared.update(linked)
        if agreed is None:  # else each node's ranks write to a storage of their own
            # Every rank's file: its data, or the marker a rank without data wrote (all but
            # rank 0's, which it need not prove it sees), removed once seen.
            _check_seen(storage, {file: rank for rank, (file, _, records, _, _)
                                  in enumerate(reports) if records or rank}, url)
            markers = [file for rank, (file, _, records, _, _) in enumerate(reports)
                       if rank and not records]
            if markers:
                try:
                    storage.delete(markers)
                except Exception:  # no manifest names them: leftovers, which go with the next
                    logger.warning("could not remove the markers %s under %s; the next save "
                                   "there will", markers, url, exc_info=True)
        if increment is not None:
            increment.share(storage, sorted(shared))
        entries = _entries(plan, chunks)
        return commit(plan.save_id, entries, {**files, **shared}, plan.tree,
                      _entry_hashes(entries, hashes))

    def discard() -> None:
        discard_unless_committed(storage, plan.save_id, [name])

    def finish() -> Any:
        # Only a failure every rank knows of removes this rank's file (see `exchange`): a
        # rank that stopped waiting for rank 0, whose commit was merely slow, would delete
        # data that rank 0's manifest then names.
        return exchange(group, write, decide_commit, what=f"saving {url}",
                        consequence=consequence, undo=discard,
                        done=f"{url} is committed (`safepoint ls` lists it)")

    return finish, stage


def _check_seen(storage: Storage, written: dict[str, int], url: str) -> None:
    """Refuse to commit data files that rank 0 does not see (`written`: each file, a rank's
    data or the empty marker of a rank with none, and the rank that wrote it): ranks that do
    not share the storage (memory://, a path local to each node of a multi-host job) would
    commit a manifest that cannot be loaded, and that replaces a good checkpoint. Takes one
    listing of the data directory; a file it lacks is looked up alone (a shared file
    system's listing may lag behind another host's write).

    Raises:
        DistributedError: a file is not there for rank 0.
    """
    try:
        listed = set(storage.list(DATA_DIR))
    except FileNotFoundError:
        listed = set()
    unseen = {rank: file for file, rank in written.items()
              if file not in listed and not storage.exists(file)}
    if unseen:
        ranks = ", ".join(map(str, sorted(unseen)))
        raise DistributedError(
            f"rank 0 does not see under {url} the files written by rank(s) {ranks} "
            f"({', '.join(unseen[rank] for rank in sorted(unseen))}), so nothing was "
            "committed: every rank must write to one storage that rank 0 sees (a shared "
            "file system or an object store), not a path local to its node nor memory://",
            url=url, failures={rank: f"rank 0 does not see {file}"
                               for rank, file in unseen.items()},
        )


def _records(
    mine: list[tuple[StatePath, Box | None]], chunked: Mapping[str, tuple[Chunk, ...]],
) -> list[tuple[StatePath, Box | None, str, int, int, tuple[int, ...]]]:
    """The chunk records of this rank's pieces, `chunked` holding each piece's chunks (by
    its index in `mine`, as a string) in order."""
    return [(path, box, chunk.file, chunk.offset, chunk.nbytes, chunk.digests)
            for n, (path, box) in enumerate(mine) for chunk in chunked[str(n)]]


def _entries(plan: SavePlan, chunks: dict[StatePath, list[Chunk]]) -> dict[StatePath, Entry]:
    """The manifest entries: a tensor stored whole (in one chunk, or in several holding
    consecutive bytes) is a plain entry, one stored as several pieces a "sharded" entry whose
    chunks carry their boxes (in offset order, the chunks of a piece in their order)."""
    entries: dict[StatePath, Entry] = {}
    for path, leaf in plan.leaves.items():
        if leaf.kind == VALUE:
            entries[path] = Entry(VALUE, value=leaf.value)
            continue
        pieces = sorted(chunks[path], key=lambda c: c.box or ((), ()))
        everything = ((0,) * len(leaf.shape or ()), leaf.shape)
        kind = TENSOR if leaf.kind == SHARDED else leaf.kind
        if all(chunk.box is None or chunk.box == everything for chunk in pieces):
            entries[path] = Entry(
                kind, leaf.dtype, leaf.shape,
                tuple(Chunk(c.file, c.offset, c.nbytes, c.digests) for c in pieces),
                device=leaf.device, scalar=leaf.scalar, strides=leaf.strides,
                big_endian=leaf.big_endian,
            )
        else:
            entries[path] = Entry(SHARDED, leaf.dtype, leaf.shape, tuple(pieces))
    return entries


def _entry_hashes(
    entries: dict[StatePath, Entry], hashes: dict[Piece, tuple[str, ...]],
) -> dict[StatePath, tuple[str, ...]]:
    """Per entry, the block hashes of its pieces in the order of its chunks (the manifest's
    `hashes`); empty when the save was not incremental."""
    if not hashes:
        return {}
    out: dict[StatePath, tuple[str, ...]] = {}
    for path, entry in entries.items():
        joined: list[str] = []
        for n, chunk in enumerate(entry.chunks):
            if n == 0 or chunk.box != entry.chunks[n - 1].box:
                joined.extend(hashes[piece(path, chunk.box, entry.shape)])
        if entry.chunks:
            out[path] = tuple(joined)
    return out



# -- loading into an optimizer without state ------------------------------------------------------


class Primed(NamedTuple):
    """An optimizer that `prime_optimizers` gave state: the prefix of its state's paths in
    the load (`optim/state/`) and the parameters it primed, by their index there."""

    optimizer: Any
    prefix: StatePath
    params: dict[str, Any]


def prime_optimizers(
    stateful: dict[StatePath, tuple[Any, Any]], saved: Collection[StatePath]
) -> list[Primed]:
    """Give the DTensor parameters (FSDP2, tensor parallel) of every optimizer their state
    before a load that holds state for them and they have none (a fresh optimizer, or one
    whose unused expert never got a gradient), as torch.distributed.checkpoint does: their
    state tensors then exist as DTensors, and the loaded pieces land in them (the optimizer
    would otherwise receive whole tensors it cannot mix with its DTensor parameters). The
    state is made by one step with zero gradients for those parameters, none for the others
    (whose state stays as it is), and a learning rate of 0, which leaves the parameters and
    their gradients unchanged. Returns each optimizer primed with the parameters it primed
    (`unprime` undoes it, for those whose state the load did not restore).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    prefixes = {}
    for path, (obj, _) in stateful.items():
        # An optimizer holding state for every parameter (the usual load) is passed over
        # without counting them one by one or scanning the entries.
        if isinstance(obj, torch.optim.Optimizer) and len(obj.state) < sum(
                len(group["params"]) for group in obj.param_groups):
            prefixes[path + "/state/" if path else "state/"] = obj
    if not prefixes:
        return []
    wanted: dict[str, set[str]] = {}
    for path in saved:
        for prefix in prefixes:
            if path.startswith(prefix):
                wanted.setdefault(prefix, set()).add(path[len(prefix):].split("/", 1)[0])
    primed = []
    for prefix, indices in wanted.items():
        optimizer = prefixes[prefix]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # An optimizer whose step needs a closure (LBFGS) is not primed: its step on zero
        # gradients returns before making any state tensor, so there is none to land in.
        if not any(is_dtensor(p) for p in params) or needs_closure(optimizer):
            continue
        stateless = {str(index): param for index, param in enumerate(params)
                     if str(index) in indices and not optimizer.state.get(param)}
        if not stateless:
            continue
        _zero_step(optimizer, params, {id(param) for param in stateless.values()})
        primed.append(Primed(optimizer, prefix, stateless))
    return primed


def needs_closure(optimizer: Any) -> bool:
    """Whether `optimizer.step()` cannot be called without a closure (LBFGS's). Read from
    its class's `step`, less `self`: an LR scheduler replaces the instance's with a wrapper
    whose signature, read through `__wrapped__`, is the unbound function's, `self` first."""
    try:
        parameters = list(inspect.signature(type(optimizer).step).parameters.values())[1:]
    except (TypeError, ValueError):  # no signature to read: assume the worst
        return True
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                   p.KEYWORD_ONLY) for p in parameters)


def _zero_step(optimizer: Any, params: Sequence[Any], chosen: Collection[int]) -> None:
    """One step of `optimizer` with zero gradients for the `chosen` parameters (by `id`),
    none for the others (which a step passes over), and a learning rate of 0, which leaves
    the parameters and their gradients unchanged: it gives the chosen ones the state a first
    step makes. It is no training step, so it runs without the step hooks (an EMA's, an LR
    scheduler's step counter) that torch's wrapper of an optimizer class's `step` (marked
    `hooked`) runs around the step beneath it."""
    torch = sys.modules["torch"]
    step = type(optimizer).step
    step = functools.partial(step.__wrapped__, optimizer) if getattr(step, "hooked", False) \
        else optimizer.step
    rates = [group.get("lr") for group in optimizer.param_groups]
    grads = [param.grad for param in params]
    for param in params:
        param.grad = torch.zeros_like(param) if id(param) in chosen else None
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
    try:
        step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            if rate is not None:
                group["lr"] = rate
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad


def state_shapes(optimizer: Any, indices: Collection[int]) -> dict[int, dict[str, tuple[int, ...]]]:
    """The shapes of the state tensors that `optimizer` would make for its parameters at
    `indices` (in `param_groups` order), which have none: index -> state key -> shape. Found
    by a zero step (`_zero_step`) of one parameter per group, shape, dtype and device, whose
    state is then dropped, so the optimizer is left as it was. Empty for an optimizer whose
    step needs a closure or fails on zero gradients (SparseAdam's wants sparse ones): what
    its state should be is then unknown."""
    if needs_closure(optimizer):
        return {}
    params: list[Any] = []
    alike: dict[int, Any] = {}  # index -> the parameter whose state stands for its
    first: dict[tuple[Any, ...], Any] = {}
    for number, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if len(params) in indices:
                kind = (number, tuple(param.shape), param.dtype, param.device)
                alike[len(params)] = first.setdefault(kind, param)
            params.append(param)
    probed = list({id(param): param for param in alike.values()}.values())
    try:
        _zero_step(optimizer, params, {id(param) for param in probed})
    except Exception as exc:  # an optimizer the probe cannot step is not checked by it
        logger.debug("could not probe the state of %s: %s", type(optimizer).__name__, exc)
        return {}
    finally:
        made = {id(param): optimizer.state.pop(param, None) or {} for param in probed}
    torch = sys.modules["torch"]
    return {index: {key: tuple(value.shape) for key, value in made[id(param)].items()
                    if isinstance(key, str) and torch.is_tensor(value)}
            for index, param in alike.items()}


def unprime(primed: Iterable[Primed], restored: Collection[StatePath] = ()) -> None:
    """Undo `prime_optimizers`: the primed parameters lose their state again (a load
    refused), except those for which `restored`, the paths a load restored, holds state. A
    parameter whose saved state a lenient load skipped (a resized head) is left without
    state, as a fresh optimizer has it: the primed state (step 1, zero moments) would give
    its next step another bias correction than a first step's. The others keep theirs."""
    for optimizer, prefix, params in primed:
        kept = {path[len(prefix):].split("/", 1)[0] for path in restored
                if path.startswith(prefix)}
        for index, param in params.items():
            if index not in kept:
                optimizer.state.pop(param, None)
