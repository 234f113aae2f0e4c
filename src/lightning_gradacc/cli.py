r"""``lightning-gradacc``: a LightningCLI whose experiments are YAML files (see ``configs/``).

Usage::

    lightning-gradacc fit --config configs/quickstart.yaml
    lightning-gradacc fit --config configs/quickstart.yaml --trainer.max_epochs=2 \\
        --trainer.callbacks.init_args.accumulation_steps=8
"""

from __future__ import annotations

from pytorch_lightning.cli import LightningCLI

from .callback import GradientAccumulationCallback
from .summary import format_summary


class GradAccCLI(LightningCLI):
    """LightningCLI that prints the accumulation summary after ``fit`` (on global rank 0)."""

    def after_fit(self) -> None:
        """Print the summary table of the first ``GradientAccumulationCallback`` of the run."""
        trainer = self.trainer
        callback = next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationCallback)), None)  # type: ignore[attr-defined]
        if callback is None or not trainer.is_global_zero or callback.accumulator is None:
            return
        log_dir = trainer.logger.log_dir if trainer.logger is not None else None
        batch_size = getattr(trainer.train_dataloader, "batch_size", None)
        full_step = None
        # micro-batch size x K x ranks counts samples; with an item counter (tokens) it would mislead
        if isinstance(batch_size, int) and callback.item_count_fn is None:
            full_step = batch_size * callback.stats.accumulation_steps * trainer.world_size
        summary = format_summary(callback.stats, callback.accumulator.window_loss, log_dir, full_step)
        print(summary, flush=True)


def build_cli(args: list[str] | None = None, *, run: bool = True) -> GradAccCLI:
    """Parse ``args`` (default: ``sys.argv[1:]``), instantiate; run the subcommand unless ``run=False``."""
    return GradAccCLI(args=args, run=run, save_config_kwargs={"overwrite": True})


def main() -> None:
    """Entry point of ``lightning-gradacc`` and ``python -m lightning_gradacc``."""
    build_cli()
