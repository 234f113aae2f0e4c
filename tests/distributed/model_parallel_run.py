"""Trains under a sharded Lightning strategy on 2 CPU processes with the callback.

``python tests/distributed/model_parallel_run.py OUT_DIR [model_parallel|fsdp|fsdp_cuda]`` (the strategy
launches the second rank by re-running the script): ``ModelParallelStrategy`` with FSDP2's ``fully_shard``
in ``configure_model``; ``FSDPStrategy`` (FSDP1, ``use_orig_params=True``) on CPU with the layers wrapped in
``configure_model``; or ``FSDPStrategy(auto_wrap_policy={nn.Linear})`` on 2 GPUs, as users run it.
Lightning refuses ``FSDPStrategy`` on CPU by its exact type (``accelerator_connector.py``: "requires a GPU
accelerator"), so :class:`CPUFSDPStrategy` is Lightning's class under another name; and FSDP1 itself needs
``device_id=cpu`` on CPU, which Lightning's auto-wrapping does not pass, so the module wraps itself
(Lightning then keeps the wrapping). On CPU only sharded checkpoints are saved: FSDP1's full state dict
(``offload_to_cpu=True``, as Lightning asks for it) crashes the process with CPU tensors (torch 2.13).

Each rank writes, per scenario, the sample indices of every micro-batch it trained on; rank 0 also writes
the full parameters and the statistics.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: `tests` importable

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.k_policies import AutoSettings
from tests.helpers import exit_together, ordered_loader

STRATEGY = sys.argv[2] if len(sys.argv) > 2 else "model_parallel"  # the same in the re-run second rank
K = 4
SAMPLES = 24  # 12 per rank, micro-batches of 2: windows of 4 and 2 per epoch
SCENARIOS: dict[str, dict[str, Any]] = {
    "mean": {},
    "clip": {"max_grad_norm": 0.05},
    "clip_parameter": {"max_grad_norm": 0.02, "clip_scope": "parameter"},
    "nan_on_one_rank": {},
    "weighted": {"scaling": "weighted", "item_count_fn": lambda batch: sample_weights(batch[0]).sum()},
    "buffers": {"accumulation_dtype": "float64", "max_grad_norm": 0.05},
    "window_end": {"sharded_reduction": "window_end"},
    "window_end_clip": {"sharded_reduction": "window_end", "max_grad_norm": 0.05},
    # rank 1's micro-batch 3 is nan: the window's last (of 4): only it is dropped, on both ranks
    "skip_last_micro_batch": {"overflow": "skip_micro_batch", "accumulation_dtype": "float64"},
    # K by optimizer steps: 2, then 4 (windows of 2 | 4 in epoch 1, 4 | 2 in epoch 2), clipped
    "step_schedule": {"accumulation_steps": {0: 2, 1: 4}, "schedule_unit": "steps", "max_grad_norm": 0.05},
    # a fused Adam (DTensor has no fused SGD): the verdict and multiplier reach its step on the device
    "fused_nan_clip": {"max_grad_norm": 0.05},
    # every micro-batch as pieces of one sample, each with its own backward: weighted by unequal counts,
    # and FSDP's reduction deferred to the window's last piece
    "weighted_pieces": {
        "scaling": "weighted",
        "item_count_fn": lambda batch: sample_weights(batch[0]).sum(),
        "piece_size": 1,
        "max_grad_norm": 0.05,
    },
    "window_end_pieces": {"sharded_reduction": "window_end", "piece_size": 1},
    # each window closed where its items over both ranks reach 17 (micro-batches of 6-10 items), clipped
    "weighted_budget": {
        "accumulation_steps": None,
        "items_per_step": 17,
        "scaling": "weighted",
        "item_count_fn": lambda batch: sample_weights(batch[0]).sum(),
        "max_grad_norm": 0.05,
    },
}
NAN_BATCH = {
    "nan_on_one_rank": 1,
    "skip_last_micro_batch": 3,
    "fused_nan_clip": 1,
}  # batch_idx made nan on rank 1

# ModelParallelStrategy only (FSDP1 refuses the noise scale): K chosen by "auto" from the noise scale,
# measured on FSDP2's unsharded gradients; K=1 first (2 ranks give an estimate), then the rule's
FSDP2_SCENARIOS: dict[str, dict[str, Any]] = {
    "auto": {
        "accumulation_steps": "auto",
        "auto": AutoSettings(patience=1, max_k=3, powers_of_two=False),
        "max_grad_norm": 0.05,
    },
}

# ModelParallelStrategy only: `fully_shard` on an HSDP mesh of 2 replicas of 1 shard each
HSDP_SCENARIOS: dict[str, dict[str, Any]] = {
    "hsdp": {"max_grad_norm": 0.05},
    "hsdp_replicas_at_window_end": {"sharded_reduction": "replicas_at_window_end", "max_grad_norm": 0.05},
    "hsdp_pieces": {"piece_size": 1, "max_grad_norm": 0.05},
}


def sample_weights(index: torch.Tensor) -> torch.Tensor:
    """Items per sample for "weighted" (1-3, like tokens per sequence): micro-batches of unequal counts."""
    return (index % 3 + 1).float()


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, 5, generator=generator), torch.randn(SAMPLES, 3, generator=generator)
    return TensorDataset(torch.arange(SAMPLES), x, y)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def weighted_loss(prediction: torch.Tensor, target: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The mean over items: each sample's squared error counts as many times as it has items."""
    weights = sample_weights(index)
    per_sample = (prediction - target).pow(2).mean(dim=1)
    return (weights * per_sample).sum() / weights.sum()


