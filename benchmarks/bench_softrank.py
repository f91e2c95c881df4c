"""Step time of the soft-rank and sampled losses as ratios to the softmax step, measured side by side.

A step is: scores = U @ V.T (U: [B, d] user vectors, V: item rows), the loss, and backward to U and V.
Two settings, both with B rows and d dimensions:

* full catalog: every one of ``--items`` items is a column (one positive per row);
* sampled: ``--sampled`` candidates per step (the batch's positives + popularity^0.75 negatives shared by all
  rows, logQ from ``PopularitySampler``).

Each loss is timed ``--repeats`` times after one warm-up call (median reported), in rounds over all losses
in the same process, so the ratios are comparable on a shared CPU. The softmax reference is
``bigrank.losses.softmax_loss`` (plain ``torch.nn.functional.cross_entropy`` if that import is unavailable).

    .venv/bin/python benchmarks/bench_softrank.py                  # B=256, d=64, 849,000 items, 8,192 sampled
    .venv/bin/python benchmarks/bench_softrank.py --items 100000   # quicker
    .venv/bin/python benchmarks/bench_softrank.py --threads 1      # steadier when other jobs share the CPU
    .venv/bin/python benchmarks/bench_softrank.py --dense-full     # also the dense [B, n] full-catalog steps
    .venv/bin/python benchmarks/bench_softrank.py --fused-only     # only the trainer's fused sampled steps

Fused sampled (``--fused-batch`` rows, default 4,096): the trainer's own sampled step (``StepLoss`` on one rank:
the draw, the touched rows, the fused shared-negatives loss and backward) for sampled softmax, Smooth-AP,
Recall@quantile and pAUC@budget with ``--sampled`` uniform negatives, in float32 and with bf16 scoring
(``train.precision=bf16``: bf16 GEMMs, float32 statistics).

Full catalog: softmax and the catalog-scale Smooth-AP / Recall@quantile / pAUC of
``bigrank.losses.softrank_catalog`` through the chunked engine (what the trainer runs for
``candidates: catalog``); ``--dense-full`` adds the dense candidate losses on the [B, n] matrix.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.nn.functional as F

from bigrank.data.samplers import PopularitySampler, candidate_labels
from bigrank.losses.sampled import sampled_softmax_loss
from bigrank.losses.softndcg import softrank_ndcg_loss
from bigrank.losses.softrank import pauc_at_budget_loss, recall_at_quantile_loss, smooth_ap_loss

try:
    from bigrank.losses import softmax_loss

    REFERENCE = "bigrank.losses.softmax_loss"
except ImportError:  # the full-catalog losses may not be installed yet

    def softmax_loss(scores, target, reduction="mean"):
        return F.cross_entropy(scores, target, reduction=reduction)

    REFERENCE = "torch.nn.functional.cross_entropy"


def losses(num_candidates_ndcg: int):
    """name -> fn(scores, target, labels, log_q) returning a scalar loss."""
    return {
        "softmax": lambda s, t, lab, lq: softmax_loss(s, t),
        "sampled_softmax(logQ)": lambda s, t, lab, lq: sampled_softmax_loss(s, lab, lq),
        "smooth_ap": lambda s, t, lab, lq: smooth_ap_loss(s, lab),
        "recall@quantile": lambda s, t, lab, lq: recall_at_quantile_loss(s, lab),
        "pauc@budget": lambda s, t, lab, lq: pauc_at_budget_loss(s, lab),
        f"softrank_ndcg(N={num_candidates_ndcg})": lambda s, t, lab, lq: softrank_ndcg_loss(
            s, lab, num_candidates=num_candidates_ndcg
        ),
    }


def make_step(fn, users, items, target, labels, log_q):
    def step():
        users.grad = items.grad = None
        scores = users @ items.T
        fn(scores, target, labels, log_q).backward()

    return step


def catalog_engine_steps(users, items, target):
    """Full-catalog steps through the chunked engine (``score_matrix(..., "auto")``: no [B, n] tensor):
    softmax and the catalog-scale soft-rank losses of ``bigrank.losses.softrank_catalog``."""
    from bigrank.losses.scores import score_matrix
    from bigrank.losses.softrank_catalog import (
        pauc_at_budget_catalog_loss,
        recall_at_quantile_catalog_loss,
        smooth_ap_catalog_loss,
    )

    functions = {
        "softmax (chunked)": softmax_loss,
        "smooth_ap (chunked)": smooth_ap_catalog_loss,
        "recall@quantile (chunked)": recall_at_quantile_catalog_loss,
        "pauc@budget (chunked)": pauc_at_budget_catalog_loss,
    }

    def make(fn):
        def step():
            users.grad = items.grad = None
            fn(score_matrix(users, items, "auto"), target).backward()

        return step

    return {name: make(fn) for name, fn in functions.items()}


FUSED_LOSSES = ("sampled_softmax", "smooth_ap", "recall_at_quantile", "pauc_at_budget")


def fused_sampled_steps(users, catalog, batch: int, negatives: int, seed: int) -> dict:
    """``StepLoss`` steps (one rank, the whole catalog as its shard) of the fused sampled losses, float32 and
    bf16 scoring: name -> step()."""
    from bigrank.config import LossConfig
    from bigrank.train.losses import StepLoss

    generator = torch.Generator().manual_seed(seed)
    rows = (torch.randn(batch, users.shape[1], generator=generator) / users.shape[1] ** 0.5).requires_grad_(True)
    target = torch.randint(0, catalog.shape[0], (batch,), generator=generator)
    weight = catalog.detach()
    steps = {}
    for name in FUSED_LOSSES:
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            config = LossConfig(name=name, candidates="sampled", num_negatives=negatives)
            step_loss = StepLoss(config, num_items=catalog.shape[0], shard_start=0, shard_stop=catalog.shape[0],
                                 seed=seed, score_dtype=dtype)  # fmt: skip

            def step(step_loss=step_loss, counter=itertools.count(1)):  # noqa: B008 - one counter per step
                rows.grad = None
                step_loss(rows, target, weight, step=next(counter)).backward()
                step_loss.last_rows.grad  # noqa: B018 - the touched rows' gradient, as the trainer reads it

            steps[f"{name} {label}"] = step
    return steps


def time_round_robin(steps: dict, repeats: int, label: str) -> dict:
    """Median time of each step; the repeats run in rounds over all steps, so a change of load on the shared
    CPU during the run affects every loss alike (ratios stay comparable)."""
    for step in steps.values():
        step()  # warm-up (allocations, lazy init)
    times = {name: [] for name in steps}
    for round_index in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            print(f"  {label:<13s} round {round_index + 1}  {name:<28s} {times[name][-1]:8.3f} s", flush=True)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=849_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--sampled", type=int, default=8192)
    parser.add_argument("--ndcg-candidates", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument(
        "--dense-full", action="store_true", help="also time the dense [B, n] full-catalog steps (6+ GB at 849K)"
    )
    parser.add_argument("--fused-batch", type=int, default=4096, help="rows of the fused sampled steps")
    parser.add_argument("--fused-only", action="store_true", help="only the fused sampled (StepLoss) steps")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if min(args.items, args.batch, args.dim, args.sampled, args.repeats) < 1 or args.sampled <= args.batch:
        parser.error("sizes must be positive and --sampled larger than --batch")

    gen = torch.Generator().manual_seed(args.seed)
    users = (torch.randn(args.batch, args.dim, generator=gen) / args.dim**0.5).requires_grad_(True)
    catalog = (torch.randn(args.items, args.dim, generator=gen) / args.dim**0.5).requires_grad_(True)
    target = torch.randint(0, args.items, (args.batch,), generator=gen)
    table = losses(args.ndcg_candidates)

    # The trainer's fused sampled steps (StepLoss), float32 and bf16 scoring.
    fused = time_round_robin(
        fused_sampled_steps(users, catalog, args.fused_batch, args.sampled, args.seed), args.repeats, "fused"
    )
    print()
    print(f"fused sampled (StepLoss, 1 rank): B={args.fused_batch} d={args.dim} items={args.items:,} "
          f"negatives={args.sampled:,} threads={torch.get_num_threads()}; median of {args.repeats} steps")  # fmt: skip
    reference = fused["sampled_softmax fp32"]
    print(f"{'loss':<22s} {'fp32 s':>8s} {'bf16 s':>8s} {'fp32/bf16':>10s} {'fp32 /sampled softmax fp32':>27s}")
    for name in FUSED_LOSSES:
        fp32, bf16 = fused[f"{name} fp32"], fused[f"{name} bf16"]
        print(f"{name:<22s} {fp32:8.3f} {bf16:8.3f} {fp32 / bf16:10.2f} {fp32 / reference:27.2f}")
    if args.fused_only:
        return 0

    # Full catalog: one positive per row.
    full_labels = torch.zeros(args.batch, args.items, dtype=torch.bool)
    full_labels[torch.arange(args.batch), target] = True
    steps = {name: make_step(fn, users, catalog, target, full_labels, None) for name, fn in table.items()}
    if args.dense_full:
        full = time_round_robin(steps, args.repeats, "full catalog")
    else:
        full = {}
    full.update(time_round_robin(catalog_engine_steps(users, catalog, target), args.repeats, "full (engine)"))
    del steps, full_labels  # the closures hold the [B, items] labels

    # Sampled: the batch's positives + shared popularity^0.75 negatives (Zipf-like counts), logQ-corrected.
    counts = 1.0 / torch.arange(1, args.items + 1, dtype=torch.float64)[torch.randperm(args.items, generator=gen)]
    sampler = PopularitySampler(counts, beta=0.75)
    positives = torch.unique(target)
    drawn = sampler.sample(args.sampled - positives.numel(), generator=gen)
    candidate_ids = torch.cat([positives, drawn.ids])
    log_q = torch.cat([torch.zeros(positives.numel(), dtype=torch.float64), drawn.log_q]).float()
    labels = candidate_labels(target, candidate_ids)
    local_target = labels.to(torch.int64).argmax(dim=1)  # first column holding the row's positive
    candidate_rows = catalog[candidate_ids].detach().requires_grad_(True)
    steps = {}
    for name, fn in table.items():

        def sampled_fn(s, t, lab, lq, fn=fn):
            return fn(s, local_target, lab, lq)

        steps[name] = make_step(sampled_fn, users, candidate_rows, None, labels, log_q)
    sampled = time_round_robin(steps, args.repeats, "sampled")

    ref_full, ref_sampled = full["softmax (chunked)"], sampled["softmax"]
    print()
    print(
        f"B={args.batch} d={args.dim} items={args.items:,} sampled={args.sampled:,} threads={torch.get_num_threads()}"
    )
    print(f"reference softmax: {REFERENCE}; median of {args.repeats} steps (scores GEMM + loss + backward)")
    print()
    print(f"{'full catalog':<28s} {'s':>8s} {'/softmax (chunked)':>19s}")
    for name, seconds in full.items():
        print(f"{name:<28s} {seconds:8.3f} {seconds / ref_full:19.2f}")
    print()
    print(f"{'sampled':<28s} {'s':>8s} {'/sampled softmax':>17s} {'/softmax_s':>11s}")
    for name in table:
        print(f"{name:<28s} {sampled[name]:8.4f} {sampled[name] / sampled['sampled_softmax(logQ)']:17.2f} "
              f"{sampled[name] / ref_sampled:11.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
