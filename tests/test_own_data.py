"""The own-data example end to end (``pipelines/own_data.py``): a shop's event log with string ids, ingested,
trained, evaluated and exported; ``recommend`` and ``serve`` by the shop's ids give the brute-force top items of the
exported vectors, with the products file's titles."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq

from tests.conftest import REPO, bigrank


def test_a_shops_log_end_to_end_by_its_own_ids(tmp_path):
    from pipelines import own_data

    work = tmp_path / "own"
    run = subprocess.run(  # as a user runs it: its own process
        [sys.executable, "-m", "pipelines.own_data", "--workdir", str(work), "--customers", "400", "--epochs", "2"],
        capture_output=True, text=True, cwd=REPO, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data, export = work / "data", work / "run" / "export"
    users = pq.read_table(data / "users.parquet").column("original_id").to_pylist()
    items = pq.read_table(data / "items.parquet").column("original_id").to_pylist()
    assert all(u.startswith("C-") for u in users) and all(i.startswith("SKU-") for i in items)
    with open(work / "shop" / "products.csv") as handle:
        titles = {row["sku"]: row["title"] for row in csv.DictReader(handle)}

    customer = "C-00042"
    rows = json.loads(bigrank("recommend", export, "--user", customer, "-k", "5", "--exclude-seen", "--json").stdout)
    assert [row["title"] for row in rows] == [titles[row["original_id"]] for row in rows]
    # the brute-force top 5 of the exported vectors over the items the customer has not interacted with
    manifest = json.loads((export / "manifest.json").read_text())
    from bigrank.export.format import read_table
    from bigrank.export.recommend import Recommender

    item_vectors = read_table(export, manifest, "items")["embedding"]
    recommender = Recommender(export)
    dense = users.index(customer)
    scores = item_vectors @ recommender.user_vector(dense)
    seen = set(recommender.seen.items_of(dense).tolist())
    ranking = [i for i in np.argsort(-scores, kind="stable") if i not in seen][:5]
    assert [row["item_id"] for row in rows] == ranking
    assert [row["original_id"] for row in rows] == [items[i] for i in ranking]

    reply = own_data.serve_and_ask(export, customer, 5)
    assert reply["user"] == customer
    assert [(row["original_id"], row["title"]) for row in reply["items"]] == [
        (row["original_id"], row["title"]) for row in rows
    ]
