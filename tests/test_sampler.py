"""sp.ResumableSampler with a plain DataLoader: per-epoch orders from (seed, epoch), a resume
mid-epoch at the exact next sample (also through a real checkpoint), a saved position that
counts consumed samples when workers prefetch, and the DataLoader's seed draws kept off
torch's global generator."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import safepoint as sp

SIZE = 50
DATA = TensorDataset(torch.arange(SIZE))


class WorkerSeeds(Dataset[tuple[int, int]]):
    """Each sample is (index, the seed of the worker that loaded it)."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        return index, -1 if info is None else info.seed


def _loader(sampler: sp.ResumableSampler, *, workers: int = 0, dataset: Any = DATA,
            batch_size: int = 4, drop_last: bool = False) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      generator=sampler.generator, drop_last=drop_last)


def _ids(batch: Any) -> list[int]:
    return [int(i) for i in batch[0]]


def _take(batches: Iterator[Any], n: int) -> list[list[int]]:
    return [_ids(next(batches)) for _ in range(n)]


def test_each_epoch_is_a_permutation_drawn_from_seed_and_epoch() -> None:
    sampler = sp.ResumableSampler(SIZE, seed=3)
    epochs = [list(sampler) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(SIZE))
    assert epochs[0] != epochs[1] != epochs[2]
    again = sp.ResumableSampler(DATA, seed=3)
    assert [list(again) for _ in range(3)] == epochs
    assert list(sp.ResumableSampler(SIZE, seed=4)) != epochs[0]
    assert list(sp.ResumableSampler(SIZE, shuffle=False)) == list(range(SIZE))
    assert sampler.epoch == 3 and sampler.position == 0


def test_resume_mid_epoch_at_the_next_sample_through_a_checkpoint(tmp_path: Path) -> None:
    reference = sp.ResumableSampler(SIZE, seed=1)
    loader = _loader(reference)
    expected = [_ids(b) for _ in range(3) for b in loader]

    sampler = sp.ResumableSampler(SIZE, seed=1)
    batches = iter(_loader(sampler))  # plain iteration: exact without workers
    first = _take(batches, 5)
    assert (sampler.epoch, sampler.position) == (0, 20)
    sp.save(str(tmp_path / "ckpt"), {"data": sampler})

    resumed = sp.ResumableSampler(SIZE, seed=0)  # the seed comes from the checkpoint
    sp.load(str(tmp_path / "ckpt"), into={"data": resumed})
    assert (resumed.epoch, resumed.position) == (0, 20)
    loader = _loader(resumed)
    rest = [_ids(b) for b in loader]  # the rest of epoch 0 only
    rest += [_ids(b) for _ in range(2) for b in loader]
    assert first + rest == expected


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("drop_last", "saved"),
    [
        # batches taken -> (epoch, position); 13 batches an epoch, or 12 with drop_last
        (False, {12: (0, 48), 17: (1, 16)}),
        (True, {12: (0, 48), 13: (1, 4)}),
    ],
)
def test_tracked_position_counts_consumed_batches_when_workers_prefetch(
    drop_last: bool, saved: dict[int, tuple[int, int]]
) -> None:
    reference = sp.ResumableSampler(SIZE, seed=2)
    batches = reference.track(_loader(reference, drop_last=drop_last), epochs=None)
    expected = _take(batches, 28)

    for stop, where in saved.items():
        sampler = sp.ResumableSampler(SIZE, seed=2)
        batches = sampler.track(_loader(sampler, workers=2, drop_last=drop_last), epochs=None)
        first = _take(batches, stop)
        state = sampler.state_dict()
        assert (state["epoch"], state["position"]) == where, stop
        del batches

        resumed = sp.ResumableSampler(SIZE, seed=2)
        resumed.load_state_dict(state)
        more = resumed.track(_loader(resumed, workers=2, drop_last=drop_last), epochs=None)
        assert first + _take(more, 28 - stop) == expected, stop


@pytest.mark.multiprocess
def test_plain_iteration_with_workers_runs_ahead_of_the_loop() -> None:
    """Why track() exists: the DataLoader draws indices for batches still in flight."""
    sampler = sp.ResumableSampler(SIZE, seed=2)
    batches = iter(_loader(sampler, workers=2))
    next(batches)
    assert sampler.position > 4
    del batches


