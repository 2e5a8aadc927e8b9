"""The provenance header for raw outputs of tools run as scripts; one implementation:
slipstream/provenance.py (command, git commit + dirty flag, machine, load, GPU, versions, UTC date).

    python tools/common/provenance.py "COMMAND"   # prints the header for COMMAND
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout

from slipstream import provenance as _prov  # noqa: E402


def header(command: str | None = None) -> str:
    return _prov.header(_prov.provenance(command))


if __name__ == "__main__":
    print(header(" ".join(sys.argv[1:]) or None), end="")
