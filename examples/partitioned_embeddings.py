"""Partitioned embedding tables in the style of PyTorch-BigGraph: save every partition (its
embeddings and its own Adagrad state) in one checkpoint, then load one partition at a time with
`keys=`, reading only that partition's bytes.

    .venv/bin/python examples/partitioned_embeddings.py [--root DIR] [--partitions 4]
        [--rows 20000] [--dim 64] [--epochs 2]

Entities are split into P partitions, each with an embedding table (`nn.Embedding`) and an
Adagrad optimizer of its own, as PBG keeps them. Training goes bucket by bucket: a bucket
(i, j) holds edges from partition i to partition j, and a step updates both tables through a
shared relation vector. After each epoch the whole model is saved as one checkpoint:

    {"epoch": e, "relation": {...}, "partitions": {0: {"embeddings": table, "optim": adagrad},
                                                   1: {...}, ...}}

Then a worker that owns partition i restores just `partitions/<i>/` into its own fresh table
and optimizer (`sp.load(url, into=..., keys=[f"partitions/{i}/"])`): the checkpoint's other
partitions are never read. The script prints each partition's share of the checkpoint (from
`sp.info`, which reads only the manifest) and safepoint's load log, which counts the bytes read.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from typing import Any

import torch

import safepoint as sp

SEED = 7
EDGES_PER_BUCKET = 512
LEARNING_RATE = 0.1


def make_partition(rows: int, dim: int, seed: int) -> dict[str, Any]:
    """A partition's embedding table and its own Adagrad optimizer."""
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.nn.Embedding(rows, dim)
    with torch.no_grad():
        embeddings.weight.copy_(torch.randn(rows, dim, generator=generator) * 0.1)
    return {"embeddings": embeddings,
            "optim": torch.optim.Adagrad(embeddings.parameters(), lr=LEARNING_RATE)}


def bucket_edges(i: int, j: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (fixed, synthetic) edges of bucket (i, j): sources in partition i, targets in j."""
    generator = torch.Generator().manual_seed(SEED * 1000 + i * 100 + j)
    return (torch.randint(rows, (EDGES_PER_BUCKET,), generator=generator),
            torch.randint(rows, (EDGES_PER_BUCKET,), generator=generator))


def train_bucket(lhs: dict[str, Any], rhs: dict[str, Any], relation: dict[str, Any],
                 edges: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator) -> float:
    """One step on the edges from partition `lhs` to `rhs`: a dot-product score with a
    diagonal relation, true edges against shuffled negatives (a logistic loss)."""
    src, dst = edges
    negatives = dst[torch.randperm(EDGES_PER_BUCKET, generator=generator)]
    optimizers = {id(o): o for o in (lhs["optim"], rhs["optim"], relation["optim"])}.values()
    for optimizer in optimizers:
        optimizer.zero_grad()
    left = lhs["embeddings"](src) * relation["diagonal"]
    positive = (left * rhs["embeddings"](dst)).sum(-1)
    negative = (left * rhs["embeddings"](negatives)).sum(-1)
    loss = torch.nn.functional.softplus(-positive).mean() + torch.nn.functional.softplus(
        negative).mean()
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
    return float(loss.detach())


def partition_bytes(url: str, partitions: int) -> tuple[list[int], int]:
    """Bytes each partition takes in the checkpoint, and the checkpoint's total, from the
    manifest alone."""
    info = sp.info(url)
    sizes = [sum(e.nbytes for e in info.entries if e.path.startswith(f"partitions/{i}/"))
             for i in range(partitions)]
    return sizes, info.nbytes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, save all partitions together, reload them one at a time; returns a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="where to write (default: a temporary directory)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--rows", type=int, default=20000, help="entities per partition")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    root = args.root or tempfile.mkdtemp(prefix="safepoint-pbg-")

    torch.manual_seed(SEED)
    partitions = {i: make_partition(args.rows, args.dim, SEED + i)
                  for i in range(args.partitions)}
    diagonal = torch.nn.Parameter(torch.ones(args.dim))
    relation = {"diagonal": diagonal, "optim": torch.optim.Adagrad([diagonal], lr=LEARNING_RATE)}
    generator = torch.Generator().manual_seed(SEED)
    url = ""
    for epoch in range(args.epochs):
        losses = [
            train_bucket(partitions[i], partitions[j], relation,
                         bucket_edges(i, j, args.rows), generator)
            for i in range(args.partitions) for j in range(args.partitions)
        ]
        url = f"{root}/epoch-{epoch}"
        sp.save(url, {"epoch": epoch, "relation": relation, "partitions": partitions},
                metadata={"partitions": args.partitions, "rows": args.rows, "dim": args.dim})
        print(f"epoch {epoch}: mean loss {sum(losses) / len(losses):.4f}, saved {url}")

    sizes, total = partition_bytes(url, args.partitions)
    print(f"\n{url}: {total / 2**20:.1f} MiB in all; each partition "
          f"{sizes[0] / 2**20:.1f} MiB ({sizes[0] / total:.0%})")
    matches = []
    for i in range(args.partitions):
        worker = make_partition(args.rows, args.dim, seed=-1 - i)  # fresh, different values
        sp.load(url, into={"partitions": {i: worker}}, keys=[f"partitions/{i}/"])
        same = torch.equal(worker["embeddings"].weight, partitions[i]["embeddings"].weight) and \
            torch.equal(worker["optim"].state_dict()["state"][0]["sum"],
                        partitions[i]["optim"].state_dict()["state"][0]["sum"])
        matches.append(same)
        print(f"partition {i}: restored {'exactly' if same else 'WRONGLY'} "
              f"({sizes[i] / 2**20:.1f} MiB read of {total / 2**20:.1f} MiB)")
    return {"url": url, "partition_bytes": sizes, "total_bytes": total, "matches": matches}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="  log: %(message)s")
    logging.getLogger("safepoint").setLevel(logging.INFO)
    summary = main()
    sys.exit(0 if all(summary["matches"]) else 1)
