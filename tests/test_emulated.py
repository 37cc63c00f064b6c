"""One device standing in for a group: virtual peers behind host copies, same executor."""

import pytest
import torch

from plait.errors import InfeasibleError
from plait.runtime import execute
from plait.runtime.emulated import emulated_group
from plait.schedule.schedule import Schedule
from plait.workload.operators import Axis


@pytest.mark.parametrize("schedule", ["seq/dma", "p2p/dma/M", "fine/dma/c2/g1/M",
                                      "fine/dma/c4/peer/M", "fine/dma/c2/g2/M"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_emulated_group_gathers_the_virtual_shards(schedule, ranks):
    a, w = torch.randn(16, 8), torch.randn(8, 5)
    s = Schedule.parse(schedule)
    rt, peers = emulated_group(ranks, a, s.chunks)
    try:
        g, (y,) = execute.all_gather_matmul(rt, a, [w], s, Axis.M, True, "emu")
    finally:
        rt.engine.close()
    full = torch.cat([a, *peers])
    assert torch.allclose(y, full @ w, atol=1e-5) and torch.equal(g, full)
    assert rt.records[-1].engine.startswith("emulated link")


def test_emulated_group_has_no_collective_kernels():
    a, w = torch.randn(8, 4), torch.randn(4, 3)
    rt, _ = emulated_group(2, a, 1)
    try:
        with pytest.raises(InfeasibleError, match="dma"):
            execute.all_gather_matmul(rt, a, [w], Schedule.parse("seq/sm"), Axis.M, False, "e")
    finally:
        rt.engine.close()
