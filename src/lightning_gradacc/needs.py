"""What each setting needs of the gradients, and what each layout provides: the refusals follow from both.

A layout (:mod:`~lightning_gradacc.layouts`) declares what its strategy provides (:data:`PROVISIONS`); a
setting that needs something its layout does not provide is refused before training, in one place
(:func:`refuse_unmet`), with the setting, the layout and the reason. The table of what each strategy refuses
in ``docs/limitations.md`` is :func:`refusal_table`'s output (a test holds the two equal), so a new layout or
setting is tried against every other one by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# What a strategy's layout may provide for the gradients, each with what it means.
PROVISIONS = {
    "unsharded_grad": "each micro-batch's gradient adds up in the rank's own, whole `.grad`",
    "piece_backwards": "a batch can run as pieces, each with its own backward, whose gradients add up where"
    " the window's are kept",
    "micro_batch_gradient": "each micro-batch's gradient can be read alone, between two backwards",
    "window_item_total": "each micro-batch's gradient can be weighed by the window's item total over the"
    " ranks: rescaled after its backward, or its window read ahead and counted before it",
    "callback_buffers": "the window can be summed in buffers of the callback's",
    "any_clipping": "the final gradient can be clipped by any norm, by value or per parameter",
    "callback_overflow": "the callback decides what a non-finite gradient does",
    "torch_step": "the optimizer's step (torch's, or an engine's around it) can take a learning-rate factor",
    "fsdp_reduction": "the reduction of the window's gradient can be deferred to its last backward",
    "window_end_per_batch": "whether a window ends can be decided at each micro-batch, once its items are"
    " counted",
}


@dataclass(frozen=True)
class Need:
    """A setting that needs a provision of the layout.

    Attributes:
        setting: How the refusal names the setting (``piece_size=2``).
        applies: Whether a callback's configuration uses it (the callback's public attributes).
        provision: What it needs (a key of :data:`PROVISIONS`).
        why: The refusal's reason, one sentence.
    """

    setting: Callable[[Any], str]
    applies: Callable[[Any], bool]
    provision: str
    why: str
    name: str  # for the table: the setting's name


def _clipping(callback: Any) -> str:
    s = callback.settings
    return f"clip_value={s.clip_value}, clip_scope={s.clip_scope!r}, norm_type={s.norm_type}"


NEEDS = (
    Need(
        lambda c: f"piece_size={c.piece_size!r}",
        lambda c: c.piece_size is not None,
        "piece_backwards",
        "it runs each batch as pieces, each with its own backward, and the engine counts every backward as"
        " a micro-batch of its window: use one device, DDP or FSDP, or remove `piece_size`.",
        "`piece_size`",
    ),
    Need(
        lambda c: f"piece_size={c.piece_size!r}",
        lambda c: c.piece_size == "auto",
        "unsharded_grad",
        "FSDP all-gathers and reduce-scatters layer by layer inside each forward and backward, so a rank"
        " that runs out of memory in one stops issuing them while the others go on: the ranks then pair"
        " collectives of different layers (exchanging wrong data) and hang, and no rank can recover alone"
        " (measured on 2 ranks, torch 2.13). Use an int `piece_size`.",
        '`piece_size="auto"`',
    ),
    Need(
        lambda c: "scaling='weighted'",
        lambda c: c.settings.mode.weighted,
        "window_item_total",
        "each micro-batch's weight needs the window's item total over the ranks, which this strategy can"
        " neither rescale by after the backward nor count ahead. Use 'mean' or 'sum'.",
        '`scaling="weighted"`',
    ),
    Need(
        lambda c: "noise_scale=True or accumulation_steps='auto'",
        lambda c: c.settings.noise_scale,
        "micro_batch_gradient",
        "the noise scale needs each micro-batch's gradient, which the engine sums inside itself.",
        '`noise_scale=True`, `accumulation_steps="auto"`',
    ),
    Need(
        lambda c: f"clip_mode={c.settings.clip_mode!r}, overflow={c.settings.overflow!r}",
        lambda c: c.settings.per_micro_batch,
        "micro_batch_gradient",
        "the engine sums the micro-batches' gradients inside itself, where none can be clipped or dropped"
        " alone. Use clip_mode='step' and overflow='skip' or 'ignore'.",
        '`clip_mode="micro_batch"`, `overflow="skip_micro_batch"`',
    ),
    Need(
        lambda c: f"accumulation_dtype={str(c.settings.accumulation_dtype).removeprefix('torch.')!r}",
        lambda c: c.settings.accumulation_dtype is not None,
        "callback_buffers",
        "the engine accumulates in its own buffers: set their type in its configuration (DeepSpeed's"
        " `data_types.grad_accum_dtype`).",
        "`accumulation_dtype`",
    ),
    Need(
        _clipping,
        lambda c: (
            c.settings.clip_value is not None
            or c.settings.clip_scope != "global"
            or c.settings.norm_type != 2.0
        ),
        "any_clipping",
        "the engine clips by the global 2-norm only (its `gradient_clipping`): use max_grad_norm.",
        '`clip_value`, `clip_scope="parameter"`, `norm_type` other than 2',
    ),
    Need(
        lambda c: "overflow='raise'",
        lambda c: c.settings.overflow == "raise",
        "callback_overflow",
        "the engine decides on overflows inside its step (its fp16 loss scaler skips them). Use"
        " overflow='skip' (fp16) or 'ignore'.",
        '`overflow="raise"`',
    ),
    Need(
        lambda c: "lr_scaling or lr_schedule",
        lambda c: c.plan.lr_scaling != "none" or c.plan.lr_schedule is not None,
        "torch_step",
        "the learning-rate factor is applied around the optimizer's step, which this strategy does not"
        " expose. Use an LR scheduler in `configure_optimizers`.",
        "`lr_scaling`, `lr_schedule`",
    ),
    Need(
        lambda c: f"items_per_step={c.plan.policy.budget:.0f}",
        lambda c: c.plan.policy.budget is not None,
        "window_end_per_batch",
        "the engine needs each window's length before its first backward (its boundary and its division),"
        " and an item budget knows it only at the window's last micro-batch. Use `accumulation_steps` or"
        " `target_batch_size`.",
        "`items_per_step`",
    ),
    Need(
        lambda c: f"sharded_reduction={c.sharded_reduction!r}",
        lambda c: c.sharded_reduction != "every_micro_batch",
        "fsdp_reduction",
        "it is FSDP's; the engine reduces once per window at its boundary already.",
        "`sharded_reduction` other than the default",
    ),
)


def refuse_unmet(callback: Any, layout: Any) -> None:
    """Raise for the first setting of ``callback`` that needs what ``layout`` does not provide.

    Raises:
        RuntimeError: ```GradientAccumulationCallback(<setting>)` cannot take effect under <layout>: <why>``.
    """
    for need in NEEDS:
        if need.provision not in layout.provides and need.applies(callback):
            raise RuntimeError(
                f"`GradientAccumulationCallback({need.setting(callback)})` cannot take effect under"
                f" {layout.name}: {need.why}"
            )


def refusal_table(layouts: Iterable[Any]) -> str:
    """What each layout refuses, as the markdown table of ``docs/limitations.md``.

    Example:
        >>> class Engine:
        ...     name, provides = "an engine", frozenset(PROVISIONS) - {"torch_step"}
        >>> print(refusal_table([Engine()]).splitlines()[2])
        | an engine | `lr_scaling`, `lr_schedule` |
    """
    rows = ["| strategy | refused before training |", "|---|---|"]
    for layout in layouts:
        refused = [need.name for need in NEEDS if need.provision not in layout.provides]
        rows.append(f"| {layout.name} | {'; '.join(refused) if refused else 'nothing'} |")
    return "\n".join(rows)
