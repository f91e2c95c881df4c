"""UserTower: brute-force references for the unsharded tower, and the 2-process row-wise sharded tower against
the single-process one (vectors, one fused optimizer step, shard coverage, DCP save/load)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bigrank.model.sharding import fused_params, shard_row_wise
from bigrank.model.tables import local_user_rows
from bigrank.model.towers import (
    HISTORY_TABLE,
    INIT_BLOCK_ROWS,
    USER_TABLE,
    UserTower,
    deterministic_rows,
    user_features,
)
from tests.distributed_utils import run_distributed

NUM_USERS, NUM_ITEMS, DIM, SEED = 11, 7, 4, 5  # 11 users over 2 ranks: uneven shards [0, 6) and [6, 11)
LR, EPS = 0.05, 1e-8


# ---------------------------------------------------------------------------------------------------------
# Single process


def test_deterministic_rows_do_not_depend_on_the_slice_asked_for():
    n = 2 * INIT_BLOCK_ROWS + 5
    full = deterministic_rows(SEED, USER_TABLE, n, 3, 0, n, 0.5)
    for start, stop in [(0, 1), (INIT_BLOCK_ROWS - 2, INIT_BLOCK_ROWS + 3), (n - 7, n), (17, 2 * INIT_BLOCK_ROWS)]:
        torch.testing.assert_close(deterministic_rows(SEED, USER_TABLE, n, 3, start, stop, 0.5), full[start:stop])
    assert deterministic_rows(SEED, USER_TABLE, n, 3, 4, 4, 0.5).shape == (0, 3)
    assert not torch.equal(deterministic_rows(SEED + 1, USER_TABLE, n, 3, 0, n, 0.5), full)
    assert not torch.equal(deterministic_rows(SEED, HISTORY_TABLE, n, 3, 0, n, 0.5), full)
    assert abs(full.std().item() - 0.5) < 0.01


def _reference_vectors(user_w, hist_w, user_ids, history):
    """Brute force: f(u) = E_user[u] (0 for u < 0) + mean of E_hist over the history (0 when empty)."""
    rows = []
    for user, items in zip(user_ids.tolist(), history, strict=True):
        vector = user_w[user] if user >= 0 else torch.zeros(user_w.shape[1])
        if hist_w is not None and len(items):
            vector = vector + hist_w[torch.tensor(items)].mean(dim=0)
        rows.append(vector)
    return torch.stack(rows)


def test_user_tower_equals_brute_force_with_history_and_fold_in():
    tower = UserTower(NUM_USERS, DIM, num_items=NUM_ITEMS, history=True, seed=SEED)
    user_w = tower.tables.embedding_bags[USER_TABLE].weight.detach()
    hist_w = tower.tables.embedding_bags[HISTORY_TABLE].weight.detach()
    torch.testing.assert_close(user_w, deterministic_rows(SEED, USER_TABLE, NUM_USERS, DIM, 0, NUM_USERS, DIM**-0.5))
    user_ids = torch.tensor([3, 10, -1, 3, 0])
    history = [[1, 2], [], [4, 5, 6], [6, 6], [0]]  # an unseen user (-1), an empty bag, a repeated item
    vectors = tower(tower.features(user_ids, history))
    assert vectors.shape == (5, DIM)
    torch.testing.assert_close(vectors, _reference_vectors(user_w, hist_w, user_ids, history))
    values, lengths = torch.tensor([1, 2, 4, 5, 6, 6, 6, 0]), torch.tensor([2, 0, 3, 2, 1])
    torch.testing.assert_close(tower(tower.features(user_ids, (values, lengths))), vectors)
    padded = tower(tower.features(user_ids, history, pad_to=8))
    torch.testing.assert_close(padded[:5], vectors)
    assert torch.equal(padded[5:], torch.zeros(3, DIM))


def test_user_tower_without_history_looks_up_user_rows():
    tower = UserTower(NUM_USERS, DIM, seed=SEED, init_std=0.3)
    user_ids = torch.tensor([0, 10, 10, 4])
    torch.testing.assert_close(
        tower(tower.features(user_ids)), tower.tables.embedding_bags[USER_TABLE].weight[user_ids]
    )
    start, stop, rows = local_user_rows(tower)
    assert (start, stop, rows.shape) == (0, NUM_USERS, (NUM_USERS, DIM))


def test_bad_input_is_rejected_with_a_clear_error():
    tower = UserTower(NUM_USERS, DIM, num_items=NUM_ITEMS, history=True)
    with pytest.raises(ValueError, match="user id 11 out of range"):
        tower.features(torch.tensor([11]), [[]])
    with pytest.raises(ValueError, match="history item ids"):
        tower.features(torch.tensor([1]), [[7]])
    with pytest.raises(ValueError, match="pass history"):
        tower.features(torch.tensor([1]))
    with pytest.raises(ValueError, match="2 bags for 1 users"):
        user_features(torch.tensor([1]), [[1], [2]])
    with pytest.raises(ValueError, match="pad_to=1 is smaller than the batch of 2"):
        user_features(torch.tensor([1, 2]), pad_to=1)
    with pytest.raises(ValueError, match="must be 1-D"):
        user_features(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="integer"):
        user_features(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="num_items"):
        UserTower(NUM_USERS, DIM, history=True)
    with pytest.raises(ValueError, match="history=False"):
        UserTower(NUM_USERS, DIM).features(torch.tensor([1]), [[1]])
    with pytest.raises(ValueError, match="not supported by fbgemm on CPU"):
        fused_params("adam", 0.1)
    with pytest.raises(ValueError, match="unknown fused optimizer 'lbfgs'"):
        fused_params("lbfgs", 0.1)
    with pytest.raises(ValueError, match="dim 6: fbgemm's sharded tables need a multiple of 4"):
        shard_row_wise(UserTower(NUM_USERS, 6))
    with pytest.raises(ValueError, match="learning rate"):
        fused_params("sgd", 0.0)
    with pytest.raises(ValueError, match="weight_decay is not supported by the fused 'adagrad' on cpu"):
        fused_params("adagrad", 0.1, weight_decay=0.01)
    with pytest.raises(ValueError, match="weight_decay is not supported by the fused 'rowwise_adagrad' on cpu"):
        fused_params("rowwise_adagrad", 0.1, weight_decay=0.01)
    assert fused_params("rowwise_adagrad", 0.1, weight_decay=0.01, device_type="cuda")["weight_decay"] == 0.01


# ---------------------------------------------------------------------------------------------------------
# Two gloo processes against the single-process reference


def _local_batch(rank):
    """Each rank's batch: duplicate users, an unseen user, shared users across ranks, empty history."""
    user_ids = [torch.tensor([0, 7, 7, -1, 10]), torch.tensor([10, 3, 5, 6, 0])][rank]
    history = [[[1], [2, 3], [2], [4, 5, 6], []], [[0, 6], [], [6], [1, 1, 2], [3]]][rank]
    weights = torch.randn(len(user_ids), DIM, generator=torch.Generator().manual_seed(100 + rank))
    return user_ids, history, weights


