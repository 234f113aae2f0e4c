"""Lightning's ``DeepSpeedStrategy`` on CPU processes (gloo), for the DeepSpeed oracles.

DeepSpeed runs on the CPU (``DS_ACCELERATOR=cpu``) through the package's
:class:`~lightning_gradacc.deepspeed_cpu.DeepSpeedCPUStrategy` (Lightning's strategy refuses CPUs), in either
namespace. One shim, kept here and never in the package, spares the JIT build of DeepSpeed's shared-memory
all-reduce (gloo's does the same sums; about 30 s on a clean machine).

With ``device="cuda"`` (``scripts/gpu_check.sh``) the unmodified ``DeepSpeedStrategy`` runs on GPUs, where
DeepSpeed's fp16 works too.

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
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def skip_shm_build() -> None:
    """DeepSpeed's collectives through gloo, without compiling its shared-memory all-reduce (tests only)."""
    # the module by name: `deepspeed.comm.torch` as an attribute is the `torch` that `deepspeed.comm` imported
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
        namespace: ``"pytorch_lightning"`` or ``"lightning.pytorch"``.
        stop_epoch_at: ``on_train_batch_start`` returns -1 at this batch of epoch 0 (the epoch ends there).
        none_at: The loader yields ``None`` instead of this batch of epoch 0 (Lightning skips every hook).
        task: ``"regression"`` (MSE, micro-batches of 4 rows per rank), ``"tokens"`` (next-token cross
            entropy over padded sequences of 1-9 real tokens, micro-batches of 2 sequences per rank) or
            ``"gpt2"`` (a random-config Hugging Face GPT-2 on sequences of 2-12 tokens, 1 process).
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
    namespace: str = "pytorch_lightning"
    stop_epoch_at: int | None = None
    none_at: int | None = None
    task: str = "regression"


class _NoneAt:
    """A loader whose batch ``index`` of epoch 0 is ``None`` (sized, so that Lightning knows the epoch)."""

    def __init__(self, loader: Any, index: int) -> None:
        self.loader, self.index, self.epochs = loader, index, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        epoch, self.epochs = self.epochs, self.epochs + 1
        for i, batch in enumerate(self.loader):
            yield None if epoch == 0 and i == self.index else batch


def _causal_lm_module(api: Any) -> Any:
    """A random-config GPT-2 on variable-length sequences (``tests/callback/test_hf_causal_lm.py``'s)."""
    from torch.utils.data import DataLoader

    from tests.callback import test_hf_causal_lm as lm

    class CausalLM(api.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(
            self, data: Any = None, lr: float = lm.LR, resumable: bool = False, seed: int = 0
        ) -> None:
            super().__init__()
            self.net, self.lr = lm.tiny_gpt2(), lr

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return lm.hf_loss(self.net, batch, lm.IGNORE_INDEX)

        def train_dataloader(self) -> Any:
            return DataLoader(lm.sequences(), batch_size=lm.BATCH, collate_fn=lm.collate)  # type: ignore[arg-type]

    return CausalLM


def _fit(scenario: Scenario, world: int, tmp: str, device: str) -> dict[str, Any]:
    from tests import helpers as h

    api = h.PACKAGES[scenario.namespace]
    if device == "cuda":
        strategy_class = api.strategies.DeepSpeedStrategy
    elif scenario.namespace == "pytorch_lightning":
        from lightning_gradacc.deepspeed_cpu import DeepSpeedCPUStrategy as strategy_class
    else:
        from lightning_gradacc.lightning import DeepSpeedCPUStrategy as strategy_class

    tokens = scenario.task == "tokens"
    modules = h.TOKEN_MODULES if tokens else h.REGRESSION_MODULES
    make_data: Any = h.token_data if tokens else h.regression_data
    base = modules[scenario.namespace]
    if scenario.task == "gpt2":
        base, make_data = _causal_lm_module(api), lambda samples: None

    class Module(base):  # type: ignore[misc,valid-type]
        lrs: list[float]

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.net.parameters(), lr=self.lr)
            self.lrs = []
            if not scenario.scheduler:
                return optimizer
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
            stop = scenario.stop_epoch_at is not None and (self.current_epoch, batch_idx) == (
                0,
                scenario.stop_epoch_at,
            )
            return -1 if stop else None

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))

        def train_dataloader(self) -> Any:
            loader = super().train_dataloader()
            return loader if scenario.none_at is None else _NoneAt(loader, scenario.none_at)

    def make_trainer() -> Any:
        given = scenario.callback
        callbacks = [] if given is None else [h.accumulation_callback(scenario.namespace, **given)]
        return api.Trainer(
            accelerator="gpu" if device == "cuda" else "cpu",
            devices=world,
            strategy=strategy_class(stage=scenario.stage),
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
    module = Module(make_data(scenario.samples), lr=scenario.lr, resumable=resumable)
    checkpoint = None
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    try:
        if scenario.resume_after is not None:
            checkpoint = os.path.join(tmp, "deepspeed.ckpt")
            first = make_trainer()
            save = h.SaveAndStop if scenario.namespace == "pytorch_lightning" else h.LitSaveAndStop
            first.callbacks.append(save(scenario.resume_after, Path(checkpoint)))
            with contextlib.suppress(h.Preempted):
                first.fit(module)
            module = Module(make_data(scenario.samples), lr=scenario.lr, seed=1, resumable=True)
        trainer = make_trainer()
        trainer.fit(module, ckpt_path=checkpoint)
    except Exception as error:  # a refusal: its message is the result
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        caught.__exit__(None, None, None)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {
        "state": {name: p.detach().float().cpu() for name, p in module.net.named_parameters()},
        "global_step": trainer.global_step,
        "engine_steps": int(trainer.model.global_steps),
        "metrics": metrics,
        "lrs": module.lrs,
        "warnings": [str(warning.message) for warning in seen],
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
        skip_shm_build()
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
