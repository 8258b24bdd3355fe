"""`ResumableSampler`: a sampler for a plain `torch.utils.data.DataLoader` whose state (epoch
and position in it) saves with the training state, so a resumed run continues at the exact
next sample (tree layer: a stateful object; torch is imported only for `generator`).
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

import numpy as np

from ._leaves import whole_number
from .errors import SafepointError, StateMismatch

__all__ = ["ResumableSampler"]

T = TypeVar("T")


@dataclass(slots=True)
class _Pass:
    """One iteration of the sampler by a DataLoader: where it started, and how far it got."""

    epoch: int
    start: int
    yielded: int = 0
    #: Set when `track` counts the batches the caller takes; None counts yielded indices.
    batch_size: int | None = None
    batches: int = 0
    started: bool = False
    #: The loop over it ended: with drop_last, samples short of a batch remain, unconsumed.
    finished: bool = False


def _share(size: int, replicas: int, drop_last: bool) -> int:
    """The samples of an epoch of `size` each of `replicas` ranks yields: the order padded to
    a multiple of `replicas`, or cut to one with `drop_last`."""
    return size // replicas if drop_last else -(-size // replicas)


def _derived_seed(seed: int, epoch: int, stream: int, rank: int = 0) -> int:
    """A 63-bit seed for (seed, epoch, stream, rank), well mixed (NumPy's SeedSequence hash);
    rank 0's is the one a sampler without ranks has."""
    entropy = [seed, epoch, stream, *([rank] if rank else [])]
    words = np.random.SeedSequence(entropy).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def _caught_signals() -> tuple[int, ...]:
    """The signals this process catches with a Python handler (sp.Run's preemption signals,
    a scheduler integration's), but SIGCHLD (torch's check for dead workers) and Python's
    own SIGINT handler (KeyboardInterrupt, which workers end on quietly)."""
    caught = []
    for signum in signal.valid_signals():
        handler = signal.getsignal(signum)
        if (callable(handler) and signum != signal.SIGCHLD
                and handler is not signal.default_int_handler):
            caught.append(signum)
    return tuple(caught)


def _flag_exiting(exiting: Any, pid: int) -> None:
    if os.getpid() == pid:  # not in a child forked with the handler registered
        exiting.value = 1


#: Per process: the byte `exiting_flag` gives.
_EXITING: dict[int, Any] = {}


def exiting_flag() -> Any:
    """A byte of shared memory, for workers to read, set when this process exits: before
    multiprocessing's own exit handler (registered when it was imported, by `RawValue` at the
    latest) terminates them. One per process, however many loaders it shields."""
    pid = os.getpid()
    if pid in _EXITING:
        return _EXITING[pid]
    import multiprocessing

    exiting = _EXITING[pid] = multiprocessing.RawValue("b", 0)
    atexit.register(_flag_exiting, exiting, pid)
    return exiting


class ShieldedWorker:
    """A DataLoader `worker_init_fn` (picklable, for spawned workers): the worker does
    nothing on `signals` until the main process is exiting (`exiting`, shared memory set at
    its exit), then ends on them as torch's worker ends on the main process's SIGTERM; then
    the loader's own `worker_init_fn` runs.

    Why: a scheduler signals every process of a job (SLURM's `scancel`, its `--signal`); a
    worker ending on a signal the main process handles (sp.Run saves at the next step
    boundary) makes torch raise "DataLoader worker ... killed by signal" in the main process
    mid-step. The main process shuts its workers down itself, or they see it gone; at its
    exit, `multiprocessing` terminates them with SIGTERM and waits for them.
    """

    __slots__ = ("exiting", "signals", "then")

    def __init__(self, signals: tuple[int, ...], exiting: Any,
                 then: Callable[[int], None] | None) -> None:
        self.signals = signals
        self.exiting = exiting
        self.then = then

    def __call__(self, worker_id: int) -> None:
        for signum in self.signals:
            signal.signal(signum, self._on_signal)
        if self.then is not None:
            self.then(worker_id)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.exiting.value:
            os._exit(0)


class ResumableSampler:
    """Sample indices `0 .. len(data) - 1`, in a new random order each epoch, and resume at the
    exact next sample.

    Epoch `e`'s order is a permutation drawn from `(seed, e)` alone, so it is the same in
    every process. The state dict holds the epoch and the number of samples of it already
    consumed; the epoch advances by itself once every sample of it was consumed.

    With `num_workers=0` a plain `for batch in loader` is enough, provided each batch is drawn
    after the step that uses it began (with `sp.Run`: after `run.range` yielded it; drawn
    before, as in `zip(loader, run.range(n))`, the saved position is one batch ahead). With
    `num_workers > 0` the
    DataLoader draws indices ahead of what the loop has consumed (prefetching), so iterate
    through `sampler.track(loader)`: it counts the batches handed to the loop, and the saved
    position is what was consumed, not what was prefetched. The workers a pass of `track`
    starts ignore the signals the main process catches then (`sp.Run`'s SIGTERM and SIGUSR1),
    which a scheduler sends to every process of the job, until the main process exits: a
    worker killed by one made torch raise in the main process before the run could save.

    Pass `generator=sampler.generator` to the DataLoader: it draws a seed for its workers from
    that generator, which the sampler reseeds from `(seed, epoch)` at every epoch. Without it
    the DataLoader draws from torch's global generator each time an iteration starts, and a
    run resumed mid-epoch draws once more than the uninterrupted one, which shifts dropout
    and every other global random stream.

    In data-parallel training give each rank its share: with `num_replicas=W, rank=r`, rank r
    yields items r, r + W, r + 2W, ... of the epoch's order (padded by repeating its start to
    a multiple of W, as `DistributedSampler` does, or cut to one with `drop_last=True`), so
    the ranks together cover the epoch once and each yields `len(sampler)` samples. The
    ranks advance in step, so the position every rank saves is the same. A checkpoint's
    position restores on another number of ranks only at an epoch boundary.

    Args:
        data: the dataset (anything with `len`) or the number of samples.
        seed: the seed of every epoch's order (an int >= 0).
        shuffle: False yields every epoch in order 0, 1, 2, ...
        num_replicas: how many ranks share each epoch.
        rank: this rank's share (0 .. num_replicas - 1); its DataLoader workers are seeded
            apart from the other ranks' too.
        drop_last: with several ranks, leave out the end of the epoch's order that does not
            fill a share on every rank, rather than repeat its start.

    Example:
        sampler = sp.ResumableSampler(dataset, seed=0)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4,
                            generator=sampler.generator)
        state = {"model": model, "optim": optimizer, "rng": sp.RNGState(), "data": sampler}
        with sp.Run("ckpt/run1", state, every_steps=500) as run:
            batches = sampler.track(loader, epochs=None)     # batches across epochs
            for step in run.range(100_000):
                train_step(next(batches))
    """

    def __init__(
        self, data: Sized | int, *, seed: int = 0, shuffle: bool = True, num_replicas: int = 1,
        rank: int = 0, drop_last: bool = False,
    ) -> None:
        size = data if isinstance(data, int) else len(data)
        if size <= 0:
            raise SafepointError(f"ResumableSampler needs at least one sample, got {size}: "
                                 "pass the dataset (or its length) the loader draws from")
        seed = whole_number("ResumableSampler seed", seed, least=0)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise SafepointError(
                f"ResumableSampler rank={rank}, num_replicas={num_replicas}: pass "
                "num_replicas >= 1 and 0 <= rank < num_replicas (the process group's size and "
                "this process's rank)")
        share = _share(size, num_replicas, drop_last)
        if share == 0:
            raise SafepointError(
                f"ResumableSampler: {size} samples leave nothing to each of {num_replicas} "
                "ranks with drop_last=True: pass drop_last=False or use fewer ranks")
        self._size = size
        self._share = share
        self._replicas = num_replicas
        self._rank = rank
        self._drop_last = drop_last
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._pass: _Pass | None = None
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._generator: Any = None

    def __len__(self) -> int:
        """The samples of an epoch this rank yields: the dataset's size without ranks (a pass
        resumed mid-epoch yields fewer)."""
        return self._share

    @property
    def epoch(self) -> int:
        """The epoch the next sample to consume belongs to (0 first)."""
        return self._where()[0]

    @property
    def position(self) -> int:
        """How many samples of `epoch` were consumed already."""
        return self._where()[1]

    @property
    def generator(self) -> Any:
        """A `torch.Generator` to pass as the DataLoader's `generator=`, reseeded from
        `(seed, epoch)` whenever the epoch changes (see the class docstring)."""
        if self._generator is None:
            try:
                import torch
            except ImportError as exc:
                raise SafepointError(
                    "ResumableSampler.generator is a torch.Generator for a DataLoader, and "
                    "torch is not installed: pip install torch (the sampler's own order "
                    "needs only NumPy)") from exc
            self._generator = torch.Generator()
            self._reseed()
        return self._generator

    def __iter__(self) -> Iterator[int]:
        current = self._pass
        if current is None or current.started:
            self._settle()
            current = self._pass = _Pass(self._epoch, self._position)
        current.started = True
        for index in self._order(current.epoch)[current.start:].tolist():
            current.yielded += 1
            yield index
        if current.batch_size is None and self._pass is current:
            self._settle()

    def track(self, loader: Iterable[T], *, epochs: int | None = 1) -> Iterator[T]:
        """Iterate `loader` (a DataLoader drawing from this sampler) for `epochs` passes
        (None: without end), counting the batches handed out, so the saved position is what
        the loop consumed even when workers prefetch. A pass resumed mid-epoch yields only the
        rest of that epoch. Worker processes it starts ignore the signals this process catches
        (see the class docstring).

        Raises:
            SafepointError: `loader` does not draw from this sampler, has no fixed batch
                size or hands out batches out of order (`in_order=False` with workers), or
                (`epochs=None`) a whole pass yields no batch.
        """
        batch_sampler = getattr(loader, "batch_sampler", None)
        if self not in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
            raise SafepointError(
                "track() needs a DataLoader built with this sampler: pass "
                "DataLoader(..., sampler=sampler)"
            )
        batch_size = getattr(loader, "batch_size", None) or getattr(
            batch_sampler, "batch_size", None
        )
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise SafepointError(
                "track() needs a DataLoader with a fixed batch_size to count consumed samples"
            )
        if getattr(loader, "num_workers", 0) and getattr(loader, "in_order", True) is False:
            raise SafepointError(
                "track() needs a DataLoader that hands out batches in the sampler's order, "
                "but this one's workers hand out whichever batch is ready first "
                "(in_order=False), so the batches taken would not be the samples before the "
                "saved position: pass DataLoader(..., in_order=True), the default"
            )
        for _ in itertools.count() if epochs is None else range(epochs):
            self._settle()
            current = self._pass = _Pass(self._epoch, self._position, batch_size=batch_size)
            for batch in self._shielded_iter(loader):
                current.batches += 1
                yield batch
            if epochs is None and not current.batches and not current.start:
                raise SafepointError(
                    f"track(epochs=None): a whole pass over the loader yielded no batch "
                    f"({self._share} samples, batch_size={batch_size}, drop_last), so an "
                    "endless loop would never yield one: use a smaller batch_size or "
                    "drop_last=False"
                )
            current.finished = True
            if self._pass is current:
                self._settle()

    def _shielded_iter(self, loader: Iterable[T]) -> Iterator[T]:
        """`iter(loader)`, the worker processes it starts (if any) given a `ShieldedWorker`
        init for the signals this process catches now; the loader's own init is back once
        they started."""
        caught = _caught_signals() if getattr(loader, "num_workers", 0) else ()
        if not caught:
            return iter(loader)
        workers: Any = loader  # a DataLoader: it has num_workers
        own = workers.worker_init_fn
        workers.worker_init_fn = ShieldedWorker(caught, exiting_flag(), own)
        try:
            return iter(loader)
        finally:
            workers.worker_init_fn = own

    def state_dict(self) -> dict[str, Any]:
        """The seed, the dataset size, how it is shared among ranks, the epoch and the samples
        of it this rank consumed."""
        epoch, position = self._where()
        return {"seed": self._seed, "size": self._size, "shuffle": self._shuffle,
                "num_replicas": self._replicas, "drop_last": self._drop_last,
                "epoch": epoch, "position": position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state`: the next pass starts at its exact next sample.

        Raises:
            StateMismatch: the checkpoint's sampler had a different number of samples, or was
                shared among another number of ranks and stopped mid-epoch.
        """
        if int(state["size"]) != self._size:
            raise StateMismatch(
                f"the checkpoint's sampler drew from {state['size']} samples and this one from "
                f"{self._size}: restore with the same dataset, or do not restore the sampler",
                mismatched=[f"size: checkpoint {state['size']}, target {self._size}"],
            )
        replicas, drop_last = int(state.get("num_replicas", 1)), bool(state.get("drop_last"))
        share = _share(self._size, replicas, drop_last)
        epoch, position = int(state["epoch"]), int(state["position"])
        if (replicas, share) != (self._replicas, self._share):  # drop_last may change nothing
            if 0 < position < share:
                raise StateMismatch(
                    f"the checkpoint's sampler shared its epochs among {replicas} rank(s) "
                    f"({share} samples each) and this one among {self._replicas} "
                    f"({self._share} each), and it stopped mid-epoch: each rank's place in it "
                    "has no match here. Restore on as many ranks, or from a checkpoint taken "
                    "at an epoch boundary",
                    mismatched=[f"num_replicas: checkpoint {replicas}, target "
                                f"{self._replicas}"],
                )
            epoch, position = (epoch + 1, 0) if position else (epoch, 0)
        self._seed = int(state["seed"])
        self._shuffle = bool(state["shuffle"])
        self._order_cache = None
        self._pass = None
        self._epoch, self._position = self._normalized(epoch, position)
        self._reseed()

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self._shuffle:
                bits = np.random.PCG64(np.random.SeedSequence([self._seed, epoch]))
                order = np.random.Generator(bits).permutation(self._size)
            else:
                order = np.arange(self._size)
            if self._replicas > 1:  # this rank's share of the order, padded or cut
                order = np.resize(order, self._share * self._replicas)[self._rank::self._replicas]
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _normalized(self, epoch: int, position: int) -> tuple[int, int]:
        return (epoch + 1, 0) if position >= self._share else (epoch, position)

    def _where(self) -> tuple[int, int]:
        current = self._pass
        if current is None:
            return self._epoch, self._position
        if current.finished:
            return current.epoch + 1, 0
        if current.batch_size is None:
            consumed = current.yielded
        else:
            consumed = min(current.batches * current.batch_size, self._share - current.start)
        return self._normalized(current.epoch, current.start + consumed)

    def _settle(self) -> None:
        """Fold the current pass's progress into (epoch, position); reseed the DataLoader's
        generator when that starts a new epoch, before the DataLoader draws from it again."""
        epoch, self._position = self._where()
        self._pass = None
        if epoch != self._epoch:
            self._epoch = epoch
            self._reseed()

    def _reseed(self) -> None:
        if self._generator is not None:
            self._generator.manual_seed(_derived_seed(self._seed, self._epoch, 1, self._rank))