# (optimizer, weight_decay, also test the DCP round trip). Adagrad's first step is lr·sign(g);
# rowwise_adagrad's (one accumulator per row) also checks magnitudes. Weight decay is CUDA-only (fbgemm).
CASES = [("sgd", 0.0, False), ("adagrad", 0.0, True), ("rowwise_adagrad", 0.0, True)]


def _sharded_steps(rank, world_size, group, checkpoint_root):
    from bigrank.train.bootstrap import silence_torchrec_step_warnings

    silence_torchrec_step_warnings()
    results = {
        optimizer: _sharded_step(optimizer, weight_decay, f"{checkpoint_root}/{optimizer}" if dcp else None)
        for optimizer, weight_decay, dcp in CASES
    }
    results["padded"] = _padded_uneven_batches(rank)
    return results


def _padded_uneven_batches(rank):
    """Ranks with batches of 5 and 2 users, both padded to 5: forward and backward work, padding is inert."""
    from bigrank.model.sharding import shard_row_wise
    from bigrank.model.tables import full_user_table

    tower = UserTower(NUM_USERS, DIM, num_items=NUM_ITEMS, history=True, seed=SEED, device="meta")
    dmp, _ = shard_row_wise(tower, optimizer="sgd", lr=LR)
    user_ids, history, weights = _local_batch(rank)
    if rank == 1:
        user_ids, history, weights = user_ids[:2], history[:2], weights[:2]
    vectors = dmp(tower.features(user_ids, history, pad_to=5))
    (vectors[: len(user_ids)] * weights).sum().backward()
    return {"vectors": vectors.detach().numpy(), "after": full_user_table(dmp).numpy()}


