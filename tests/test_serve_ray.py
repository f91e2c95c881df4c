"""``bigrank serve --ray``: a real Ray Serve application on loopback, one Ray runtime for the module.

Its answers equal the stdlib server's and a numpy brute force, also by string original ids (and by dense ids with
``dense_ids``); bad parameters and unknown ids get the same 400s; a full
queue answers 503 with Retry-After; a replica killed during a stream of requests costs each client at most the
requests it held (every answer given is right) and the application recovers.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from bigrank.export.recommend import Recommender
from bigrank.export.seen import SeenItems
from bigrank.train.launcher import free_port
from tests.helpers import HANG_GUARD_S, stdlib_server
from tests.id_datasets import ODD_ITEM_IDS, ODD_USER_IDS, export_random, string_ids, write_id_dataset

# Ray Serve's own config models use a pydantic idiom that pydantic 2 deprecates; not ours to fix.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")]


@pytest.fixture(scope="module", params=["proxy", "haproxy"])
def apps(request, demo_export, tmp_path_factory):
    """The demo export (history tower, seen table), the stdlib server, and two Ray Serve applications:
    ``/`` (2 replicas) and ``/tight`` (1 replica, 1 ongoing + 1 queued request), behind Serve's Python proxy
    and then behind HAProxy with direct ingress (each a Ray runtime of its own: Serve reads it at start). Also an
    export of string original ids, served by the stdlib server and by ``/strings`` (original ids) and
    ``/strings-dense`` (``dense_ids``)."""
    import ray
    from ray import serve

    from bigrank.export.ray_serve import (
        DRAINING_PERIOD_ENV,
        HAPROXY_ENVIRONMENT,
        ServeSettings,
        deploy,
        set_ingress_environment,
    )

    rec = Recommender(demo_export.path)
    export = str(demo_export.path)
    root = tmp_path_factory.mktemp("serve-ray-strings")
    rng = np.random.default_rng(7)
    ids = {"users": string_ids("u", 60, ODD_USER_IDS, rng), "items": string_ids("sku", 40, ODD_ITEM_IDS, rng)}
    write_id_dataset(root / "strings-data", ids["users"], ids["items"], seed=7)
    string_tables = export_random(root / "strings", root / "strings-data", 60, 40)
    string_rec = Recommender(root / "strings")
    saved = {name: os.environ.get(name) for name in (*HAPROXY_ENVIRONMENT, DRAINING_PERIOD_ENV)}
    set_ingress_environment(request.param)  # Ray's processes read it when they start
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        port = free_port()
        url = deploy(ServeSettings(export, replicas=2, replica_cpus=0.5, search_threads=1), port=port)
        tight = ServeSettings(
            export, max_ongoing_requests=1, max_queued_requests=1, max_batch_size=1, replica_cpus=0.5, search_threads=1
        )
        tight_url = deploy(tight, port=port, name="tight", route_prefix="/tight")
        small = {"replica_cpus": 0.5, "search_threads": 1}
        strings_url = deploy(
            ServeSettings(str(root / "strings"), **small), port=port, name="strings", route_prefix="/strings"
        )
        strings_dense_url = deploy(
            ServeSettings(str(root / "strings"), dense_ids=True, **small),
            port=port,
            name="strings-dense",
            route_prefix="/strings-dense",
        )
        with stdlib_server(rec) as stdlib, stdlib_server(string_rec) as stdlib_strings:
            yield {
                "ray": f"{url}",
                "tight": tight_url,
                "stdlib": stdlib,
                "rec": rec,
                "seen": SeenItems(demo_export.dataset),
                "items": demo_export.tables["items"].numpy(),
                "strings": {
                    "ray": strings_url,
                    "ray_dense": strings_dense_url,
                    "stdlib": stdlib_strings,
                    "rec": string_rec,
                    "ids": ids,
                    **string_tables,
                },
            }
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in saved.items():  # the next module's Ray gets the environment this one found
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def request(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict, dict]:
    """``(status, JSON body, headers)`` of a GET (or a POST of ``body``)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        raw = error.read()
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError:
            payload = {"text": raw.decode(errors="replace")}
        return error.code, payload, dict(error.headers)


def _ids(rows) -> list[int]:
    return [row["item_id"] for row in rows]


def _reference(apps, user: int, k: int, exclude=()) -> list[int]:
    """Numpy brute force: the top-k item ids of ``user``'s vector, skipping ``exclude``."""
    scores = apps["items"] @ apps["rec"].user_vector(user)
    scores[list(exclude)] = -np.inf
    return np.argsort(-scores, kind="stable")[:k].tolist()


