"""Fuzzed requests to ``bigrank serve`` (Hypothesis): every query string and POST body parses into queries that
the export answers, or raises one ValueError line (the server's 400 reply); the same through a real server on
an ephemeral loopback port, whose every reply is 200 or a 4xx with a one-line JSON error, never a 500 or a
dropped connection. The same for an export of string original ids (ids drawn from the known ones, near misses and
any text), where a known id's answer also equals the dense id's. The plain tests at the end pin each bug the fuzzing
found."""

from __future__ import annotations

import http.client
import json
import urllib.parse

import numpy as np
import pytest
from fuzz_strategies import assert_one_line
from hypothesis import given, settings
from hypothesis import strategies as st

from bigrank.export.api import parse_flag, parse_get, parse_post, search_queries
from bigrank.export.recommend import Recommender
from tests.helpers import random_tables, stdlib_server, write_export
from tests.id_datasets import ODD_ITEM_IDS, ODD_USER_IDS, export_random, string_ids, write_id_dataset

DIM = 8
NAMES = ["user", "items", "k", "exclude_seen"]
# Values of a query parameter or JSON field: ids in and out of range, numbers of every kind, flags, text.
TEXT_VALUES = st.one_of(
    st.integers(min_value=-3, max_value=130).map(str),
    st.integers().map(str),
    st.sampled_from(["", " ", "1.0", "1e3", "nan", "inf", "-0", "0x1", "1_0", "١", "true", "yes", "2 ", "+3"]),
    st.lists(st.integers(min_value=-2, max_value=110), max_size=4).map(lambda ids: ",".join(map(str, ids))),
    st.lists(st.integers().map(str) | st.text(max_size=4), max_size=3).map(",".join),
    st.text(max_size=10),
)
QUERIES = st.one_of(
    st.lists(st.tuples(st.sampled_from(NAMES) | st.text(max_size=5), TEXT_VALUES), max_size=4).map(
        lambda pairs: urllib.parse.urlencode(pairs)
    ),
    st.lists(st.tuples(st.sampled_from(NAMES), TEXT_VALUES), max_size=4).map(
        lambda pairs: "&".join(f"{name}={value}" for name, value in pairs)  # unencoded: what a hand typed
    ),
    st.text(max_size=30),
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
IDS = st.lists(st.integers(min_value=-2, max_value=130) | st.integers() | JSON, max_size=4)
BODIES = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "users": IDS | JSON,
            "histories": st.lists(IDS | JSON, max_size=3) | JSON,
            "k": st.integers(min_value=-1, max_value=1100) | JSON,
            "exclude_seen": st.booleans() | st.sampled_from(["1", "no", 2]) | JSON,
            "x": JSON,
        },
    ).map(lambda body: json.dumps(body).encode()),
    JSON.map(lambda body: json.dumps(body).encode()),
    st.binary(max_size=40),
    st.integers(min_value=1, max_value=5000).map(lambda depth: b'{"histories": ' + b"[" * depth),
)