def _sharded_step(optimizer, weight_decay, checkpoint_dir):
    from bigrank.model.sharding import load_tower_state, save_tower_state, set_fused_learning_rate, shard_row_wise
    from bigrank.model.tables import full_table

    rank = torch.distributed.get_rank()
    tower = UserTower(NUM_USERS, DIM, num_items=NUM_ITEMS, history=True, seed=SEED, device="meta")
    dmp, _ = shard_row_wise(tower, optimizer=optimizer, lr=LR, weight_decay=weight_decay, eps=EPS)
    user_ids, history, weights = _local_batch(rank)
    features = tower.features(user_ids, history)
    shard = local_user_rows(dmp)
    initial_shard = shard[2].detach().clone().numpy()
    vectors = dmp(features)
    (vectors * weights).sum().backward()  # loss = Σ_ranks Σ_b <f(u_b), w_b>; fused step inside backward
    after = {table: full_table(dmp, table).numpy() for table in (USER_TABLE, HISTORY_TABLE)}
    result = {
        "vectors": vectors.detach().numpy(),
        "shard": (shard[0], shard[1], initial_shard),
        "after": after,
    }
    if checkpoint_dir is None:
        # A zero learning rate (as a schedule would set it) freezes the tables.
        set_fused_learning_rate(dmp, 0.0)
        frozen = dmp(features)
        (frozen * weights).sum().backward()
        result["frozen_equal"] = bool(torch.equal(dmp(features), frozen))
        return result

    # DCP round trip: a fresh module (other seed) loads the weights and the optimizer state.
    save_tower_state(dmp, checkpoint_dir)
    saved_vectors = dmp(features).detach().clone()
    fresh = UserTower(NUM_USERS, DIM, num_items=NUM_ITEMS, history=True, seed=SEED + 1, device="meta")
    fresh_dmp, _ = shard_row_wise(fresh, optimizer=optimizer, lr=LR, weight_decay=weight_decay, eps=EPS)
    before_load = fresh_dmp(features).detach().clone()
    load_tower_state(fresh_dmp, checkpoint_dir)
    loaded_vectors = fresh_dmp(features).detach().clone()
    # One more identical step on both: equal only if the optimizer state was restored too.
    for module in (dmp, fresh_dmp):
        (module(features) * weights).sum().backward()
    result["checkpoint"] = {
        "saved": saved_vectors.numpy(),
        "before_load": before_load.numpy(),
        "loaded": loaded_vectors.numpy(),
        "next_original": dmp(features).detach().numpy(),
        "next_loaded": fresh_dmp(features).detach().numpy(),
    }
    return result


def _reference_step(optimizer, weight_decay):
    """Plain PyTorch twin: nn.Embedding tables, both ranks' losses summed, one sparse optimizer step."""
    tables = {}
    for table, rows in ((USER_TABLE, NUM_USERS), (HISTORY_TABLE, NUM_ITEMS)):
        embedding = torch.nn.Embedding(rows, DIM)
        with torch.no_grad():
            embedding.weight.copy_(deterministic_rows(SEED, table, rows, DIM, 0, rows, DIM**-0.5))
        tables[table] = embedding
    user_w, hist_w = tables[USER_TABLE].weight, tables[HISTORY_TABLE].weight
    vectors, loss = [], 0.0
    for rank in range(2):
        user_ids, history, weights = _local_batch(rank)
        rank_vectors = _reference_vectors(user_w, hist_w, user_ids, history)
        vectors.append(rank_vectors.detach().numpy())
        loss = loss + (rank_vectors * weights).sum()
    loss.backward()
    after = {}
    for table, embedding in tables.items():
        w, g = embedding.weight.detach(), embedding.weight.grad
        touched = torch.zeros(len(w), dtype=torch.bool)
        touched[_touched_rows(table)] = True
        # fbgemm's fused optimizers update (and decay) only the rows looked up in the batch.
        g = torch.where(touched[:, None], g + weight_decay * w, torch.zeros_like(g))
        if optimizer == "sgd":
            new = w - LR * g
        elif optimizer == "adagrad":  # from a zero accumulator: s = g², w -= lr * g / (sqrt(s) + eps)
            new = w - LR * g / (g.pow(2).sqrt() + EPS)
        else:  # rowwise_adagrad: one accumulator per row, s = mean_j g_j²
            new = w - LR * g / (g.pow(2).mean(dim=1, keepdim=True).sqrt() + EPS)
        after[table] = new.numpy()
    return vectors, after