@pytest.mark.multiprocess
def test_tracked_epochs_end_where_the_loop_ends() -> None:
    sampler = sp.ResumableSampler(SIZE, seed=0)
    loader = _loader(sampler, workers=2)
    assert len([b for b in sampler.track(loader)]) == 13
    assert (sampler.epoch, sampler.position) == (1, 0)
    seen = []
    for batch in sampler.track(loader):
        seen.append(_ids(batch))
        if len(seen) == 2:
            break
    assert (sampler.epoch, sampler.position) == (1, 8)
    rest = [_ids(b) for b in sampler.track(loader)]  # the next pass continues the epoch
    assert sorted(i for batch in seen + rest for i in batch) == list(range(SIZE))
    assert (sampler.epoch, sampler.position) == (2, 0)


def test_dataloader_does_not_draw_from_the_global_generator() -> None:
    sampler = sp.ResumableSampler(SIZE, seed=0)
    loader = _loader(sampler)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for _ in sampler.track(loader, epochs=2):
        pass
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.multiprocess
def test_worker_seeds_follow_the_epoch_on_resume() -> None:
    """Workers are seeded from the sampler's generator, which restarts from (seed, epoch): a run
    resumed at an epoch boundary gives its workers the uninterrupted run's seeds."""
    data = WorkerSeeds()

    def seeds(sampler: sp.ResumableSampler, epochs: int) -> list[set[int]]:
        loader = _loader(sampler, workers=2, dataset=data)
        return [{int(s) for b in sampler.track(loader) for s in b[1]} for _ in range(epochs)]

    full = seeds(sp.ResumableSampler(SIZE, seed=5), 3)
    assert full[0] != full[1] != full[2]
    first = sp.ResumableSampler(SIZE, seed=5)
    seeds(first, 1)
    resumed = sp.ResumableSampler(SIZE, seed=5)
    resumed.load_state_dict(first.state_dict())
    assert seeds(resumed, 2) == full[1:]


def test_the_last_batch_of_an_epoch_saves_as_the_next_epoch() -> None:
    sampler = sp.ResumableSampler(SIZE, seed=0)
    batches = iter(_loader(sampler))
    _take(batches, 13)
    assert sampler.state_dict() == {"seed": 0, "size": SIZE, "shuffle": True, "num_replicas": 1,
                                    "drop_last": False, "epoch": 1, "position": 0}


def test_a_different_dataset_size_is_refused() -> None:
    sampler = sp.ResumableSampler(SIZE + 1)
    with pytest.raises(sp.StateMismatch, match="51"):
        sampler.load_state_dict(sp.ResumableSampler(SIZE).state_dict())


def test_track_needs_a_loader_of_this_sampler() -> None:
    sampler = sp.ResumableSampler(SIZE)
    other = DataLoader(DATA, batch_size=4)
    with pytest.raises(sp.SafepointError, match="sampler=sampler"):
        next(sampler.track(other))


def test_an_endless_track_over_a_loader_with_no_batch_is_refused() -> None:
    """With drop_last and fewer samples than a batch, a pass yields nothing: an endless
    track() says so instead of spinning through epochs forever; a finite one just ends."""
    data = list(range(3))
    sampler = sp.ResumableSampler(data, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=True,
                        generator=sampler.generator)
    assert list(sampler.track(loader, epochs=2)) == []
    with pytest.raises(sp.SafepointError, match="yielded no batch"):
        next(sampler.track(loader, epochs=None))


def test_ranks_share_each_epoch_as_distributed_sampler_does() -> None:
    """Data parallelism: rank r of W yields items r, r+W, ... of the epoch's order, padded by
    its start (or cut with drop_last), so the ranks cover the epoch once (found by a
    review: every rank used to train on the same samples)."""
    for epoch in range(2):
        whole = sp.ResumableSampler(SIZE, seed=5)
        for _ in range(epoch):
            list(whole)
        order = list(whole)
        for replicas, drop_last in ((3, False), (3, True), (7, False)):
            ranks = [sp.ResumableSampler(SIZE, seed=5, num_replicas=replicas, rank=r,
                                         drop_last=drop_last) for r in range(replicas)]
            for sampler in ranks:
                for _ in range(epoch):
                    list(sampler)
            shares = [list(sampler) for sampler in ranks]
            length = SIZE // replicas if drop_last else -(-SIZE // replicas)
            assert all(len(share) == len(sampler) == length
                       for share, sampler in zip(shares, ranks, strict=True))
            interleaved = [share[i] for i in range(length) for share in shares]
            assert interleaved == (order * 2)[: length * replicas]
    assert len(sp.ResumableSampler(SIZE, num_replicas=1)) == SIZE