# String original ids: the export's own (users and items, so each also lands where the other kind is expected),
# near misses of them (a character added, dropped or changed case), and any text.
STRING_USERS = string_ids("u", 40, ODD_USER_IDS, np.random.default_rng(5))
STRING_ITEMS = string_ids("sku", 30, ODD_ITEM_IDS, np.random.default_rng(6))
KNOWN_IDS = st.sampled_from(STRING_USERS + STRING_ITEMS)
STRING_IDS = st.one_of(
    KNOWN_IDS,
    KNOWN_IDS.map(lambda value: value + "x"),
    KNOWN_IDS.map(lambda value: value[:-1]),
    KNOWN_IDS.map(str.upper),
    st.text(max_size=8),
)
KNOWN_USERS = st.sampled_from(STRING_USERS)
KNOWN_ITEMS = st.sampled_from(STRING_ITEMS)
# Requests of known ids, so that answers (compared with the dense ids' answers) are common, not rare.
KNOWN_QUERIES = st.one_of(
    st.builds(
        lambda user, k, flag: urllib.parse.urlencode({"user": user, "k": k, "exclude_seen": flag}),
        KNOWN_USERS,
        st.integers(min_value=1, max_value=60),
        st.sampled_from(["0", "1"]),
    ),
    st.builds(
        lambda items, k: urllib.parse.urlencode({"items": ",".join(items), "k": k}),
        st.lists(st.sampled_from([i for i in STRING_ITEMS if "," not in i]), min_size=1, max_size=4),
        st.integers(min_value=1, max_value=60),
    ),
)
KNOWN_BODIES = st.one_of(
    st.builds(
        lambda users, k, flag: json.dumps({"users": users, "k": k, "exclude_seen": flag}).encode(),
        st.lists(KNOWN_USERS, min_size=1, max_size=5),
        st.integers(min_value=1, max_value=60),
        st.booleans(),
    ),
    st.builds(
        lambda histories: json.dumps({"histories": histories}).encode(),
        st.lists(st.lists(KNOWN_ITEMS, min_size=1, max_size=4), min_size=1, max_size=3),
    ),
)
STRING_QUERIES = st.one_of(
    KNOWN_QUERIES,
    st.lists(
        st.tuples(
            st.sampled_from(NAMES),
            STRING_IDS | st.lists(STRING_IDS, max_size=4).map(",".join) | TEXT_VALUES,
        ),
        max_size=4,
    ).map(urllib.parse.urlencode),
    QUERIES,
)
STRING_ID_LISTS = st.lists(STRING_IDS | st.integers() | JSON, max_size=4)
STRING_BODIES = st.one_of(
    KNOWN_BODIES,
    st.fixed_dictionaries(
        {},
        optional={
            "users": STRING_ID_LISTS | JSON,
            "histories": st.lists(STRING_ID_LISTS | JSON, max_size=3) | JSON,
            "k": st.integers(min_value=-1, max_value=60) | JSON,
            "exclude_seen": st.booleans() | JSON,
        },
    ).map(lambda body: json.dumps(body).encode()),
    BODIES,
)


HEADER_CHARACTERS = st.characters(min_codepoint=32, max_codepoint=126)  # what http.client sends in a header


@pytest.fixture(scope="module")
def served(tiny_dataset, tmp_path_factory):
    """An export of random tables of the tiny dataset (a history table and seen items) and a server on an
    ephemeral loopback port (stopped after the module)."""
    from bigrank.data.manifest import load_manifest

    manifest = load_manifest(tiny_dataset)
    export = tmp_path_factory.mktemp("fuzz-serve") / "export"
    tables = random_tables(manifest["num_items"], manifest["num_users"], DIM)
    write_export(export, tables, dataset_root=tiny_dataset, user_vectors=None)
    recommender = Recommender(export)
    with stdlib_server(recommender) as url:
        yield recommender, int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def served_strings(tmp_path_factory):
    """An export of string user and item ids (a history table, seen items) and a server on a loopback port taking
    them (stopped after the module)."""
    root = tmp_path_factory.mktemp("fuzz-serve-strings")
    write_id_dataset(root / "data", STRING_USERS, STRING_ITEMS, seed=5)
    export_random(root / "export", root / "data", len(STRING_USERS), len(STRING_ITEMS))
    recommender = Recommender(root / "export")
    with stdlib_server(recommender) as url:
        yield recommender, int(url.rsplit(":", 1)[1])


def _answered_or_named(rec, parse):
    """``parse()``'s queries searched (each answer at most k items); or its ValueError, one line."""
    try:
        queries = parse()
    except ValueError as error:
        assert_one_line(error)
        return None
    if isinstance(queries, tuple):  # parse_post's (k, queries)
        queries = queries[1]
    else:
        queries = [queries]
    answers = search_queries(rec, queries)
    assert len(answers) == len(queries)
    for query, answer in zip(queries, answers, strict=True):
        assert len(answer["items"]) <= query.k
    return answers


def _equals_the_dense_answer(rec, answer: dict, exclude_seen: bool) -> None:
    """``answer`` (to original ids) equals ``Recommender``'s answer for the same dense ids, and each item's
    ``original_id`` is the dataset's."""
    if "user" in answer:
        dense = STRING_USERS.index(answer["user"])
        expected = rec.recommend(dense, answer["k"], rec.seen.items_of(dense) if exclude_seen else None)
    else:
        expected = rec.recommend_items_history([STRING_ITEMS.index(i) for i in answer["items_given"]], answer["k"])
    assert answer["items"] == expected
    assert [row["original_id"] for row in answer["items"]] == [STRING_ITEMS[row["item_id"]] for row in expected]


