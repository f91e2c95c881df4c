"""The local launcher on torch elastic, with real processes and gloo groups: a failed group starts again up to
``max_restarts`` times, and the caller's signal handlers are its own again afterwards. (Failures naming their
rank: tests/test_train.py; signals and exit statuses of `bigrank train`: tests/test_operations.py.)"""

from __future__ import annotations

import os
import signal

import pytest

from bigrank.train.launcher import WorkerError, launch_local


def _fail_once_on_rank_one():
    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and dist.get_rank() == 1:
        raise ValueError("first attempt fails on purpose")
    dist.barrier()
    return attempt


def test_a_failed_group_restarts_up_to_max_restarts_and_the_signal_handlers_come_back():
    def handler(signum, frame):
        pass

    # Handlers of the caller's own (whatever the test run inherited: a background run ignores SIGINT).
    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert launch_local(_fail_once_on_rank_one, 2, max_restarts=1, timeout=180) == [1, 1]
        # torch elastic's agent installs its own SIGTERM/SIGINT handlers and leaves them: the launcher restores.
        assert signal.getsignal(signal.SIGTERM) is handler
        assert signal.getsignal(signal.SIGINT) is handler
        assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
    with pytest.raises(WorkerError, match="rank 1 failed: ValueError: first attempt fails on purpose"):
        launch_local(_fail_once_on_rank_one, 2, max_restarts=0, timeout=180)
