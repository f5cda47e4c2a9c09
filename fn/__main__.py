"""``python -m fn`` (and the ``fn-optim`` script): the demo application's command line,
:func:`fn.app.cli.main`."""

import sys

from fn.app.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
