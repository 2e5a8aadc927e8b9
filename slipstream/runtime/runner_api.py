"""The runner interface the engine loop is written against (torch-free, so the scheduler and the
test fake can use it): a step's inputs are a `ForwardInput` (runtime/batch.py), its outputs a
`SampledTokens`; launching it returns the runner's record of it (a `Launched`: LaunchedStep on a
device), which the loop hands back to launch its late sampling, await and read its tokens.

`ModelRunner` (runtime/model_runner.py) implements it on a real device; tests/fake_runner.py
implements it without torch. tests/test_runner_api.py checks both against this Protocol.
"""
from __future__ import annotations

from typing import Generic, NamedTuple, Protocol, Sequence, TypeVar, runtime_checkable

import numpy as np

from slipstream.runtime.batch import ForwardInput, ImageSpan


class SampledTokens(NamedTuple):
    """What a committed step hands back: one id per sampling row, and its log-probability (None when
    no row of the step asked for one), for the rows that asked for top_logprobs their alternatives
    {token id: logprob} by sampling row; for the rows whose sampled id is a carry token, {sampling
    row: (carry kind, head values)}; for a speculating step, each decode row's run of tokens."""

    ids: list[int]
    logprobs: list[float] | None
    top: dict[int, dict[int, float]] | None = None
    carried: dict[int, tuple[int, tuple[float, ...]]] | None = None
    # a speculating step's (ForwardInput.num_drafts): the tokens each decode row emitted, 1..k + 1
    # (its accepted drafts and the token after them); `ids` then holds each run's last token
    runs: list[list[int]] | None = None
    fed: list[int] | None = None  # the drafts each row fed (at most the planned k; the device may feed fewer)
    # a speculating step's proposal time (all its rows) over its forward's, where the compute stream runs
    # on the host (the CPU) and so can time them; None elsewhere (the policy keeps its default)
    draft_cost: float | None = None
    # with speculation on (ModelRunner.spec_timed), an unmasked step's time on the compute stream (ms:
    # forward, drafting and sampling): CUDA's events, the CPU compute thread's CPU time; None when not measured
    step_ms: float | None = None


class Launched(Protocol):
    """A runner's record of one launched step, from launch to commit (opaque to the loop)."""

    step_id: int


L = TypeVar("L", bound=Launched)


@runtime_checkable
class Runner(Protocol, Generic[L]):
    def launch_encoder(self, images: Sequence[ImageSpan]) -> None:
        """Enqueue the vision encoder on these images (on the compute stream, before the forward
        that first reads them); returns at once. Their outputs are kept by digest until dropped."""

    def drop_features(self, digests: Sequence[bytes]) -> None:
        """Forget these encoder outputs (the encoder cache evicted them: no launched step reads them)."""

    def launch_forward(self, step_id: int, packed: ForwardInput, unmasked: bool = False) -> L:
        """Enqueue a step's forward into a free slot (one per step the depth allows in flight);
        returns at once. `unmasked`: no row of the step carries a grammar mask: every row is
        sampled right behind the forward and the tokens copied back, and launch_sampling is not
        called for it (a runner may then sample plain greedy rows with the forward). The scheduler
        hands the same ForwardInput again while its batch is steady (nothing joined, left or
        needs the host): the runner may reuse what it staged for it."""

    def launch_sampling(self, step: L, rows: list[int] | None = None,
                        bitmask: np.ndarray | None = None, final: bool = True) -> None:
        """Enqueue sampling of some of a masked step's rows; with `final`, the device→host copy too."""

    def is_done(self, step: L) -> bool:
        """Whether the step has its tokens on the host already (its device→host copy completed);
        never blocks. False while its final sampling is not launched."""

    async def read_sampled(self, step: L) -> SampledTokens:
        """Await the step's copy without blocking the loop and read it (its slot is free again);
        raises what its launched work raised."""

    async def drain(self) -> None:
        """Wait until every stream has run what was launched on it (after a failure)."""

    def recover(self, steps: list[L]) -> bool:
        """Free failed steps' slots and clear sticky errors; False: the device cannot go on."""
