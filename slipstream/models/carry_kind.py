"""`CarryKind`: a kind of head value a row may carry (torch-free: grammars declare them too)."""
from __future__ import annotations

from typing import NamedTuple


class CarryKind(NamedTuple):
    """A kind of head value: its name (what a grammar asks for) and how many float values it has."""

    name: str
    values: int
