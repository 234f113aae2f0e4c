"""Lightning's ``DeepSpeedStrategy`` on CPU processes (gloo), for the DeepSpeed oracles.

DeepSpeed runs on the CPU (``DS_ACCELERATOR=cpu``), but Lightning's strategy does not let it: three shims,
kept here and never in the package, make it start there (:func:`cpu_shims`): its CUDA guard in
``setup_environment`` is skipped, ``_validate_device_index_selection`` accepts CPU devices, and
``root_device`` gets the integer index DeepSpeed's ``device_rank`` needs. A fourth spares the JIT build of
DeepSpeed's shared-memory all-reduce (gloo's does the same sums). The product code runs the
unmodified strategy on GPUs (``scripts/gpu_check.sh``).

With ``device="cuda"`` (``scripts/gpu_check.sh``) the shims are left out: the unmodified strategy runs on
GPUs, where DeepSpeed's fp16 works too.

Every fit runs in spawned processes, never in pytest's (DeepSpeed leaves its process group behind): the
processes are started as ``torchrun`` would (``RANK``, ``WORLD_SIZE``, ...), so that Lightning's strategy
takes them as launched for it; each runs a list of :class:`Scenario` in turn and rank 0 writes what they
ended with.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def cpu_shims() -> None:
    """Let Lightning's ``DeepSpeedStrategy`` start on CPU processes (tests only: see the module)."""
    import pytorch_lightning.strategies.deepspeed as strategy_module
    from pytorch_lightning.strategies import DDPStrategy

    strategy_module.DeepSpeedStrategy.setup_environment = (  # type: ignore[method-assign]
        lambda self: DDPStrategy.setup_environment(self)
    )
    strategy_module._validate_device_index_selection = lambda devices: None  # type: ignore[assignment]
    strategy_module.DeepSpeedStrategy.root_device = property(  # type: ignore[assignment,method-assign]
        lambda self: torch.device("cpu", 0)
    )
    # DeepSpeed's shared-memory all-reduce for CPU ranks is compiled at the first start (about 30 s on a
    # clean machine); without it DeepSpeed's collectives go through gloo, which sums the same. The module by
    # name: `deepspeed.comm.torch` as an attribute is the `torch` that `deepspeed.comm` imported
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


@dataclass
class Scenario:
    """One fit: the callback's arguments (``None``: Lightning's built-in accumulation with ``trainer_k``).

    Attributes:
        callback: ``GradientAccumulationCallback`` keyword arguments, or ``None`` for no callback.
        stage: ZeRO stage of ``DeepSpeedStrategy(stage=...)``.
        samples: Rows of the regression data (micro-batches of 4 per rank).
        epochs: ``max_epochs``.
        trainer_k: ``Trainer(accumulate_grad_batches=...)``.
        lr: SGD's learning rate.
        scheduler: Step an ``LambdaLR`` every optimizer step (its learning rates are reported).
        trainer: Further ``Trainer`` keyword arguments.
        resume_after: Save a checkpoint at the end of this global micro-batch and stop (a preemption,
            ``tests.helpers.SaveAndStop``); resume from it in a new Trainer, with a new callback, to the end.
    """

    callback: dict[str, Any] | None = None
    stage: int = 2
    samples: int = 20
    epochs: int = 2
    trainer_k: int = 1
    lr: float = 0.1
    scheduler: bool = False
    trainer: dict[str, Any] = field(default_factory=dict)
    resume_after: int | None = None


def _fit(scenario: Scenario, world: int, tmp: str, device: str) -> dict[str, Any]:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DeepSpeedStrategy

    from lightning_gradacc import GradientAccumulationCallback
    from tests import helpers as h

    class Module(h.RegressionModule):
        lrs: list[float]

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.net.parameters(), lr=self.lr)
            self.lrs = []
            if not scenario.scheduler:
                return optimizer
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))

    def make_trainer() -> pl.Trainer:
        callbacks = [] if scenario.callback is None else [GradientAccumulationCallback(**scenario.callback)]
        return pl.Trainer(
            accelerator="gpu" if device == "cuda" else "cpu",
            devices=world,
            strategy=DeepSpeedStrategy(stage=scenario.stage),
            accumulate_grad_batches=scenario.trainer_k,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,  # the module's loader splits the rows over the ranks in order
            **{"max_epochs": scenario.epochs, **scenario.trainer},
        )

    # a resume goes on where the loader stood (Lightning restarts a plain loader's epoch from its start)
    resumable = scenario.resume_after is not None
    module = Module(h.regression_data(scenario.samples), lr=scenario.lr, resumable=resumable)
    checkpoint = None
    try:
        if scenario.resume_after is not None:
            checkpoint = os.path.join(tmp, "deepspeed.ckpt")
            first = make_trainer()
            first.callbacks.append(h.SaveAndStop(scenario.resume_after, Path(checkpoint)))
            with contextlib.suppress(h.Preempted):
                first.fit(module)
            module = Module(h.regression_data(scenario.samples), lr=scenario.lr, seed=1, resumable=True)
        trainer = make_trainer()
        trainer.fit(module, ckpt_path=checkpoint)
    except Exception as error:  # a refusal: its message is the result
        return {"error": f"{type(error).__name__}: {error}"}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {
        "state": {name: p.detach().float().cpu() for name, p in module.net.named_parameters()},
        "global_step": trainer.global_step,
        "engine_steps": int(trainer.model.global_steps),
        "metrics": metrics,
        "lrs": module.lrs,
    }


def _worker(rank: int, world: int, port: int, scenarios: list[Scenario], out: str, device: str) -> None:
    tmp = os.path.dirname(out)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
        cpu_shims()
    else:
        os.environ.pop("DS_ACCELERATOR", None)
    results = []
    for scenario in scenarios:
        try:
            results.append(_fit(scenario, world, tmp, device))
        except BaseException:
            results.append({"error": traceback.format_exc()})
    if rank == 0:
        torch.save(results, out)
    from tests import helpers as h

    h.exit_together()  # gloo's threads must not meet a finalizing interpreter (see there)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(
    scenarios: list[Scenario], tmp_path: Path, world: int = 1, device: str = "cpu"
) -> list[dict[str, Any]]:
    """Fit each scenario in ``world`` spawned processes (one after another); rank 0's results.

    ``device="cuda"``: on GPUs, with Lightning's strategy unmodified.
    """
    out = str(tmp_path / "deepspeed_results.pt")
    mp.start_processes(
        _worker, args=(world, _free_port(), scenarios, out, device), nprocs=world, start_method="spawn"
    )
    results: list[dict[str, Any]] = torch.load(out, weights_only=False)
    return results