def test_ray_answers_equal_the_stdlib_server_and_a_brute_force(apps):
    rec, seen = apps["rec"], apps["seen"]
    users = [0, 5, 17, 400, rec.num_users - 1]
    for user in users:
        for extra, exclude in (("", ()), ("&exclude_seen=1", seen.items_of(user).tolist())):
            query = f"/recommend?user={user}&k=12{extra}"
            status, ray_body, _ = request(apps["ray"] + query)
            assert status == 200, ray_body
            _, std_body, _ = request(apps["stdlib"] + query)
            assert _ids(ray_body["items"]) == _ids(std_body["items"]) == _reference(apps, user, 12, exclude)
            np.testing.assert_allclose(
                [r["score"] for r in ray_body["items"]], [r["score"] for r in std_body["items"]], rtol=1e-5
            )
    status, body, _ = request(apps["ray"] + "/recommend?items=1,2,3&k=4")
    assert status == 200 and _ids(body["items"]) == _ids(rec.recommend_items_history([1, 2, 3], 4))

    # POST: many users searched as one batch give the same answers as one at a time.
    batch = list(range(0, rec.num_users, 37))
    status, body, _ = request(apps["ray"] + "/recommend", {"users": batch, "k": 10, "exclude_seen": True})
    assert status == 200 and len(body["results"]) == len(batch)
    for user, result in zip(batch, body["results"], strict=True):
        assert result["user"] == user
        assert _ids(result["items"]) == _reference(apps, user, 10, seen.items_of(user).tolist())
    _, std_body, _ = request(apps["stdlib"] + "/recommend", {"users": batch, "k": 10, "exclude_seen": True})
    assert [_ids(r["items"]) for r in std_body["results"]] == [_ids(r["items"]) for r in body["results"]]
    histories = [[1, 2, 3], [40], [7, 700, 1400]]
    status, body, _ = request(apps["ray"] + "/recommend", {"histories": histories, "k": 5})
    assert status == 200
    assert [_ids(r["items"]) for r in body["results"]] == [_ids(rec.recommend_items_history(h, 5)) for h in histories]
    status, health, _ = request(apps["ray"] + "/health")
    assert status == 200 and health["num_items"] == rec.num_items and health["exclude_seen"] is True


@pytest.mark.parametrize(
    "query, body, message",
    [
        ("user=abc", None, "user must be an integer"),
        ("user=1&k=0", None, "k must lie in"),
        ("user=999999", None, "outside"),
        ("k=3", None, "exactly one of user"),
        ("user=1&colour=red", None, "unknown parameters"),
        ("items=1,x", None, "items must be an integer"),
        ("", {"users": [1], "histories": [[2]]}, "exactly one of"),
        ("", {"users": "1"}, "non-empty JSON list"),
        ("", {"users": [1], "k": 5000}, "k must lie in"),
    ],
)
def test_bad_parameters_answer_400_like_the_stdlib_server(apps, query, body, message):
    status, ray_body, _ = request(apps["ray"] + "/recommend?" + query, body)
    _, std_body, _ = request(apps["stdlib"] + "/recommend?" + query, body)
    assert status == 400 and message in ray_body["error"]
    assert ray_body == std_body


def test_a_full_queue_answers_503_with_a_retry_hint(apps):
    """1 ongoing + 1 queued request at most: of 24 simultaneous slow requests, some are refused at once."""
    slow = {"users": list(range(1000)), "k": 1000}
    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(lambda _: request(apps["tight"] + "/recommend", slow), range(24)))
    statuses = [status for status, _, _ in answers]
    assert set(statuses) <= {200, 503}, statuses
    assert 200 in statuses and 503 in statuses, statuses
    refused = next(headers for status, _, headers in answers if status == 503)
    assert {k.lower(): v for k, v in refused.items()}.get("retry-after") == "1"


