"""Your own data, end to end: a shop's event log with string ids -> ingest -> train -> evaluate -> export ->
recommend and serve by the shop's own ids, with product titles.

    python -m pipelines.own_data [--workdir runs/own-data] [--fresh]

1. writes a small e-commerce-like log (what a shop exports): gzip'd JSON Lines parts of events ``{"customer_id":
   "C-00042", "sku": "SKU-00317-B", "event": "purchase", "weight": 3, "ts": "2026-03-01T12:34:56Z"}`` (views weigh
   1, carts 2, purchases 3; customers prefer one or two categories) and ``products.csv`` (sku, title, category);
2. ``bigrank ingest`` with a column mapping: repeated (customer, sku) events summed, a 3-core, a per-customer split
   by time; the products file's title and category travel with the items;
3. ``bigrank train`` (the towers with the history tower, softmax over the whole catalog, local processes);
4. ``bigrank evaluate`` (Recall@K, AP@K, Accuracy on valid and test);
5. ``bigrank export``;
6. ``bigrank recommend --user C-00042``, and ``--items`` for a basket (fold-in), by the shop's ids;
7. ``bigrank serve`` and ``GET /recommend?user=C-00042&exclude_seen=1``: the same answer over HTTP, with titles.

Each step prints the command it runs. Paths are under ``--workdir``; ``--fresh`` deletes it first.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CATEGORIES = ["books", "garden", "kitchen", "toys", "sports", "music", "office", "pets", "beauty", "games"]
ADJECTIVES = ["Classic", "Compact", "Deluxe", "Eco", "Giant", "Mini", "Pro", "Smart", "Travel", "Vintage"]
EVENTS = {"view": 1, "cart": 2, "purchase": 3}

CONFIG = """\
# written by pipelines/own_data.py: the towers with the history tower on the shop's log
data: {{root: {data}}}
run_dir: {run}
seed: 0
workers: 1
model: {{dim: 32, history: true}}
loss: {{name: softmax}}
optim: {{user_lr: 0.1, item_lr: 0.1}}
train: {{batch_size: 256, epochs: {epochs}, log_every: 50, progress: false}}
eval: {{every_epochs: {epochs}, ks: [10, 50], splits: [valid, test]}}
"""


def write_shop_log(directory: Path, customers: int = 1200, products: int = 400, seed: int = 0) -> tuple[Path, Path]:
    """The event log (gzip'd JSON Lines, three parts) and ``products.csv`` of a made-up shop; returns their paths."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    skus = [f"SKU-{k:05d}-{'ABC'[k % 3]}" for k in range(products)]
    category = {sku: CATEGORIES[k % len(CATEGORIES)] for k, sku in enumerate(skus)}
    popularity = {sku: rng.paretovariate(1.5) for sku in skus}
    by_category = {c: [s for s in skus if category[s] == c] for c in CATEGORIES}
    with open(directory / "products.csv", "w") as handle:
        handle.write("sku,title,category\n")
        for k, sku in enumerate(skus):
            handle.write(f"{sku},{ADJECTIVES[k % len(ADJECTIVES)]} {category[sku]} item {k},{category[sku]}\n")
    start = datetime(2026, 3, 1, tzinfo=UTC)
    events = []
    for c in range(customers):
        customer = f"C-{c:05d}"
        liked = rng.sample(CATEGORIES, rng.choice([1, 2]))
        for _ in range(max(3, int(rng.lognormvariate(2.8, 0.6)))):
            pool = by_category[rng.choice(liked)] if rng.random() < 0.85 else skus
            sku = rng.choices(pool, weights=[popularity[s] for s in pool])[0]
            event = rng.choices(list(EVENTS), weights=[6, 2, 1])[0]
            when = start + timedelta(seconds=rng.randrange(90 * 86_400))
            events.append({"customer_id": customer, "sku": sku, "event": event, "weight": EVENTS[event],
                           "ts": when.strftime("%Y-%m-%dT%H:%M:%SZ")})  # fmt: skip
    log = directory / "events"
    log.mkdir(exist_ok=True)
    for part in range(3):
        with gzip.open(log / f"part-{part:05d}.jsonl.gz", "wt") as handle:
            for event in events[part::3]:
                handle.write(json.dumps(event) + "\n")
    return log, directory / "products.csv"


def bigrank(*args, capture: bool = False) -> str:
    """Run ``bigrank ARGS`` as a user would (printing the command); returns its stdout when ``capture``."""
    print(f"\n$ bigrank {' '.join(map(str, args))}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "bigrank.cli", *map(str, args)], env=env, text=True, capture_output=capture
    )
    if done.returncode != 0:
        raise SystemExit(f"bigrank {args[0]} failed ({done.returncode}){': ' + done.stderr if capture else ''}")
    if capture:
        print(done.stdout, end="")
    return done.stdout if capture else ""


def serve_and_ask(export: Path, customer: str, k: int) -> dict:
    """Start ``bigrank serve`` on a free port, ask ``GET /recommend?user=CUSTOMER&k=K&exclude_seen=1`` (the items
    the customer has not interacted with), stop it; the reply."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "bigrank.cli", "serve", str(export), "--port", "0", "--quiet"]
    print(f"\n$ bigrank serve {export} --port 0 &", flush=True)
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stderr.readline()  # "serving … on http://127.0.0.1:PORT/recommend?…"
        if "http://" not in line:
            raise SystemExit(f"bigrank serve did not start: {line}{server.stderr.read()}")
        base = line.split("http://", 1)[1].split("/", 1)[0]
        url = f"http://{base}/recommend?user={customer}&k={k}&exclude_seen=1"
        print(f"$ curl '{url}'", flush=True)
        with urllib.request.urlopen(url, timeout=60) as response:
            reply = json.loads(response.read())
        print(json.dumps(reply, indent=1)[:1500])
        return reply
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.own_data", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=str(REPO / "runs" / "own-data"), help="where everything is written")
    parser.add_argument("--fresh", action="store_true", help="delete --workdir first")
    parser.add_argument("--customer", default="C-00042", help="whose recommendations are shown")
    parser.add_argument("--customers", type=int, default=1200, help="customers in the made-up shop")
    parser.add_argument("--epochs", type=int, default=6, help="training epochs")
    args = parser.parse_args(argv)
    work = Path(args.workdir).resolve()
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    started = time.perf_counter()
    log, products = write_shop_log(work / "shop", customers=args.customers)
    print(f"== wrote the shop's event log {log} and {products}")
    data, run_dir = work / "data", work / "run"
    if not (data / "manifest.json").is_file():
        shutil.rmtree(data, ignore_errors=True)
        bigrank(
            "ingest", log, "--out", data, "--user", "customer_id", "--item", "sku", "--time", "ts",
            "--weight", "weight", "--dedup", "sum", "--min-user-items", "3", "--min-item-users", "3",
            "--split", "last", "--items-file", products, "--item-key", "sku", "--no-progress",
        )  # fmt: skip
    config = work / "config.yaml"
    config.write_text(CONFIG.format(data=data, run=run_dir, epochs=args.epochs))
    bigrank("train", config, "--launcher", "local")
    bigrank("evaluate", run_dir)
    export = run_dir / "export"
    if not (export / "manifest.json").is_file():
        shutil.rmtree(export, ignore_errors=True)
        bigrank("export", run_dir, "--out", export)
    bigrank("recommend", export, "--user", args.customer, "-k", "5", "--exclude-seen", capture=True)
    basket = "SKU-00003-A,SKU-00013-B"
    bigrank("recommend", export, "--items", basket, "-k", "5", capture=True)
    serve_and_ask(export, args.customer, 5)
    print(f"\n== done in {time.perf_counter() - started:.0f} s; everything is under {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
