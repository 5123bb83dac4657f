"""``python -m roundpipe.cli``: the ``roundpipe`` console script, as torchrun starts each process."""

import sys

from roundpipe.cli.main import main

sys.exit(main())
