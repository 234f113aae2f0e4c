"""Every private or undocumented attribute of torch the package relies on: one small function each.

A torch upgrade that moves one of them breaks here, in one place (as ``lightning_internals.py`` does for
Lightning). The comments name what each relies on in torch 2.x's sources; nothing else in the package
reads a private attribute of torch.

**The device step.** torch's fused optimizers (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``)
read two tensors a GradScaler leaves on them for the length of one ``step()``: ``found_inf`` (1.0: change
neither the parameters nor any state, ``step`` counters included) and ``grad_scale`` (every gradient is
divided by it inside the kernel, and written back divided). A window's decision made on the device
(non-finite, no items, an invalid count) becomes ``found_inf``; its multiplier (normalization x clip
coefficient) may become ``grad_scale``, which saves the separate multiply pass over every gradient. No host
sync: the step is launched at once. A skip never multiplies by 0 (0 x nan = nan would reach Adam's
moments): the kernel returns before it reads a gradient.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# ------------------------------------------------------------------------------------------ GradScaler


def scaler_scale(scaler: Any) -> Tensor | None:
    """A GradScaler's scale as the device tensor it keeps (``get_scale()`` would sync with the host).

    ``GradScaler._scale`` (``torch/amp/grad_scaler.py``): ``None`` until the first ``scale()`` call.
    """
    scale: Tensor | None = getattr(scaler, "_scale", None)
    return scale


def scaler_scales_lazily(scaler: Any) -> bool:
    """Whether ``scaler`` is torch's own GradScaler, whose scale tensor appears at its first ``scale()``."""
    return getattr(type(scaler), "scale", None) is torch.amp.GradScaler.scale


def ensure_scaler_scale(scaler: Any) -> None:
    """Create the scaler's scale tensor if no loss was scaled yet, so that ``unscale_`` works.

    ``GradScaler._lazy_init_scale_growth_tracker`` on ``_device`` (``torch/amp/grad_scaler.py``), what the
    first ``scale()`` calls: a scale loaded from a checkpoint waits in ``_init_scale`` until then.
    """
    if getattr(scaler, "_scale", True) is None:
        scaler._lazy_init_scale_growth_tracker(torch.device(scaler._device))


def scaler_found_inf(scaler: Any, optimizer: Any) -> bool:
    """Whether ``scaler``'s ``unscale_(optimizer)`` found a non-finite gradient (one host sync).

    ``GradScaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]``
    (``torch/amp/grad_scaler.py``), what ``scaler.step`` reads to skip the step.
    """
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    return any(float(value.item()) for value in found.values())


def reset_scaler_optimizer_states(scaler: Any) -> None:
    """Forget what a GradScaler noted of each optimizer since its last ``update()`` (unscaled, ``found_inf``).

    ``GradScaler._per_optimizer_states`` (``torch/amp/grad_scaler.py``), renewed as ``update()`` does: after
    an out-of-memory error the failed pass must leave no state behind for the step.
    """
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is not None:
        states.clear()  # a defaultdict: each optimizer gets a fresh state at its next use


def steps_with_amp_scaling(optimizer: Any) -> bool:
    """Whether ``optimizer``'s step reads ``found_inf``/``grad_scale`` (and unscales inside it).

    ``Optimizer._step_supports_amp_scaling`` (``torch/optim/adam.py`` and the other fused optimizers), which
    ``GradScaler.step`` and Lightning's ``_optimizer_handles_unscaling`` read too.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


# ------------------------------------------------------------------------------------------- foreach


@functools.cache
def device_has_foreach(device_type: str) -> bool:
    """Whether ``torch._foreach_*`` kernels run on ``device_type``, as ``torch.nn.utils`` asks.

    ``torch.utils._foreach_utils._device_has_foreach_support``.
    """
    from torch.utils._foreach_utils import _device_has_foreach_support

    return bool(_device_has_foreach_support(torch.device(device_type)))


# ---------------------------------------------------------------------------------------------- DDP


def set_ddp_backward_sync(ddp: Any, enabled: bool) -> None:
    """Turn DDP's gradient all-reduce on or off for every backward: ``no_sync()`` for a whole fit.

    ``DistributedDataParallel.require_backward_grad_sync`` (``torch/nn/parallel/distributed.py``): the flag
    ``no_sync()`` clears, read at each forward to prepare (or not) the reducer of the coming backward.
    """
    ddp.require_backward_grad_sync = enabled


def ddp_backward_syncs(ddp: Any) -> bool:
    """Whether DDP's next backward all-reduces (the flag of :func:`set_ddp_backward_sync`, ``no_sync``)."""
    return bool(getattr(ddp, "require_backward_grad_sync", False))


