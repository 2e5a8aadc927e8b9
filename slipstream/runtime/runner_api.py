"""The runner interface the engine loop is written against (torch-free, so the scheduler and the
test fake can use it): a step's inputs are a `ForwardInput` (runtime/batch.py), its outputs a
`SampledTokens`; each step runs in one of the runner's `slots` (a `Slot`: StepSlot on a device).

`ModelRunner` (runtime/model_runner.py) implements it on a real device; tests/fake_runner.py
implements it without torch. tests/test_runner_api.py checks both against this Protocol.
"""
from __future__ import annotations

from typing import Generic, NamedTuple, Protocol, Sequence, TypeVar, runtime_checkable

import numpy as np

from slipstream.runtime.batch import ForwardInput, ImageSpan


class SampledTokens(NamedTuple):
    """What a committed step hands back: one id (and its log-probability) per sampling row, and for
    the rows that asked for top_logprobs, their alternatives {token id: logprob} by sampling row;
    for the rows whose sampled id is a carry token, {sampling row: (carry kind, head values)}."""

    ids: list[int]
    logprobs: list[float]
    top: dict[int, dict[int, float]] | None = None
    carried: dict[int, tuple[int, tuple[float, ...]]] | None = None


class Slot(Protocol):
    """The buffers one in-flight step owns; free again once the step's commit released it."""

    index: int

    @property
    def is_free(self) -> bool: ...

    def release(self) -> None: ...


S = TypeVar("S", bound=Slot)


@runtime_checkable
class Runner(Protocol, Generic[S]):
    @property
    def slots(self) -> Sequence[S]:
        """One per step that may be in flight at once (the pipeline depth)."""

    def launch_encoder(self, images: Sequence[ImageSpan]) -> None:
        """Enqueue the vision encoder on these images (on the compute stream, before the forward
        that first reads them); returns at once. Their outputs are kept by digest until dropped."""

    def drop_features(self, digests: Sequence[bytes]) -> None:
        """Forget these encoder outputs (the encoder cache evicted them: no launched step reads them)."""

    def launch_forward(self, slot: S, step_id: int, packed: ForwardInput, unmasked: bool = False) -> None:
        """Enqueue a step's forward into `slot`; returns at once. `unmasked`: no sampling group of
        the step will carry a grammar mask (a runner may then sample plain greedy rows with it)."""

    def launch_sampling(self, slot: S, packed: ForwardInput, rows: list[int] | None = None,
                        bitmask: np.ndarray | None = None, final: bool = True) -> None:
        """Enqueue sampling of some of the step's rows; with `final`, the device→host copy too."""

    def is_done(self, slot: S) -> bool:
        """Whether the step in `slot` has its tokens on the host already (its device→host copy
        completed); never blocks. False while its final sampling is not launched."""

    async def read_sampled(self, slot: S) -> SampledTokens:
        """Await the step's copy without blocking the loop; raises what its launched work raised."""

    async def drain(self) -> None:
        """Wait until every stream has run what was launched on it (after a failure)."""

    def recover(self, slots: list[S]) -> bool:
        """Free failed steps' slots and clear sticky errors; False: the device cannot go on."""
