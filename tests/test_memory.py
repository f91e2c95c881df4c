"""The worker bootstrap's allocator setting (``bigrank.train.bootstrap.keep_freed_memory``): a step's freed
buffers stay mapped in the process instead of going back to the kernel.

Checked on glibc's own accounting (``mallinfo2``) in a fresh process: a 16 MB block — a step's score block — is
served from the heap (not a private mmap that ``free`` unmaps) and stays in the heap once freed (the probe imports
the bootstrap, and so torch, first: as a worker does). The effect on a training run (page faults, system time,
examples/s) is measured, not asserted: see bigrank/train/bootstrap.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bigrank.train.bootstrap import keep_freed_memory

PROBE = """
import ctypes, json, sys
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):  # glibc >= 2.33 struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
    from bigrank.train.bootstrap import keep_freed_memory
    assert keep_freed_memory()
block = libc.malloc(16 << 20)
ctypes.memset(block, 1, 16 << 20)  # touched, as a score block is
held = libc.mallinfo2()
libc.free(block)
freed = libc.mallinfo2()
print(json.dumps({"mmapped_while_held": held.hblkhd, "heap_after_free": freed.arena}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_a_freed_step_buffer_stays_in_the_process():
    default, kept = _probe("default"), _probe("keep")
    # glibc's defaults: a fresh process serves 16 MB with its own mmap, unmapped by free (the next step
    # faults every page in again).
    assert default["mmapped_while_held"] >= 16 << 20 and default["heap_after_free"] < 16 << 20, default
    # Raised thresholds: from the heap, and still there after free.
    assert kept["mmapped_while_held"] < 16 << 20 and kept["heap_after_free"] >= 16 << 20, kept


def test_the_defaults_can_be_kept(monkeypatch):
    monkeypatch.setenv("BIGRANK_MALLOC_DEFAULTS", "1")
    assert keep_freed_memory() is False
