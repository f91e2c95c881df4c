"""CLI commands for Ray Jobs: ``bigrank submit``, ``bigrank status``, ``bigrank logs``, ``bigrank stop``.

All take ``--address http://HOST:8265`` (the head's dashboard; default ``RAY_ADDRESS``). ``submit`` checks
the config locally (unknown keys, bad values) before anything is sent.
"""

from __future__ import annotations

import argparse
import sys

from bigrank.config import add_override_argument, load_config
from bigrank.errors import Terminated
from bigrank.launch import jobs
from bigrank.signals import graceful_stop, raise_for


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray head's dashboard, http://HOST:8265 (default: RAY_ADDRESS)",
    )


def register(subparsers) -> None:
    """Add the Ray Jobs sub-commands to the ``bigrank`` parser."""
    submit = subparsers.add_parser(
        "submit",
        help="submit a training run to a Ray cluster (Ray Jobs API)",
        description="Ship this project directory and the resolved CONFIG to a Ray cluster and train there with "
        "Ray Train. Paths in the config must exist on the cluster (shared storage).",
    )
    submit.add_argument("config", metavar="CONFIG", help="YAML config file (see configs/)")
    _add_address(submit)
    add_override_argument(submit)
    submit.add_argument(
        "--wait",
        action="store_true",
        help="follow the job's log until it ends; exit 1 unless it succeeded. Ctrl+C / SIGTERM stop following "
        "(exit 130 / 143); the job keeps running (bigrank stop JOB stops it)",
    )
    submit.add_argument(
        "--job-id", default=None, help="submission id: letters, digits, . _ - (default: bigrank-<run>-<time>)"
    )
    submit.add_argument(
        "--python",
        default=None,
        help="the cluster's Python interpreter (default: this one for a head on 127.0.0.1, else `python`)",
    )
    submit.set_defaults(func=run_submit)

    status = subparsers.add_parser("status", help="show the status of a submitted job")
    status.add_argument("job", metavar="JOB", help="submission id printed by bigrank submit")
    _add_address(status)
    status.set_defaults(func=run_status)

    logs = subparsers.add_parser("logs", help="print the log of a submitted job")
    logs.add_argument("job", metavar="JOB", help="submission id")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    _add_address(logs)
    logs.set_defaults(func=run_logs)

    stop = subparsers.add_parser("stop", help="stop a submitted job")
    stop.add_argument("job", metavar="JOB", help="submission id")
    _add_address(stop)
    stop.set_defaults(func=run_stop)


def run_submit(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    address = jobs.normalize_address(args.address) if (args.address or "").strip() else args.address
    job_id = jobs.submit_training(config, address, python=args.python, submission_id=args.job_id)
    where = address or "RAY_ADDRESS"
    at = f" --address {address}" if address else ""  # without: RAY_ADDRESS, as for this command
    print(f"submitted job {job_id} to {where} (run dir {config.run_dir})", flush=True)
    if not args.wait:
        print(f"follow it with: bigrank logs {job_id} --follow{at}")
        return 0
    # The first SIGINT / SIGTERM only sets the stop event, which the follow and the wait look at (an exception
    # raised from the handler can be swallowed: bigrank.launch.jobs.follow_logs); a second one stops at once.
    try:
        with graceful_stop() as stop:
            if jobs.follow_logs(address, job_id, stop=stop.event):
                status = jobs.wait_for_job(address, job_id, stop=stop.event)
        if stop.signum is not None:
            raise_for(stop.signum)
    except (KeyboardInterrupt, Terminated) as stopped:
        # As `ray job submit` does: the job is the cluster's; only the following stops. Say how to go on.
        why = "interrupted" if isinstance(stopped, KeyboardInterrupt) else "stopped by SIGTERM"
        print(
            f"\nbigrank submit: {why}; stopped following job {job_id}, which keeps running on the cluster:\n"
            f"  follow it: bigrank logs {job_id} --follow{at}\n"
            f"  stop it:   bigrank stop {job_id}{at}",
            file=sys.stderr,
        )
        return 130 if isinstance(stopped, KeyboardInterrupt) else 143
    print(f"job {job_id} {status}")
    return 0 if status == "SUCCEEDED" else 1


def run_status(args: argparse.Namespace) -> int:
    info = jobs.job_status(args.address, args.job)
    print(f"job         {info['job']}")
    print(f"status      {info['status']}")
    if info.get("message"):
        print(f"message     {info['message']}")
    print(f"entrypoint  {info['entrypoint']}")
    run_dir = (info.get("metadata") or {}).get("bigrank_run_dir")
    if run_dir:
        print(f"run dir     {run_dir}")
    return 0


def run_logs(args: argparse.Namespace) -> int:
    if args.follow:  # until the job ends; SIGINT / SIGTERM stop following (exit 130 / 143), not the job
        with graceful_stop() as stop:
            jobs.follow_logs(args.address, args.job, stop=stop.event)
        if stop.signum is not None:
            raise_for(stop.signum)
    else:
        sys.stdout.write(jobs.job_logs(args.address, args.job))
    return 0


def run_stop(args: argparse.Namespace) -> int:
    stopped = jobs.stop_job(args.address, args.job)
    print(f"job {args.job}: {'stop requested' if stopped else 'was not running'}")
    return 0