def test_ray_takes_and_returns_string_ids_like_the_stdlib_server(apps):
    """By string original ids: the Ray application's answers equal the stdlib server's (rows with original ids
    and attributes), a brute force, and the dense-ids application's for the same users; bad ids are the same 400."""
    from urllib.parse import quote

    strings = apps["strings"]
    users, items, seen = strings["ids"]["users"], strings["ids"]["items"], strings["rec"].seen
    for dense in (0, users.index("00042"), users.index("a,b"), users.index("long-" * 50), 59):
        query = f"/recommend?user={quote(users[dense], safe='')}&k=6&exclude_seen=1"
        status, ray_body, _ = request(strings["ray"] + query)
        assert status == 200, ray_body
        _, std_body, _ = request(strings["stdlib"] + query)
        assert ray_body["user"] == users[dense] and ray_body["items"] == std_body["items"]
        scores = strings["items"] @ strings["users"][dense]
        scores[seen.items_of(dense)] = -np.inf
        expected = np.argsort(-scores, kind="stable")[:6].tolist()
        assert _ids(ray_body["items"]) == expected and [r["original_id"] for r in ray_body["items"]] == [
            items[i] for i in expected
        ]
        _, dense_body, _ = request(strings["ray_dense"] + f"/recommend?user={dense}&k=6&exclude_seen=1")
        assert dense_body["user"] == dense and dense_body["items"] == ray_body["items"]
    body = {"users": users[:5], "k": 4}
    status, ray_body, _ = request(strings["ray"] + "/recommend", body)
    assert status == 200 and [r["user"] for r in ray_body["results"]] == users[:5]
    assert ray_body == request(strings["stdlib"] + "/recommend", body)[1]
    body = {"histories": [["sku-9-A", "品-1"], ["c,d"]], "k": 5}
    status, ray_body, _ = request(strings["ray"] + "/recommend", body)
    assert status == 200 and ray_body == request(strings["stdlib"] + "/recommend", body)[1]
    assert ray_body["results"][0]["items_given"] == ["sku-9-A", "品-1"]
    assert request(strings["ray"] + "/health")[1]["user_ids"] == "string"
    assert request(strings["ray_dense"] + "/health")[1]["user_ids"] == "dense"
    for query, body, message in (
        ("user=u-nobody", None, "unknown user id 'u-nobody'"),
        ("", {"users": [42]}, "user ids of this export are strings"),
        ("items=sku-9-A,nope", None, "unknown item ids 'nope'"),
    ):
        status, ray_body, _ = request(strings["ray"] + "/recommend?" + query, body)
        assert status == 400 and message in ray_body["error"], ray_body
        assert ray_body == request(strings["stdlib"] + "/recommend?" + query, body)[1]


def test_a_killed_replica_fails_at_most_two_requests_a_client_and_the_app_recovers(apps):
    """Three clients stream requests while one of the two replicas is killed. Allowed: each client loses at most
    the request in flight on the killed replica and one routed to it before its death is noticed, as a 5xx or
    (behind HAProxy) a cut connection; over four runs here: 0-1 in all behind Serve's proxy, 2-3 behind HAProxy, 2
    at most a client. Never a 4xx or a wrong answer; every client is answered again after the kill; the
    application gets its second replica back."""
    import ray
    from ray import serve

    users = list(range(0, apps["rec"].num_users, 11))
    expected = {user: _reference(apps, user, 10) for user in users}
    answers, stop = {offset: [] for offset in (0, 7, 14)}, threading.Event()

    def stream(offset: int) -> None:
        position = offset
        while not stop.is_set():
            user = users[position % len(users)]
            try:
                status, body, _ = request(apps["ray"] + f"/recommend?user={user}&k=10", timeout=30)
            except OSError as error:  # behind HAProxy, a request in flight on the killed replica is cut off
                status, body = type(error).__name__, {}
            answers[offset].append((user, status, body))
            position += 1

    def wait_until(condition, what: str) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while not condition():
            assert time.monotonic() < deadline, f"{what}: {[[a[1] for a in got] for got in answers.values()]}"
            time.sleep(0.05)

    threads = [threading.Thread(target=stream, args=(offset,)) for offset in answers]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: all(len(got) >= 3 for got in answers.values()), "each client is answered")
        replicas = [
            actor for actor in ray.util.list_named_actors(all_namespaces=True) if "bigrank#Recommend#" in actor["name"]
        ]
        assert len(replicas) == 2, replicas
        before = {offset: len(got) for offset, got in answers.items()}
        ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=True)
        # Five answers after the kill: a routing that kept sending requests to the dead replica would lose as many.
        wait_until(
            lambda: all(sum(a[1] == 200 for a in got[before[o] :]) >= 5 for o, got in answers.items()),
            "each client is answered again after the kill",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    lost = {offset: [status for _, status, _ in got if status != 200] for offset, got in answers.items()}
    assert all(len(statuses) <= 2 for statuses in lost.values()), lost
    assert all(s in (500, 502, 503) or isinstance(s, str) for statuses in lost.values() for s in statuses), lost
    for user, status, body in (answer for got in answers.values() for answer in got):
        if status == 200:  # every 200 is a correct answer
            assert _ids(body["items"]) == expected[user]

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        app = serve.status().applications["bigrank"]
        states = app.deployments["Recommend"].replica_states
        running = sum(count for state, count in states.items() if str(state).endswith("RUNNING"))
        if str(app.status).endswith("RUNNING") and running == 2:
            break
        time.sleep(1.0)
    else:
        pytest.fail(f"the application did not recover: {serve.status().applications['bigrank']}")
    for user in users[:20]:
        status, body, _ = request(apps["ray"] + f"/recommend?user={user}&k=10")
        assert status == 200 and _ids(body["items"]) == expected[user]
