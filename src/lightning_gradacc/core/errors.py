"""Exceptions raised by the accumulation core."""

from __future__ import annotations


class GradientOverflowError(RuntimeError):
    """Raised by the ``overflow="raise"`` policy when an accumulated gradient is not finite.

    Attributes:
        step: Index of the optimizer step (0-based count of finished windows) that overflowed.
        parameter_names: Names of up to five parameters whose gradient holds ``nan`` or ``inf``.
    """

    def __init__(self, step: int, parameter_names: list[str]) -> None:
        self.step = step
        self.parameter_names = parameter_names
        names = ", ".join(f"`{name}`" for name in parameter_names) or "(none found after reduction)"
        super().__init__(
            f"Non-finite gradient at optimizer step {step} in {names}. The optimizer step was not taken."
            " Lower the learning rate, check the data of this window, or use `overflow='skip'` to drop"
            " such windows."
        )
