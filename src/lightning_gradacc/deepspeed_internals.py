"""Every private part of DeepSpeed the package touches, one named function each.

As the torch and Lightning ones live in ``core/torch_internals.py`` and ``lightning_internals.py``. Read
from DeepSpeed 0.19.8 (``deepspeed/runtime/zero/stage_1_and_2.py``); the oracle that guards them is the
abandoned-window test of ``tests/distributed/test_deepspeed.py`` (it fails where one of them stops working).
"""

from __future__ import annotations

from typing import Any


def forget_zero_partitions(optimizer: Any) -> None:
    """Forget what a ZeRO-1/2 optimizer summed of an abandoned window, between two micro-batches.

    ZeRO-2 reduces each micro-batch in its backward into partitions it adds up over the window
    (``all_grad_tensors``; ``averaged_gradients`` with fp32 accumulation of 16-bit weights; the CPU
    buffers with offload, added to while ``micro_step_id > 0``), which ``zero_grad`` does not clear. They
    are reset as DeepSpeed's own step does after an fp16 overflow. Other optimizers: nothing.
    """
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID, DeepSpeedZeroOptimizer
    except ImportError:
        return
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return
    zero: Any = optimizer
    wait = getattr(zero, "_wait_for_offload_copies", None)
    if wait is not None:  # copies into the CPU buffers still under way (offload on a GPU)
        wait()
    for group in range(len(zero.bit16_groups)):
        zero.all_grad_tensors[group] = None
        if group in zero.averaged_gradients:  # the same dict is linked to the parameters' mappings
            zero.averaged_gradients[group] = None
    zero.micro_step_id = INITIAL_MICRO_STEP_ID  # the next micro-batch copies into the CPU buffers
    if zero.cpu_offload:
        zero.reset_cpu_buffers()
        zero._offload_accumulated_param_ids = set()
