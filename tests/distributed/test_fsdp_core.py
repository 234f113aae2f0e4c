"""The core under torch's own FSDP on two CPU processes (gloo), against the big batch.

FSDP2 (``fully_shard``, gradients as DTensors) and FSDP1 (``FullyShardedDataParallel(use_orig_params=True)``,
gradients as flat slices, ``None`` where a rank holds none of a parameter).

Each rank accumulates its micro-batches into its gradient shards; the boundary measures local shards and
combines the norms with one all-reduce. Oracle: the parameters after training equal a plain PyTorch run
taking one step per window on both ranks' data as one batch.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_gradacc import GradAccumulator
from tests.helpers import exit_together

pytestmark = pytest.mark.slow
WORLD = 2
K = 2
WINDOWS = 3
SCENARIOS: dict[str, dict[str, Any]] = {
    "mean": {},
    "clip": {"max_grad_norm": 0.05},
    "clip_parameter": {"max_grad_norm": 0.02, "clip_scope": "parameter"},
    "clip_inf_ignore": {"max_grad_norm": 0.01, "norm_type": float("inf"), "overflow": "ignore"},
    "weighted": {"scaling": "weighted"},
    "buffers": {"accumulation_dtype": "float64", "max_grad_norm": 0.05},
    "nan_on_one_rank": {},
    # an output layer of 1 unit: rank 1's shards of its weight and bias are empty
    "narrow_inf_clip": {"max_grad_norm": 0.01, "norm_type": float("inf")},
    "narrow_clip_value": {"clip_value": 0.01},
}
# Checked micro-batch by micro-batch: with FSDP a micro-batch is index i of every rank (reduced together)
PER_MICRO_BATCH: dict[str, dict[str, Any]] = {
    "skip_micro_batch": {"overflow": "skip_micro_batch", "accumulation_dtype": "float64"},
    "clip_micro_batch": {"clip_mode": "micro_batch", "max_grad_norm": 0.05, "accumulation_dtype": "float64"},
    "clip_micro_batch_weighted": {
        "clip_mode": "micro_batch",
        "max_grad_norm": 0.05,
        "accumulation_dtype": "float64",
        "scaling": "weighted",
    },
}
NARROW = {"narrow_inf_clip", "narrow_clip_value"}


def _net(outputs: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, outputs))


def _sharded_net(mesh: Any, outputs: int = 3) -> nn.Module:
    """:func:`_net` with each linear layer and the whole model sharded over ``mesh``: by FSDP2 when it is
    a mesh, by FSDP1 (``use_orig_params=True``) when it is ``"fsdp1"``."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    net = _net(outputs)
    if mesh in ("fsdp1", "fsdp1_hybrid"):
        options: dict[str, Any] = {"device_id": torch.device("cpu"), "use_orig_params": True}
        if mesh == "fsdp1_hybrid":  # 2 replicas of 2 shards (FSDP1 turns 1 shard into NO_SHARD)
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import ShardingStrategy

            options["sharding_strategy"] = ShardingStrategy.HYBRID_SHARD
            names = ("replicate", "shard")
            options["device_mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        for index, layer in enumerate(net):
            if isinstance(layer, nn.Linear):
                net[index] = FullyShardedDataParallel(layer, **options)
        return FullyShardedDataParallel(net, **options)
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _accumulator(net: nn.Module, mesh: Any, **options: Any) -> GradAccumulator:
    fsdp_module = net if mesh in ("fsdp1", "fsdp1_hybrid") else None  # FSDP2's describe themselves
    return GradAccumulator(net.named_parameters(), K, fsdp_module=fsdp_module, **options)


def _full(net: nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters, named as in :func:`_net` (a collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(net, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(net):
            return {
                n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in net.named_parameters()
            }
    return {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()}


def _micro_batch(
    rank: int, window: int, index: int, weighted: bool, outputs: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + 10 * window + index)
    rows = 2 + (rank + window + index) % 3 if weighted else 4  # uneven counts for "weighted"
    return torch.randn(rows, 5, generator=generator), torch.randn(rows, outputs, generator=generator)


def _world(kind: str) -> int:
    return 4 if kind == "fsdp1_hybrid" else WORLD


def _worker(rank: int, port: int, out: str, kind: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=_world(kind))
    from torch.distributed.device_mesh import init_device_mesh

    mesh: Any = kind if kind.startswith("fsdp1") else init_device_mesh("cpu", (WORLD,))
    if kind == "hsdp":  # 2 replicas of 1 shard: the norms must be combined over the shard dimension only
        mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    results: dict[str, Any] = {}
    for name, options in {**SCENARIOS, **PER_MICRO_BATCH}.items():
        outputs = 1 if name in NARROW else 3
        net = _sharded_net(mesh, outputs)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        accumulator = _accumulator(net, mesh, **options)
        weighted = options.get("scaling") == "weighted"
        for window in range(WINDOWS):
            for index in range(K):
                x, y = _micro_batch(rank, window, index, weighted, outputs)
                loss = nn.functional.mse_loss(net(x), y)
                nan_here = rank == 1 and window == 1 and index == 0
                if name in ("nan_on_one_rank", "skip_micro_batch") and nan_here:
                    loss = loss * float("nan")
                if kind == "hsdp" and name in SCENARIOS:  # all-reduce across replicas at the window's end
                    net.set_requires_all_reduce(index == K - 1)
                accumulator.backward(loss, items=len(x))
            accumulator.step(optimizer)
        full = _full(net)
        stats = accumulator.stats
        results[name] = (
            full,
            stats.windows,
            stats.skipped_steps,
            stats.non_finite_windows,
            stats.clipped_steps,
            stats.buffer_bytes,
        )
    results["stale"] = _unsynced_gradients_dropped(rank, mesh)
    if kind.startswith("fsdp1"):
        results["no_sync_buffers"] = _buffers_inside_no_sync(rank, mesh)
    for name in ("mean", "buffers"):
        results[f"resumed_{name}"] = _resumed_mid_window(rank, mesh, SCENARIOS[name])
    results["num_parameters"] = _accumulator(_sharded_net(mesh), mesh).stats.num_parameters
    results["layouts"] = _saved_under_another_layout(rank, mesh)
    if not kind.startswith("fsdp1"):
        results["held_back"] = _held_back_by_part_of_the_model(rank, mesh)
    if rank == 0:
        torch.save(results, out)
    exit_together()


def _resumed_mid_window(rank: int, mesh: Any, options: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The run of ``options``, with its accumulator saved after window 1's first micro-batch and replaced by
    a new one loaded from rank 0's saved window (as every rank loads rank 0's checkpoint in Lightning)."""
    net = _sharded_net(mesh)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    accumulator = _accumulator(net, mesh, **options)
    for window in range(WINDOWS):
        for index in range(K):
            x, y = _micro_batch(rank, window, index, False)
            accumulator.backward(nn.functional.mse_loss(net(x), y), items=len(x))
            if (window, index) == (1, 0):
                saved = [accumulator.window_state_dict()]  # a collective: every rank saves
                dist.broadcast_object_list(saved, src=0)
                for param in net.parameters():
                    param.grad = None
                accumulator = _accumulator(net, mesh, **options)
                accumulator.load_window_state_dict(saved[0], primary=rank == 0)
        accumulator.step(optimizer)
    return _full(net)


def _saved_under_another_layout(rank: int, mesh: Any) -> list[str]:
    """A window saved with plain parameters loaded under FSDP, and the reverse: each refused, naming the
    layouts, before anything changes (the plain gradients stay as they were)."""
    x, y = _micro_batch(rank, 0, 0, False)

    def accumulator_of(net: nn.Module) -> GradAccumulator:  # named as in `_net` under FSDP1 too
        named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in net.named_parameters()]
        return GradAccumulator(named, K, fsdp_module=net if mesh in ("fsdp1", "fsdp1_hybrid") else None)

    saved = {}
    for layout, net in (("plain", _net()), ("sharded", _sharded_net(mesh))):
        accumulator = accumulator_of(net) if layout == "sharded" else _accumulator(net, None)
        accumulator.backward(nn.functional.mse_loss(net(x), y), items=len(x))
        saved[layout] = accumulator.window_state_dict()  # a collective: every rank saves
    found = []
    sharded = _sharded_net(mesh)
    try:
        accumulator_of(sharded).load_window_state_dict(saved["plain"], primary=rank == 0)
        found.append("no error")
    except ValueError as error:
        found.append(str(error))
    plain = _net()
    for param in plain.parameters():
        param.grad = torch.ones_like(param)
    try:
        _accumulator(plain, None).load_window_state_dict(saved["sharded"], primary=rank == 0)
        found.append("no error")
    except ValueError as error:
        found.append(str(error))
    found.append(str(all(bool((p.grad == 1).all()) for p in plain.parameters())))
    return found


def _held_back_by_part_of_the_model(rank: int, mesh: Any) -> str:
    """Only the first layer sharded, its sync off: a mid-window save names the parameters FSDP2 holds
    back (the others have plain gradients, so "no gradient at all" cannot tell)."""
    from torch.distributed.fsdp import fully_shard

    from lightning_gradacc.core.torch_internals import drop_fsdp2_held_back

    net = _net()
    fully_shard(net[0], mesh=mesh)
    hold = net[0].set_requires_all_reduce if mesh.ndim > 1 else net[0].set_requires_gradient_sync
    hold(False)
    accumulator = GradAccumulator(net.named_parameters(), K, fsdp_module=net)
    x, y = _micro_batch(rank, 0, 0, False)
    accumulator.backward(nn.functional.mse_loss(net(x), y), items=len(x))
    try:
        accumulator.window_state_dict()
        found = "no error"
    except NotImplementedError as error:
        found = str(error)
    hold(True)
    drop_fsdp2_held_back(net[0])
    return found


def _buffers_inside_no_sync(rank: int, mesh: Any) -> str:
    """FSDP1 inside ``no_sync()`` leaves whole gradients: buffers of slices refuse them by name."""
    net = _sharded_net(mesh)
    accumulator = _accumulator(net, mesh, accumulation_dtype="float64")
    x, y = _micro_batch(rank, 0, 0, False)
    with net.no_sync():
        loss = nn.functional.mse_loss(net(x), y)
        try:
            accumulator.backward(loss, items=len(x))
        except RuntimeError as error:
            return str(error)
    return "no error"


def _unsynced_gradients_dropped(rank: int, mesh: Any) -> float:
    """A backward with FSDP's sync off, dropped as an abandoned window is, leaves nothing behind."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from lightning_gradacc.core.torch_internals import drop_fsdp2_held_back

    grads = []
    if mesh in ("fsdp1", "fsdp1_hybrid"):
        for abandon in (False, True):
            net = _sharded_net(mesh)
            x, y = _micro_batch(rank, 0, 0, False)
            if abandon:
                with net.no_sync():
                    nn.functional.mse_loss(net(x), y).mul(100).backward()
                GradAccumulator(net.parameters(), fsdp_module=net).reset()  # as a discarded window
            nn.functional.mse_loss(net(x), y).backward()
            with FullyShardedDataParallel.summon_full_params(net, with_grads=True):
                grads.append([p.grad.clone() for p in net.parameters()])
        return max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))
    for abandon in (False, True):
        net = _net()
        fully_shard(net, mesh=mesh)
        x, y = _micro_batch(rank, 0, 0, False)
        if abandon:  # HSDP: only the all-reduce across replicas held back
            hold = net.set_requires_all_reduce if mesh.ndim > 1 else net.set_requires_gradient_sync
            hold(False)
            nn.functional.mse_loss(net(x), y).mul(100).backward()
            hold(True)
            drop_fsdp2_held_back(net)
            net.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        grads.append([p.grad.full_tensor() for p in net.parameters()])
    return max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))


