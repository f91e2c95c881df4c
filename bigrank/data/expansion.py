"""Randomized fractal (Kronecker) expansion of a rating matrix (Belletti et al., 2019, arXiv:1901.08910).

Given a seed rating matrix R (m users x n items, binary) and multipliers (a, b), the expansion builds the
(a*m) x (b*n) matrix whose block (i, j) is

    F(R_hat[i, j], R) = R with its rows and columns permuted at random (independently for every block),
                        each rating kept with probability R_hat[i, j]                     (paper, sec. III.4)

where R_hat (a x b) is a reduced matrix with the same leading spectrum as R (paper, Algorithm 2):

1. top k = min(a, b) singular triplets of R: R ~ U diag(s) V^T  (randomized SVD, Halko et al. 2011);
2. resize U (m x k) to a x k and V^T (k x n) to k x b by linear interpolation of each singular vector;
3. replace each resized factor by its closest column-orthogonal matrix (polar factor);
4. R_hat = U' diag(s) V'^T, folded into [0, 1] as |R_hat| / max |R_hat|, clipped to [0.05, 0.99].

Expanded ids: user ``i*m + row_perm_ij[u]`` and item ``j*n + col_perm_ij[v]``; pairs are unique because
each block's permutations are bijections of a duplicate-free seed and blocks cover disjoint id ranges. Each
kept rating is assigned to train / valid / test with probability 0.8 / 0.1 / 0.1.

Blocks are generated one at a time in bounded memory (the seed plus one block), each with its own random
generator seeded by (seed, block), so the result is deterministic and a killed run resumes from the blocks
already written: block b writes ``<split>/part-<b>.parquet`` atomically, then a marker
``_work/blocks/block-<b>.json`` (with bitmaps of the users and items it touched in a ``.npz``). The
manifest is written after the last block and ``_work`` is then removed. ``num_users`` / ``num_items`` are
the expanded id spaces (a*m, b*n); ``num_rated_users`` / ``num_rated_items`` count ids with a rating
(as in the paper: ml-20mx16x32 has 855,776 item columns of which ~849K are rated).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bigrank.data import manifest as layout
from bigrank.data.user_index import write_manifest_with_indexes

CLIP = (0.05, 0.99)
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
WORK_DIR = "_work"


def parse_multiplier(text: str) -> tuple[int, int]:
    """Parse ``"16x32"`` into ``(16, 32)``; ValueError on anything else."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or min(int(p) for p in parts) < 1:
        raise ValueError(f"--expand takes ROWSxCOLS with positive integers, e.g. 16x32; got {text!r}")
    return int(parts[0]), int(parts[1])


def randomized_svd(users, items, num_users, num_items, rank, oversample=10, power_iterations=4, seed=0):
    """Top-``rank`` singular triplets of the binary matrix with ones at (users, items).

    Randomized range finder with power iterations (Halko, Martinsson & Tropp 2011, Alg. 4.4), using
    torch CSR sparse products. Returns ``(u, s, vt)``: (m x rank), (rank,) descending, (rank x n), float64.
    """

    def csr(rows, cols, shape):
        order = np.argsort(rows, kind="stable")
        crow = np.zeros(shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=shape[0]), out=crow[1:])
        with warnings.catch_warnings():  # "sparse CSR support is in beta": products are all we use
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(
                torch.from_numpy(crow),
                torch.from_numpy(cols[order].astype(np.int64)),
                torch.ones(len(rows), dtype=torch.float64),
                size=shape,
            )

    matrix = csr(users, items, (num_users, num_items))
    transpose = csr(items, users, (num_items, num_users))
    width = min(rank + oversample, num_users, num_items)
    rng = np.random.default_rng([seed, 0x5FD])
    omega = torch.from_numpy(rng.standard_normal((num_items, width)))
    basis, _ = torch.linalg.qr(matrix @ omega)
    for _ in range(power_iterations):
        co_basis, _ = torch.linalg.qr(transpose @ basis)
        basis, _ = torch.linalg.qr(matrix @ co_basis)
    small = (transpose @ basis).T  # (width x n) = basis^T R
    u_small, s, vt = torch.linalg.svd(small, full_matrices=False)
    u = basis @ u_small
    return u[:, :rank].numpy(), s[:rank].numpy(), vt[:rank].numpy()