@given(query=STRING_QUERIES)
def test_string_id_query_strings_are_answered_or_named_and_equal_the_dense_answer(served_strings, query):
    """Any query string to a string-id export is answered or named; an answer equals the dense ids' answer."""
    rec = served_strings[0]
    answers = _answered_or_named(rec, lambda: parse_get(rec, rec.seen, query))
    if answers is not None:
        exclude = parse_flag(dict(urllib.parse.parse_qsl(query, keep_blank_values=True)).get("exclude_seen", ""), "")
        _equals_the_dense_answer(rec, answers[0], exclude)


@given(body=STRING_BODIES)
def test_string_id_post_bodies_are_answered_or_named_and_equal_the_dense_answers(served_strings, body):
    rec = served_strings[0]
    answers = _answered_or_named(rec, lambda: parse_post(rec, rec.seen, body))
    for answer in answers or []:
        _equals_the_dense_answer(rec, answer, parse_flag(json.loads(body).get("exclude_seen", False), ""))


@given(query=QUERIES)
def test_query_strings_are_answered_or_named(served, query):
    rec = served[0]
    _answered_or_named(rec, lambda: parse_get(rec, rec.seen, query))


@given(body=BODIES)
def test_post_bodies_are_answered_or_named(served, body):
    rec = served[0]
    _answered_or_named(rec, lambda: parse_post(rec, rec.seen, body))


def _request(port: int, method: str, target: str, body: bytes | None = None, headers: dict | None = None):
    """``(status, JSON reply)`` of one request to the server on ``port``."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request(method, target, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _check_reply(status: int, reply: dict) -> None:
    assert status == 200 or 400 <= status < 500, (status, reply)
    if status != 200:
        assert isinstance(reply.get("error"), str) and reply["error"].strip() and "\n" not in reply["error"], reply


@settings(max_examples=max(15, settings().max_examples // 10))  # HTTP round trips: fewer
@given(query=QUERIES, body=BODIES, length=st.none() | st.integers(min_value=-3) | st.text(HEADER_CHARACTERS))
def test_a_real_server_answers_200_or_a_4xx_line(served, query, body, length):
    """GET with any query string; POST with any body and Content-Length (the body's, a shorter or negative one,
    or any text; never a longer one, for which the server rightly waits for the rest)."""
    port = served[1]
    _check_reply(*_request(port, "GET", "/recommend?" + urllib.parse.quote(query, safe="=&,+%")))
    if isinstance(length, int):
        length = min(length, len(body))
    elif length is not None and length.strip().isdigit():
        length = str(min(int(length), len(body)))
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body) if length is None else length)}
    _check_reply(*_request(port, "POST", "/recommend", body, headers))


@settings(max_examples=max(15, settings().max_examples // 10))  # HTTP round trips: fewer
@given(query=STRING_QUERIES, body=STRING_BODIES)
def test_a_real_string_id_server_answers_200_or_a_4xx_line(served_strings, query, body):
    port = served_strings[1]
    _check_reply(*_request(port, "GET", "/recommend?" + urllib.parse.quote(query, safe="=&,+%")))
    _check_reply(*_request(port, "POST", "/recommend", body, {"Content-Type": "application/json"}))


# ------------------------------------------------------------------------------ the bugs the fuzzing found
@pytest.mark.parametrize(
    "method, target, body, headers, message",
    [
        # An id beyond int64 overflowed numpy's conversion: 500 "OverflowError: Python int too large ...".
        ("GET", "/recommend?items=9223372036854775808", None, {}, "item ids [9223372036854775808] are outside"),
        ("POST", "/recommend", b'{"histories": [[9223372036854775808]]}', {}, "item ids [9223372036854775808]"),
        # A JSON body nested deeper than Python's recursion limit: 500 "RecursionError: ...".
        ("POST", "/recommend", b"[" * 100_000, {}, "the body must be JSON: nested too deeply"),
        # A negative Content-Length read until the client closed the connection: no reply at all.
        ("POST", "/recommend", b'{"users": [1]}', {"Content-Length": "-1"}, "Content-Length must be a number"),
        ("POST", "/recommend", b'{"users": [1]}', {"Content-Length": "abc"}, "Content-Length must be a number"),
    ],
)
def test_a_bad_request_is_a_400_with_one_line(served, method, target, body, headers, message):
    status, reply = _request(served[1], method, target, body, headers)
    assert status == 400 and message in reply["error"], (status, reply)
    _check_reply(status, reply)
