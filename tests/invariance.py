"""Batch invariance for tests that compare outputs across runs.

`EngineConfig.batch_invariant` is off by default (the fast CPU path: oneDNN-packed projections,
one batched attention call per decode step). Off, a row's float32 result may differ in the last
bits with what else shares its step, and a greedy near-tie can then pick another token. A test
that compares token ids between depth 1 and depth 2, a request alone and in a batch, a worker and
an in-process engine, a traced and an untraced run, a faulted and a clean run, needs the
guarantee, so it builds its config with INVARIANT (docs/architecture.md, "Batch invariance").
"""
from slipstream import EngineConfig

INVARIANT = {"batch_invariant": True}


def invariant_config(**fields) -> EngineConfig:
    return EngineConfig(**{**INVARIANT, **fields})
