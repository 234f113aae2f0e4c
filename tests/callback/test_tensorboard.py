"""TensorBoard, for real: event files read with TensorBoard's reader, and its HTTP server."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_gradacc import GradientAccumulationCallback
from lightning_gradacc.callback import LOGGED_STATISTICS
from tests import helpers as h

TAGS = {f"grad_accum/{name}" for name in LOGGED_STATISTICS} | {"grad_accum/window_loss"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GradientAccumulationCallback]:
    """Two epochs of 10 micro-batches of 4 samples, K=4 (windows 4, 4, 2), clipping at 0.5."""
    root = tmp_path_factory.mktemp("tb")
    callback = GradientAccumulationCallback(4, max_grad_norm=0.5)
    logger = TensorBoardLogger(save_dir=root, name="run", version=0)
    h.trainer(callbacks=[callback], logger=logger, log_every_n_steps=1, max_epochs=2).fit(
        h.RegressionModule(h.regression_data(40))
    )
    return root / "run" / "version_0", callback


def test_every_scalar_has_one_point_per_optimizer_step(finished_run) -> None:
    log_dir, callback = finished_run
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) >= TAGS
    steps = callback.stats.windows
    assert steps == 6
    for tag in TAGS:
        assert [e.step for e in events.Scalars(tag)] == list(range(steps)), tag  # Lightning's step axis
    assert [e.value for e in events.Scalars("grad_accum/items_last_step")] == [16, 16, 8] * 2
    assert [e.value for e in events.Scalars("grad_accum/micro_batches_last_step")] == [4, 4, 2] * 2
    assert [e.value for e in events.Scalars("grad_accum/windows")] == list(range(1, steps + 1))
    norms = [e.value for e in events.Scalars("grad_accum/last_grad_norm")]
    clips = [e.value for e in events.Scalars("grad_accum/clipped_steps")]
    assert clips[-1] == sum(n > 0.5 for n in norms) == callback.stats.clipped_steps
    assert events.Scalars("grad_accum/last_grad_norm")[-1].value == pytest.approx(
        callback.stats.last_grad_norm
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_tensorboard_server_serves_the_scalars(finished_run) -> None:
    log_dir, _ = finished_run
    port = _free_port()
    command = [str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(log_dir.parent)]
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    try:
        deadline = time.monotonic() + 90
        tags: dict = {}
        while time.monotonic() < deadline and not set(tags.get("version_0", {})) >= TAGS:
            assert server.poll() is None, server.stderr.read().decode() if server.stderr else ""
            with contextlib.suppress(urllib.error.URLError, ConnectionError):
                tags = _get_json(f"{base}/tags")  # type: ignore[assignment]
            time.sleep(0.5)
        assert set(tags["version_0"]) >= TAGS
        query = urllib.parse.urlencode({"run": "version_0", "tag": "grad_accum/items_last_step"})
        points = _get_json(f"{base}/scalars?{query}")
        assert [(step, value) for _, step, value in points] == list(enumerate([16, 16, 8] * 2))  # type: ignore[misc]
    finally:
        server.terminate()
        server.wait(timeout=30)
