"""Fuzzed arguments of ``bigrank submit`` (Hypothesis), checked before anything reaches Ray (no Ray starts here,
and no address that could answer is ever used): a cluster address normalises to one the connection can use or
raises one JobsError line; ``bigrank submit`` with any address, job id, interpreter and overrides exits with
status 2 and one line on stderr (nothing listens at the address it is given). The plain tests at the end pin
each bug the fuzzing found."""

from __future__ import annotations

import contextlib
import io
import socket
from urllib.parse import urlparse

import pytest
import yaml
from fuzz_strategies import KEYS, VALUE_TEXTS, assert_one_line
from hypothesis import given
from hypothesis import strategies as st

from bigrank.cli import main
from bigrank.launch.jobs import JobsError, check_submission_id, normalize_address

HOSTS = st.one_of(
    st.sampled_from(["127.0.0.1", "localhost", "[::1]", "[::1", "::1", "head", "a" * 64, "a..b", ".", "é.example"]),
    st.from_regex(r"[a-z0-9.\-]{0,70}", fullmatch=True),
    st.text(max_size=12),
)
PORTS = st.one_of(st.integers(min_value=-1, max_value=70000).map(str), st.sampled_from(["", "abc", "8265 ", "+1"]))
SCHEMES = st.sampled_from(["", "http://", "https://", "ray://", "ftp://"])
ADDRESSES = st.one_of(
    st.builds(lambda scheme, host, port: f"{scheme}{host}:{port}", SCHEMES, HOSTS, PORTS),
    st.builds(lambda scheme, host: f"{scheme}{host}", SCHEMES, HOSTS),
    st.text(max_size=20),
)
JOB_IDS = st.one_of(
    st.none(),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
    st.sampled_from(["", "a/b", "a?b", "a#b", "a b", "../x", "-x", "x\n"]),
    st.text(max_size=10),
)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@given(address=ADDRESSES)
def test_an_address_normalises_to_one_the_connection_can_use_or_is_named(address):
    try:
        normalized = normalize_address(address)
    except JobsError as error:
        assert_one_line(error)
        return
    parsed = urlparse(normalized)
    assert parsed.scheme in ("http", "https") and parsed.hostname
    parsed.hostname.encode("idna")  # what socket.create_connection does with it
    assert parsed.port is None or 0 <= parsed.port <= 65535


@given(job_id=JOB_IDS.filter(lambda job_id: job_id is not None))
def test_a_job_id_is_usable_or_named(job_id):
    try:
        assert check_submission_id(job_id) == job_id
    except JobsError as error:
        assert_one_line(error)
        return
    assert job_id.strip() == job_id and not set("/?#% \\") & set(job_id) and not job_id.startswith(".")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-submit")
    path = root / "submit.yaml"
    path.write_text(yaml.safe_dump({"data": {"root": str(root / "data")}, "run_dir": str(root / "run")}))
    return path


@given(
    address=ADDRESSES,
    job_id=JOB_IDS,
    python=st.none() | st.sampled_from(["", " ", "python3", "/usr/bin/python"]) | st.text(max_size=8),
    overrides=st.lists(st.tuples(st.sampled_from(KEYS), VALUE_TEXTS).map("=".join), max_size=2),
)
def test_submit_cli_answers_bad_arguments_with_status_2_and_one_line(config_file, address, job_id, python, overrides):
    """Whatever the arguments, ``bigrank submit`` sends nothing: an address that normalises is replaced by a
    closed loopback port, so a submission that passes every check fails at the connection (status 2 too)."""
    try:
        normalize_address(address)
        address = f"http://127.0.0.1:{_closed_port()}"
    except JobsError:
        pass
    argv = ["submit", str(config_file), f"--address={address}"]  # "=": a value may start with "-"
    argv += [] if job_id is None else [f"--job-id={job_id}"]
    argv += [] if python is None else [f"--python={python}"]
    argv += [f"--set={text}" for text in overrides]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    err = stderr.getvalue()
    assert code == 2 and err.startswith("bigrank submit: error: ") and err.count("\n") == 1, (code, err)


# ------------------------------------------------------------------------------ the bugs the fuzzing found
@pytest.mark.parametrize(
    "address, message",
    [
        ("http://[::1", "Invalid IPv6 URL"),  # ValueError from urlparse, naming no address
        ("http://head:99999", "Port out of range 0-65535"),  # ValueError from the connection's urlparse().port
        ("head:abc", "Port could not be cast to integer value as 'abc'"),
        ("http://" + "a" * 64 + ":8265", "label too long"),  # UnicodeError from the socket layer's idna
        ("http://a..b:8265", "label empty or too long"),
    ],
)
def test_an_address_the_connection_cannot_use_is_one_error_naming_it(config_file, address, message):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        assert main(["submit", str(config_file), f"--address={address}"]) == 2
    err = stderr.getvalue()
    assert f"cluster address '{address if '://' in address else 'http://' + address}' must look like" in err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("argument", ["--job-id=", "--job-id=a/b", "--job-id=a?b", "--job-id=x y", "--python= "])
def test_a_job_id_or_interpreter_the_cluster_cannot_use_is_refused_before_connecting(config_file, argument):
    """Before: sent to the cluster, where an id with "/" names a log file in a missing directory and a URL that
    `bigrank status` cannot reach, and an empty one lists every job; here nothing listens, so the error proves
    that the check comes before the connection."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        assert main(["submit", str(config_file), f"--address=http://127.0.0.1:{_closed_port()}", argument]) == 2
    err = stderr.getvalue()
    assert ("job id" in err or "--python" in err) and "cannot reach" not in err and err.count("\n") == 1, err