def test_a_rank_resumes_its_share_and_its_workers_are_seeded_apart() -> None:
    """Each rank saves its own place in its share (the same position on every rank, as
    they step together) and resumes at its next sample; rank 0's worker seeds are those of
    a sampler without ranks, the others' differ."""
    ranks = [sp.ResumableSampler(SIZE, seed=2, num_replicas=2, rank=r) for r in range(2)]
    loaders = [iter(_loader(sampler)) for sampler in ranks]
    taken = [_take(batches, 3) for batches in loaders]
    states = [sampler.state_dict() for sampler in ranks]
    assert [state["position"] for state in states] == [12, 12]
    rest = [_take(batches, 3) for batches in loaders]
    for rank, state in enumerate(states):
        resumed = sp.ResumableSampler(SIZE, seed=0, num_replicas=2, rank=rank)
        resumed.load_state_dict(state)
        assert _take(iter(_loader(resumed)), 3) == rest[rank]
        assert not {i for batch in taken[rank] for i in batch} & {i for b in rest[rank] for i in b}
    seeds = [sampler.generator.initial_seed() for sampler in ranks]
    assert seeds[0] == sp.ResumableSampler(SIZE, seed=2).generator.initial_seed() != seeds[1]


def test_a_position_moves_to_another_number_of_ranks_only_at_an_epoch_boundary() -> None:
    two = sp.ResumableSampler(SIZE, seed=1, num_replicas=2, rank=0)
    batches = iter(_loader(two))
    _take(batches, 2)
    one = sp.ResumableSampler(SIZE, seed=1)
    with pytest.raises(sp.StateMismatch, match=r"among 2 rank.*stopped mid-epoch"):
        one.load_state_dict(two.state_dict())
    _take(batches, 5)  # the rest of its 25 samples: the next epoch
    one.load_state_dict(two.state_dict())
    assert (one.epoch, one.position) == (1, 0)
    assert list(one) == list(sp.ResumableSampler(SIZE, seed=1, shuffle=True)._order(1))
    old = {"seed": 1, "size": SIZE, "shuffle": True, "epoch": 0, "position": 5}
    one.load_state_dict(old)  # written before ranks were recorded: one rank
    assert (one.epoch, one.position) == (0, 5)
    # drop_last changes nothing on one rank, or when the ranks divide the epoch evenly
    for size, replicas in ((SIZE, 1), (SIZE, 5)):
        saved = sp.ResumableSampler(size, seed=1, num_replicas=replicas)
        first = [next(iter(saved)) for _ in range(1)]
        taken = sp.ResumableSampler(size, seed=1, num_replicas=replicas, drop_last=True)
        taken.load_state_dict(saved.state_dict())
        assert first + list(taken) == list(sp.ResumableSampler(size, seed=1,
                                                               num_replicas=replicas))


def test_bad_arguments() -> None:
    with pytest.raises(sp.SafepointError, match="at least one"):
        sp.ResumableSampler(0)
    with pytest.raises(sp.SafepointError, match="seed"):
        sp.ResumableSampler(3, seed=-1)
    with pytest.raises(sp.SafepointError, match="rank"):
        sp.ResumableSampler(3, num_replicas=2, rank=2)
    with pytest.raises(sp.SafepointError, match="nothing to each"):
        sp.ResumableSampler(3, num_replicas=4, drop_last=True)


@pytest.mark.parametrize("seed", [None, "0", 1.5, True], ids=["None", "str", "float", "bool"])
def test_a_seed_that_is_no_whole_number_is_refused_saying_what_to_pass(seed: Any) -> None:
    """`seed=None` (a "random seed" convention) or a str read from a config raised a bare
    TypeError from the comparison with 0, and `seed=1.5` was taken and failed only at the
    first iteration, in torch (found by a review)."""
    with pytest.raises(sp.SafepointError, match=r"seed=.*pass a whole number >= 0"):
        sp.ResumableSampler(SIZE, seed=seed)


def test_a_seed_may_be_a_numpy_or_torch_integer() -> None:
    sampler = sp.ResumableSampler(SIZE, seed=np.int64(3))
    assert list(sampler) == list(sp.ResumableSampler(SIZE, seed=3))
    assert sp.ResumableSampler(SIZE, seed=torch.tensor(3)).state_dict()["seed"] == 3


class SignalledWorkers(Dataset[tuple[int, int]]):
    """Each sample is (index, a value the loader's own worker_init_fn set); the worker sends
    itself SIGTERM when it loads index 0, as a scheduler signalling the whole job does."""

    mark = 0

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> tuple[int, int]:
        if index == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return index, SignalledWorkers.mark


