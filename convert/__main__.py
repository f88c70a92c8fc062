"""`python -m convert SRC OUT [--dtype D]` (see `convert.cli`)."""

import sys

from convert import cli

main = cli.main  # main(argv) -> exit status, for callers that import this module

if __name__ == "__main__":
  sys.exit(main())
