"""`python -m attnlab <command>`: the same as the `attnlab` command (see attnlab.cli)."""

import sys

from attnlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
