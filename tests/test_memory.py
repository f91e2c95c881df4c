"""bigrank.memory: freed step buffers stay mapped, so a loop that re-allocates them stops page-faulting."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bigrank.memory import keep_freed_memory

LOOP = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from bigrank.memory import keep_freed_memory
    assert keep_freed_memory()
def step():  # a step's buffers: several 8 MB blocks alive at once, written, then all freed
    blocks = [torch.ones(2_000_000) for _ in range(4)]
    return sum(float(b[-1]) for b in blocks)
for _ in range(3):  # warm-up: the first allocations fault whatever the thresholds
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_reallocated_buffer_stops_page_faulting():
    default, kept = _faults("default"), _faults("keep")
    # Default glibc gives part of what the step held back to the kernel when it is freed (munmap or heap trim),
    # so each step faults it in again, 4 KiB at a time (measured: 400-1,000 faults a step of 4 x 8 MB, none
    # with the thresholds raised).
    assert default > 20 * 100, default
    assert kept * 10 < default, (kept, default)


def test_the_defaults_can_be_kept(monkeypatch):
    monkeypatch.setenv("BIGRANK_MALLOC_DEFAULTS", "1")
    assert keep_freed_memory() is False
