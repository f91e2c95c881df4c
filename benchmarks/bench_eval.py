"""Evaluation at catalog scale: fp32 vs certified-bf16 ranking, and reading a split's data once vs scoring it.

Two modes, both with ``--workers`` gloo processes (each rank owns ``n / W`` catalog rows, as in training):

``--synthetic-items N`` (no dataset needed): ``--users`` user vectors ranked against a catalog of N items of
dimension ``--dim``, top ``--k`` per user, ``--excluded`` random "train" items per user left out, in batches of
``--batch`` users per rank (the evaluation's batching). Vectors are ``random`` (Gaussian) or ``trained``-like
(items around 256 topic centres with log-normal norms, the popular items longest; users near one topic each:
a user's top items crowd together, the harder case for the bound). Three rankings, timed in turn
``--repeat`` times (the slowest rank of each, min and median over the repeats):

* ``fp32 before``: the path evaluation had before certification: fp32 GEMM, -inf for the excluded items,
  ``distributed_topk`` (catalog.py);
* ``fp32 exact``: ``exact_topk(certified=False)`` + ``merge_topk`` (``eval.certified_bf16: false``);
* ``certified bf16``: ``exact_topk`` + ``merge_topk`` with the bf16 pass forced (by default it is tried only
  from ``MIN_ITEMS_PER_K`` = 300 items per k on the rank, where it pays: the report says which the default
  would take).

Checks that the certified lists equal the fp32 ones bit for bit (values and ids), counts the rows where the
old path's ids differ (only where ties at the k-th place were broken another way), and reports the share of
the certified rows' scores rescored in fp32 and the rows that fell back to fp32.

``--data ROOT``: a real dataset (bigrank layout): builds one split's evaluation data once (what the trainer's
Evaluator does once per run), then times one evaluation of ``--users`` sampled users over the whole catalog with
certified bf16 and with fp32 (random catalog and user vectors), and checks the metrics agree.

Usage::

    .venv/bin/python -m benchmarks.bench_eval --synthetic-items 428000 --users 2048 --workers 2
    .venv/bin/python -m benchmarks.bench_eval --data /work/data/ml1b --users 10000 --workers 2
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import subprocess
import time

import numpy as np
import torch


def synthetic_vectors(kind: str, num_items: int, num_users: int, dim: int, seed: int = 0):
    """``(items float32[n, d], users float32[u, d])``: ``random`` Gaussian or ``trained``-like (see the module)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "random":
        items = torch.randn(num_items, dim, generator=generator) * 0.1
        return items, torch.randn(num_users, dim, generator=generator)
    topics = torch.randn(256, dim, generator=generator)
    topic = torch.randint(0, 256, (num_items,), generator=generator)
    items = topics[topic] + 0.8 * torch.randn(num_items, dim, generator=generator)
    popularity = torch.exp(0.5 * torch.randn(num_items, generator=generator))  # log-normal item norms
    items = items / items.norm(dim=1, keepdim=True) * popularity.unsqueeze(1) * 0.3
    user_topic = torch.randint(0, 256, (num_users,), generator=generator)
    users = topics[user_topic] + 0.6 * torch.randn(num_users, dim, generator=generator)
    users = users / users.norm(dim=1, keepdim=True) * torch.exp(0.3 * torch.randn(num_users, 1, generator=generator))
    return items, users * 3.0