def skip_ddp_buffer_sync_at_next_forward(ddp: Any) -> None:
    """Have DDP not broadcast its buffers at the next forward (a forward that failed broadcast them already).

    ``DistributedDataParallel.require_forward_param_sync`` (``torch/nn/parallel/distributed.py``): set at the
    end of a forward, read at the start of the next; a forward that raised left it as it was, so its rerun
    would broadcast once more than the other ranks.
    """
    ddp.require_forward_param_sync = False


def sync_ddp_buffers_at_next_forward(ddp: Any) -> None:
    """Have DDP broadcast its buffers at the next forward, as after a backward that synced.

    ``DistributedDataParallel.require_forward_param_sync`` (``torch/nn/parallel/distributed.py``): a
    forward sets it when its backward will sync and clears it otherwise; the next forward reads it.
    """
    ddp.require_forward_param_sync = True


# --------------------------------------------------------------------------------------------- FSDP1


@dataclass(frozen=True)
class FlatLayout:
    """Where one parameter flattened by FSDP1 lies in its wrapper's flat parameter, on this rank."""

    param: Tensor
    shape: torch.Size  # the whole parameter's
    start: int  # where this rank's slice starts in the flattened whole
    numel: int  # this rank's slice (0: it holds none)
    sharded: bool  # False: NO_SHARD (the whole on every rank)
    process_group: Any


def fsdp1_layouts(module: torch.nn.Module) -> list[FlatLayout]:
    """Every parameter flattened by FSDP1 inside ``module``, with its slice on this rank.

    ``FullyShardedDataParallel._handle`` and its ``flat_param``'s ``_params``, ``_shard_param_infos``,
    ``_shapes`` (``torch/distributed/fsdp/_flat_param.py``: private, stable since torch 2.0; FSDP1 is frozen
    upstream).

    Raises:
        ValueError: a module wrapped with ``use_orig_params=False`` (``_use_orig_params``): the optimizer
            then holds flat parameters that mix many tensors, which neither per-parameter clipping nor the
            statistics can tell apart.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    layouts: list[FlatLayout] = []
    for fsdp in FullyShardedDataParallel.fsdp_modules(module):
        handle: Any = fsdp._handle
        if handle is None:  # a wrapper without parameters of its own
            continue
        if not handle._use_orig_params:
            raise ValueError(
                "`FullyShardedDataParallel` with `use_orig_params=False` is not supported: its optimizer"
                " sees flat parameters that mix many tensors. Wrap with `use_orig_params=True` (the default"
                " of Lightning's `FSDPStrategy`)."
            )
        flat = handle.flat_param
        for param, info, shape in zip(flat._params, flat._shard_param_infos, flat._shapes, strict=True):
            held = info.numel_in_shard if info.in_shard else 0
            start = info.intra_param_start_idx if info.in_shard else 0
            sharded = bool(handle.uses_sharded_strategy)
            layouts.append(
                FlatLayout(param, torch.Size(shape), int(start), int(held), sharded, fsdp.process_group)
            )
    return layouts


def is_fsdp_flattened(param: Tensor) -> bool:
    """Whether FSDP1 flattened ``param``: ``_fsdp_flattened``, the mark FSDP1 sets on what it flattened."""
    return bool(getattr(param, "_fsdp_flattened", False))


# --------------------------------------------------------------------------------------------- FSDP2


def _fsdp2_group(module: Any) -> Any:
    """An FSDP2 module's parameter group.

    ``_get_fsdp_state()._fsdp_param_group`` (``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``).
    """
    return getattr(module._get_fsdp_state(), "_fsdp_param_group", None)


def fsdp2_held_back(modules: list[Any]) -> set[int]:
    """The sharded parameters (by ``id``) whose window gradient the FSDP2 ``modules`` hold back inside.

    While its gradient sync is off (``set_requires_gradient_sync(False)``) FSDP2 accumulates each rank's
    unsharded gradient in its own state (``FSDPParam.unsharded_accumulated_grad``, ``_unsharded_param.grad``)
    and leaves ``.grad`` alone; while only the all-reduce across replicas is off
    (``set_requires_all_reduce(False)``, HSDP) the reduce-scattered sum waits in the parameter group
    (``FSDPParamGroup._partial_reduce_output``). Read only.
    """
    held: set[int] = set()
    for module in modules:
        group = _fsdp2_group(module)
        if group is None:
            continue
        partial = getattr(group, "_partial_reduce_output", None) is not None
        for fsdp_param in getattr(group, "fsdp_params", []):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if (
                partial
                or getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None
                or (unsharded is not None and unsharded.grad is not None)
            ):
                held.add(id(fsdp_param.sharded_param))
    return held


def fsdp2_unsharded_params(modules: list[Any]) -> dict[int, Tensor]:
    """Each FSDP2 parameter's unsharded twin by the ``id`` of its sharded parameter, where it exists yet.

    ``FSDPParam._unsharded_param`` (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``): the parameter
    the module computes with between FSDP2's all-gather and its reduce-scatter, made at the first all-gather
    and kept (its storage is freed and reused). Autograd accumulates this rank's micro-batch gradient into
    it before the reduce-scatter, so a hook on it sees the gradient a DDP rank's parameter would.
    """
    twins: dict[int, Tensor] = {}
    for module in modules:
        group = _fsdp2_group(module)
        for fsdp_param in getattr(group, "fsdp_params", []):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                twins[id(fsdp_param.sharded_param)] = unsharded
    return twins


def drop_fsdp2_held_back(module: Any) -> None:
    """Forget the gradients an FSDP2 module held back while its sync or all-reduce was off (see above)."""
    group = _fsdp2_group(module)
    if getattr(group, "_partial_reduce_output", None) is not None:
        group._partial_reduce_output = None
    for fsdp_param in getattr(group, "fsdp_params", []):
        # an attribute of its own before torch 2.15; from 2.15 a read-only property giving
        # `_unsharded_param.grad`, cleared below
        own = not isinstance(getattr(type(fsdp_param), "unsharded_accumulated_grad", None), property)
        if own and getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            fsdp_param.unsharded_accumulated_grad = None
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None


# ------------------------------------------------------------------------------------- the device step

ARMED = ("found_inf", "grad_scale")


def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer``'s next ``step()`` honours ``found_inf`` and ``grad_scale`` exactly.

    True for torch's fused optimizers, except fused SGD with momentum before its first step: it creates its
    momentum buffers with ``empty_like`` in that step even when ``found_inf`` skips it, and the next step
    would read the uninitialized memory (a GradScaler's first overflow meets the same). That one step is
    decided on the host.

    Example:
        >>> params = [torch.nn.Parameter(torch.zeros(1))]
        >>> skips_on_device(torch.optim.Adam(params, fused=True)), skips_on_device(torch.optim.Adam(params))
        (True, False)
        >>> skips_on_device(torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True))  # no step yet
        False
    """
    if not steps_with_amp_scaling(optimizer):
        return False
    if isinstance(optimizer, torch.optim.SGD) and not optimizer.state:
        return not any(group.get("momentum", 0) for group in optimizer.param_groups)
    return True


