"""How promptly a stopped command ends: seconds from the signal to the command's exit, and to the end of the last
process it started, for the stops whose outcome tests/test_operations.py checks (exit status, no orphan, every
process ended: those tests bound the wait by a hang guard only, so they say nothing of the speed).

Each case runs the real command on the demo data as the test does, waits for the moment the test signals at (a
first checkpoint written, the workers started, the server answering), sends the signal and polls the command
and its process group (its session for Ray, whose processes make groups of their own) every 10 ms:

* ``train``: `bigrank train --launcher local`, SIGTERM (replicated tables) and Ctrl+C (SIGINT to the process
  group; sharded tables) after the first checkpoint: the workers agree on a step and checkpoint it; SIGKILL of
  the command: the workers end on their own (parent-death signal);
* ``evaluate`` / ``export``: SIGTERM once their 2 workers run;
* ``serve``: SIGTERM to the stdlib server with no request open;
* ``submit``: not a signal: `bigrank submit --wait` to an address where nothing listens, until its error;
* with ``--ray``: `bigrank train --launcher ray` (SIGTERM after the first checkpoint) and `bigrank serve --ray`
  (SIGTERM while serving), each starting its own Ray runtime (about a minute a repeat).

    .venv/bin/python -m benchmarks.bench_stop [--repeats 3] [--ray]

Medians and ranges over the repeats; the machine's load is printed with them: on a loaded machine these
figures mostly measure the load.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bigrank.train.checkpoint import latest_checkpoint
from bigrank.train.launcher import free_port
from tests.helpers import HANG_GUARD_S, group_processes, kill_group, start_command

TRAIN = {"batch_size": 256, "epochs": 1000, "max_steps": 1_000_000, "checkpoint_every": 10, "log_every": 10,
         "progress": False}  # fmt: skip


def _run_config(tmp: Path, data: Path, name: str) -> Path:
    """A 2-worker demo run that trains until it is stopped (checkpoints every 10 steps); returns its YAML."""
    import yaml

    raw = {"data": {"root": str(data)}, "run_dir": str(tmp / name), "seed": 0, "workers": 2, "model": {"dim": 16},
           "train": TRAIN, "eval": {"every_epochs": None, "at_end": False}}  # fmt: skip
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _wait_for(proc: subprocess.Popen, log: Path, ready, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come (exit status {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _time_stop(proc: subprocess.Popen, log: Path, send, status: int, field: int = 2) -> tuple[float, float]:
    """``send(proc)``; seconds until the command exits and until no process of its group (``field`` 3: of its
    session) is left. Raises when the exit status is not ``status``."""
    sent = time.monotonic()
    send(proc)
    exited = None
    while True:
        now = time.monotonic()
        if exited is None and proc.poll() is not None:
            exited = now - sent
            if proc.returncode != status:
                raise RuntimeError(f"exit status {proc.returncode}, expected {status}:\n{log.read_text()[-3000:]}")
        if exited is not None and not group_processes(proc.pid, field):
            return exited, now - sent
        if now - sent > HANG_GUARD_S:
            raise RuntimeError(f"still running {HANG_GUARD_S:.0f} s after the signal:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)


def _case(log: Path, args: list[str], ready, send, status: int, field: int = 2) -> tuple[float, float]:
    proc = start_command(log, *args)
    try:
        ready(proc)
        return _time_stop(proc, log, send, status, field)
    finally:
        kill_group(proc.pid)


def _sigterm(proc):
    proc.send_signal(signal.SIGTERM)


def _ctrl_c(proc):
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends it: to the whole foreground group


def _sigkill(proc):
    proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ray", action="store_true", help="add the Ray cases (train --launcher ray, serve --ray)")
    args = parser.parse_args()
    from bigrank.data.synthetic import generate

    tmp = Path(tempfile.mkdtemp(prefix="bench-stop-"))
    data, log = tmp / "demo", tmp / "command.log"
    generate("demo", data, progress=False)
    # A finished run and its export, for evaluate, export and serve.
    trained = _run_config(tmp, data, "trained")
    cli = [sys.executable, "-m", "bigrank.cli"]
    subprocess.run([*cli, "train", str(trained), "--launcher", "local", "--set", "train.max_steps=20"], check=True,
                   capture_output=True)  # fmt: skip
    export = tmp / "export"
    subprocess.run([*cli, "export", str(tmp / "trained"), "--out", str(export)], check=True, capture_output=True)

    def first_checkpoint(run_dir: Path):
        return lambda proc: _wait_for(proc, log, lambda: latest_checkpoint(run_dir), "a first checkpoint")

    def workers_up(proc):
        _wait_for(proc, log, lambda: len(group_processes(proc.pid)) >= 3, "2 workers")

    def line(text: str):
        return lambda proc: _wait_for(proc, log, lambda: text in log.read_text(), repr(text))

    def train_case(launcher: str, send, status: int, layout: str, field: int = 2):
        def run(repeat: int):
            name = f"{launcher}-{send.__name__}-{repeat}"
            config = _run_config(tmp, data, name)
            args = ["train", str(config), "--launcher", launcher, "--set", f"model.layout={layout}"]
            return _case(log, args, first_checkpoint(tmp / name), send, status, field)

        return run

    def command_case(args: list[str], ready, send, status: int, field: int = 2):
        return lambda repeat: _case(log, args, ready, send, status, field)

    def submit_nowhere(repeat: int):
        address = f"http://127.0.0.1:{free_port()}"
        started = time.monotonic()
        done = subprocess.run([*cli, "submit", str(trained), "--address", address, "--wait"], capture_output=True)
        if done.returncode != 2:
            raise RuntimeError(f"bigrank submit exited {done.returncode}:\n{done.stderr.decode()[-3000:]}")
        seconds = time.monotonic() - started
        return seconds, seconds

    cases = [
        ("train --launcher local, SIGTERM", train_case("local", _sigterm, 143, "replicated")),
        ("train --launcher local, Ctrl+C", train_case("local", _ctrl_c, 130, "sharded")),
        ("train --launcher local, SIGKILL", train_case("local", _sigkill, -signal.SIGKILL, "replicated")),
        ("evaluate --workers 2, SIGTERM",
         command_case(["evaluate", str(tmp / "trained"), "--workers", "2"], workers_up, _sigterm, 143)),
        ("export --workers 2, SIGTERM",
         command_case(["export", str(tmp / "trained"), "--out", str(tmp / "export-again"), "--workers", "2"],
                      workers_up, _sigterm, 143)),
        ("serve, SIGTERM",
         command_case(["serve", str(export), "--port", "0", "--quiet"], line("/recommend?user=0"), _sigterm, 0)),
        ("submit --wait where nothing listens", submit_nowhere),
    ]  # fmt: skip
    if args.ray:
        serve_ray = ["serve", str(export), "--ray", "--port", str(free_port()), "--replica-cpus", "0.5"]
        cases += [
            ("train --launcher ray, SIGTERM", train_case("ray", _sigterm, 143, "replicated")),
            ("serve --ray, SIGTERM", command_case(serve_ray, line("/recommend?user=0"), _sigterm, 0, field=3)),
        ]

    print(f"seconds from the signal to the command's exit and to the end of its last process; {args.repeats} "
          f"repeats: median (min-max)")  # fmt: skip
    print(f"machine load (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs")
    print(f"{'case':<40}{'exit s':>22}{'last process s':>22}")
    for name, run in cases:
        figures = [run(repeat) for repeat in range(args.repeats)]
        cells = []
        for column in zip(*figures, strict=True):
            cells.append(f"{statistics.median(column):.2f} ({min(column):.2f}-{max(column):.2f})")
        print(f"{name:<40}{cells[0]:>22}{cells[1]:>22}", flush=True)
    print(f"machine load (1/5/15 min) after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
