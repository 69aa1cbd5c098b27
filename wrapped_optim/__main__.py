"""``python -m wrapped_optim``: the ``wrapped-optim`` command, for a venv or container whose
scripts directory is not on ``PATH``."""

import sys

from wrapped_optim._cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m wrapped_optim"))