@dataclass(frozen=True, slots=True)
class DeviceStep:
    """The device tensors one fused optimizer step reads.

    Attributes:
        found_inf: A float32 scalar: 1.0 skips the step, 0.0 takes it.
        grad_scale: A float32 scalar every gradient is divided by in the step (the reciprocal of the
            window's multiplier), or ``None`` when the gradients already are final.

    Example:
        >>> param = torch.nn.Parameter(torch.zeros(1))
        >>> optimizer = torch.optim.SGD([param], lr=1.0, fused=True)
        >>> param.grad = torch.ones(1)
        >>> step = DeviceStep(torch.tensor(0.0), grad_scale=torch.tensor(4.0))
        >>> step.arm(optimizer)
        >>> optimizer.step()
        >>> param.detach(), hasattr(optimizer, "found_inf")  # the gradient was divided by 4; disarmed
        (tensor([-0.2500]), False)
    """

    found_inf: Tensor
    grad_scale: Tensor | None = None

    def arm(self, optimizer: torch.optim.Optimizer) -> None:
        """Leave the tensors on ``optimizer`` for its next ``step()`` only (a one-shot post-hook disarms).

        Raises:
            RuntimeError: ``optimizer`` cannot skip on the device, or something else (a GradScaler's step)
                armed it already.
        """
        if not skips_on_device(optimizer):
            raise RuntimeError(
                f"{type(optimizer).__name__} does not read `found_inf`/`grad_scale` in its step: only torch's"
                " fused optimizers (`fused=True`) skip a step on the device."
            )
        if any(hasattr(optimizer, name) for name in ARMED):
            raise RuntimeError(
                "The optimizer already carries `found_inf`/`grad_scale` for its next step (a GradScaler's"
                " step?): a window's device step cannot be added to it."
            )
        optimizer.found_inf = self.found_inf  # type: ignore[attr-defined]
        optimizer.grad_scale = self.grad_scale  # type: ignore[attr-defined]
        _PENDING[optimizer] = optimizer.register_step_post_hook(_disarm_after_step)


# the one-shot step post-hook of each armed optimizer, removed by `disarm` with the tensors
_PENDING: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _disarm_after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    disarm(optimizer)


