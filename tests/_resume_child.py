"""A training job for test_resume_e2e, run as a subprocess: a small MLP with dropout, AdamW and
OneCycleLR on a shuffled DataLoader, with augmentation drawing on Python's, NumPy's and torch's
global RNGs, looped by `sp.Run`. The parent kills it at random moments and restarts it.

    python tests/_resume_child.py ROOT MODE OUT [--pause-after K] [--arm-second-signal]

MODE: "steps" (steps with epochs inside: sp.ResumableSampler, 2 workers, `track`), "epochs"
(`run.range(num_epochs)`, a save every epoch, plain `for batch in loader`), or "stateful"
(steps over torchdata's StatefulDataLoader, 2 workers). Prints `step N` after each step; after
the K-th step it runs (0: the first) prints `paused` and waits for a line on stdin, so that the
parent's signal lands a random moment after a known step however loaded the machine is. On
completion writes sha256 digests of the model, the optimizer and the scheduler to OUT.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import safepoint as sp

SEED = 7
SAMPLES = 200
BATCH = 16  # 13 batches an epoch, the last one short
STEPS = 60
EPOCHS = 4
EVERY = 7  # not a divisor of an epoch: most resumes land mid-epoch


def digest(value: Any) -> str:
    """sha256 of a state dict: tensors by their bytes, everything else as JSON."""
    sha = hashlib.sha256()

    def feed(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            sha.update(path.encode())
            sha.update(node.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(node, dict):
            for key in sorted(node, key=str):
                feed(node[key], f"{path}/{key}")
        elif isinstance(node, list | tuple):
            for index, item in enumerate(node):
                feed(item, f"{path}/{index}")
        else:
            sha.update(f"{path}={json.dumps(node, default=str)}".encode())

    feed(value, "")
    return sha.hexdigest()


class SignalAgainWhileSaving:
    """Sends SIGTERM and SIGUSR1 to this process from inside the save that follows a
    preemption signal: a second signal during the final save."""

    def __init__(self) -> None:
        self.run: sp.Run | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.run is not None and self.run.preempted:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def main() -> None:
    root, mode, out = sys.argv[1:4]
    arm = "--arm-second-signal" in sys.argv
    flag = "--pause-after"
    pause = int(sys.argv[sys.argv.index(flag) + 1]) if flag in sys.argv else -1
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata on torch 2.13
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)

    data_gen = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(SAMPLES, 16, generator=data_gen)
    labels = (inputs @ torch.randn(16, 4, generator=data_gen)).argmax(1)
    dataset = TensorDataset(inputs, labels)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    total = EPOCHS if mode == "epochs" else STEPS
    per_epoch = -(-SAMPLES // BATCH)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=1e-2,
        total_steps=EPOCHS * per_epoch if mode == "epochs" else STEPS,
    )
    state: dict[str, Any] = {"model": model, "optim": optimizer, "sched": scheduler,
                             "rng": sp.RNGState()}
    if mode == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader: Any = StatefulDataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=2,
                                         generator=torch.Generator().manual_seed(SEED))
        state["data"] = loader

        def endless() -> Iterator[Any]:
            while True:
                yield from loader

        batches = endless()
    else:
        sampler = sp.ResumableSampler(dataset, seed=SEED)
        workers = 2 if mode == "steps" else 0
        loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers,
                            generator=sampler.generator)
        state["data"] = sampler
        batches = sampler.track(loader, epochs=None)
    bomb = SignalAgainWhileSaving()
    if arm:
        state["bomb"] = bomb

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        if random.random() < 0.5:  # augmentation on all three host RNGs
            x = x.flip(1)
        x = x + float(np.random.uniform(0, 0.1)) * torch.randn_like(x)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        time.sleep(0.01)  # so the parent's signal lands at varied moments

    model.train()
    with sp.Run(root, state, every_steps=1 if mode == "epochs" else EVERY) as run:
        bomb.run = run
        start = run.step
        print(f"start {start}", flush=True)
        for step in run.range(total):
            if mode == "epochs":
                for x, y in loader:  # plain iteration, no workers: exact without track()
                    train_step(x, y)
            else:
                train_step(*next(batches))
            print(f"step {step}", flush=True)
            if step == start + pause:
                print("paused", flush=True)
                sys.stdin.readline()
    with open(out, "w") as file:
        json.dump({"model": digest(model.state_dict()), "optim": digest(optimizer.state_dict()),
                   "sched": digest(scheduler.state_dict())}, file)


if __name__ == "__main__":
    main()
