"""``python -m bigrank.cli``: the ``bigrank`` command."""

import sys

from bigrank.cli import main

sys.exit(main())
