"""The checkpoint formats: one version number for everything this package saves, and the window check.

``FORMAT_VERSION`` is written by :func:`stamp` alone (into the accumulator's counters and its open window, the
two forms a plain loop saves, and the callback's entry holding both) and read by :func:`check_format` alone.
A format change raises it, and the one reader says which version it found. Version 4 saves the noise scale's
window totals and ``"auto"``'s timings by name; 3 (the same, as lists in their declared order) is still read;
1 and 2 were never released.

The saved window holds its summed gradients (``.grad`` or the buffers) and its counters. Loading it is
all-or-nothing: every check runs before anything is modified, and the first mismatch is named.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .buffers import GradBuffers
from .parameters import TrackedParameters
from .shards import as_sharded_like, distribute_like, fsdp2_held_back, local_shards
from .weighting import GradientScale, ItemWeighting
from .window import NAMES, Window, WindowState
from .world import World

FORMAT_VERSION = 4
READABLE_VERSIONS = (3, FORMAT_VERSION)  # 3: totals and timings as lists (read by their declared order)


def stamp(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the format version, the one place it is written.

    Example:
        >>> stamp({"windows": 2})
        {'version': 4, 'windows': 2}
    """
    return {"version": FORMAT_VERSION, **state}


def check_format(state: Mapping[str, Any], what: str) -> None:
    """Raise ``ValueError`` unless ``state`` has this format version, the one place it is read.

    Example:
        >>> check_format({"version": 2}, "accumulator state")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: The checkpoint's accumulator state has format version 2; this version ... reads 3 and 4.
    """
    version = state.get("version") if isinstance(state, Mapping) else None
    if version not in READABLE_VERSIONS or type(version) is not int:
        readable = " and ".join(str(v) for v in READABLE_VERSIONS)
        raise ValueError(
            f"The checkpoint's {what} has format version {version!r}; this version of lightning_gradacc reads"
            f" {readable}."
        )


# what a saved window must hold besides its version, kind, ranks and tensors: its micro-batches, its
# quantities (as the window declares them) and the scales its sums carry
_WINDOW_KEYS = ("micro_batches", *NAMES, "loss_scale", "amp_scale")


def check_window_state(
    state: Mapping[str, Any],
    expected: Mapping[str, tuple[torch.Size, torch.dtype]],
    kind: str,
    world_size: int,
    sharded: Collection[str] = (),
) -> None:
    """Raise ``ValueError`` naming the first way ``state`` does not fit the model and the accumulator.

    Args:
        state: A dict saved by ``GradAccumulator.window_state_dict``.
        expected: Shape and dtype of the tensor each tracked parameter name needs. A parameter the state
            has no tensor for had no gradient in the window.
        kind: ``"grads"`` or ``"buffers"``: where the accumulator keeps the window's sum now.
        world_size: Ranks now.
        sharded: The names of the parameters sharded now (FSDP1 or FSDP2): a window saved under another
            layout holds its sums in another form (whole and averaged over ranks, or this rank's sum).

    Example:
        >>> state = {"version": 3, "kind": "grads", "world_size": 2, "tensors": {"w": torch.zeros(3)},
        ...          **dict.fromkeys(_WINDOW_KEYS, 1.0)}
        >>> check_window_state(state, {"w": (torch.Size([3]), torch.float32)}, "grads", 2)
        >>> check_window_state(state, {"w": (torch.Size([3]), torch.float32)}, "grads", 1)
        Traceback (most recent call last):
        ...
        ValueError: The checkpoint's pending window was accumulated on 2 rank(s), but this run has 1. ...
    """
    check_format(state, "pending accumulation window")
    if state.get("kind") != kind:
        where = {"grads": "`.grad` (no accumulation_dtype)", "buffers": "accumulation buffers"}
        saved = where.get(str(state.get("kind")), repr(state.get("kind")))
        raise ValueError(
            f"The checkpoint's pending window was accumulated in {saved}, but this run accumulates in"
            f" {where[kind]}. Resume with the same `accumulation_dtype`."
        )
    if state.get("world_size") != world_size:
        raise ValueError(
            f"The checkpoint's pending window was accumulated on {state.get('world_size')} rank(s), but this"
            f" run has {world_size}. Resume with the same number of ranks, or from a checkpoint taken at the"
            " end of a window."
        )
    missing = [key for key in _WINDOW_KEYS if key not in state]
    if missing:
        raise ValueError(f"The checkpoint's pending window is missing {missing}.")
    tensors = state.get("tensors")
    if not isinstance(tensors, Mapping):
        raise ValueError("The checkpoint's pending window has no `tensors`.")
    saved_sharded = set(state.get("sharded", ()))
    for name in tensors:
        if name in expected and (name in saved_sharded) != (name in sharded):
            then, now = (
                ("sharded by FSDP" if name in saved_sharded else "not sharded"),
                ("sharded by FSDP" if name in sharded else "not sharded"),
            )
            raise ValueError(  # the sums differ in form: whole and averaged, or one rank's sum
                f"The checkpoint's pending window was saved with parameter `{name}` {then}, but it is"
                f" {now} in this run. Resume with the same strategy, or from a checkpoint taken at the end"
                " of a window."
            )
    for name, tensor in tensors.items():
        if name not in expected:
            raise ValueError(
                f"The checkpoint's pending window has a gradient for unknown parameter `{name}`."
            )
        shape, dtype = expected[name]
        if not isinstance(tensor, torch.Tensor) or tensor.shape != shape or tensor.dtype != dtype:
            found = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(
                f"The checkpoint's pending gradient of `{name}` is {found}, but the parameter needs"
                f" {(tuple(shape), dtype)}."
            )


