"""`python -m slipstream ...`: the same as the `slipstream` command."""
import sys

from slipstream.cli import main

if __name__ == "__main__":  # (importing the module, as tests that import every module do, runs nothing)
    sys.exit(main())