def _reference(
    options: dict[str, Any], skip_windows: tuple[int, ...] = (), outputs: int = 3, world: int = WORLD
) -> tuple[dict, int]:
    """One step per window on both ranks' micro-batches as ONE batch (mean over every item)."""
    net = _net(outputs)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    weighted = options.get("scaling") == "weighted"
    clipped = 0
    for window in range(WINDOWS):
        pairs = [
            _micro_batch(rank, window, index, weighted, outputs)
            for rank in range(world)
            for index in range(K)
        ]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        if window in skip_windows:
            continue
        if options.get("clip_value") is not None:
            clipped += any(float(p.grad.abs().max()) > options["clip_value"] for p in net.parameters())
            torch.nn.utils.clip_grad_value_(net.parameters(), options["clip_value"])
        max_norm = options.get("max_grad_norm")
        if max_norm is not None:
            norm_type = options.get("norm_type", 2.0)
            groups = (
                [[p] for p in net.parameters()]
                if options.get("clip_scope") == "parameter"
                else [list(net.parameters())]
            )
            norms = [torch.nn.utils.clip_grad_norm_(group, max_norm, norm_type=norm_type) for group in groups]
            clipped += any(float(n) > max_norm for n in norms)
        optimizer.step()
    return {n: p.detach() for n, p in net.named_parameters()}, clipped


