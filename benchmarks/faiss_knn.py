"""kNN-Per datastore search: FAISS flat index vs numpy brute force, and HNSW vs flat.

    python benchmarks/faiss_knn.py [--stored 100000] [--dim 512] [--queries 1000] [--k 10]

Prints, from one run on the same random data: queries per second of the exact flat index and
of numpy brute force (||q||² − 2 q·x + ||x||², then argpartition) and their ratio; HNSW build
time, query time and recall@k against the exact neighbours. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import time

import faiss
import numpy as np

from florist.strategies.knnper.datastore import Datastore


def numpy_knn(stored: np.ndarray, queries: np.ndarray, k: int, chunk: int = 100) -> np.ndarray:
    """Exact kNN ids with numpy only, in query chunks to bound memory."""
    norms = (stored**2).sum(1)
    out = []
    for i in range(0, len(queries), chunk):
        q = queries[i : i + chunk]
        d = norms[None, :] - 2 * q @ stored.T
        part = np.argpartition(d, k, axis=1)[:, :k]
        order = np.take_along_axis(d, part, 1).argsort(1)
        out.append(np.take_along_axis(part, order, 1))
    return np.concatenate(out)


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stored", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    stored = rng.standard_normal((args.stored, args.dim), dtype=np.float32)
    queries = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    labels = np.arange(args.stored)
    print(
        f"{args.stored:,} stored x {args.dim}-d, {args.queries:,} queries, k={args.k}, "
        f"{faiss.omp_get_max_threads()} FAISS threads"
    )

    flat, flat_build = timed(lambda: _store("flat", stored, labels))
    (_, exact), flat_query = timed(lambda: flat.search(queries, args.k))
    brute, brute_query = timed(lambda: numpy_knn(stored, queries, args.k))
    agree = np.mean([len(set(a) & set(b)) / args.k for a, b in zip(exact, brute)])
    print(f"flat (exact)   build {flat_build:7.2f} s  query {flat_query:7.3f} s  {args.queries / flat_query:9.0f} q/s")
    print(
        f"numpy brute    build {0:7.2f} s  query {brute_query:7.3f} s  {args.queries / brute_query:9.0f} q/s  "
        f"(same neighbours: {agree:.4f})"
    )
    print(f"flat / numpy query throughput: {brute_query / flat_query:.1f}x")

    hnsw, hnsw_build = timed(lambda: _store("hnsw", stored, labels))
    (_, approx), hnsw_query = timed(lambda: hnsw.search(queries, args.k))
    recall = np.mean([len(set(a) & set(b)) / args.k for a, b in zip(approx, exact)])
    print(
        f"hnsw (M=32, efSearch=64) build {hnsw_build:7.2f} s  query {hnsw_query:7.3f} s  "
        f"{args.queries / hnsw_query:9.0f} q/s  recall@{args.k} vs flat {recall:.3f}"
    )


def _store(index_type: str, stored: np.ndarray, labels: np.ndarray) -> Datastore:
    store = Datastore(stored.shape[1], index_type)
    store.add(stored, labels)
    return store


if __name__ == "__main__":
    main()