UNSYNCED = (
    "This window's gradients are held unsynced inside {} (`sharded_reduction='window_end'` or"
    " `'replicas_at_window_end'`) and"
    " cannot be saved in the middle of the window: checkpoint at the end of a window (e.g."
    " `ModelCheckpoint(every_n_train_steps=...)`), or use `sharded_reduction='every_micro_batch'`."
)


@dataclass
class WindowCheckpoint:
    """The open window's saved form, owned by the parts its sums and counts live in: save, check, load.

    The window's sums are in ``.grad`` or the buffers, its counts in its tally, the scales they carry in
    ``scale``, the weighting's reference in ``weighting`` and the noise scale's totals in ``noise``: this one
    object saves them together and loads them back all-or-nothing (every check first). Under data
    parallelism the rank-dependent parts (gradients, items, losses) are summed over ranks when saved: a
    collective, so every rank must save (Lightning does, when it saves a checkpoint). Loaded on the first
    rank, with the other ranks starting from zero, the sum continues exactly, because the all-reduce at the
    end of the window is linear. Syncs with the device (checkpoint time only).

    Attributes:
        tracked: The parameters.
        buffers: The accumulation buffers, if any.
        scale: The loss and AMP scale the sums carry.
        weighting: The item weighting (its reference count).
        world: The data-parallel ranks.
        noise: The noise scale (or its stand-in doing nothing).
    """

    tracked: TrackedParameters
    buffers: GradBuffers | None
    scale: GradientScale
    weighting: ItemWeighting
    world: World
    noise: Any

    def state_dict(self, window: Window) -> dict[str, Any] | None:
        """The open ``window`` (its summed gradients and counters), or ``None`` between windows."""
        if window.empty:
            return None
        tracked, buffers = self.tracked, self.buffers
        named, shard_groups = tracked.named, tracked.shard_groups
        in_buffers = window.sums_in_buffers
        module = tracked.fsdp_module
        if module is not None:  # decided per parameter
            held = fsdp2_held_back(module)
            names = [name for name, param in named if id(param) in held]
            if names:
                raise NotImplementedError(UNSYNCED.format("FSDP2") + f" Held back: {', '.join(names)}.")
        elif (
            any(group is not None for group in shard_groups)
            and not in_buffers
            and all(grad is None for grad in tracked.grads())
        ):  # without the module only a window with no gradient at all shows it
            raise NotImplementedError(UNSYNCED.format("FSDP2"))
        flat = tracked.flat_shards
        if not in_buffers and any(
            shard is not None and p.grad is not None and p.grad.shape != p.shape
            for (_, p), shard in zip(named, flat, strict=True)
        ):  # FSDP1 inside `no_sync()`: whole gradients, each rank's own
            raise NotImplementedError(UNSYNCED.format("FSDP1 (`no_sync()`)"))
        world_size, all_reduce = self.world.resolve()

        def summed(tensor: Tensor) -> Tensor:
            return all_reduce(tensor.clone()) if all_reduce is not None else tensor

        sums = buffers.window() if in_buffers and buffers is not None else None
        if buffers is not None and window.state is WindowState.FLUSHED:
            # flushed into `.grad` (for DDP's last backward, or a GradScaler): still a buffered window, saved
            # as the buffers' local sums in their dtype, so that it loads into buffers again
            grads = local_shards(tracked.grads())[0]
            in_buffers, sums = True, [None if t is None else t.to(buffers.dtype) for t in grads]
        tensors: dict[str, Tensor] = {}
        sharded: list[str] = []
        for index, (name, param) in enumerate(named):
            tensor = sums[index] if sums is not None else param.grad
            if tensor is None and not param.requires_grad:  # frozen: nothing to save (the same on every rank)
                continue
            dtype = buffers.dtype if in_buffers and buffers is not None else param.dtype
            if flat[index] is not None:  # FSDP1: each rank's slice, put together once here
                whole_flat = flat[index].whole(  # type: ignore[union-attr]
                    tensor.detach() if tensor is not None else None, dtype, param.device
                )
                tensors[name] = whole_flat.cpu()
                sharded.append(name)
                continue
            if shard_groups[index] is not None:
                # FSDP2 reduced (averaged over ranks) every micro-batch into the shards: the window's whole
                # gradient is gathered once here, and every rank takes its shard of it back at load
                zeros: Any = torch.zeros_like(param, dtype=dtype)  # a DTensor like the parameter
                local = tensor.detach() if tensor is not None else zeros.to_local()
                whole: Any = as_sharded_like(param, local) if sums is not None or tensor is None else local
                tensors[name] = whole.full_tensor().cpu()
                sharded.append(name)
                continue
            local = tensor.detach() if tensor is not None else torch.zeros_like(param, dtype=dtype)
            tensors[name] = summed(local).cpu()
        return stamp(
            {
                "kind": "buffers" if in_buffers else "grads",
                "world_size": world_size,
                "micro_batches": window.micro_batches,
                **window.tally.saved(
                    summed
                ),  # each quantity, summed over ranks where the ranks' parts differ
                **self.weighting.state_dict(),
                **self.scale.state_dict(),
                "tensors": tensors,
                "sharded": sharded,  # sharded parameters: each rank takes its shard of the whole at load
                **({"noise": totals} if (totals := self.noise.window_state(summed)) else {}),
            }
        )

    def _expected(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        buffers = self.buffers
        return {
            name: (
                shard.shape if shard is not None else param.shape,  # FSDP1: the whole parameter's
                buffers.dtype if buffers is not None else param.dtype,
            )
            for (name, param), shard in zip(self.tracked.named, self.tracked.flat_shards, strict=True)
        }

    def check(self, state: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` if the saved window ``state`` does not fit these parameters and ranks."""
        world_size, _ = self.world.resolve()
        kind = "buffers" if self.buffers is not None else "grads"
        check_window_state(state, self._expected(), kind, world_size, self.tracked.sharded_names())
        self.noise.check_window(state.get("noise"))  # its totals too: nothing is loaded if they do not fit

    def load_state_dict(self, state: Mapping[str, Any], window: Window, *, primary: bool = True) -> None:
        """Put a window checked by :meth:`check` into the new, empty ``window``.

        The saved sums are rescaled from the loss scale (and AMP scale) they were saved with to the current
        ones, so a window resumes exactly with another K or after the GradScaler changed its scale.

        Args:
            state: The saved window.
            window: The open window (empty; its gradients were set to ``None``).
            primary: Whether this rank takes the saved sums (rank 0); the other ranks start from zero.
        """
        tracked, buffers, scale = self.tracked, self.buffers, self.scale
        expected = self._expected()
        rescale = scale.rescale_from(dict(state))
        saved_tensors = state["tensors"]
        sharded = set(state.get("sharded", ()))
        saved: list[Tensor | None] = []
        for (name, param), piece in zip(tracked.named, tracked.flat_shards, strict=True):
            if name not in saved_tensors:
                saved.append(None)
            elif name in sharded and piece is not None:  # FSDP1: every rank, its slice of the whole
                saved.append(piece.local(saved_tensors[name].to(param.device) * rescale))
            elif name in sharded:  # every rank: its shard of the whole gradient
                whole = saved_tensors[name].to(param.device) * rescale
                shard = distribute_like(param, whole)
                saved.append(shard.to_local() if buffers is not None else shard)  # type: ignore[attr-defined]
            elif primary:
                saved.append(saved_tensors[name].to(param.device) * rescale)
            else:
                saved.append(torch.zeros_like(param, dtype=expected[name][1]))
        window.tally.restore(state, rescale=rescale, primary=primary)
        self.weighting.load_state_dict(state)
        if buffers is not None:
            buffers.load(saved)
        else:
            for (_, param), tensor in zip(tracked.named, saved, strict=True):
                param.grad = tensor
        window.restored(in_buffers=buffers is not None, micro_batches=int(state["micro_batches"]))
        self.noise.restore_window(state.get("noise"), primary=primary)  # older saves: no estimate
