"""The HTTP endpoint answers real requests on loopback (threaded server, urllib client)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import numpy as np
import pytest

from bigrank.export.recommend import Recommender, SeenItems
from tests.helpers import stdlib_server

DIM = 8


@pytest.fixture(scope="module")
def served(demo_export):
    """The demo export (a history table) behind a running server, which answers with the seen items of the demo
    dataset (stopped after the module)."""
    recommender = Recommender(demo_export.path)
    seen = SeenItems(demo_export.dataset)
    with stdlib_server(recommender, seen=seen) as url:
        yield {"url": url, "rec": recommender, "seen": seen, "items": demo_export.tables["items"].numpy()}


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_health(served):
    status, body = get(served["url"] + "/health")
    assert status == 200
    assert body["status"] == "ok" and body["num_items"] == served["rec"].num_items and body["dim"] == DIM


def test_recommend_answers_with_the_exact_top_k(served):
    rec = served["rec"]
    assert rec.user_vector_rule == "table+history_mean"  # vectors include the mean of the train items
    status, body = get(served["url"] + "/recommend?user=5&k=7")
    assert status == 200 and body["user"] == 5 and body["k"] == 7
    scores = served["items"] @ rec.user_vector(5)
    assert [row["item_id"] for row in body["items"]] == np.argsort(-scores, kind="stable")[:7].tolist()
    np.testing.assert_allclose([row["score"] for row in body["items"]], np.sort(scores)[::-1][:7], rtol=1e-5)


def test_recommend_excludes_seen_items_over_http(served):
    k = 50
    rec, seen = served["rec"], served["seen"]
    # A user whose unfiltered top-k holds rated items, so the exclusion has something to remove.
    user = next(u for u in range(rec.num_users) if set(seen.items_of(u).tolist()) & _top_ids(rec, u, k))
    rated = set(seen.items_of(user).tolist())
    status, body = get(served["url"] + f"/recommend?user={user}&k={k}&exclude_seen=1")
    assert status == 200 and len(body["items"]) == k
    got = [row["item_id"] for row in body["items"]]
    assert not set(got) & rated
    scores = served["items"] @ rec.user_vector(user)
    scores[list(rated)] = -np.inf
    assert got == np.argsort(-scores, kind="stable")[:k].tolist()


def _top_ids(rec, user, k):
    return {row["item_id"] for row in rec.recommend(user, k)}


def test_fold_in_over_http(served):
    status, body = get(served["url"] + "/recommend?items=1,2,3&k=4")
    assert status == 200
    assert body["items"] == served["rec"].recommend_items_history([1, 2, 3], 4)
    assert not {1, 2, 3} & {row["item_id"] for row in body["items"]}


@pytest.mark.parametrize(
    "query, message",
    [
        ("user=abc", "user must be an integer"),
        ("user=1&k=0", "k must lie in"),
        ("user=1&k=many", "k must be an integer"),
        ("user=999999", "outside"),
        ("user=-1", "outside"),
        ("k=3", "exactly one of user"),
        ("user=1&items=2", "exactly one of user"),
        ("user=1&colour=red", "unknown parameters"),
        ("user=1&user=2", "more than once"),
        ("user=1&exclude_seen=maybe", "exclude_seen must be 0 or 1"),
        ("items=1,x", "items must be an integer"),
        ("items=5000000", "outside"),
    ],
)
def test_bad_parameters_answer_400_with_a_message(served, query, message):
    status, body = get(served["url"] + "/recommend?" + query)
    assert status == 400
    assert message in body["error"]


def test_unknown_path_is_404(served):
    status, body = get(served["url"] + "/nothing")
    assert status == 404 and "unknown path" in body["error"]


@pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")  # Ray Serve's pydantic models
def test_serve_config_and_rayservice_manifest_deploy_the_same_valid_application(tmp_path):
    """cluster/serve-bigrank.yaml is a valid Ray Serve config whose args build the application, and the
    RayService manifest carries the same application."""
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from bigrank.export.ray_serve import DEPLOYMENT_NAME, ServeSettings, app_builder

    cluster = Path(__file__).resolve().parents[1] / "cluster"
    config = yaml.safe_load((cluster / "serve-bigrank.yaml").read_text())
    service = yaml.safe_load((cluster / "kuberay/rayservice.yaml").read_text())
    inner = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert {key: value for key, value in config.items() if key != "http_options"} == inner
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "bigrank.export.ray_serve:app_builder"
    settings = ServeSettings(**app["args"])
    assert settings.autoscale_range() == (2, 16) and settings.max_queued_requests > 0
    bound = app_builder(app["args"])  # builds (binds) without deploying
    assert bound._bound_deployment.name == DEPLOYMENT_NAME
    with pytest.raises(ValueError, match="unbounded"):
        ServeSettings(export=str(tmp_path), max_queued_requests=-1)


def test_ingress_choice_sets_and_clears_rays_haproxy_environment(monkeypatch):
    """``--ingress haproxy`` (the CLI default) turns on Ray 2.60's HAProxy + direct ingress for a Ray started
    here, with a short draining window for its replicas (Ray's 30 s one made every stop take 30+ s) unless the
    user set one; ``proxy`` clears it; anything else is refused."""
    from bigrank.cli import build_parser
    from bigrank.export.ray_serve import (
        DRAINING_PERIOD_ENV,
        EMBEDDED_DRAINING_PERIOD_S,
        HAPROXY_ENVIRONMENT,
        drain_bound_s,
        set_ingress_environment,
    )

    for name in (*HAPROXY_ENVIRONMENT, DRAINING_PERIOD_ENV):
        monkeypatch.delenv(name, raising=False)
    assert build_parser().parse_args(["serve", "DIR", "--ray"]).ingress == "haproxy"
    assert drain_bound_s(haproxy=True) == 35.0  # Ray's own window: the stop this setting avoids
    set_ingress_environment("haproxy")
    assert {name: os.environ.get(name) for name in HAPROXY_ENVIRONMENT} == HAPROXY_ENVIRONMENT
    assert float(os.environ[DRAINING_PERIOD_ENV]) == EMBEDDED_DRAINING_PERIOD_S < 5
    assert drain_bound_s(haproxy=True) == EMBEDDED_DRAINING_PERIOD_S + 5 and drain_bound_s(haproxy=False) == 5
    monkeypatch.setenv(DRAINING_PERIOD_ENV, "20")
    set_ingress_environment("haproxy")
    assert os.environ[DRAINING_PERIOD_ENV] == "20"
    set_ingress_environment("proxy")
    assert not any(name in os.environ for name in HAPROXY_ENVIRONMENT)
    with pytest.raises(ValueError, match="ingress must be one of"):
        set_ingress_environment("nginx")