def disarm(optimizer: Any) -> None:
    """Remove what :meth:`DeviceStep.arm` left on ``optimizer``: the tensors and its step post-hook.

    Nothing happens if nothing is there. Called after the step, and for a step that never came (an
    exception), so that no hook of this package stays on the optimizer.
    """
    handle = _PENDING.pop(optimizer, None)
    if handle is not None:
        handle.remove()
    for name in ARMED:
        if name in vars(optimizer):
            delattr(optimizer, name)


# ----------------------------------------------------------------------------------- torch.compile

_CUDA_GRAPH_BACKENDS = ("cudagraphs",)  # torch._dynamo's backend that captures CUDA graphs itself


def _innermost_backend(callback: Any) -> Any:
    """The compiler behind a dynamo callback.

    Its wrappers link inward by ``_torchdynamo_orig_backend`` (torch 2.9 on) or
    ``_torchdynamo_orig_callable`` (before).
    """
    backend = callback
    for _ in range(32):
        inner = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(
            backend, "_torchdynamo_orig_callable", None
        )
        if inner is None or inner is backend:
            break
        backend = inner
    return backend


def _backend_uses_cuda_graphs(backend: Any) -> str | None:
    """What makes a compiler capture CUDA graphs, else ``None``.

    Inductor's ``triton.cudagraphs`` (``mode="reduce-overhead"`` or ``"max-autotune"`` set it in
    ``_TorchCompileInductorWrapper.config``; else the global config) or the ``cudagraphs`` backend
    (``_TorchCompileWrapper.compiler_name``).
    """
    config = getattr(backend, "config", None)
    if isinstance(config, dict):
        if "triton.cudagraphs" in config:
            return (
                "triton.cudagraphs=True (mode='reduce-overhead' or 'max-autotune')"
                if config["triton.cudagraphs"]
                else None
            )
        import torch._inductor.config as inductor_config

        return "torch._inductor.config.triton.cudagraphs=True" if inductor_config.triton.cudagraphs else None
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return f"backend={name!r}" if name in _CUDA_GRAPH_BACKENDS else None


def dynamo_context_uses_cuda_graphs(context: Any) -> str | None:
    """What makes a dynamo context capture CUDA graphs, else ``None``.

    The context of ``OptimizedModule.dynamo_ctx``, or Lightning's ``dynamo_ctx`` of a compiled module.
    """
    callback = getattr(context, "callback", None)
    if callback is None or callback is False:  # `torch._dynamo.disable()` and `run()` contexts
        return None
    return _backend_uses_cuda_graphs(_innermost_backend(callback))


def _compiled_function_context(function: Any) -> Any:
    """The dynamo context of ``torch.compile(function)``.

    ``nn.Module.compile``'s ``_compiled_call_impl`` keeps it only in its closure (as ``self``).
    """
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or not cells:
        return None
    for name, cell in zip(code.co_freevars, cells, strict=False):
        if name == "self":
            try:
                return cell.cell_contents
            except ValueError:
                return None
    return None


def compiled_with_cuda_graphs(module: torch.nn.Module) -> str | None:
    """Where ``module`` or a submodule was compiled to capture CUDA graphs, and by what; else ``None``.

    ``torch.compile(module)`` (an ``OptimizedModule``, also as a submodule) and ``module.compile()``; a
    global inductor setting changed after this reads it is not seen (compilation is lazy).
    """
    from torch._dynamo.eval_frame import OptimizedModule

    for name, submodule in module.named_modules():
        where = name or type(module).__name__
        attributes = vars(submodule)  # not through OptimizedModule's __getattr__
        found = None
        if isinstance(submodule, OptimizedModule):
            found = dynamo_context_uses_cuda_graphs(attributes.get("dynamo_ctx"))
        compiled_call = attributes.get("_compiled_call_impl")
        if found is None and compiled_call is not None:
            found = dynamo_context_uses_cuda_graphs(_compiled_function_context(compiled_call))
        if found is not None:
            return f"`{where}` ({found})"
    return None


def leave_the_group() -> None:
    """Every rank meets, then the process group is destroyed (nothing where none is running).

    A gloo worker thread can still need the GIL after its collective completed, to drop a Python object (the
    autograd context a backward's reduction carries); if the interpreter is finalizing by then, CPython ends
    that thread inside a C++ destructor and the process aborts (SIGABRT) after its work is done. After the
    barrier every collective of this rank has completed, and no rank exits while another still talks to it
    (Lightning destroys only NCCL groups at exit).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave_the_group_and_exit() -> None:
    """End a process of a gloo group once its work is done: :func:`leave_the_group`, then exit at once.

    ``os._exit`` skips the interpreter's teardown, which a gloo worker thread still holding a Python object
    could meet even after the group is destroyed (DDP's reducer may still hold it).
    """
    import os
    import sys

    leave_the_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
