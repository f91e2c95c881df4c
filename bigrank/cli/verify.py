"""``bigrank verify PATH…``: check datasets, exports and checkpoints byte for byte against what was recorded.

What each kind of directory records and what is checked (``bigrank.integrity``):

* a dataset (``manifest.json`` with splits): the size and CRC-32 of every data file
  (``bigrank.data.manifest.verify_dataset``);
* an export (``manifest.json`` of kind ``bigrank-embeddings``): the size and sha256 of every part and index,
  and each part's row count (``bigrank.export.format.verify_export``);
* a checkpoint (``trainer.json``), or a run directory (all its complete checkpoints): the size and CRC-32 of
  every DCP file (``bigrank.train.checkpoint.verify_checkpoint``).

Every damaged file is reported by name (not only the first). Exit status 0 when everything matches, 1 when a
file is damaged, 2 when a PATH is none of these. Reads every byte: at ML-1B scale about as long as reading the
dataset once. Training checks the CRC-32s of the dataset files it reads, and loading a checkpoint those of its
DCP files, but stops at the first damaged file; this command reports them all.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bigrank.errors import CommandError

# The readers (pyarrow, torch) are imported when the command runs: `bigrank --help` imports none of them.


def register(subparsers) -> None:
    """Add ``bigrank verify`` to the ``bigrank`` parser."""
    verify = subparsers.add_parser(
        "verify",
        help="check a dataset, export or checkpoint against its recorded sizes and checksums",
        description="Check every file of a dataset, an export, a checkpoint or a run directory's checkpoints "
        "against the sizes and checksums recorded when they were written; report each damaged file by name. "
        "Exit status 1 when a file is damaged.",
    )
    verify.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="dataset directory, export directory, checkpoint directory, or run directory (all its checkpoints)",
    )
    verify.set_defaults(func=run_verify)


def reports(path: Path) -> list:
    """The ``integrity.Report``s of the directory ``path`` (one, or one per checkpoint of a run directory).

    Raises CommandError when ``path`` is no dataset, export, checkpoint or run directory.
    """
    manifest = path / "manifest.json"
    if manifest.is_file():
        from bigrank.export.format import EXPORT_KIND, verify_export

        try:
            kind = json.loads(manifest.read_text()).get("kind")
        except (json.JSONDecodeError, AttributeError) as error:
            raise CommandError(f"{manifest} is not a valid manifest: {error}") from error
        if kind == EXPORT_KIND:
            return [verify_export(path)]
        from bigrank.data.manifest import verify_dataset

        return [verify_dataset(path)]
    from bigrank.train import checkpoint

    if (path / checkpoint.TRAINER_FILE).is_file():
        return [checkpoint.verify_checkpoint(path)]
    if checkpoint.checkpoint_root(path).is_dir():
        found = checkpoint.list_checkpoints(path)
        if not found:
            raise CommandError(f"{path} is a run directory without a complete checkpoint: nothing to verify")
        return [checkpoint.verify_checkpoint(one) for one in found]
    raise CommandError(
        f"{path} is not a bigrank dataset (manifest.json), export (manifest.json), checkpoint (trainer.json) "
        "or run directory (checkpoints/)"
    )


def run_verify(args: argparse.Namespace) -> int:
    damaged = False
    for name in args.paths:
        path = Path(name)
        if not path.is_dir():
            raise CommandError(f"{path} is not a directory")
        print(f"verifying {path} …", flush=True)  # reading every byte takes a while at scale
        for report in reports(path):
            print("\n".join(report.lines()), flush=True)
            damaged = damaged or not report.ok
    return 1 if damaged else 0