class ShardedModule(pl.LightningModule):
    def __init__(
        self, nan_batch: int | None, weighted: bool, hsdp: bool = False, fused: bool = False
    ) -> None:
        super().__init__()
        self.net = net()
        self.fused = fused
        self.nan_batch = nan_batch
        self.weighted = weighted
        self.hsdp = hsdp
        self.seen: list[list[int]] = []
        self.steps: list[int] = []  # the global step after each micro-batch: which ones a step took
        self.estimates: list[tuple[float, float]] = []  # each step's |G|² and tr(Σ) (a read: tests only)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

        if STRATEGY == "fsdp_cuda":
            return  # the strategy's auto-wrap policy shards the layers
        if STRATEGY == "fsdp":
            if isinstance(self.net, FullyShardedDataParallel):
                return
            wrap: Any = functools.partial(
                FullyShardedDataParallel, device_id=torch.device("cpu"), use_orig_params=True
            )
            for index, layer in enumerate(self.net):
                if isinstance(layer, nn.Linear):
                    self.net[index] = wrap(layer)
            self.net = wrap(self.net)
            return
        mesh = self.device_mesh["data_parallel"]
        if self.hsdp:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        self.seen.append(index.tolist())
        loss = (
            weighted_loss(self.net(x), y, index) if self.weighted else nn.functional.mse_loss(self.net(x), y)
        )
        if self.global_rank == 1 and batch_idx == self.nan_batch:
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        stepped = self.trainer.global_step != (self.steps[-1] if self.steps else 0)
        self.steps.append(self.trainer.global_step)
        callback = next(c for c in self.trainer.callbacks if isinstance(c, GradientAccumulationCallback))
        if stepped and callback.settings.noise_scale:
            stats = callback.stats
            self.estimates.append((stats.grad_sq_norm_estimate, stats.trace_sigma_estimate))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.fused:
            return torch.optim.Adam(self.parameters(), lr=0.05, fused=True)
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(data(), batch_size=2)


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``; only the type differs, which the CPU refusal checks exactly."""


def full_parameters(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """The whole parameters of ``module.net``, named as in :func:`net` (a collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if STRATEGY.startswith("fsdp"):
        with FullyShardedDataParallel.summon_full_params(module.trainer.model):
            return {
                n.replace("_fsdp_wrapped_module.", ""): p.detach().cpu().clone()
                for n, p in module.net.named_parameters()
            }
    return {n: p.full_tensor().detach().clone() for n, p in module.net.named_parameters()}


def count_calls(*names: str) -> list[int]:
    """Counts this process's calls of the ``torch.distributed`` functions ``names`` (for reduce-scatters:
    FSDP2 calls ``dist.reduce_scatter_single``, FSDP1 and older torch ``reduce_scatter_tensor``)."""
    import torch.distributed as dist

    calls = [0]
    for name in names:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            calls[0] += 1
            return __original(*args, **kwargs)

        setattr(dist, name, counting)
    return calls


class ResumableModule(ShardedModule):
    """Reads its rows through a loader that resumes mid-epoch, and saves a checkpoint in a window."""

    def __init__(self, save_at: tuple[int, int] | None, path: Path) -> None:
        super().__init__(nan_batch=None, weighted=False)
        self.save_at, self.path = save_at, path

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.trainer.train_dataloader.consumed += 1  # type: ignore[union-attr]
        return loss

    def on_train_epoch_start(self) -> None:
        self.trainer.train_dataloader.consumed = 0  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # with momentum: Lightning's FSDP cannot load a sharded optimizer state that is empty (plain SGD)
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.5)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (self.current_epoch, batch_idx) == self.save_at:  # window 2's first micro-batch: mid-window
            self.trainer.save_checkpoint(self.path)

    def train_dataloader(self) -> DataLoader:
        return ordered_loader(self, data(), 2, resumable=True)


def sharded_trainer(callback: pl.Callback, state_dict_type: str = "sharded", **options: Any) -> pl.Trainer:
    """2 CPU processes, sharded over both, 2 epochs, nothing but the callback."""
    strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if STRATEGY == "fsdp":
        strategy = CPUFSDPStrategy(state_dict_type=state_dict_type)
    elif STRATEGY == "fsdp_cuda":
        strategy = FSDPStrategy(state_dict_type=state_dict_type, auto_wrap_policy={nn.Linear})
    return pl.Trainer(
        strategy=strategy,
        accelerator="cuda" if STRATEGY == "fsdp_cuda" else "cpu",
        devices=2,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[callback],
        **options,
    )