def _synthetic_body(kind, num_items, num_users, dim, k, excluded, batch, repeat, threads):
    import torch.distributed as dist

    from bigrank.devices import use_certified_bf16
    from bigrank.model.catalog import distributed_topk, shard_range
    from bigrank.model.topk import MIN_ITEMS_PER_K, TopKCatalog, TopKStats, exact_topk, merge_topk
    from bigrank.train.evaluate import MAX_SCORE_ELEMENTS

    torch.set_num_threads(threads)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    start, stop = shard_range(num_items, rank, world)
    items, users = synthetic_vectors(kind, num_items, num_users, dim)
    weight = items[start:stop].contiguous()
    del items
    rng = np.random.default_rng(1)
    train = rng.integers(0, num_items, size=(num_users, excluded))  # the users' "train" items
    local = (train >= start) & (train < stop)
    rows_per_batch = max(1, min(batch, MAX_SCORE_ELEMENTS // math.ceil(num_items / world)))
    batches = []
    for first in range(0, num_users, rows_per_batch):
        last = min(first + rows_per_batch, num_users)
        rows, cols = np.nonzero(local[first:last])
        pairs = (torch.from_numpy(rows), torch.from_numpy(train[first:last][rows, cols] - start))
        batches.append((first, last, pairs))

    def before():
        out = []
        for first, last, pairs in batches:
            scores = users[first:last] @ weight.T
            scores[pairs] = float("-inf")
            out.append(distributed_topk(scores, k, group=group, offset=start))
        return out

    def ranked(certified: bool, stats=None):
        catalog = TopKCatalog.build(weight, certified=certified)  # the bf16 copy: once per evaluation
        out = []
        for first, last, pairs in batches:
            top = exact_topk(
                users[first:last], catalog, k, exclude=pairs, certified=certified, min_items_per_k=0, stats=stats
            )
            out.append(merge_topk(*top, k, offset=start, num_local=stop - start, group=group))
        return out

    certified_on = use_certified_bf16(True, weight.device)
    modes = {"fp32 before": before, "fp32 exact": lambda: ranked(False), "certified bf16": lambda: ranked(True)}
    if not certified_on:
        modes.pop("certified bf16")
    times = {name: [] for name in modes}
    cpu_times = {name: [] for name in modes}
    answers = {}
    with torch.no_grad():
        for _ in range(repeat):
            for name, fn in modes.items():
                dist.barrier()
                started, cpu_started = time.perf_counter(), time.process_time()
                answers[name] = fn()
                times[name].append(time.perf_counter() - started)
                cpu_times[name].append(time.process_time() - cpu_started)
        stats = TopKStats()
        certified = ranked(certified_on, stats)
    values = {name: torch.cat([v for v, _ in answer]) for name, answer in answers.items()}
    ids = {name: torch.cat([i for _, i in answer]) for name, answer in answers.items()}
    certified_values, certified_ids = torch.cat([v for v, _ in certified]), torch.cat([i for _, i in certified])
    return {
        "times": times,
        "cpu_times": cpu_times,
        "equal": bool(
            torch.equal(certified_values.view(torch.int32), values["fp32 exact"].view(torch.int32))
            and torch.equal(certified_ids, ids["fp32 exact"])
        ),
        "before_rows_differ": int((ids["fp32 before"] != ids["fp32 exact"]).any(dim=1).sum()),
        "before_values_equal": bool(torch.equal(values["fp32 before"], values["fp32 exact"])),
        "stats": stats,
        "certified": certified_on,
        "default_bf16": certified_on and (stop - start) >= MIN_ITEMS_PER_K * k,
        "rows_per_batch": rows_per_batch,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _dataset_body(root: str, users: int, dim: int, batch: int, threads: int) -> dict:
    import torch.distributed as dist

    from bigrank.data.manifest import DatasetManifest
    from bigrank.model.catalog import CatalogShard
    from bigrank.model.topk import TopKStats
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
    out = {"data_s": data_seconds, "excluded": int(data.excluded[1].size)}
    for certified in (False, True):
        stats = TopKStats()
        started = time.perf_counter()
        result = evaluate_model(
            user_vectors, shard, root, "valid", [10, 100, 1000], group=group, batch_size=batch, data=data,
            certified_bf16=certified, stats=stats,
        )  # fmt: skip
        out[certified] = {"score_s": time.perf_counter() - started, "result": result, "stats": stats}
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _load() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "(uptime unavailable)"


def _report_synthetic(args, results) -> None:
    first = results[0]
    print(
        f"ranking {args.users:,} users x {args.synthetic_items:,} items (d={args.dim}, {args.vectors} vectors), "
        f"top {args.k}, {args.excluded} excluded items per user, {args.workers} ranks x {args.threads} thread(s), "
        f"batches of {first['rows_per_batch']} users"
    )
    print(f"load: {_load()}")

    def slowest_rank(key):
        return {name: [max(r[key][name][i] for r in results) for i in range(args.repeat)] for name in first[key]}

    wall, cpu = slowest_rank("times"), slowest_rank("cpu_times")
    base, cpu_base = min(wall["fp32 before"]), min(cpu["fp32 before"])
    print("wall: the slowest rank's seconds; cpu: its process CPU seconds (less sensitive to a loaded machine)")
    print("| ranking | wall min s | wall median s | cpu min s | fp32 before / this (wall min) | (cpu min) |")
    print("|---|---|---|---|---|---|")
    for name in wall:
        w, c = wall[name], cpu[name]
        print(
            f"| {name} | {min(w):.2f} | {statistics.median(w):.2f} | {min(c):.2f} | {base / min(w):.2f}x | "
            f"{cpu_base / min(c):.2f}x |"
        )
    if "certified bf16" in wall:
        ratio = min(wall["fp32 exact"]) / min(wall["certified bf16"])
        cpu_ratio = min(cpu["fp32 exact"]) / min(cpu["certified bf16"])
        print(f"fp32 exact / certified bf16: {ratio:.2f}x wall, {cpu_ratio:.2f}x cpu (min over the repeats)")
    stats = [r["stats"] for r in results]
    rows = sum(s.rows for s in stats)
    rescored, certified_scores = sum(s.rescored for s in stats), sum(s.certified_scores for s in stats)
    bf16_rows, fallback = sum(s.bf16_rows for s in stats), sum(s.fallback_rows for s in stats)
    if first["certified"]:
        print(
            f"certified: {bf16_rows:,} of {rows:,} rank-rows scored in bf16, {fallback:,} fell back to fp32 "
            f"({fallback / max(bf16_rows, 1):.2%}); rescored in fp32: {rescored:,} scores = "
            f"{rescored / max(certified_scores, 1):.4%} of the certified rows' scores "
            f"({rescored / max(bf16_rows - fallback, 1):,.0f} per row, k = {args.k})"
        )
        default = "the bf16 pass" if all(r["default_bf16"] for r in results) else "fp32 (too few items per k)"
        print(f"the default (eval.certified_bf16: true) takes {default} at this k and shard size")
    else:
        print("certified bf16: not available on this CPU (no bf16 units): fp32 only")
    print(f"certified lists == fp32 lists (values bit for bit, ids): {all(r['equal'] for r in results)}")
    print(
        f"fp32 before vs fp32 exact: values equal {all(r['before_values_equal'] for r in results)}, rows with "
        f"other ids {first['before_rows_differ']} (ties at the k-th place: the old path kept any of them)"
    )
    rss = ", ".join(f"{r['rss_mb']:,.0f} MB" for r in results)
    print(f"peak RSS per rank: {rss}")


def _report_dataset(args, results) -> None:
    first = results[0]
    users = first[True]["result"]["users"]
    print(f"evaluation of {users:,} sampled users over {args.data} ({args.workers} workers, d={args.dim})")
    print(f"load: {_load()}")
    print("| rank | build data s (once per run) | score s fp32 | score s certified bf16 | excluded | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for rank, r in enumerate(results):
        print(
            f"| {rank} | {r['data_s']:.1f} | {r[False]['score_s']:.1f} | {r[True]['score_s']:.1f} | "
            f"{r['excluded']:,} | {r['rss_mb']:,.0f} |"
        )
    fp32 = max(r[False]["score_s"] for r in results)
    certified = max(r[True]["score_s"] for r in results)
    stats = first[True]["stats"]
    print(f"fp32 / certified bf16: {fp32 / certified:.2f}x; rescored share {stats.candidate_fraction:.4%}, "
          f"fallback rate {stats.fallback_rate:.2%}")  # fmt: skip
    same = all(r[True]["result"] == r[False]["result"] for r in results)
    print(f"metrics identical with and without certified bf16: {same}")
    print(
        f"each evaluation: {certified:.1f} s = the time of {certified / 0.5:.0f} steps of 0.5 s "
        "(compare with bench_train's step time)"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="dataset root (bigrank layout)")
    source.add_argument("--synthetic-items", type=int, help="rank against a synthetic catalog of this many items")
    parser.add_argument("--users", type=int, default=None, help="users (default 2048 synthetic, 10000 --data)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256, help="users scored at once per rank")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--k", type=int, default=1000, help="synthetic: top k per user (evaluation's max K)")
    parser.add_argument("--excluded", type=int, default=100, help="synthetic: random excluded items per user")
    parser.add_argument("--vectors", choices=("random", "trained"), default="random", help="synthetic vectors")
    parser.add_argument("--repeat", type=int, default=3, help="synthetic: timings of each ranking")
    args = parser.parse_args(argv)

    from bigrank.train.launcher import launch_local

    args.threads = max(1, (torch.get_num_threads() or 1) // args.workers)
    if args.synthetic_items:
        args.users = args.users or 2048
        body_args = (
            args.vectors, args.synthetic_items, args.users, args.dim, args.k, args.excluded, args.batch,
            args.repeat, args.threads,
        )  # fmt: skip
        _report_synthetic(args, launch_local(_synthetic_body, args.workers, body_args))
    else:
        args.users = args.users or 10_000
        body_args = (args.data, args.users, args.dim, args.batch, args.threads)
        _report_dataset(args, launch_local(_dataset_body, args.workers, body_args))


if __name__ == "__main__":
    main()
