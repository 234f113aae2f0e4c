"""Each loader batch run as pieces (``piece_size``): the runner, plugged into one fit.

The runner (:class:`~lightning_gradacc.piece_runner.PieceRunner`) stands in for the strategy's
``training_step`` and the precision plugin's ``backward`` for the fit; this part installs and removes it,
marks a batch that runs in pieces (its micro-batch then begins through ``begin_pieces``), hands the runner
the handle of its pieces, and ends each batch. Its saved state is the size the ranks agreed on and the
errors recovered: the smallest size and the largest count over the ranks are what a checkpoint holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor
from typing_extensions import override

from ..piece_runner import PieceRunner
from .base import Declaration, Fit, FitPart

if TYPE_CHECKING:
    from collections.abc import Callable


class PiecesPart(FitPart):
    """``piece_size`` in one fit (see the module).

    Args:
        fit: The fit.
        runner: The callback's runner (it keeps the size over fits).
        count: The item counter, or ``None``.
        lightning_k: What Lightning divides each loss by (the plan's).
        additive: Each loss is a sum over its items (``scaling="constant"``): pieces add without a share.
    """

    saved: ClassVar[Declaration] = {"pieces": {"size": "smallest", "oom_retries": "largest"}}

    def __init__(
        self,
        fit: Fit,
        *,
        runner: PieceRunner,
        count: Callable[[Any], Any] | None,
        lightning_k: Callable[[], int],
        additive: bool = False,
    ) -> None:
        super().__init__(fit)
        self.runner, self.count, self.lightning_k = runner, count, lightning_k
        self.additive = additive

    @override
    def train_start(self) -> None:
        fit = self.fit
        self.runner.install(
            fit.trainer,
            fit.driver,
            count=self.count,
            extract=fit.api.extract_batch_size,
            warn=fit.warn,
            lightning_k=self.lightning_k,
            mark=self._mark,
            sync=fit.sync,
            additive=self.additive,
        )

    def _mark(self, hold_in_grad: bool) -> None:
        """The running batch goes in pieces (its stand-in was handed to Lightning)."""
        batch = self.fit.batch
        batch.in_pieces, batch.hold_in_grad = True, hold_in_grad

    @override
    def batch_start(self, batch: Any, batch_idx: int) -> None:
        self.runner.begin_batch(batch, self.fit.batch.items)

    @override
    def before_backward(self, loss: Tensor) -> None:
        pieces = self.fit.batch.pieces
        if pieces is not None:
            self.runner.begun(pieces)

    @override
    def batch_end(self, outputs: Any) -> None:
        self.runner.end_batch(outputs)

    @override
    def exception(self) -> None:
        self.runner.uninstall()

    @override
    def train_end(self) -> None:
        self.runner.uninstall()

    @override
    def statistics(self) -> dict[str, float]:
        return self.runner.metrics()

    @override
    def state_dict(self) -> dict[str, Any]:
        """The size that fits (a resume does not run out of memory again) and the errors recovered."""
        return {"pieces": self.runner.counters.state_dict()}
