"""Item-parallel full-catalog losses equal their single-process twins (real gloo groups, 2 and 3 ranks)."""

from __future__ import annotations

import math

import pytest
import torch

from bigrank.distributed.collectives import all_gather_rows, count_bytes
from bigrank.losses import rankmax_loss, softmax_loss, sparsemax_loss
from bigrank.losses.scores import score_matrix
from bigrank.model.catalog import CatalogShard, distributed_topk, shard_range
from tests.distributed_utils import run_distributed

LOSSES = {
    "rankmax1": lambda s, y, **kw: rankmax_loss(s, y, k=1, **kw),
    "rankmax5": lambda s, y, **kw: rankmax_loss(s, y, k=5, **kw),
    # A k per row, some larger than the narrowest shard (those shards pad their top-k with -inf).
    "rankmax_per_row_k": lambda s, y, **kw: rankmax_loss(s, y, k=torch.tensor([1, 12, 3, 5, 2, 9, 4])[: len(y)], **kw),
    "softmax": lambda s, y, **kw: softmax_loss(s, y, **kw),
    "sparsemax": lambda s, y, **kw: sparsemax_loss(s, y, support_guess=2, **kw),
}


def uneven_bounds(n: int, world_size: int) -> list[tuple[int, int]]:
    """Deliberately uneven contiguous shards (the last rank gets the most)."""
    cuts = [0] + [n * (r + 1) // (world_size + 2) for r in range(world_size - 1)] + [n]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def scores_with_ties(batch: int, n: int, k: int, dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    scores = (torch.randn(batch, n, generator=generator, dtype=torch.float64) * 1.5).to(dtype)
    target = torch.randint(0, n, (batch,), generator=generator)
    order = torch.argsort(scores, dim=1, descending=True)
    # Row 0: positive at the top and a tie at the k-th value between the first and the last columns.
    scores[0, 0] = scores[0].max() + 1
    target[0] = 0
    scores[0, n - 1] = scores[0, order[0, k]]
    scores[0, 1] = scores[0, order[0, k]]
    # Row 1: positive inside the top k; row 2: positive held by the last column (last rank).
    target[1] = order[1, k // 2]
    target[2] = n - 1
    return scores, target


def _loss_body(rank, world_size, group, scores, target, bounds):
    """Every loss on this rank's columns: {name: (loss, grad of the local scores)}."""
    start, stop = bounds[rank]
    results = {}
    for name, loss_fn in LOSSES.items():
        local = scores[:, start:stop].clone().requires_grad_(True)
        loss = loss_fn(local, target, group=group, offset=start)
        loss.backward()
        results[name] = (loss.detach(), local.grad)
    return results


def assert_matches_single_process(scores, target, bounds, tolerance):
    results = run_distributed(_loss_body, len(bounds), args=(scores, target, bounds))
    for name, loss_fn in LOSSES.items():
        full = scores.clone().requires_grad_(True)
        expected = loss_fn(full, target)
        expected.backward()
        for per_rank in results:
            torch.testing.assert_close(per_rank[name][0], expected.detach(), atol=tolerance, rtol=tolerance, msg=name)
        grad = torch.cat([per_rank[name][1] for per_rank in results], dim=1)
        torch.testing.assert_close(grad, full.grad, atol=tolerance, rtol=tolerance, msg=name)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_distributed_losses_equal_single_process(world_size, dtype):
    scores, target = scores_with_ties(batch=6, n=41, k=5, dtype=dtype)
    tolerance = 1e-9 if dtype == torch.float64 else 1e-5
    assert_matches_single_process(scores, target, uneven_bounds(41, world_size), tolerance)


def _shard_body(rank, world_size, group, users, items, target, user_splits, chunk_size):
    start, stop = shard_range(items.shape[0], rank, world_size)
    results = {}
    for name, loss_fn in LOSSES.items():
        shard = CatalogShard(items.shape[0], items.shape[1], group, dtype=items.dtype)
        with torch.no_grad():
            shard.weight.copy_(items[start:stop])
        local_users = users[user_splits[rank] : user_splits[rank + 1]].clone().requires_grad_(True)
        gathered = all_gather_rows(local_users, group)
        loss = loss_fn(score_matrix(gathered, shard.weight, chunk_size), target, group=group, offset=shard.start)
        loss.backward()
        results[name] = (loss.detach(), local_users.grad, shard.weight.grad)
    return results


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_catalog_shard_gradients_reach_users_and_items(chunk_size):
    generator = torch.Generator().manual_seed(3)
    users = torch.randn(7, 4, generator=generator, dtype=torch.float64)
    items = torch.randn(23, 4, generator=generator, dtype=torch.float64)
    target = torch.randint(0, 23, (7,), generator=generator)
    user_splits = [0, 2, 4, 7]  # each rank contributes a different number of rows to the global batch
    results = run_distributed(_shard_body, 3, args=(users, items, target, user_splits, chunk_size))
    for name, loss_fn in LOSSES.items():
        full_users, full_items = users.clone().requires_grad_(True), items.clone().requires_grad_(True)
        expected = loss_fn(full_users @ full_items.T, target)
        expected.backward()
        torch.testing.assert_close(results[0][name][0], expected.detach(), atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(torch.cat([r[name][1] for r in results]), full_users.grad, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(torch.cat([r[name][2] for r in results]), full_items.grad, atol=1e-9, rtol=1e-9)


def _full_catalog_scores(batch: int, n: int, k: int):
    """[B, n] float64 scores (the same on every rank) built so that every loss takes its costly paths: rows
    1, 4, 7, … have their positive at the top (Rankmax's second pass: mu = z_[k] - eta), and rows 0, 3, 6, … have a
    flat top of 10 equal scores spread over both shards (a sparsemax support of 10, so ``support_guess=2``
    must grow 2 -> 4 -> 8 -> 16: three retries); the other rows have one score far above the rest."""
    generator = torch.Generator().manual_seed(n)
    scores = torch.randn(batch, n, generator=generator, dtype=torch.float64)
    flat_columns = torch.arange(10) * (n // 10) + 3
    scores[0::3, flat_columns] = 10.0
    scores[1::3, 7] = 10.0
    scores[2::3, n - 5] = 10.0
    target = torch.randint(0, n, (batch,), generator=generator)
    target[1::3] = 7  # the top of the row
    return scores, target


def _full_catalog_bytes_body(rank, world_size, group, batch, sizes, k):
    """{(loss, n): (bytes this rank sent, calls by op)} for one forward + backward of each full-catalog loss."""
    losses = {
        "rankmax": lambda s, y, **kw: rankmax_loss(s, y, k=k, **kw),
        "softmax": softmax_loss,
        "sparsemax": lambda s, y, **kw: sparsemax_loss(s, y, support_guess=2, **kw),
    }
    out = {}
    for n in sizes:
        scores, target = _full_catalog_scores(batch, n, k)
        start, stop = shard_range(n, rank, world_size)
        for name, loss_fn in losses.items():
            local = scores[:, start:stop].clone().requires_grad_(True)
            with count_bytes() as counter:
                loss_fn(local, target, group=group, offset=start).backward()
            out[name, n] = (counter.total, dict(counter.calls))
    return out


def test_full_catalog_losses_send_the_per_row_statistics_only_whatever_the_catalog_size(monkeypatch):
    """Every byte each rank sends, counted exactly (a collective outside the counted path would raise): the
    per-row statistics of the docstrings, the same for a catalog of 2,000 and of 100,000 items."""
    monkeypatch.setenv("BIGRANK_COMPILE", "0")  # the kernels do not change what crosses the wire (saves ~4 s)
    batch, k, world_size, sizes = 12, 5, 2, (2_000, 100_000)
    results = run_distributed(_full_catalog_bytes_body, world_size, args=(batch, sizes, k))
    check = 6 * 8  # the layout check: 6 int64 per rank (equal shapes everywhere: no size exchange)
    positive = 8 * batch  # z_y, one float64 per row
    for n in sizes:
        scores, target = _full_catalog_scores(batch, n, k)
        positive_scores = scores.gather(1, target.unsqueeze(1)).squeeze(1)
        in_top_k = int((positive_scores > scores.topk(k, dim=1).values[:, -1]).sum())  # rows of pass 2
        assert in_top_k >= batch // 3
        expected = {
            # pass 1: each shard's top k and two sums per row; pass 2: three sums per row whose y is in the top k
            "rankmax": check + positive + 8 * batch * (k + 2) + 8 * 3 * in_top_k,
            "softmax": check + positive + 8 * batch * 2,  # max and sum of exp per row
            # top-m rounds: all rows with m = 2, then the 4 flat-top rows with m = 4, 8, 16
            "sparsemax": check + positive + sum(8 * rows * m for rows, m in [(batch, 2), (4, 4), (4, 8), (4, 16)]),
        }
        for name, want in expected.items():
            for rank_bytes, calls in (r[name, n] for r in results):
                assert rank_bytes == want, (name, n, rank_bytes, want, calls)
    assert results[0]["rankmax", sizes[0]][1]["all_reduce"] == 2  # z_y, and the sums of pass 2
    assert results[0]["sparsemax", sizes[0]][1]["all_gather"] == 1 + 4  # the layout check + 4 top-m rounds


def _candidate_bytes_body(rank, world_size, group, names, batch, dim, sizes, candidates):
    """{(loss, n): bytes} of one training step's loss (forward + backward, the all-gather of the user vectors
    included) through the trainer's ``StepLoss``, for catalogs of each size in ``sizes``."""
    from bigrank.config import LossConfig
    from bigrank.losses.registry import parse_params
    from bigrank.train.losses import StepLoss

    out = {}
    for n in sizes:
        start, stop = shard_range(n, rank, world_size)
        generator = torch.Generator().manual_seed(n)
        users = torch.randn(batch, dim, generator=generator, dtype=torch.float64)
        items = torch.randn(n, dim, generator=generator, dtype=torch.float64)
        # The same number of positives in each shard for every n: row b's item lies in shard b % 2.
        target = torch.tensor([shard_range(n, b % 2, 2)[0] + 3 * b for b in range(batch)])
        for name in names:
            config = LossConfig(name=name, candidates=candidates, num_negatives=64)
            config.params = parse_params(name, {}, "loss.params")
            step_loss = StepLoss(config, num_items=n, shard_start=start, shard_stop=stop, seed=1, rank=rank)
            local_users = users[rank::world_size].clone().requires_grad_(True)
            weight = items[start:stop].clone().requires_grad_(True)
            with count_bytes() as counter:
                gathered = all_gather_rows(local_users, group)
                step_loss(gathered, target, weight, group=group, step=0).backward()
            touched = step_loss.last_rows  # sampled candidates: the gradient of the rows the step read
            item_grad = weight.grad if touched is None else touched.rows.grad
            assert local_users.grad is not None and item_grad is not None, name
            out[name, n] = counter.total
    return out


def test_candidate_losses_bytes_per_step_do_not_grow_with_the_catalog():
    """Sampled candidates: a step's payload depends on the batch and the number of negatives, not on n (the
    counted path misses nothing: a direct collective inside ``count_bytes`` raises)."""
    from bigrank.config import CANDIDATE_LOSSES

    batch, dim, sizes = 8, 4, (20_000, 200_000)  # large enough that no negative drawn is a positive
    results = run_distributed(
        _candidate_bytes_body, 2, args=(CANDIDATE_LOSSES, batch, dim, sizes, "sampled"), timeout=240
    )
    for name in CANDIDATE_LOSSES:
        for per_rank in results:
            small, large = per_rank[name, sizes[0]], per_rank[name, sizes[1]]
            assert small == large, (name, small, large)
            # O(B (d + C)): the user vectors and their gradient, per-row counts and sums, the gathered
            # positives, and at most a B x C block of candidate scores (C = 64 negatives + B positives).
            assert 0 < large <= 8 * batch * (2 * dim + 8 + 2 * (64 + batch)) + 1024, (name, large)


def test_candidate_losses_over_the_catalog_send_per_row_statistics(monkeypatch):
    """Candidate losses over the whole shard: Smooth-AP, SoftRank-NDCG (its candidate list) and the sampled
    softmax send per-row statistics whose size does not depend on n; Recall@quantile and pAUC@budget send each
    shard's top ceil(q n) scores per row (their threshold is that exact quantile), so their payload follows
    q n and not n: at most 8 B ceil(q n) bytes more than a fixed part."""
    monkeypatch.setenv("BIGRANK_COMPILE", "0")  # the kernels do not change what crosses the wire (saves ~4 s)
    from bigrank.config import CANDIDATE_LOSSES
    from bigrank.losses.registry import parse_params

    defaults = {name: parse_params(name, {}) for name in CANDIDATE_LOSSES}
    batch, dim, sizes = 8, 4, (20_000, 200_000)
    results = run_distributed(
        _candidate_bytes_body, 2, args=(CANDIDATE_LOSSES, batch, dim, sizes, "catalog"), timeout=240
    )
    fixed = 8 * batch * (2 * dim + 8 + 3 * 64) + 1024
    for name in CANDIDATE_LOSSES:
        for per_rank in results:
            small, large = per_rank[name, sizes[0]], per_rank[name, sizes[1]]
            if name in ("recall_at_quantile", "pauc_at_budget"):
                fraction = defaults[name].get("quantile", defaults[name].get("beta"))
                # pAUC's IQR: this rank's share of a strided sample of at most scale_sample_size columns per row
                share = defaults[name].get("scale_sample_size", 0) // 2 + 1
                sample = 0 if name == "recall_at_quantile" else 8 * batch * share
                for n, sent in ((sizes[0], small), (sizes[1], large)):
                    assert sent <= fixed + sample + 8 * batch * math.ceil(fraction * n), (name, n, sent)
                assert large > small, name  # the top q n does travel
            else:
                assert small == large <= fixed, (name, small, large)


def _uncounted_body(rank, world_size, group):
    import torch.distributed as dist

    from bigrank.distributed.collectives import UncountedCollectiveError

    x = torch.ones(3)
    with count_bytes() as counter:
        try:
            dist.all_reduce(x, group=group)
        except UncountedCollectiveError as error:
            message = str(error)
        else:
            message = None
        gathered = all_gather_rows(torch.ones(2, 4, requires_grad=True), group)
        gathered.sum().backward()
    dist.all_reduce(x, group=group)  # outside count_bytes the guard is gone
    return message, counter.by_op, x.tolist()


def test_a_direct_collective_inside_count_bytes_is_an_error():
    for message, by_op, summed in run_distributed(_uncounted_body, 2):
        assert message is not None and "torch.distributed.all_reduce called directly inside count_bytes" in message
        # all_gather_rows: the size exchange (8 B) and 2 x 4 floats; its backward all-reduces the 4 x 4 gradient.
        assert by_op == {"all_gather": 8 + 2 * 4 * 4, "all_reduce": 4 * 4 * 4}
        assert summed == [2.0, 2.0, 2.0]


def _bad_input_body(rank, world_size, group, case):
    n = 20
    start, stop = shard_range(n, rank, world_size)
    local = torch.randn(4, stop - start, dtype=torch.float64)
    target = torch.tensor([0, 5, 10, 19])
    offset = start
    if case == "target_out_of_range":
        target = torch.tensor([0, 5, 10, 20])
    elif case == "bad_offsets":
        offset = 0  # every rank claims to start at column 0
    elif case == "different_targets":
        target = target + rank
    elif case == "nan_on_one_rank" and rank == world_size - 1:
        local[2, 0] = float("nan")
    try:
        rankmax_loss(local, target, k=2, group=group, offset=offset)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("target_out_of_range", "outside \\[0, 20\\)"),
        ("bad_offsets", "contiguous and in rank order"),
        ("different_targets", "same target"),
        ("nan_on_one_rank", "NaN or infinite"),
    ],
)
def test_bad_input_raises_on_every_rank_without_hanging(case, message):
    import re

    errors = run_distributed(_bad_input_body, 2, args=(case,), timeout=60)
    assert all(error is not None and re.search(message, error) for error in errors), errors


def test_a_rank_with_an_empty_shard_gives_the_right_answer():
    scores, target = scores_with_ties(batch=5, n=17, k=5, dtype=torch.float64, seed=4)
    assert_matches_single_process(scores, target, [(0, 9), (9, 9), (9, 17)], 1e-9)


def _topk_body(rank, world_size, group, scores, exclude, bounds, k):
    start, stop = bounds[rank]
    with torch.no_grad():
        return distributed_topk(scores[:, start:stop], k, group=group, offset=start, exclude=exclude[:, start:stop])


def test_distributed_topk_equals_full_topk_with_exclusions():
    generator = torch.Generator().manual_seed(9)
    scores = torch.randn(6, 50, generator=generator)
    scores[0, 10] = scores[0, 40]  # a tie across ranks: the lower id comes first
    exclude = torch.rand(6, 50, generator=generator) < 0.3
    bounds = uneven_bounds(50, 3)
    results = run_distributed(_topk_body, 3, args=(scores, exclude, bounds, 8))
    masked = scores.masked_fill(exclude, float("-inf"))
    for values, ids in results:
        torch.testing.assert_close(values, masked.topk(8, dim=1).values)
        assert (masked.gather(1, ids) == values).all()
        assert not exclude.gather(1, ids).any()
    values, ids = distributed_topk(scores, 3, exclude=exclude)
    torch.testing.assert_close(values, masked.topk(3, dim=1).values)


def test_shard_range_covers_the_catalog_and_init_does_not_depend_on_the_split():
    for world_size in (1, 2, 3, 7):
        ranges = [shard_range(100, r, world_size) for r in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == 100
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    whole = CatalogShard(100_000, 3, seed=5).weight
    part = CatalogShard(100_000, 3, seed=5, bounds=(60_000, 70_001)).weight
    torch.testing.assert_close(part, whole[60_000:70_001])


# ------------------------------------------------------------------ one gather of vectors and ids; cached layout
def _rows_with_ids_body(rank, world_size, group, rows_by_rank, pad_to):
    from bigrank.distributed.collectives import all_gather_rows_with_ids

    generator = torch.Generator().manual_seed(rank)
    rows = rows_by_rank[rank]
    x = torch.randn(rows, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    ids = torch.arange(rows, dtype=torch.int64) + 1_000_003 * (rank + 1) + (1 << 40)  # beyond float precision
    with count_bytes() as counter:
        gathered, gathered_ids = all_gather_rows_with_ids(x, ids, pad_to, group)
        weights = torch.arange(gathered.numel(), dtype=torch.float64).view_as(gathered)
        (gathered * weights).sum().backward()  # a different weight for every gathered entry
    return x.detach(), ids, gathered.detach(), gathered_ids, x.grad, dict(counter.calls)


def test_all_gather_rows_with_ids_equals_separate_gathers_with_padding():
    rows_by_rank, pad_to, world = [4, 2, 0], 4, 3
    results = run_distributed(_rows_with_ids_body, world, args=(rows_by_rank, pad_to))
    expected_x, expected_ids = [], []
    for x, ids, *_ in results:
        expected_x.append(torch.cat([x, torch.zeros(pad_to - len(x), 3, dtype=torch.float64)]))
        expected_ids.append(torch.cat([ids, torch.full((pad_to - len(ids),), -1)]))
    weights = torch.arange(world * pad_to * 3, dtype=torch.float64).view(world * pad_to, 3)
    for rank, (x, _ids, gathered, gathered_ids, grad, calls) in enumerate(results):
        assert torch.equal(gathered, torch.cat(expected_x))
        assert torch.equal(gathered_ids, torch.cat(expected_ids))  # byte-exact, even above 2^40
        # every rank back-propagates the same weights: the reduce-scatter sums them over the 3 ranks
        own = weights[rank * pad_to : rank * pad_to + len(x)]
        assert torch.equal(grad, world * own)
        assert calls == {"all_gather": 1, "all_reduce": 1}


def _replicated_layout_body(rank, world_size, group, case):
    from bigrank.losses.scores import replicated_inputs

    n, batch = 20, 4
    start, stop = shard_range(n, rank, world_size)
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(batch, n, generator=generator, dtype=torch.float64)
    target = torch.tensor([0, 5, 10, 19])
    calls = []
    try:
        with replicated_inputs():
            for step in range(3):
                local = scores[:, start:stop].clone()
                if case == "nan_at_second_step" and step == 1 and rank == world_size - 1:
                    local[2, 0] = float("nan")
                if case == "target_out_of_range" and step == 1:
                    target = torch.tensor([0, 5, 10, 20])
                local.requires_grad_(True)
                with count_bytes() as counter:
                    loss = rankmax_loss(local, target, k=2, group=group, offset=start)
                calls.append(dict(counter.by_op))
    except ValueError as error:
        return str(error), calls
    return float(loss), calls


def test_replicated_inputs_check_the_layout_once_and_still_catch_bad_scores_on_every_rank():
    import re

    results = run_distributed(_replicated_layout_body, 2, args=("ok",), timeout=60)
    for value, calls in results:
        assert value == pytest.approx(results[0][0])
        # the first call checks the layout (an all-gather of 6 int64); later calls make no all-gather of it
        first, later = calls[0]["all_gather"], calls[1]["all_gather"]
        assert first - later == 6 * 8 and calls[2] == calls[1]
    for case, message in [("nan_at_second_step", "NaN or infinite"), ("target_out_of_range", "outside \\[0, 20\\)")]:
        for error, calls in run_distributed(_replicated_layout_body, 2, args=(case,), timeout=60):
            assert isinstance(error, str) and re.search(message, error), error
            assert len(calls) == 1  # the second step raised on every rank (no rank was left in a collective)


@pytest.mark.parametrize("case", ["random", "ties", "excluded", "nan", "tail"])
def test_row_topk_by_threshold_equals_torch_topk(case):
    from bigrank.model.catalog import _row_topk

    generator = torch.Generator().manual_seed(5)
    rows, width, k = 6, 40_000 + (37 if case == "tail" else 0), 300
    scores = torch.randn(rows, width, generator=generator)
    if case == "ties":
        scores = (scores * 4).round()  # thousands of exact ties around the k-th value
    if case == "excluded":
        scores[:, ::3] = float("-inf")
        scores[0, 500:] = float("-inf")  # a row with fewer than k finite entries
    if case == "nan":
        scores[2, 17] = float("nan")
    values, columns = _row_topk(scores, k)
    expected = scores.topk(k, dim=1).values
    assert torch.equal(values, expected) if case != "nan" else torch.equal(values.isnan(), expected.isnan())
    finite = torch.isfinite(values)
    assert torch.equal(scores.gather(1, columns)[finite], values[finite])  # the columns hold those values
    for row in range(rows):  # no column twice
        assert columns[row][finite[row]].unique().numel() == int(finite[row].sum())