def _resize_rows(matrix: np.ndarray, rows: int) -> np.ndarray:
    """Linear interpolation of every column of ``matrix`` (length L) onto ``rows`` pixel centres."""
    length = matrix.shape[0]
    positions = (np.arange(rows) + 0.5) * length / rows - 0.5
    grid = np.arange(length)
    return np.stack([np.interp(positions, grid, matrix[:, c]) for c in range(matrix.shape[1])], axis=1)


def _polar_factor(matrix: np.ndarray) -> np.ndarray:
    """Closest column-orthogonal matrix M (M^T M)^(-1/2), computed as A B^T from M = A S B^T."""
    left, _, right_t = np.linalg.svd(matrix, full_matrices=False)
    return left @ right_t


def reduced_matrix(
    users, items, num_users, num_items, multiplier, seed=0, clip=CLIP, target_ratings: float | None = None
) -> np.ndarray:
    """The a x b keep-probability matrix R_hat of the expansion (module docstring, steps 1-4).

    With ``target_ratings``, the folded matrix is multiplied by the one factor c (before the clip) that
    makes the expected size ``len(users) * sum(R_hat)`` equal to the target (see ``scale_to_target``).
    """
    rows, cols = multiplier
    rank = min(rows, cols, num_users, num_items)
    u, s, vt = randomized_svd(users, items, num_users, num_items, rank, seed=seed)
    u_small = _polar_factor(_resize_rows(u, rows))  # (rows x rank)
    v_small = _polar_factor(_resize_rows(vt.T, cols))  # (cols x rank)
    reduced = np.abs(u_small @ np.diag(s) @ v_small.T)
    reduced /= reduced.max()
    if target_ratings is not None:
        reduced = scale_to_target(reduced, len(users), target_ratings, clip)
    # Rounded so that a resumed run on another thread count keeps exactly the same probabilities.
    return np.round(np.clip(reduced, *clip), 6)


def scale_to_target(folded: np.ndarray, seed_ratings: int, target: float, clip=CLIP) -> np.ndarray:
    """``c * folded`` with c found by bisection so that ``seed_ratings * sum(clip(c * folded))`` = target.

    A documented departure from the paper, used by the ``ml1b`` preset: the spectrum of a synthetic seed
    differs from ML-20M's, so the unscaled matrix would not give the ~1B ratings of ml-20mx16x32. One
    common factor keeps the relative block structure. ValueError when the clip makes the target unreachable.
    """
    low_total = seed_ratings * folded.size * clip[0]
    high_total = seed_ratings * folded.size * clip[1]
    if not low_total <= target <= high_total:
        raise ValueError(
            f"target of {target:,.0f} ratings is outside what a {folded.shape} expansion of {seed_ratings:,} "
            f"ratings can give with keep rates in {clip}: [{low_total:,.0f}, {high_total:,.0f}]"
        )
    low, high = 0.0, 1.0
    while seed_ratings * np.clip(high * folded, *clip).sum() < target:
        high *= 2.0
    for _ in range(100):
        middle = (low + high) / 2
        if seed_ratings * np.clip(middle * folded, *clip).sum() < target:
            low = middle
        else:
            high = middle
    return high * folded


def expected_ratings(reduced: np.ndarray, seed_ratings: int) -> float:
    """Expected size of the expansion: seed ratings x sum of the keep probabilities."""
    return float(reduced.sum() * seed_ratings)


