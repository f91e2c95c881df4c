"""Item-parallel catalog: one vs two gloo processes, dense vs chunked scoring, bytes on the wire.

Each configuration runs in fresh processes (so peak RSS is its own): build a ``CatalogShard`` of n items,
all-gather the global batch of user vectors, score it against the local shard (dense, or ``ChunkedScores`` of
``--chunk`` items), Rankmax k=10 loss, backward to users and items. Reported per configuration: best step time,
peak RSS of the largest rank, bytes this rank sent per step (``count_bytes``) and the naive alternative
(all-gathering the B x n_local score block of every rank).

    .venv/bin/python -m benchmarks.bench_catalog [--items 849000] [--dim 64] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, port, args, batch, chunk, items, queue):
    torch.set_num_threads(max(1, 2 // world_size))
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    group = dist.group.WORLD if world_size > 1 else None
    from bigrank.distributed.collectives import all_gather_rows, count_bytes
    from bigrank.losses import rankmax_loss
    from bigrank.losses.scores import score_matrix
    from bigrank.model.catalog import CatalogShard

    shard = CatalogShard(items, args.dim, group)
    generator = torch.Generator().manual_seed(rank)
    local_users = (torch.randn(batch // world_size, args.dim, generator=generator) * 0.1).requires_grad_(True)
    target = torch.randint(0, items, (batch,), generator=torch.Generator().manual_seed(0))
    times, sent = [], 0
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        with count_bytes() as counter:
            users = all_gather_rows(local_users, group)
            loss = rankmax_loss(score_matrix(users, shard.weight, chunk), target, k=10, group=group, offset=shard.start)
            loss.backward()
        times.append(time.perf_counter() - start)
        sent = counter.total
        local_users.grad = shard.weight.grad = None
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    naive = batch * shard.num_local * 4  # all-gathering this rank's [B, n_local] float32 score block
    queue.put((rank, min(times[1:]), rss_mb, sent, naive))
    if world_size > 1:
        dist.destroy_process_group()


def run(args, world_size, batch, chunk, items):
    from bigrank.train.launcher import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, args, batch, chunk, items, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        results.append(queue.get(timeout=3600))
    for p in procs:
        p.join()
    return {
        "step_s": max(r[1] for r in results),
        "rss_mb": max(r[2] for r in results),
        "sent": max(r[3] for r in results),
        "naive": max(r[4] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=849_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunk", default="auto", help='items per chunk, or "auto" (about 2^22 scores a block)')
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 4096], help="global batch sizes to run")
    parser.add_argument("--small-items", type=int, default=150_000, help="catalog for the B=4096 dense comparison")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    # B=4096 dense over 849K items needs 2 x 13.9 GB (scores + gradient) and does not fit in 24 GB: it is
    # compared with chunking on a smaller catalog instead.
    configs = [
        (1, 256, None, args.items),
        (1, 256, args.chunk, args.items),
        (2, 256, None, args.items),
        (2, 256, args.chunk, args.items),
        (2, 4096, args.chunk, args.items),
        (1, 4096, args.chunk, args.items),
        (1, 4096, None, args.small_items),
        (1, 4096, args.chunk, args.small_items),
    ]
    chunk = args.chunk if args.chunk == "auto" else int(args.chunk)
    configs = [c for c in configs if c[1] in args.batches]
    configs = [(w, b, None if c is None else chunk, n) for w, b, c, n in configs]
    print(f"Rankmax k=10, d={args.dim}, chunk={args.chunk}, best of {args.steps} steps after one warm-up")
    header = f"{'ranks':>5} {'B':>5} {'items':>8} {'scoring':>8} {'step s':>8} {'peak RSS MB':>12}"
    print(header + f" {'bytes sent/rank':>16} {'naive gather':>14} {'ratio':>9}")
    for world_size, batch, chunk, items in configs:
        r = run(args, world_size, batch, chunk, items)
        scoring = "dense" if chunk is None else "chunked"
        ratio = f"{r['sent'] / r['naive']:.1e}" if world_size > 1 else "-"
        sent = f"{r['sent']:,}" if world_size > 1 else "-"
        print(
            f"{world_size:>5} {batch:>5} {items:>8} {scoring:>8} {r['step_s']:>8.2f} {r['rss_mb']:>12.0f}"
            f" {sent:>16} {r['naive'] if world_size > 1 else 0:>14,} {ratio:>9}",
            flush=True,
        )


if __name__ == "__main__":
    main()