def resume(out: Path, state_dict_type: str) -> None:
    """An uninterrupted fit that saves a checkpoint inside a window, then a fit resumed from it."""
    finals = []
    path = out / f"mid-window-{state_dict_type}.ckpt"
    for save_at, ckpt_path in (((0, 4), None), (None, path)):
        module = ResumableModule(save_at, path)
        trainer = sharded_trainer(
            GradientAccumulationCallback(K, max_grad_norm=0.05),
            state_dict_type=state_dict_type,
            use_distributed_sampler=False,
        )
        trainer.fit(module, ckpt_path=ckpt_path)
        finals.append(full_parameters(module))
        if trainer.global_rank == 0:
            torch.save((finals, trainer.global_step), out / f"resume-{state_dict_type}.pt")


def unsynced_save(out: Path) -> None:
    """A checkpoint inside a window whose gradients FSDP holds unsynced (`window_end`): refused, on every
    rank, with the reason (it used to save zeros for them)."""
    callback = GradientAccumulationCallback(K, sharded_reduction="window_end")
    trainer = sharded_trainer(callback, use_distributed_sampler=False)
    try:
        trainer.fit(ResumableModule((0, 1), out / "unsynced.ckpt"))
    except NotImplementedError as error:
        (out / f"unsynced-save-{trainer.global_rank}.txt").write_text(str(error))


def main(out: Path) -> None:
    reduce_scatters = count_calls("reduce_scatter_single", "reduce_scatter_tensor")
    all_reduces = count_calls("all_reduce")
    fsdp2 = {**HSDP_SCENARIOS, **FSDP2_SCENARIOS} if STRATEGY == "model_parallel" else {}
    scenarios = {**SCENARIOS, **fsdp2}
    for name, options in scenarios.items():
        reduce_scatters[0] = all_reduces[0] = 0
        options = dict(options)
        callback = GradientAccumulationCallback(options.pop("accumulation_steps", K), **options)
        module = ShardedModule(
            NAN_BATCH.get(name),
            weighted=name.startswith("weighted"),
            hsdp=name in HSDP_SCENARIOS,
            fused=name.startswith("fused"),
        )
        trainer = sharded_trainer(callback)
        trainer.fit(module)
        full = full_parameters(module)
        stats = callback.stats
        torch.save(module.seen, out / f"{name}-seen-{trainer.global_rank}.pt")
        torch.save(module.steps, out / f"{name}-steps-{trainer.global_rank}.pt")
        if trainer.global_rank == 0:
            counts = (stats.windows, stats.skipped_steps, stats.non_finite_windows, stats.clipped_steps)
            collectives = (reduce_scatters[0], all_reduces[0])
            torch.save((full, counts, trainer.global_step, collectives), out / f"{name}.pt")
            torch.save(module.estimates, out / f"{name}-estimates.pt")
    refused: dict[str, dict[str, Any]] = {  # refused at train start, on both ranks
        "micro_batch_window_end": {
            "clip_mode": "micro_batch",
            "max_grad_norm": 0.05,
            "accumulation_dtype": "float64",
            "sharded_reduction": "window_end",
        },
    }
    refused["buffers_window_end"] = {"accumulation_dtype": "float64", "sharded_reduction": "window_end"}
    if STRATEGY != "model_parallel":  # FSDP1 only
        refused["replicas_at_window_end"] = {"sharded_reduction": "replicas_at_window_end"}
        refused["auto"] = {"accumulation_steps": "auto"}  # the noise scale of flat parameters
        refused["lightning_norm_clip"] = {"trainer": {"gradient_clip_val": 0.05}}
    for name, options in refused.items():
        trainer_options = options.pop("trainer", {})
        try:
            callback = GradientAccumulationCallback(options.pop("accumulation_steps", K), **options)
            sharded_trainer(callback, **trainer_options).fit(ShardedModule(nan_batch=None, weighted=False))
        except RuntimeError as error:
            (out / f"refused-{name}-{trainer.global_rank}.txt").write_text(str(error))
    if STRATEGY == "model_parallel":  # plain FSDP2: no replicate dimension, nothing to defer
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sharded_trainer(GradientAccumulationCallback(K, sharded_reduction="replicas_at_window_end")).fit(
                ShardedModule(nan_batch=None, weighted=False)
            )
        if trainer.global_rank == 0:
            found = [str(w.message) for w in caught if "has no effect" in str(w.message)]
            (out / "replicas_without_hsdp.txt").write_text("\n".join(found))
    unsynced_save(out)
    for state_dict_type in ("sharded", "full") if STRATEGY == "fsdp_cuda" else ("sharded",):
        resume(out, state_dict_type)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_together()  # both ranks: Lightning re-runs this script for the second