def _block_pairs(users, items, num_users, num_items, block, multiplier, probability, seed):
    """Generate block ``block`` (row-major over the a x b grid): returns (users, items, split labels)."""
    _, cols = multiplier
    i, j = divmod(block, cols)
    rng = np.random.default_rng([seed, 0xB10C, block])
    row_perm = rng.permutation(num_users).astype(np.int32)
    col_perm = rng.permutation(num_items).astype(np.int32)
    kept = np.flatnonzero(rng.random(len(users), dtype=np.float32) < np.float32(probability))
    block_users = row_perm[users[kept]]
    block_users += np.int32(i * num_users)
    block_items = col_perm[items[kept]]
    block_items += np.int32(j * num_items)
    draws = rng.random(len(kept), dtype=np.float32)
    labels = (draws >= np.float32(SPLIT_FRACTIONS[0])).astype(np.int8)
    labels += draws >= np.float32(SPLIT_FRACTIONS[0] + SPLIT_FRACTIONS[1])
    return block_users, block_items, labels


def _write_block(root: Path, block: int, block_users, block_items, labels, num_users, num_items, local):
    """Write the three split files of one block, then its bitmaps and (last) its marker."""
    files = {}
    for label, split in enumerate(layout.SPLITS):
        mask = labels == label
        if not mask.any():
            files[split] = []
            continue
        name = layout.part_name(split, block)
        layout.write_parquet_atomic(root / name, {"user_id": block_users[mask], "item_id": block_items[mask]})
        files[split] = [name]
    user_bits = np.zeros(num_users, dtype=bool)
    user_bits[block_users - local[0]] = True
    item_bits = np.zeros(num_items, dtype=bool)
    item_bits[block_items - local[1]] = True
    work = root / WORK_DIR / "blocks"
    bits_path = work / f"block-{block:05d}.npz"
    tmp = layout.temporary_path(bits_path)
    with open(tmp, "wb") as handle:
        np.savez(handle, users=np.packbits(user_bits), items=np.packbits(item_bits))
    tmp.replace(bits_path)
    layout.write_json_atomic(work / f"block-{block:05d}.json", {"block": block, "files": files})
    return int(len(labels))