@pytest.fixture(scope="module", params=["fsdp2", "fsdp1", "hsdp", "fsdp1_hybrid"])
def fsdp_results(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = str(tmp_path_factory.mktemp("fsdp") / "results.pt")
    mp.spawn(_worker, args=(port, out, request.param), nprocs=_world(request.param))
    results = torch.load(out, weights_only=True)
    results["kind"] = request.param
    return results


def _reference_per_micro_batch(options: dict[str, Any], world: int, drop: tuple[int, int] | None) -> dict:
    """One step per window; micro-batch i of every rank as one gradient, clipped on its own (clip_mode
    "micro_batch") or dropped (``drop``: (window, index)); the window's gradient their mean, by items for
    "weighted"."""
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    weighted = options.get("scaling") == "weighted"
    for window in range(WINDOWS):
        total = [torch.zeros_like(p) for p in net.parameters()]
        kept_items, kept = 0, 0
        for index in range(K):
            if (window, index) == drop:
                continue
            pairs = [_micro_batch(rank, window, index, weighted) for rank in range(world)]
            x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
            net.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            if options.get("clip_mode") == "micro_batch":
                torch.nn.utils.clip_grad_norm_(net.parameters(), options["max_grad_norm"])
            factor = len(x) if weighted else 1
            for t, p in zip(total, net.parameters(), strict=True):
                t.add_(p.grad, alpha=factor)
            kept_items, kept = kept_items + len(x), kept + 1
        for t, p in zip(total, net.parameters(), strict=True):
            p.grad = t / (kept_items if weighted else kept)
        optimizer.step()
    return {n: p.detach() for n, p in net.named_parameters()}


@pytest.mark.parametrize("scenario", list(PER_MICRO_BATCH))
def test_sharded_micro_batches_are_checked_and_clipped_each(
    fsdp_results: dict[str, Any], scenario: str
) -> None:
    full, windows, skipped, non_finite, clipped, _ = fsdp_results[scenario]
    world = _world(fsdp_results["kind"])
    drop = (1, 0) if scenario == "skip_micro_batch" else None
    expected = _reference_per_micro_batch(PER_MICRO_BATCH[scenario], world, drop)
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert (windows, skipped, non_finite) == (WINDOWS, 0, 0)
    if scenario.startswith("clip"):
        assert clipped > 0
        options = {**PER_MICRO_BATCH[scenario], "clip_mode": "step"}
        unclipped = _reference_per_micro_batch(options, world, None)
        assert max(float((expected[n] - unclipped[n]).abs().max()) for n in expected) > 1e-3


@pytest.mark.parametrize("scenario", [name for name in SCENARIOS if name != "nan_on_one_rank"])
def test_sharded_gradients_equal_the_big_batch(fsdp_results: dict[str, Any], scenario: str) -> None:
    full, windows, skipped, non_finite, clipped, buffer_bytes = fsdp_results[scenario]
    world = _world(fsdp_results["kind"])
    outputs = 1 if scenario in NARROW else 3
    expected, expected_clipped = _reference(SCENARIOS[scenario], outputs=outputs, world=world)
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert (windows, skipped, non_finite) == (WINDOWS, 0, 0)
    assert clipped == expected_clipped
    if "max_grad_norm" in SCENARIOS[scenario] or "clip_value" in SCENARIOS[scenario]:
        assert expected_clipped > 0  # the clipping case really clips
    parameters = sum(p.numel() for p in _net().parameters())
    # float64 buffers of the local shards: 8 bytes x this rank's share (rows split over 2 ranks)
    shards = {"hsdp": 1, "fsdp1_hybrid": 2}.get(fsdp_results["kind"], WORLD)
    assert buffer_bytes == (0 if scenario != "buffers" else pytest.approx(8 * parameters / shards, rel=0.2))


def test_a_non_finite_shard_on_one_rank_skips_the_window_on_both(fsdp_results: dict[str, Any]) -> None:
    full, windows, skipped, non_finite, _, _ = fsdp_results["nan_on_one_rank"]
    expected, _ = _reference({}, skip_windows=(1,), world=_world(fsdp_results["kind"]))
    assert max(float((full[n] - expected[n]).abs().max()) for n in expected) < 1e-6
    assert (windows, skipped, non_finite) == (WINDOWS, 1, 1)


def test_the_reference_is_not_trivially_met() -> None:
    """Control: the per-parameter and the global clipping (and no clipping) end far apart."""
    plain, _ = _reference({})
    clipped, _ = _reference(SCENARIOS["clip"])
    per_parameter, _ = _reference(SCENARIOS["clip_parameter"])
    for other in (clipped, per_parameter):
        assert max(float((plain[n] - other[n]).abs().max()) for n in plain) > 1e-3


def test_an_abandoned_unsynced_window_leaves_no_gradient_behind(fsdp_results: dict[str, Any]) -> None:
    assert fsdp_results["stale"] == 0.0


@pytest.mark.parametrize("name", ["mean", "buffers"])
def test_a_window_saved_in_the_middle_resumes_exactly(fsdp_results: dict[str, Any], name: str) -> None:
    uninterrupted = fsdp_results[name][0]
    resumed = fsdp_results[f"resumed_{name}"]
    assert max(float((resumed[n] - uninterrupted[n]).abs().max()) for n in uninterrupted) < 1e-6


def test_fsdp1_buffers_refuse_whole_gradients_from_no_sync(fsdp_results: dict[str, Any]) -> None:
    if not fsdp_results["kind"].startswith("fsdp1"):
        pytest.skip("FSDP1's `no_sync()`")
    assert "is whole ((8, 5)), not this rank's slice ((24,))" in fsdp_results["no_sync_buffers"]


def test_a_window_saved_under_another_layout_is_refused_before_anything_changes(
    fsdp_results: dict[str, Any],
) -> None:
    into_sharded, into_plain, plain_grads_kept = fsdp_results["layouts"]
    assert (
        "saved with parameter `0.weight` not sharded, but it is sharded by FSDP in this run" in into_sharded
    )
    assert "saved with parameter `0.weight` sharded by FSDP, but it is not sharded in this run" in into_plain
    assert plain_grads_kept == "True"


def test_a_save_names_the_parameters_fsdp2_holds_back(fsdp_results: dict[str, Any]) -> None:
    if fsdp_results["kind"].startswith("fsdp1"):
        pytest.skip("FSDP2's held-back gradients")
    assert "cannot be saved in the middle of the window" in fsdp_results["held_back"]
    assert fsdp_results["held_back"].endswith("Held back: 0.weight, 0.bias.")


def test_num_parameters_counts_the_whole_model_whatever_the_sharding(fsdp_results: dict[str, Any]) -> None:
    assert fsdp_results["num_parameters"] == sum(p.numel() for p in _net().parameters())  # rank 0's
