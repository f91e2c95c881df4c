"""Original ids end to end through the export, ``bigrank recommend`` and ``bigrank serve`` (issue 38): string and
int64 ids in shuffled dense order, item attributes, the lookup index against a dict, unknown ids, ``--dense-ids``,
and exports written before original ids had a type."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bigrank import integrity
from bigrank.cli import main as cli_main
from bigrank.export.format import load_export, read_table, sha256_file
from bigrank.export.ids import OriginalIdIndex, parse_original_id
from bigrank.export.recommend import Recommender
from bigrank.export.serve import make_server
from tests.id_datasets import (
    ODD_ITEM_IDS,
    ODD_USER_IDS,
    export_random,
    int_ids,
    item_attributes,
    string_ids,
    write_id_dataset,
)

NUM_USERS, NUM_ITEMS = 80, 50


@pytest.fixture(scope="module")
def strings(tmp_path_factory):
    """A dataset and an export with string user and item ids (and item attributes)."""
    root = tmp_path_factory.mktemp("string-ids")
    rng = np.random.default_rng(3)
    users = string_ids("u", NUM_USERS, ODD_USER_IDS, rng)
    items = string_ids("sku", NUM_ITEMS, ODD_ITEM_IDS, rng)
    # Dense order != sorted order (by index: numpy's str arrays would drop the NUL that ends "u-0\x00").
    users, items = [users[i] for i in rng.permutation(len(users))], [items[i] for i in rng.permutation(len(items))]
    write_id_dataset(root / "data", users, items, seed=3)
    tables = export_random(root / "export", root / "data", NUM_USERS, NUM_ITEMS)
    return {"export": root / "export", "data": root / "data", "user_ids": users, "item_ids": items, **tables}


@pytest.fixture(scope="module")
def integers(tmp_path_factory):
    """A dataset and an export with int64 ids over the whole range, in shuffled dense order, no attributes."""
    root = tmp_path_factory.mktemp("int-ids")
    rng = np.random.default_rng(4)
    users, items = int_ids(NUM_USERS, rng), int_ids(NUM_ITEMS, rng)
    assert users != sorted(users) and items != sorted(items)
    write_id_dataset(root / "data", users, items, seed=4, attributes=False)
    tables = export_random(root / "export", root / "data", NUM_USERS, NUM_ITEMS, seed=1)
    return {"export": root / "export", "data": root / "data", "user_ids": users, "item_ids": items, **tables}


def top(vectors: np.ndarray, query: np.ndarray, k: int, exclude=()) -> list[int]:
    """Numpy brute force: the dense ids of the ``k`` best items for ``query``, skipping ``exclude``."""
    scores = vectors @ query
    scores[list(exclude)] = -np.inf
    return np.argsort(-scores, kind="stable")[:k].tolist()


# ------------------------------------------------------------------------------------------------- the lookup
@pytest.mark.parametrize("kind", ["string", "int64"])
def test_the_index_finds_every_id_and_no_other_like_a_dict(kind):
    rng = np.random.default_rng(0)
    if kind == "string":
        ids = [*ODD_USER_IDS, *ODD_ITEM_IDS, "", "\x00", "a", "a\x00", "a\x00\x00", "é" * 9, "z" * 300]
        ids += ["".join(rng.choice(list("ab,\x00é-"), size=rng.integers(1, 40))) for _ in range(3000)]
        ids = list(dict.fromkeys(ids))
        absent = ["nope", "a\x00\x00\x00", "u-0\x00\x00", "z" * 299, "z" * 301, "A", "00042 ", "x" * 39]
    else:
        ids = int_ids(3000, rng)
        absent = [0, 1, -1, 41, 43, (1 << 63) - 2, -(1 << 63) + 1, 1 << 63, -(1 << 63) - 1, 10**30]
    dense = {value: position for position, value in enumerate(ids)}
    absent = [value for value in absent if value not in dense]
    index = OriginalIdIndex(pa.array(ids, pa.string() if kind == "string" else pa.int64()))
    assert index.kind == kind and len(index) == len(ids)
    queries = [*rng.permutation(np.asarray(ids, dtype=object)).tolist(), *absent]
    got = index.lookup(queries)
    assert got.tolist() == [dense.get(value, -1) for value in queries]
    assert index.nbytes < 64 * len(ids) + 4096  # fixed-width keys: bounded by the width classes, not the longest
    with pytest.raises(ValueError, match="unknown item id"):
        index.dense_id(absent[0], "item")


def test_the_index_refuses_repeated_ids_and_reads_an_empty_table():
    with pytest.raises(ValueError, match="'b' is given to two dense ids"):
        OriginalIdIndex(pa.array(["a", "b", "c", "b"]))
    with pytest.raises(ValueError, match="given to two dense ids"):
        OriginalIdIndex(pa.array([5, 7, 5]))
    with pytest.raises(ValueError, match="null"):
        OriginalIdIndex(pa.array(["a", None]))
    with pytest.raises(ValueError, match="integers or strings"):
        OriginalIdIndex(pa.array([1.5, 2.5]))
    assert OriginalIdIndex(pa.array([], pa.string())).lookup(["a"]).tolist() == [-1]


def test_ids_are_parsed_by_the_exports_type():
    assert parse_original_id("00042", "string", "user") == "00042"
    assert parse_original_id(" 00042", "int64", "user") == 42 and parse_original_id(-5, "int64", "user") == -5
    for bad in ("1_0", "١", "4.0", "", "0x1", True, 4.0, None, [1]):
        with pytest.raises(ValueError, match="user ids of this export are integers"):
            parse_original_id(bad, "int64", "user")
    for bad in (42, None, ["a"], True):
        with pytest.raises(ValueError, match="user ids of this export are strings"):
            parse_original_id(bad, "string", "user")


# ------------------------------------------------------------------------------------------------- the export
def test_the_export_carries_string_ids_and_the_item_attributes(strings):
    manifest = load_export(strings["export"])
    assert manifest["original_ids"] == {
        "users": "string",
        "items": "string",
        "item_attributes": {"title": "string", "price": "double", "in_stock": "bool", "category": "string"},
        "item_attributes_skipped": {
            "tags": "type list<element: string> is not carried (strings, integers, floats and booleans are)",
            "score": "'score' is a reserved name in exports and replies",
        },
    }
    items = read_table(strings["export"], manifest, "items")
    assert items["original_id"].tolist() == strings["item_ids"]  # dense order, though the file's rows were shuffled
    assert read_table(strings["export"], manifest, "users")["original_id"].tolist() == strings["user_ids"]
    for item in range(NUM_ITEMS):
        expected = item_attributes(item, strings["item_ids"])
        assert items["title"][item] == expected.get("title")
        assert items["category"][item] == expected["category"] and bool(items["in_stock"][item]) == (item % 2 == 1)
    # A reply's rows: the original id and the attributes not null, NaN or infinite (JSON has none of those).
    rows = Recommender(strings["export"]).describe(np.arange(NUM_ITEMS), np.zeros(NUM_ITEMS))
    json.dumps(rows, allow_nan=False)
    for item, row in enumerate(rows):
        assert row == {"item_id": item, "score": 0.0, "original_id": strings["item_ids"][item]} | item_attributes(
            item, strings["item_ids"]
        )
    assert "price" not in rows[3] and "price" not in rows[13] and rows[4]["price"] == 6.0
    schema = pq.read_schema(strings["export"] / "items/part-r00000.parquet")
    assert str(schema.field("original_id").type) == "string" and "tags" not in schema.names
    assert pq.read_schema(strings["export"] / "history/part-r00000.parquet").names == ["item_id", "embedding"]


def test_the_export_of_a_synthetic_dataset_says_it_has_no_original_ids(tiny_dataset, tmp_path):
    from bigrank.data.manifest import load_manifest

    dataset = load_manifest(tiny_dataset)
    export_random(tmp_path / "export", tiny_dataset, dataset["num_users"], dataset["num_items"], history=False)
    manifest = load_export(tmp_path / "export")
    assert manifest["original_ids"]["users"] is None and manifest["original_ids"]["items"] is None
    rec = Recommender(tmp_path / "export")
    assert rec.user_ids is None and rec.item_ids is None and "original_id" not in rec.recommend(3, 2)[0]


def test_an_export_refuses_repeated_original_ids_by_name(tmp_path):
    write_id_dataset(tmp_path / "data", ["a", "b", "a"], ["x", "y"], attributes=False)
    with pytest.raises(ValueError, match="original_id 'a' is given to two dense ids"):
        export_random(tmp_path / "export", tmp_path / "data", 3, 2, history=False)
    assert not (tmp_path / "export/manifest.json").exists()


# ------------------------------------------------------------------------------------------ bigrank recommend
def _recommend_json(capsys, *args) -> list[dict]:
    assert cli_main(["recommend", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("fixture", ["strings", "integers"])
def test_recommend_by_original_id_equals_dense_ids_and_brute_force(request, capsys, fixture):
    data = request.getfixturevalue(fixture)
    export, users, items = data["export"], data["user_ids"], data["item_ids"]
    for dense in (0, 7, users.index(42) if 42 in users else users.index("00042"), NUM_USERS - 1):
        original = users[dense]
        by_original = _recommend_json(capsys, export, f"--user={original}", "-k", 6, "--exclude-seen")
        by_dense = _recommend_json(capsys, export, "--user", dense, "--dense-ids", "-k", 6, "--exclude-seen")
        assert by_original == by_dense
        seen = Recommender(export).seen.items_of(dense)
        expected = top(data["items"], data["users"][dense], 6, seen)
        assert [row["item_id"] for row in by_original] == expected
        assert [row["original_id"] for row in by_original] == [items[i] for i in expected]
        if fixture == "strings":
            for row in by_original:
                assert {k: v for k, v in row.items() if k not in ("item_id", "score", "original_id")} == (
                    item_attributes(row["item_id"], items)
                )
        # --original-ids, the old flag, is the default now and still accepted
        assert _recommend_json(capsys, export, f"--user={original}", "--original-ids", "-k", 6, "--exclude-seen") == (
            by_original
        )
    given = [items[3], items[11], items[40]]
    # "--items=…": int64 ids may be negative, and argparse takes "-4,-5" for an option
    fold = _recommend_json(capsys, export, "--items=" + ",".join(map(str, given)), "-k", 5)
    assert fold == _recommend_json(capsys, export, "--items", "3,11,40", "--dense-ids", "-k", 5)
    query = data["history"][[3, 11, 40]].mean(axis=0)
    assert [row["item_id"] for row in fold] == top(data["items"], query, 5, [3, 11, 40])


def test_recommend_takes_string_ids_as_written(strings, capsys):
    """ "00042" and "42" are two users of a string-id export; "a,b" is one user (--user is not split)."""
    users = strings["user_ids"]
    for original in ("00042", "42", "a,b", " spaced ", "ü-ß-用户", "long-" * 50):
        rows = _recommend_json(capsys, strings["export"], "--user", original, "-k", 3)
        expected = top(strings["items"], strings["users"][users.index(original)], 3)
        assert [row["item_id"] for row in rows] == expected, original
    assert cli_main(["recommend", str(strings["export"]), "--user", "00042", "-k", "3"]) == 0
    text = capsys.readouterr().out
    assert f"top 3 items of user 00042 (dense id {users.index('00042')})" in text
    assert "original_id" in text and "title" in text and "category" in text


@pytest.mark.parametrize(
    "fixture, args, message",
    [
        ("strings", ["--user", "u-nobody"], "unknown user id 'u-nobody'"),
        ("strings", ["--user", "0042"], "unknown user id '0042'"),
        ("strings", ["--items", "sku-9-A,sku-nope"], "unknown item ids 'sku-nope'"),
        ("strings", ["--items", "sku-9-A, 17"], "unknown item ids ' 17'"),  # taken as written: a space is kept
        ("integers", ["--user", "12345"], "unknown user id 12345"),
        ("integers", ["--user", "u-1"], "user ids of this export are integers, got 'u-1'"),
        ("integers", ["--user", "99999999999999999999"], "unknown user id 99999999999999999999"),
        ("integers", ["--items", "1,2"], "unknown item ids 1, 2"),
        ("strings", ["--user", "1", "--dense-ids", "--original-ids"], None),  # argparse: not both
    ],
)
def test_unknown_or_wrongly_typed_ids_are_one_error_line_and_status_2(request, capsys, fixture, args, message):
    export = request.getfixturevalue(fixture)["export"]
    with pytest.raises(SystemExit) if message is None else _no_raise():
        code = cli_main(["recommend", str(export), *args])
    if message is None:
        return
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bigrank recommend: error: ") and message in err, err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_recommend_on_a_synthetic_export_takes_dense_ids_and_refuses_original_ids(tiny_dataset, tmp_path, capsys):
    from bigrank.data.manifest import load_manifest

    dataset = load_manifest(tiny_dataset)
    tables = export_random(tmp_path / "export", tiny_dataset, dataset["num_users"], dataset["num_items"])
    plain = _recommend_json(capsys, tmp_path / "export", "--user", 5, "-k", 4)
    assert plain == _recommend_json(capsys, tmp_path / "export", "--user", 5, "-k", 4, "--dense-ids")
    assert [row["item_id"] for row in plain] == top(tables["items"], tables["users"][5], 4)
    assert cli_main(["recommend", str(tmp_path / "export"), "--user", "5", "--original-ids"]) == 2
    assert "this export has no original user ids" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- exports of an older bigrank
def _as_old_export(export, out) -> None:
    """Rewrite ``export`` as a bigrank before issue 38 wrote it: no ``original_ids`` in the manifest, and the
    history parts carrying ``original_id: int64`` and ``title`` too (checksums updated)."""
    import shutil

    shutil.copytree(export, out)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["original_ids"]
    items = pq.read_table(out / "items/part-r00000.parquet")
    for part in manifest["tables"]["history"]["parts"]:
        path = out / part["file"]
        history = pq.read_table(path)
        history = pa.table(
            {
                "item_id": history["item_id"],
                "original_id": items["original_id"],
                "title": items["title"],
                "embedding": history["embedding"],
            }
        )
        pq.write_table(history, path, **integrity.PARQUET_WRITE_OPTIONS)
        part.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    items = items.drop_columns(["price", "in_stock", "category"])
    path = out / "items/part-r00000.parquet"
    pq.write_table(items, path, **integrity.PARQUET_WRITE_OPTIONS)
    manifest["tables"]["items"]["parts"][0].update(bytes=path.stat().st_size, sha256=sha256_file(path))
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_an_old_export_with_int64_ids_and_titles_still_loads_and_answers(tmp_path, capsys):
    rng = np.random.default_rng(8)
    users, items = int_ids(30, rng), int_ids(20, rng)
    write_id_dataset(tmp_path / "data", users, items, seed=8)
    tables = export_random(tmp_path / "new", tmp_path / "data", 30, 20)
    _as_old_export(tmp_path / "new", tmp_path / "old")
    old = load_export(tmp_path / "old")
    assert "original_ids" not in old
    rec = Recommender(tmp_path / "old")
    assert rec.user_id_kind == rec.item_id_kind == "int64" and list(rec.item_attributes) == ["title"]
    rows = _recommend_json(capsys, tmp_path / "old", "--user", users[4], "-k", 5)
    expected = top(tables["items"], tables["users"][4], 5)
    assert [row["item_id"] for row in rows] == expected and [row["original_id"] for row in rows] == [
        items[i] for i in expected
    ]
    assert all(set(row) <= {"item_id", "score", "original_id", "title"} for row in rows)
    assert read_table(tmp_path / "old", old, "history")["original_id"].tolist() == items


# -------------------------------------------------------------------------------------------- bigrank serve
@pytest.fixture(scope="module")
def servers(strings, integers):
    """Stdlib servers on loopback: the string-id export by original ids and by dense ids, the int64 one."""
    started = {}
    for name, data, dense in (("strings", strings, False), ("dense", strings, True), ("integers", integers, False)):
        rec = Recommender(data["export"])
        server = make_server(rec, "127.0.0.1", 0, quiet=True, dense_ids=dense)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        started[name] = (server, thread, "http://{}:{}".format(*server.server_address[:2]))
    yield {name: url for name, (_, _, url) in started.items()}
    for server, thread, _ in started.values():
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def call(url: str, body=None) -> tuple[int, dict]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def q(value) -> str:
    return urllib.parse.quote(str(value), safe="")


def test_serve_takes_and_returns_string_ids(strings, servers):
    users, items, seen = strings["user_ids"], strings["item_ids"], Recommender(strings["export"]).seen
    status, health = call(servers["strings"] + "/health")
    assert status == 200 and (health["user_ids"], health["item_ids"]) == ("string", "string")
    assert call(servers["dense"] + "/health")[1]["user_ids"] == "dense"
    for dense in (0, users.index("00042"), users.index("a,b"), users.index("u-0\x00"), users.index("long-" * 50)):
        original = users[dense]
        status, body = call(servers["strings"] + f"/recommend?user={q(original)}&k=7&exclude_seen=1")
        assert status == 200, body
        assert body["user"] == original
        expected = top(strings["items"], strings["users"][dense], 7, seen.items_of(dense))
        assert [row["item_id"] for row in body["items"]] == expected
        assert [row["original_id"] for row in body["items"]] == [items[i] for i in expected]
        for row in body["items"]:
            assert {k: v for k, v in row.items() if k not in ("item_id", "score", "original_id")} == (
                item_attributes(row["item_id"], items)
            )
        _, by_dense = call(servers["dense"] + f"/recommend?user={dense}&k=7&exclude_seen=1")
        assert by_dense["user"] == dense and by_dense["items"] == body["items"]

    picked = [0, 9, users.index("00042"), users.index("a,b")]
    status, body = call(servers["strings"] + "/recommend", {"users": [users[u] for u in picked], "k": 4})
    assert status == 200 and [r["user"] for r in body["results"]] == [users[u] for u in picked]
    for dense, result in zip(picked, body["results"], strict=True):
        assert [row["item_id"] for row in result["items"]] == top(strings["items"], strings["users"][dense], 4)

    given = [items.index("sku-9-A"), items.index("品-1"), items.index("00017")]
    status, fold = call(servers["strings"] + f"/recommend?items={','.join(q(items[i]) for i in given)}&k=5")
    assert status == 200 and fold["items_given"] == [items[i] for i in given]
    assert [row["item_id"] for row in fold["items"]] == top(
        strings["items"], strings["history"][given].mean(0), 5, given
    )
    status, posted = call(servers["strings"] + "/recommend", {"histories": [[items[i] for i in given], ["c,d"]]})
    assert (
        status == 200
        and posted["results"][0]["items"]
        == call(servers["strings"] + f"/recommend?items={','.join(q(items[i]) for i in given)}")[1]["items"]
    )
    assert posted["results"][1]["items_given"] == ["c,d"]


def test_serve_takes_int64_ids_as_numbers_or_digit_strings(integers, servers):
    users, items = integers["user_ids"], integers["item_ids"]
    dense = users.index(42)
    status, body = call(servers["integers"] + "/recommend?user=00042&k=5")
    assert status == 200 and body["user"] == 42
    expected = top(integers["items"], integers["users"][dense], 5)
    assert [row["item_id"] for row in body["items"]] == expected
    assert [row["original_id"] for row in body["items"]] == [items[i] for i in expected]
    extreme = users.index(np.iinfo(np.int64).min)
    status, posted = call(servers["integers"] + "/recommend", {"users": [42, "42", str(users[extreme])], "k": 5})
    assert status == 200 and [r["user"] for r in posted["results"]] == [42, 42, users[extreme]]
    assert posted["results"][0]["items"] == posted["results"][1]["items"] == body["items"]
    assert call(servers["integers"] + "/health")[1]["user_ids"] == "int64"


@pytest.mark.parametrize(
    "server, target, body, message",
    [
        ("strings", "user=u-nobody", None, "unknown user id 'u-nobody'"),
        ("strings", "user=0042", None, "unknown user id '0042'"),
        ("strings", "items=sku-9-A,nope", None, "unknown item ids 'nope'"),
        ("strings", "", {"users": [42]}, "user ids of this export are strings: give 42 as a JSON string"),
        ("strings", "", {"users": [["u-0"]]}, "user ids of this export are strings"),
        ("strings", "", {"histories": [["sku-9-A", 17]]}, "item ids of this export are strings"),
        ("strings", "", {"users": ["u-0\n2"]}, "unknown user id 'u-0\\n2'"),
        ("integers", "user=u-1", None, "user ids of this export are integers, got 'u-1'"),
        ("integers", "user=1.0", None, "user ids of this export are integers"),
        ("integers", "user=9223372036854775808", None, "unknown user id 9223372036854775808"),
        ("integers", "", {"users": [1.5]}, "user ids of this export are integers, got 1.5"),
        ("integers", "", {"users": [True]}, "user ids of this export are integers, got true"),
        ("integers", "", {"histories": [[3]]}, "unknown item ids 3"),
        ("dense", "user=00042", None, None),  # a dense server reads 00042 as dense user 42: a valid request
        ("dense", "user=u-0", None, "user must be an integer"),
    ],
)
def test_unknown_or_wrongly_typed_ids_answer_400_with_one_line(servers, server, target, body, message):
    status, reply = call(servers[server] + "/recommend?" + target, body)
    if message is None:
        assert status == 200, reply
        return
    assert status == 400, reply
    assert message in reply["error"] and "\n" not in reply["error"], reply


@pytest.mark.parametrize("dense", [False, True])
def test_bigrank_serve_prints_a_working_url_and_takes_dense_ids_with_the_flag(strings, dense):
    """`bigrank serve` (the command, in its own process): the URL it prints names a real user (the original id of
    dense user 0, URL-quoted) and answers; with --dense-ids it takes dense ids and /health says so."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    command = [sys.executable, "-m", "bigrank.cli", "serve", str(strings["export"]), "--port", "0", "--quiet"]
    command += ["--dense-ids"] if dense else []
    env = dict(os.environ, PYTHONPATH=str(REPO))
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = server.stderr.readline()
        assert (" dense ids) on http://" if dense else " original string user ids) on http://") in line, line
        url = line.split(" on ")[-1].strip()
        status, body = call(url)
        assert status == 200 and body["user"] == (0 if dense else strings["user_ids"][0])
        assert [row["item_id"] for row in body["items"]] == top(strings["items"], strings["users"][0], 10)
        base = url.split("/recommend")[0]
        assert call(base + "/health")[1]["item_ids"] == ("dense" if dense else "string")
        named = next(user for user in strings["user_ids"] if user.startswith("u-0"))  # not an integer's text
        status, reply = call(base + "/recommend?user=" + q(named))
        assert (status, reply.get("user")) == ((400, None) if dense else (200, named))
    finally:
        server.terminate()
        server.wait(timeout=60)
        server.stderr.close()
