"""Ray Jobs API glue: submit a training run to a cluster's dashboard address, follow it, stop it.

``submit_training(config, address)`` ships two things as the job's runtime environment:

    working_dir   the bigrank project directory (without .venv, data, runs, .git, caches), so the cluster
                  runs the same code as the submitter;
    env_vars      BIGRANK_JOB_CONFIG = the resolved config as YAML (``--set`` overrides applied, relative
                  paths made absolute on the submitting machine), and RAY_JOB_STOP_WAIT_TIME_S: how long
                  ``bigrank stop`` lets the run stop at a step boundary before Ray SIGKILLs it.

and runs the entrypoint ``python -m bigrank.run`` (``bigrank.run.main``), which trains that config with Ray
Train on the cluster the job runs in (the run layer's ``train``, with its pre-flight). Paths in
the config must therefore exist on the cluster: on one machine (or NFS) the resolved local paths do; for a
remote cluster point ``data.root`` / ``run_dir`` at shared storage (``--set data.root=/mnt/shared/...``).

Authentication. Ray 2.60 heads started with ``ray start`` require a token on every dashboard request. The
token is read from ``RAY_AUTH_TOKEN``, the file named by ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``
(where ``ray start`` writes it on the head) and sent as ``Authorization: Bearer <token>``; a 401/403 answer
becomes an error that says where to put the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bigrank.config import dump_config
from bigrank.errors import CommandError
from bigrank.ray_runtime import read_auth_token
from bigrank.signals import STOP_GRACE_SECONDS, held_stop_signals

__all__ = [
    "CONFIG_ENV",
    "ENTRYPOINT_MODULE",
    "JobsError",
    "TERMINAL_STATUSES",
    "check_submission_id",
    "connect",
    "follow_logs",
    "job_logs",
    "job_status",
    "normalize_address",
    "project_dir",
    "stop_job",
    "submit_training",
    "wait_for_job",
]

CONFIG_ENV = "BIGRANK_JOB_CONFIG"
# The module a submitted job runs (``python -m ...``): the run layer's Jobs entrypoint.
ENTRYPOINT_MODULE = "bigrank.run"
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
# Left out of the uploaded working directory (Ray's limit is 100 MiB; data and runs live on shared storage).
# gitignore syntax: the leading "/" anchors a name at the project root ("data" alone would also drop the
# bigrank/data package).
WORKING_DIR_EXCLUDES = [
    "/.venv",
    "/.venv-cuda",
    "/data",
    "/runs",
    "/.git",
    "/build",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    "*.egg-info",
]
_SUBMISSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_CONNECT_TIMEOUT_S = 5.0
_AGENT_WAIT_S = 60.0
_STOP_POLL_S = 0.1  # how often following a job's log looks at its stop event
# `bigrank stop` (Ray Jobs) SIGTERMs the entrypoint and SIGKILLs it RAY_JOB_STOP_WAIT_TIME_S later (Ray's default:
# 3 s). The entrypoint's workers stop at a step boundary with a final checkpoint and get STOP_GRACE_SECONDS for
# it (bigrank.launch.ray_train): the job's supervisor, which reads this from the job's env_vars, waits that long
# and a few seconds for the driver to leave Ray.
_STOP_WAIT_ENV = {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_SECONDS + 10)}


class JobsError(CommandError):
    """A Jobs API problem the user can fix (unreachable address, missing token, unknown job)."""


def project_dir() -> Path:
    """The directory holding the ``bigrank`` package (the job's working directory)."""
    return Path(__file__).resolve().parents[2]


def normalize_address(address: str | None) -> str:
    """``http://HOST:PORT`` from ``address`` or ``RAY_ADDRESS`` (``HOST:PORT`` gets ``http://``); the dashboard
    port (8265 by default), not the GCS port 6379."""
    address = (address or os.environ.get("RAY_ADDRESS") or "").strip().rstrip("/")
    if not address:
        raise JobsError("no cluster address: pass --address http://HOST:8265 (the head's dashboard) or set RAY_ADDRESS")
    if "://" not in address:
        address = f"http://{address}"
    looks_wrong = f"cluster address {address!r} must look like http://HOST:8265 (the Ray dashboard)"
    try:
        parsed = urlparse(address)
        # What the connection will do with them: a port outside 0-65535 or not a number, or a host name the
        # socket layer cannot encode (a label longer than 63 characters or empty), raise ValueError here.
        if parsed.hostname:
            parsed.hostname.encode("idna")
        parsed.port  # noqa: B018 - read for its check
    except ValueError as error:  # UnicodeError is one
        raise JobsError(f"{looks_wrong}: {error}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise JobsError(looks_wrong)
    return address


def check_submission_id(job_id: str) -> str:
    """``job_id`` when the cluster can use it as a submission id (it names the job's log file and its URL
    path): letters, digits, ``.``, ``_`` and ``-``, starting with a letter or digit; JobsError otherwise."""
    if not _SUBMISSION_ID.fullmatch(job_id):
        raise JobsError(
            f"job id {job_id!r} must be letters, digits, '.', '_' and '-' (it names the job's log file and URL)"
        )
    return job_id


def _token_help(address: str) -> str:
    return (
        f"the Ray cluster at {address} requires token authentication. Copy the head's token (on the head: "
        "`ray get-auth-token`, or the file ~/.ray/auth_token) to ~/.ray/auth_token on this machine, or set "
        "RAY_AUTH_TOKEN=<token> (RAY_AUTH_TOKEN_PATH=<file> also works)"
    )


def _check_reachable(address: str, timeout: float = _CONNECT_TIMEOUT_S) -> None:
    parsed = urlparse(address)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            pass
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        raise JobsError(
            f"cannot reach the Ray dashboard at {address}: {reason}. Is the head running with its dashboard "
            f"on that host and port (cluster/local_cluster.sh start; `ray start --head --dashboard-host ...`)?"
        ) from None


def connect(address: str | None):
    """A ``JobSubmissionClient`` for ``address`` (``http://HOST:8265``) with the auth token when there is one.

    Fails within ~5 s when nothing listens there (JobsError naming the address)."""
    address = normalize_address(address)
    _check_reachable(address)
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    token = read_auth_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        return JobSubmissionClient(address, headers=headers)
    except AuthenticationError:
        if token:
            raise JobsError(f"the token was rejected; {_token_help(address)}") from None
        raise JobsError(_token_help(address)) from None
    except ConnectionError as error:
        raise JobsError(f"cannot connect to the Ray dashboard at {address}: {error}") from None


def _call(client, what: str, fn, *args, **kwargs):
    """Run a client call, turning auth and unknown-job errors into JobsError."""
    from ray.exceptions import AuthenticationError

    try:
        return fn(*args, **kwargs)
    except AuthenticationError:
        raise JobsError(_token_help(client.get_address())) from None
    except RuntimeError as error:
        text = str(error)
        if "404" in text or "does not exist" in text:
            raise JobsError(f"{what}: no such job on {client.get_address()} ({text})") from None
        raise


def submit_training(
    config,
    address: str | None,
    *,
    python: str | None = None,
    submission_id: str | None = None,
    working_dir: str | os.PathLike | None = None,
) -> str:
    """Submit a training job for ``config`` (a resolved Config); returns the submission id (``submission_id``,
    checked by :func:`check_submission_id`; default ``bigrank-<run dir name>-<time>``).

    The entrypoint is ``{python} -m bigrank.run``: ``python`` must be the cluster's interpreter with
    the pinned stack. Default: this interpreter for a head on this machine (127.0.0.1 / localhost), else
    ``python`` from the cluster's PATH (the images in docker/ put theirs first).
    """
    if submission_id is not None:
        check_submission_id(submission_id)
    if python is not None and not python.strip():
        raise JobsError("--python must name the cluster's Python interpreter (empty: use the default)")
    client = connect(address)
    if python is None:
        host = urlparse(normalize_address(address)).hostname
        python = sys.executable if host in ("127.0.0.1", "localhost", "::1") else "python"
    directory = Path(working_dir) if working_dir else project_dir()
    if submission_id is None:
        run_name = Path(config.run_dir).name or "run"
        submission_id = f"bigrank-{run_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    runtime_env = {
        "working_dir": str(directory),
        "excludes": list(WORKING_DIR_EXCLUDES),
        "env_vars": {CONFIG_ENV: dump_config(config), **_STOP_WAIT_ENV},
    }
    # A head that has just started answers "No available agent to submit job" until its job agent is up.
    deadline = time.monotonic() + _AGENT_WAIT_S
    while True:
        try:
            return _call(
                client,
                "submit",
                client.submit_job,
                entrypoint=f"{shlex.quote(python)} -m {ENTRYPOINT_MODULE}",
                submission_id=submission_id,
                runtime_env=runtime_env,
                metadata={"bigrank_run_dir": config.run_dir},
            )
        except RuntimeError as error:
            if "No available agent" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(2.0)


def job_status(address: str | None, job_id: str) -> dict[str, Any]:
    """``{"status", "message", "entrypoint", "start_time", "end_time"}`` of a job."""
    client = connect(address)
    info = _call(client, f"status of {job_id}", client.get_job_info, job_id)
    return {
        "job": job_id,
        "status": str(getattr(info.status, "value", info.status)),
        "message": info.message,
        "entrypoint": info.entrypoint,
        "start_time": info.start_time,
        "end_time": info.end_time,
        "metadata": info.metadata,
    }


def job_logs(address: str | None, job_id: str) -> str:
    """The job's whole log so far."""
    client = connect(address)
    return _call(client, f"logs of {job_id}", client.get_job_logs, job_id)


def follow_logs(address: str | None, job_id: str, out=None, stop: threading.Event | None = None) -> bool:
    """Print the job's log as it grows until the job ends (the Jobs API's log stream), or until ``stop`` is set
    (looked at every ``_STOP_POLL_S``): True when the log ended, False when ``stop`` ended the following.

    A command stops it through ``stop``, the event its signal handler sets (``bigrank.signals.graceful_stop``),
    never through an exception raised from the handler: a signal that lands while a finaliser runs (urllib3's
    connection pools are finalised during garbage collection) has that exception swallowed by Python ("Exception
    ignored in: <finalize object>"), and the following went on until the job ended."""
    out = out or sys.stdout
    client = connect(address)
    _call(client, f"logs of {job_id}", client.get_job_info, job_id)  # unknown job → clear error

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    async def follow() -> bool:
        tailing = asyncio.ensure_future(tail())
        while stop is None or not stop.is_set():
            done, _ = await asyncio.wait({tailing}, timeout=_STOP_POLL_S)
            if done:
                tailing.result()  # the stream's error, if it failed
                return True
        tailing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tailing
        return False

    # A second signal stops at once with its exception (graceful_stop): never inside the loop's set-up, so the
    # loop is built in a held block (entering `with asyncio.Runner()` would build it before the block).
    runner = asyncio.Runner()
    try:
        with held_stop_signals():
            runner.get_loop()
        return runner.run(follow())
    finally:
        runner.close()  # closes the loop and its log stream however the follow ends


def wait_for_job(
    address: str | None,
    job_id: str,
    *,
    poll_s: float = 2.0,
    timeout_s: float | None = None,
    stop: threading.Event | None = None,
) -> str | None:
    """Poll until the job is SUCCEEDED, FAILED or STOPPED; returns that status (TimeoutError after timeout_s),
    or None once ``stop`` is set (see :func:`follow_logs`)."""
    client = connect(address)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    stop = stop or threading.Event()
    while not stop.is_set():
        status = str(getattr(_call(client, job_id, client.get_job_status, job_id), "value", ""))
        if status in TERMINAL_STATUSES:
            return status
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} is still {status} after {timeout_s} s")
        stop.wait(poll_s)
    return None


def stop_job(address: str | None, job_id: str) -> bool:
    """Ask the cluster to stop the job; True when it was running."""
    client = connect(address)
    return bool(_call(client, f"stop {job_id}", client.stop_job, job_id))
