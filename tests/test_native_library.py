"""The native bucket kernel's library cache (``bigrank.losses.buckets``): keyed on the compiler's view of the target,
kept in a directory of this user's closed to others, rebuilt once when a cached file does not load. Each case runs
real ``cc`` builds in fresh processes, with ``XDG_CACHE_HOME`` in the test's directory."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler here")

PROBE = "from bigrank.losses import buckets; print(buckets.native_available())"


def native_in_new_process(cache: Path, **env) -> subprocess.CompletedProcess:
    """``native_available()`` of this checkout in a fresh Python with its cache under ``cache``; asserts the
    process succeeded."""
    environment = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(REPO), **env}
    environment.pop("BIGRANK_NATIVE", None)
    command = [sys.executable, "-W", "always", "-c", PROBE]
    result = subprocess.run(command, env=environment, cwd=cache.parent, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def libraries(directory: Path) -> list[Path]:
    return sorted(directory.glob("buckets-*.so"))


def test_a_damaged_cached_library_is_rebuilt_once_instead_of_falling_back_for_good(tmp_path):
    first = native_in_new_process(tmp_path)
    assert first.stdout.strip() == "True", first.stderr
    [library] = libraries(tmp_path / "bigrank")
    library.write_bytes(b"not a shared object: a disk filled up while it was written")
    again = native_in_new_process(tmp_path)
    assert again.stdout.strip() == "True" and "no native bucket kernel" not in again.stderr, again.stderr
    assert libraries(tmp_path / "bigrank") == [library] and library.read_bytes()[:4] == b"\x7fELF"


def test_the_key_is_the_target_the_compiler_sees_not_the_cpuinfo_flags_line(tmp_path):
    """A compiler whose ``-march=native`` target differs (here: one more predefined macro, as a CPU with other
    extensions gives) builds a library of its own; the same target finds the one built before."""
    wrapper = tmp_path / "cc-wrapper"
    real = shutil.which(os.environ.get("CC", "cc"))
    wrapper.write_text(
        "#!/bin/sh\n"
        'for argument in "$@"; do\n'
        '  if [ "$argument" = "-dM" ]; then "' + real + '" "$@" && echo "#define TARGET_FEATURE_$TARGET 1"; exit; fi\n'
        "done\n"
        'exec "' + real + '" "$@"\n'
    )
    wrapper.chmod(0o755)
    cache = tmp_path / "cache"
    for target, built in (("A", 1), ("B", 2), ("A", 2)):
        result = native_in_new_process(cache, CC=str(wrapper), TARGET=target)
        assert result.stdout.strip() == "True", result.stderr
        assert len(libraries(cache / "bigrank")) == built


def test_the_cache_is_a_private_directory_and_a_file_others_could_write_is_not_loaded(tmp_path):
    """Made 0700 (an existing one of this user's closed to 0700); a library file that others could write is built
    again before it is loaded."""
    assert native_in_new_process(tmp_path).stdout.strip() == "True"
    cache = tmp_path / "bigrank"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    [library] = libraries(cache)
    cache.chmod(0o777)
    library.chmod(0o666)
    planted = library.stat().st_ino
    assert native_in_new_process(tmp_path).stdout.strip() == "True"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert library.stat().st_ino != planted and not library.stat().st_mode & 0o022


def test_a_cache_directory_that_is_a_symlink_or_another_users_is_not_used(tmp_path):
    """A symlink in place of the cache directory (anyone's directory behind it) is not followed, and (as root) a
    directory of another user is not trusted: the library is built in a temporary directory of this process, with
    one warning, and nothing is written into theirs."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "bigrank").symlink_to(elsewhere)
    cases = [tmp_path / "linked"]
    if os.geteuid() == 0:  # only root can give a directory to another user
        theirs = tmp_path / "theirs" / "bigrank"
        theirs.mkdir(parents=True, mode=0o755)
        os.chown(theirs, 65534, 65534)
        cases.append(tmp_path / "theirs")
    for cache in cases:
        result = native_in_new_process(cache)
        assert result.stdout.strip() == "True", result.stderr
        assert "is not a directory of this user's" in result.stderr
        assert libraries(cache / "bigrank") == []
    assert list(elsewhere.iterdir()) == []
