"""16-mixed through ``Trainer.fit`` with wider accumulation buffers: unscaled, and the GradScaler still
backs off."""

from __future__ import annotations

from lightning_gradacc import GradientAccumulationCallback
from tests import helpers as h

BATCH = 4


reference = h.regression_reference


def test_16_mixed_with_buffers_unscales_and_keeps_the_scaler_working() -> None:
    plugin = h.amp_plugin()
    callback = GradientAccumulationCallback(4, accumulation_dtype="float64")
    module = h.RegressionModule(h.regression_data(40), nan_at=[5])
    h.trainer(callbacks=[callback], plugins=[plugin]).fit(module)
    # the reference runs the same fp16 autocast: what is left is micro- vs big-batch fp16 rounding (4e-5)
    expected = reference(h.windows(10, 4), skip_windows=[1], fp16_autocast=True)
    assert h.max_abs_diff(module.net, expected) < 2e-4
    assert (callback.stats.non_finite_windows, callback.stats.skipped_steps) == (1, 1)
    assert plugin.scaler.get_scale() == 2.0**7  # the scaler saw the overflow and backed off
