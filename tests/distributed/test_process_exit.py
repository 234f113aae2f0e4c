"""Distributed test processes end without meeting a finalizing interpreter: ``helpers.exit_together``.

About 1 clean-clone CI run in 25 failed with a gloo abort at process exit ("terminate
called without an active exception", SIGABRT) after all the work was done. A gloo worker thread can need the
GIL after its collective has completed (to drop a ``Future.then`` callback, or the ``contextvars`` context
autograd stashes in the thread-local state every work captures during a backward); if the interpreter is
finalizing by then, CPython ends the thread with ``pthread_exit`` inside a C++ destructor, and the process
aborts. Lightning leaves gloo process groups, with their threads, alive at exit.

The same script ended by a plain exit crashes (SIGSEGV or SIGABRT) in most runs but not all: whether the
gloo thread asks for the GIL while the interpreter is finalizing is a race, so it is no test here (a control
that cannot be made deterministic would fail at random).
"""

from __future__ import annotations

import atexit
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch.distributed as dist

from tests import helpers as h
from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def _record_process_group(path: Path) -> None:
    path.write_text(str(dist.is_initialized()))


class ExitProbe(pl.Callback):
    """In each worker: an exit handler that records whether a process group is alive at the teardown."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        atexit.register(_record_process_group, self.folder / f"rank{trainer.global_rank}")


def test_ddp_spawn_workers_leave_no_process_group_to_the_interpreters_teardown(tmp_path: Path) -> None:
    trainer = h.trainer(
        strategy="ddp_spawn", devices=2, callbacks=[ExitProbe(tmp_path)], use_distributed_sampler=False
    )
    module = h.RegressionModule(h.regression_data(16))
    trainer.fit(module)
    assert trainer.state.finished and h.max_abs_diff(module.net, h.regression_net()) > 0  # weights came back
    # no teardown at all (`exit_together`), or one without a process group
    assert [path.read_text() for path in sorted(tmp_path.glob("rank*"))] in ([], ["False", "False"])
    assert not dist.is_initialized()  # ddp_spawn's launching process never joins the group


SCRIPT = """
import atexit, socket, sys, time
import torch, torch.distributed as dist
from tests.helpers import exit_together

with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
atexit.register(print, "interpreter teardown", flush=True)


class SlowToClear:  # keeps the interpreter finalizing for a second (cleared with this module's globals)
    def __del__(self):
        time.sleep(3.0)


slow = SlowToClear()
# a collective whose Python callback still runs on gloo's worker thread when the script ends
dist.all_reduce(torch.ones(4), async_op=True).get_future().then(lambda future: time.sleep(1.0))
print("work done", flush=True)
if sys.argv[1] == "exit_together":
    exit_together()
"""


def run(ending: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", SCRIPT, ending]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_exit_together_ends_a_process_whose_gloo_thread_still_runs_python() -> None:
    result = run("exit_together")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "work done\n"
