"""The optimizer's side of a window: the GradScaler's unscale, a step decided on the device, the step itself.

:class:`OptimizerStepping` is the part of :class:`~lightning_gradacc.core.GradAccumulator` that meets the
optimizer (its base class): :meth:`~OptimizerStepping.end_window` is the one path to a window's step for a
plain loop (:meth:`~OptimizerStepping.step`) and the Lightning callback alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .torch_internals import DeviceStep, disarm, ensure_scaler_scale, scaler_found_inf, skips_on_device

if TYPE_CHECKING:
    from .settings import AccumulationSettings
    from .weighting import GradientScale
    from .window import Window


class OptimizerStepping:
    """How a window meets its optimizer (the accumulator's base: it finalizes, this steps)."""

    # the accumulator's, which this reads
    settings: AccumulationSettings
    device_step: DeviceStep | None
    _scale: GradientScale
    _window: Window

    if TYPE_CHECKING:  # the accumulator's, which this calls

        @property
        def window_full(self) -> bool:
            """Whether K micro-batches have been recorded."""

        def flush_to_grad(self) -> None:
            """Write the buffered window into ``.grad``."""

        def finalize(
            self,
            *,
            reevaluation: bool = False,
            read_statistics: bool = False,
            on_device: bool = False,
            fold_multiplier: bool = False,
        ) -> bool:
            """Turn the window's sums into the final gradient; whether to step."""

    def decides_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a window stepped by ``optimizer`` can be decided on the device (``finalize(on_device=)``).

        For an optimizer that skips on the device (``core.device_step.skips_on_device``), without a
        ``grad_scaler`` (it skips itself) and unless ``overflow="raise"`` (it raises at the step).
        """
        return self._scale.scaler is None and self.settings.overflow != "raise" and skips_on_device(optimizer)

    def end_window(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        unscale: bool = True,
        on_device: bool | None = None,
        fold_multiplier: bool = True,
        reevaluation: bool = False,
        read_statistics: bool = False,
    ) -> bool:
        """Finalize the window for ``optimizer``'s coming step: one path for :meth:`step` and the callback.

        Under a ``grad_scaler`` the window goes into ``.grad`` and the scaler unscales it (``unscale=False``:
        the caller's precision plugin already did). An optimizer that skips on the device (see
        :meth:`decides_on_device`) is armed with the window's :attr:`device_step` (``fold_multiplier``: where
        nothing reads ``.grad`` before the step); otherwise the window is decided on the host.

        Args:
            optimizer: The optimizer that steps next.
            unscale: Let the ``grad_scaler`` unscale the gradients first.
            on_device: Decide on the device (``None``: where :meth:`decides_on_device` says so).
            fold_multiplier: See :meth:`finalize`.
            reevaluation: See :meth:`finalize`.
            read_statistics: See :meth:`finalize`.

        Returns:
            :meth:`finalize`'s answer.
        """
        scaler = self._scale.scaler
        if scaler is not None and unscale:
            ensure_scaler_scale(scaler)  # none yet if no loss was scaled since the scaler was made (a resume)
            self.flush_to_grad()  # the scaler unscales and checks `.grad`
            scaler.unscale_(optimizer)
        if on_device is None:
            on_device = self.decides_on_device(optimizer)
        stepped = self.finalize(
            reevaluation=reevaluation,
            read_statistics=read_statistics,
            on_device=on_device,
            fold_multiplier=on_device and fold_multiplier,
        )
        if self.device_step is not None:
            disarm(optimizer)  # a step interrupted before: its tensors are stale
            self.device_step.arm(optimizer)
        return stepped

    def step(
        self, optimizer: torch.optim.Optimizer, *, force: bool = False, on_device: bool | None = None
    ) -> bool:
        """Finalize and step ``optimizer`` when the window is full (or ``force``), then zero gradients.

        Args:
            optimizer: The optimizer to step.
            force: Finalize a window that is not full (e.g. the last of an epoch).
            on_device: Decide on the device and let the optimizer skip a non-finite window itself, with no
                host sync and no separate multiply pass (see :meth:`end_window`). ``None``: for torch's fused
                optimizers (``fused=True``), without a ``grad_scaler`` and unless ``overflow="raise"``.

        Returns:
            Whether the optimizer stepped. On the device: whether it was asked to (it skips a non-finite
            window itself; :attr:`stats` counts it).
        """
        if not (self.window_full or (force and not self._window.empty)):
            return False
        stepped = self.end_window(optimizer, on_device=on_device)
        scaler = self._scale.scaler
        if scaler is not None:  # it skips a non-finite step itself; whether it did is one sync, here only
            stepped = stepped and not scaler_found_inf(scaler, optimizer)
            scaler.step(optimizer)
            scaler.update()
        elif stepped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return stepped