def expand_ratings(
    users: np.ndarray,
    items: np.ndarray,
    num_users: int,
    num_items: int,
    out: str | Path,
    multiplier: tuple[int, int] = (16, 32),
    seed: int = 0,
    resume: bool = False,
    progress: bool = True,
    source: str = "seed",
    generator: dict | None = None,
    target_ratings: float | None = None,
    max_blocks: int | None = None,
) -> dict:
    """Expand the seed pairs (``users``, ``items``; unique, 0-based) ``multiplier`` times into ``out``.

    See the module docstring for the algorithm and the resumable block layout. ``generator`` is recorded
    in the manifest (with the expansion parameters added). ``target_ratings`` rescales the keep
    probabilities (``scale_to_target``). Returns the manifest; with ``max_blocks``, at most that many new
    blocks are written and, when blocks remain, a progress dict ``{"complete": False, "blocks_done",
    "num_blocks", "rows_written"}`` is returned instead (the run stays resumable: benchmarks time a subset).
    """
    out = Path(out)
    users = np.ascontiguousarray(users, dtype=np.int32)
    items = np.ascontiguousarray(items, dtype=np.int32)
    rows, cols = multiplier
    if rows * num_users >= 2**31 or cols * num_items >= 2**31:
        raise ValueError(f"expanded ids of {multiplier} x ({num_users}, {num_items}) overflow int32")
    base = {
        **(generator or {}),
        "expand": [rows, cols],
        "seed_ratings": int(len(users)),
        "target_ratings": target_ratings,
    }
    params_path = out / WORK_DIR / "params.json"
    if (out / layout.MANIFEST_NAME).is_file():
        if not resume:
            raise ValueError(f"{out} already holds a dataset; choose a new --out or pass --resume")
        manifest = layout.load_manifest(out)
        if {k: manifest["generator"].get(k) for k in base} != base:
            raise ValueError(f"{out} holds a dataset generated with other parameters; choose a new --out")
        return manifest
    if params_path.is_file() and resume:
        saved = json.loads(params_path.read_text())
        if saved["base"] != base or saved["seed"] != seed:
            raise ValueError(f"{out} holds an unfinished run with other parameters; choose a new --out")
        reduced = np.asarray(saved["reduced"])
    else:
        if out.exists() and any(out.iterdir()):
            hint = " or pass --resume" if params_path.is_file() else ""
            raise ValueError(f"{out} is not empty; choose a new --out{hint}")
        reduced = reduced_matrix(
            users, items, num_users, num_items, multiplier, seed=seed, target_ratings=target_ratings
        )
        params_path.parent.mkdir(parents=True, exist_ok=True)
        layout.write_json_atomic(params_path, {"base": base, "seed": seed, "reduced": reduced.tolist()})
    (out / WORK_DIR / "blocks").mkdir(parents=True, exist_ok=True)
    layout.remove_stale_temporaries(out)

    num_blocks = rows * cols
    done = {b for b in range(num_blocks) if (out / WORK_DIR / "blocks" / f"block-{b:05d}.json").is_file()}
    expected = expected_ratings(reduced, len(users))
    bar = tqdm(
        total=num_blocks,
        initial=len(done),
        unit="block",
        file=sys.stderr,
        disable=not progress,
        desc=f"expand {rows}x{cols} (~{expected / 1e6:,.0f}M ratings)",
    )
    started = time.perf_counter()
    written_rows = 0
    todo = [b for b in range(num_blocks) if b not in done]
    if max_blocks is not None:
        todo = todo[:max_blocks]
    with ThreadPoolExecutor(max_workers=1) as writer:
        pending = None
        for block in todo:
            i, j = divmod(block, cols)
            pairs = _block_pairs(users, items, num_users, num_items, block, multiplier, reduced[i, j], seed)
            if pending is not None:
                written_rows += pending.result()
                bar.update(1)
                bar.set_postfix(rows=f"{written_rows / 1e6:,.1f}M")
            # Writing (pyarrow, GIL released) overlaps with drawing the next block.
            local = (i * num_users, j * num_items)
            pending = writer.submit(_write_block, out, block, *pairs, num_users, num_items, local)
        if pending is not None:
            written_rows += pending.result()
            bar.update(1)
    bar.close()
    if len(done) + len(todo) < num_blocks:
        return {
            "complete": False,
            "blocks_done": len(done) + len(todo),
            "num_blocks": num_blocks,
            "rows_written": written_rows,
        }
    return _finish(out, num_users, num_items, multiplier, seed, source, base, reduced, expected, started, progress)


def _finish(out, num_users, num_items, multiplier, seed, source, base, reduced, expected, started, progress=False):
    """Gather the block markers into the manifest (written last), then remove ``_work``."""
    rows, cols = multiplier
    split_files = {split: [] for split in layout.SPLITS}
    rated_users = np.zeros(rows * num_users, dtype=bool)
    rated_items = np.zeros(cols * num_items, dtype=bool)
    work = out / WORK_DIR / "blocks"
    for block in range(rows * cols):
        marker = json.loads((work / f"block-{block:05d}.json").read_text())
        for split in layout.SPLITS:
            split_files[split].extend(marker["files"][split])
        i, j = divmod(block, cols)
        with np.load(work / f"block-{block:05d}.npz") as bits:
            rated_users[i * num_users : (i + 1) * num_users] |= np.unpackbits(bits["users"], count=num_users).astype(
                bool
            )
            rated_items[j * num_items : (j + 1) * num_items] |= np.unpackbits(bits["items"], count=num_items).astype(
                bool
            )
    generator = {**base, "reduced_matrix": reduced.tolist(), "expected_ratings": round(expected)}
    manifest = write_manifest_with_indexes(
        out,
        num_users=rows * num_users,
        num_items=cols * num_items,
        split_files=split_files,
        seed=seed,
        source=source,
        generator=generator,
        extra={
            "num_rated_users": int(rated_users.sum()),
            "num_rated_items": int(rated_items.sum()),
            "truth": None,
            "generation_seconds_last_run": round(time.perf_counter() - started, 1),
        },
        progress=(lambda line: print(line, file=sys.stderr, flush=True)) if progress else None,
    )
    shutil.rmtree(out / WORK_DIR, ignore_errors=True)
    return manifest
