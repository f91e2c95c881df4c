"""Evaluation at catalog scale: reading a split's evaluation data once vs scoring it, per rank.

Measures, with ``--workers`` gloo processes over a dataset (e.g. the synthetic ML-1B):

* ``data``: building one split's :class:`~bigrank.train.evaluate.EvaluationData` (the users, their held-out items
  and their train items within the rank's catalog rows) — what the trainer's Evaluator does once per run;
* ``score``: one evaluation of ``--users`` sampled users over the whole catalog with that data (what every
  evaluation during training costs), with a random catalog and random user vectors of dimension ``--dim``;
* the peak RSS of each rank.

Usage::

    .venv/bin/python -m benchmarks.bench_eval --data /work/data/ml1b --users 10000 --workers 2
"""

from __future__ import annotations

import argparse
import resource
import time

import torch


def _body(root: str, users: int, dim: int, batch: int, threads: int) -> dict:
    import torch.distributed as dist

    from bigrank.data.manifest import DatasetManifest
    from bigrank.model.catalog import CatalogShard
    from bigrank.train.evaluate import evaluate_model, evaluation_data

    torch.set_num_threads(threads)
    group = dist.group.WORLD
    manifest = DatasetManifest.load(root)
    shard = CatalogShard(manifest.num_items, dim, group, init_std=0.1, seed=1)
    generator = torch.Generator().manual_seed(0)

    def user_vectors(ids: torch.Tensor) -> torch.Tensor:  # a stand-in tower: deterministic per user id
        return torch.randn(len(ids), dim, generator=generator.manual_seed(int(ids.sum()) % (2**31)))

    started = time.perf_counter()
    data = evaluation_data(root, "valid", (shard.start, shard.stop), sample_users=users, seed=0)
    data_seconds = time.perf_counter() - started
    started = time.perf_counter()
    result = evaluate_model(user_vectors, shard, root, "valid", [10, 100], group=group, batch_size=batch, data=data)
    score_seconds = time.perf_counter() - started
    return {
        "data_s": data_seconds,
        "score_s": score_seconds,
        "users": result["users"],
        "recall@100": result["recall@100"],
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "excluded": int(data.excluded[1].size),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="dataset root (bigrank layout)")
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256, help="users scored at once per rank")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)

    from bigrank.train.launcher import launch_local

    threads = max(1, (torch.get_num_threads() or 1) // args.workers)
    results = launch_local(_body, args.workers, (args.data, args.users, args.dim, args.batch, threads))
    print(
        f"evaluation of {results[0]['users']:,} sampled users over {args.data} ({args.workers} workers, d={args.dim})"
    )
    print("| rank | build data s (once per run) | score s (each evaluation) | excluded items | peak RSS MB |")
    print("|---|---|---|---|---|")
    for rank, r in enumerate(results):
        print(f"| {rank} | {r['data_s']:.1f} | {r['score_s']:.1f} | {r['excluded']:,} | {r['rss_mb']:,.0f} |")
    slowest = max(r["score_s"] for r in results)
    print(
        f"each evaluation: {slowest:.1f} s = the time of {slowest / 0.5:.0f} steps of 0.5 s "
        "(compare with bench_train's step time)"
    )
    print(f"random ranking sanity: recall@100 = {results[0]['recall@100']:.4f} (random vectors)")


if __name__ == "__main__":
    main()