def _mark_worker(worker_id: int) -> None:
    SignalledWorkers.mark = 100 + worker_id


@pytest.mark.multiprocess
def test_tracked_workers_outlive_a_signal_the_main_process_catches() -> None:
    """A scheduler signals every process of the job (SLURM); sp.Run catches SIGTERM in the
    main process and saves at the next step boundary. The workers died of it, and torch
    raised "DataLoader worker ... killed by signal" in the main process: track's workers now
    ignore the signals the main process catches, after which the loader's own
    worker_init_fn still runs; they end with the pass as before, and the sampler still
    copies."""
    import psutil

    sampler = sp.ResumableSampler(SIZE, seed=0)
    loader = DataLoader(SignalledWorkers(), batch_size=5, sampler=sampler, num_workers=2,
                        generator=sampler.generator, worker_init_fn=_mark_worker)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        samples = [(int(i), int(m)) for indices, marks in sampler.track(loader)
                   for i, m in zip(indices, marks, strict=True)]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sorted(i for i, _ in samples) == list(range(SIZE))
    assert {m for _, m in samples} == {100, 101}
    assert loader.worker_init_fn is _mark_worker
    assert not [p for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE]
    assert copy.deepcopy(sampler).state_dict() == sampler.state_dict()


def test_the_exit_flag_is_one_per_process_and_set_only_by_its_own_exit() -> None:
    """The byte shielded workers read: one per process however many loaders are shielded
    (each shield made another), and a child forked with its exit handler registered, which
    exits through sys.exit, no longer sets it for the parent's workers (found by a review)."""
    script = (
        "import os, sys\n"
        "from safepoint._sampler import exiting_flag\n"
        "flag = exiting_flag()\n"
        "assert exiting_flag() is flag\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(flag.value)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


SHIELDED_CHILD = """
import os, signal, sys, time, torch, safepoint as sp
from torch.utils.data import DataLoader, Dataset


class Pids(Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, index):
        return os.getpid()


if __name__ == "__main__":
    context, end = sys.argv[1:]
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the main process handles it
    sampler = sp.ResumableSampler(400, seed=0)
    loader = DataLoader(Pids(), batch_size=4, sampler=sampler, num_workers=2,
                        generator=sampler.generator, multiprocessing_context=context)
    batches = sampler.track(loader, epochs=None)
    pids = set()
    while len(pids) < 2:
        pids.update(next(batches).tolist())
    print(*pids, flush=True)
    if end == "killed":
        time.sleep(120)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(("context", "end"), [("fork", "exit"), ("spawn", "exit"),
                                              ("fork", "killed")])
def test_tracked_workers_still_end_with_the_main_process(
    tmp_path: Path, context: str, end: str
) -> None:
    """Workers that ignore the signals the main process catches still end when it exits
    with them running (multiprocessing terminates them with SIGTERM and waits: ignored, that
    wait would never end) and when it is killed (torch's workers watch their parent)."""
    import psutil

    child = tmp_path / "child.py"
    child.write_text(SHIELDED_CHILD)
    proc = subprocess.Popen([sys.executable, str(child), context, end],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        workers = [psutil.Process(int(pid)) for pid in proc.stdout.readline().split()]
        assert len(workers) == 2
        if end == "killed":
            proc.kill()
        assert proc.wait(timeout=60) == (-signal.SIGKILL if end == "killed" else 0)
        assert not psutil.wait_procs(workers, timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_track_refuses_a_loader_that_hands_out_batches_out_of_order() -> None:
    """track() saves position = batches taken * batch size, which is what the loop consumed
    only when the loader hands out batches in the sampler's order. A DataLoader with
    in_order=False hands out whichever batch a worker finished first, so a resumed run
    skipped and repeated samples silently. Without workers it stays in order, and tracks."""
    sampler = sp.ResumableSampler(SIZE, seed=0)
    loader: DataLoader[Any] = DataLoader(DATA, batch_size=4, sampler=sampler, num_workers=2,
                                         in_order=False, generator=sampler.generator)
    with pytest.raises(sp.SafepointError, match=r"in_order=True"):
        next(sampler.track(loader))
    assert sampler.position == 0
    alone: DataLoader[Any] = DataLoader(DATA, batch_size=4, sampler=sampler, in_order=False,
                                        generator=sampler.generator)
    assert len(_take(sampler.track(alone), 2)) == 2 and sampler.position == 8