def _touched_rows(table):
    rows = set()
    for rank in range(2):
        user_ids, history, _ = _local_batch(rank)
        if table == USER_TABLE:
            rows |= {u for u in user_ids.tolist() if u >= 0}
        else:
            rows |= {i for items in history for i in items}
    return sorted(rows)


def test_sharded_tower_equals_single_process_tower_and_plain_embedding_step(tmp_path):
    all_results = run_distributed(_sharded_steps, world_size=2, args=(str(tmp_path),))
    for optimizer, weight_decay, dcp in CASES:
        results = [rank_results[optimizer] for rank_results in all_results]
        _check_case(optimizer, weight_decay, results, str(tmp_path / optimizer) if dcp else None)

    # Uneven local batches padded to a common size: real rows as unpadded, padded rows 0, SGD step exact.
    user_w = torch.nn.Parameter(deterministic_rows(SEED, USER_TABLE, NUM_USERS, DIM, 0, NUM_USERS, DIM**-0.5))
    hist_w = deterministic_rows(SEED, HISTORY_TABLE, NUM_ITEMS, DIM, 0, NUM_ITEMS, DIM**-0.5)
    loss = 0.0
    for rank, sizes in enumerate((5, 2)):
        user_ids, history, weights = _local_batch(rank)
        reference = _reference_vectors(user_w, hist_w, user_ids[:sizes], history[:sizes])
        padded = all_results[rank]["padded"]["vectors"]
        np.testing.assert_allclose(padded[:sizes], reference.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(padded[sizes:], 0.0)
        loss = loss + (reference * weights[:sizes]).sum()
    loss.backward()
    expected = (user_w - LR * user_w.grad).detach().numpy()
    for rank_results in all_results:
        np.testing.assert_allclose(rank_results["padded"]["after"], expected, rtol=1e-5, atol=1e-6)


def _check_case(optimizer, weight_decay, results, checkpoint_dir):
    ref_vectors, ref_after = _reference_step(optimizer, weight_decay)

    # Vectors of each rank's local batch equal the single-process tower's (same init, any world size).
    for rank, result in enumerate(results):
        np.testing.assert_allclose(result["vectors"], ref_vectors[rank], rtol=1e-5, atol=1e-6, err_msg=optimizer)

    # Shards: contiguous, disjoint, cover [0, num_users), about half each, initialised like the full table.
    shards = sorted(result["shard"][:2] for result in results)
    assert shards == [(0, 6), (6, NUM_USERS)]
    full_init = deterministic_rows(SEED, USER_TABLE, NUM_USERS, DIM, 0, NUM_USERS, DIM**-0.5).numpy()
    for result in results:
        start, stop, rows = result["shard"]
        np.testing.assert_array_equal(rows, full_init[start:stop])

    # One fused step equals the plain nn.Embedding step (so the gradients, summed over ranks, agree).
    for result in results:
        for table in (USER_TABLE, HISTORY_TABLE):
            np.testing.assert_allclose(
                result["after"][table], ref_after[table], rtol=1e-5, atol=1e-6, err_msg=f"{optimizer} {table}"
            )
    if checkpoint_dir is None:
        assert all(result["frozen_equal"] for result in results)
        return

    for result in results:
        ckpt = result["checkpoint"]
        assert not np.allclose(ckpt["before_load"], ckpt["saved"])
        np.testing.assert_array_equal(ckpt["loaded"], ckpt["saved"], err_msg=optimizer)
        # Without the restored accumulators the second Adagrad step would differ.
        np.testing.assert_array_equal(ckpt["next_loaded"], ckpt["next_original"], err_msg=optimizer)
    # The sharded checkpoint also loads into a single-process, unsharded tower (DCP reshards).
    from bigrank.model.sharding import load_tower_state

    plain = UserTower(NUM_USERS, DIM, num_items=NUM_ITEMS, history=True, seed=SEED + 2)
    load_tower_state(plain, checkpoint_dir)
    for rank, result in enumerate(results):
        user_ids, history, _ = _local_batch(rank)
        vectors = plain(plain.features(user_ids, history)).detach().numpy()
        # Equal up to float rounding: the sharded mean pooling sums partial bags before dividing.
        np.testing.assert_allclose(vectors, result["checkpoint"]["saved"], rtol=1e-5, atol=1e-5, err_msg=optimizer)
