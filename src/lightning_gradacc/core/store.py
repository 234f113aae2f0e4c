"""WindowGradients: the open window's gradients by parameter name, for gradients autograd did not put there.

Gradients computed with ``torch.func``, received from another worker, or produced by a custom backward
are added with :meth:`WindowGradients.add` as one micro-batch (weighted, scaled and checked like a
back-propagated one); the window's sums are read by name like a read-only mapping.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

from .buffers import GradBuffers
from .parameters import TrackedParameters
from .weighting import GradientScale, ItemCount
from .window import Window, WindowState


class Recorder(Protocol):
    """The accumulator's public recording API, which :meth:`WindowGradients.add` goes through."""

    @property
    def window(self) -> Window:
        """The open window."""
        ...

    def weigh(self, items: Any) -> ItemCount:
        """A micro-batch's item count, checked and weighed."""
        ...

    def record(self, items: ItemCount | Any = None, loss: Tensor | float | None = None) -> None:
        """Count a micro-batch whose gradient is in ``.grad``."""
        ...


class WindowGradients(Mapping[str, Tensor]):
    """A view of the open window's summed gradients: ``get``, ``keys``, ``len``, ``in`` by parameter name.

    The values are the sums as they are (with the loss scale, before the boundary's normalization); names
    of parameters without a gradient in the window are absent. Obtained from
    :attr:`GradAccumulator.gradients`.

    Example:
        >>> from lightning_gradacc.core import GradAccumulator
        >>> weight = torch.nn.Parameter(torch.zeros(2))
        >>> accumulator = GradAccumulator([("weight", weight)], accumulation_steps=2)
        >>> accumulator.gradients.add({"weight": torch.tensor([1.0, 2.0])})
        >>> accumulator.gradients.add({"weight": torch.tensor([3.0, 2.0])})
        >>> "weight" in accumulator.gradients, len(accumulator.gradients)
        (True, 1)
        >>> accumulator.finalize(), weight.grad  # the mean of the two
        (True, tensor([2., 2.]))
    """

    def __init__(
        self,
        recorder: Recorder,
        tracked: TrackedParameters,
        buffers: GradBuffers | None,
        scale: GradientScale,
    ) -> None:
        self._recorder = recorder
        self._tracked = tracked
        self._buffers = buffers
        self._scale = scale

    def _sums(self) -> dict[str, Tensor]:
        window = self._recorder.window
        if window.state is WindowState.EMPTY:
            return {}
        named = self._tracked.named
        if window.sums_in_buffers:
            assert self._buffers is not None
            sums = self._buffers.window()
            return {name: tensor for (name, _), tensor in zip(named, sums, strict=True) if tensor is not None}
        return {name: param.grad for name, param in named if param.grad is not None}

    def __getitem__(self, name: str) -> Tensor:
        sums = self._sums()
        if name not in sums:
            known = name in self._tracked.index
            raise KeyError(
                f"Parameter `{name}` has no gradient in the open window."
                if known
                else f"`{name}` is not a tracked parameter."
            )
        return sums[name].detach()

    def __iter__(self) -> Iterator[str]:
        return iter(self._sums())

    def __len__(self) -> int:
        return len(self._sums())

    def __repr__(self) -> str:
        return f"WindowGradients({list(self)})"

    def add(
        self, gradients: Mapping[str, Tensor], *, items: Any = None, loss: Tensor | float | None = None
    ) -> None:
        """Add one micro-batch's gradients (of its mean loss) into the open window, and record it.

        Every name must be a tracked parameter and every tensor must have its parameter's shape and dtype;
        otherwise ``ValueError`` (or ``KeyError``) is raised and the window is unchanged. A tensor on another
        device is copied to the parameter's. The gradient is weighted by the micro-batch's items (under
        ``scaling="weighted"``) and carries the loss scale, as a back-propagated one would; parameters not
        named simply get no gradient from this micro-batch. Call it between micro-batches, not between a
        ``backward`` and its :meth:`GradAccumulator.record`.

        Args:
            gradients: Parameter name -> gradient.
            items: The micro-batch's item count, as for :meth:`GradAccumulator.record`.
            loss: Its loss, for the ``window_loss`` statistic.
        """
        recorder, tracked = self._recorder, self._tracked
        index = tracked.index
        checked: list[tuple[int, Tensor]] = []
        for name, gradient in gradients.items():
            if name not in index:
                raise KeyError(f"`{name}` is not a tracked parameter; the window is unchanged.")
            param = tracked.named[index[name]][1]
            if (
                not isinstance(gradient, Tensor)
                or gradient.shape != param.shape
                or gradient.dtype != param.dtype
            ):
                found = (
                    (tuple(gradient.shape), gradient.dtype)
                    if isinstance(gradient, Tensor)
                    else type(gradient)
                )
                raise ValueError(
                    f"The gradient given for `{name}` is {found}, but the parameter is"
                    f" {(tuple(param.shape), param.dtype)}; the window is unchanged."
                )
            if gradient.is_sparse:
                raise ValueError(f"The gradient given for `{name}` is sparse; the window is unchanged.")
            checked.append((index[name], gradient))
        if any(grad is not None for grad in tracked.grads()) and recorder.window.sums_in_buffers:
            raise RuntimeError(
                "`.grad` holds a gradient not recorded yet: call `record()` after its backward first."
            )
        count = recorder.weigh(items)
        gradient_scale = self._scale.value()
        scale = count.weight * gradient_scale
        with torch.no_grad():
            for position, gradient in checked:
                param = tracked.named[position][1]
                contribution = gradient.to(param.device, non_blocking=True) * scale
                if isinstance(contribution, Tensor) and contribution.dtype != param.dtype:
                    contribution = contribution.to(param.dtype)
                param.grad = contribution if param.grad is None else param.grad.add_(contribution)
        recorded = None if loss is None else loss * gradient_scale  # as a backward would
        if isinstance(recorded, Tensor):
            recorded = recorded.detach()
        recorder.record(count, recorded)

    def remove(self, name: str) -> Tensor:
        """Take one parameter's gradient out of the open window and return it (e.g. to send it elsewhere).

        Raises:
            KeyError: the parameter has no gradient in the window.
        """
        removed = self[name]
        position = self._tracked.index[name]
        if self._recorder.window.sums_in_buffers:
            assert self._buffers is not None
            removed = removed.clone()  # the buffer is reused by the next window
            self._buffers.forget(position)
        else:
            self._tracked.named[position][1].grad = None
        return removed
