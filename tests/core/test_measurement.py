"""Measurement: the boundary's values declared by name, copied to the host in one sync."""

from __future__ import annotations

import torch

from lightning_gradacc.core.ledger import Ledger
from lightning_gradacc.core.measurement import Measurement, mean_loss


def test_every_device_value_is_copied_in_one_call_and_host_values_are_kept() -> None:
    calls: list[int] = []

    def sync(*values: torch.Tensor) -> list[object]:
        calls.append(len(values))
        return [v.tolist() for v in values]

    measured = Measurement(
        items=torch.tensor(12.0),
        weights=3.0,
        bad_items=torch.tensor(0.0),
        dropped=0.0,
        micro_clips=torch.tensor(1.0),
        tensor_norms=torch.tensor([3.0, 4.0]),
    )
    host = measured.to_host(sync)
    assert calls == [4]  # one copy of the four device values
    assert (host.items, host.weights, host.bad_items, host.micro_clips) == (12.0, 3.0, 0.0, 1.0)
    assert host.tensor_norms == [3.0, 4.0] and host.loss_sum is None
    assert host.to_host(sync) is host and calls == [4]  # nothing left on the device: no copy


def test_the_ledger_copies_the_packet_with_its_pending_statistics() -> None:
    ledger = Ledger(torch.float64)
    ledger.fold({"last_grad_norm": torch.tensor(2.5, dtype=torch.float64)})
    host = Measurement(items=torch.tensor(8.0), weights=1.0, bad_items=0.0, dropped=0.0, micro_clips=0.0)
    assert host.to_host(ledger.sync).items == 8.0
    assert ledger.values()["last_grad_norm"] == 2.5  # folded in the same copy


def test_the_mean_loss_is_nan_without_a_loss() -> None:
    assert mean_loss(6.0, 3.0, 0.5) == 4.0
    assert mean_loss(0.0, 0.0, 1.0) != mean_loss(0.0, 0.0, 1.0)  # nan
