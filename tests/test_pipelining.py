"""plait's OVERLAP_F_B inside PyTorch's DualPipeV (plait.pipelining), on 4 gloo ranks:
PP=2 x TP=2, the same losses and gradients as PyTorch's default (forward then backward) and
as the unsharded model in one process."""

import pytest
import torch

from plait.runtime.launch import run_ranks

pytestmark = pytest.mark.slow

H, FFN, T, MB, STAGES = 8, 16, 8, 8, 4  # hidden, FFN, tokens a micro-batch, micro-batches


def _full_weights():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(FFN, H, generator=g) / H**0.5, torch.randn(H, FFN, generator=g) / FFN**0.5)
            for _ in range(STAGES)]


def _inputs():
    g = torch.Generator().manual_seed(8)
    return torch.randn(MB, T, H, generator=g), torch.randn(MB, T, H, generator=g)


def _reference():
    """Every micro-batch through the 4 unsharded blocks; the loss is the mean squared error
    over the whole batch (the schedule divides each micro-batch's gradient by MB)."""
    ws = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in _full_weights()]
    xs, ys = _inputs()
    losses = []
    for x, y in zip(xs, ys, strict=True):
        h = x
        for w1, w2 in ws:
            h = h + torch.nn.functional.gelu(h @ w1.T) @ w2.T
        loss = (h - y).square().sum() / (T * H)
        (loss / MB).backward()
        losses.append(loss.detach())
    return torch.stack(losses), [(a.grad, b.grad) for a, b in ws]


def _pipelined(rank, world, overlap, order):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    from plait.nn import ColumnParallelLinear, RowParallelLinear
    from plait.pipelining import overlap_f_b

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    tp_group = mesh["tp"].get_group()

    class Block(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            self.fc1 = ColumnParallelLinear(H, FFN, tp_group, schedule="fine/sm/c2/g1/M")
            self.fc2 = RowParallelLinear(FFN, H, tp_group, schedule="fine/dma/c2/g1/M")
            w1, w2 = _full_weights()[index]
            with torch.no_grad():
                self.fc1.weight.copy_(w1.chunk(2, 0)[tp])
                self.fc2.weight.copy_(w2.chunk(2, 1)[tp])

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    mine = (pp, 2 * 2 - 1 - pp)  # DualPipeV: stage r and its mirror 2P-1-r
    blocks = [Block(s) for s in mine]
    stages = [PipelineStage(b, s, STAGES, torch.device("cpu"), group=mesh["pp"].get_group())
              for b, s in zip(blocks, mine, strict=True)]

    def loss_fn(out, target):  # this rank's tokens' share of the micro-batch's mean
        return (out - target).square().sum() / (T * H)

    schedule = ScheduleDualPipeV(stages, n_microbatches=MB, loss_fn=loss_fn)
    ran = overlap_f_b(schedule, order) if overlap else None
    xs, ys = _inputs()
    shard = slice(tp * T // 2, (tp + 1) * T // 2)  # this TP rank's sequence shard
    losses = []
    if pp == 0:  # holds the first and the last stage
        schedule.step(xs[:, shard].reshape(-1, H), target=ys[:, shard].reshape(-1, H),
                      losses=losses)
    else:
        schedule.step()
    grads = {s: (b.fc1.weight.grad.clone(), b.fc2.weight.grad.clone())
             for s, b in zip(mine, blocks, strict=True)}
    local = torch.stack([x.detach() for x in losses]) if losses else None
    records = None if ran is None else [(r.overlapped, len(r.calls), r.reason)
                                        for r in ran.records]
    return pp, tp, local, grads, records


@pytest.mark.parametrize("order", [None, "FFBB"])
def test_overlap_f_b_equals_pytorchs_default_and_the_unsharded_model(order):
    want_loss, want = _reference()
    default = run_ranks(4, _pipelined, False, None, timeout_s=240)
    plait = run_ranks(4, _pipelined, True, None if order is None else list(order * 40),
                      timeout_s=240)
    loss_sum = torch.zeros(MB)
    for (_, tp, loss, grads, records), (_, _, loss0, grads0, _) in zip(plait, default,
                                                                         strict=True):
        for s, (g1, g2) in grads.items():
            w1, w2 = want[s]
            # exactly PyTorch's default: the same ops, only interleaved
            assert torch.equal(g1, grads0[s][0]) and torch.equal(g2, grads0[s][1])
            assert torch.allclose(g1, w1.chunk(2, 0)[tp], atol=1e-5)
            assert torch.allclose(g2, w2.chunk(2, 1)[tp], atol=1e-5)
        if loss is not None:
            assert torch.equal(loss, loss0)
            loss_sum += loss
        # every OVERLAP_F_B of DualPipeV ran overlapped, its plait calls in turn
        assert records and all(ok and calls > 0 for ok, calls, _ in records), records
    assert torch.allclose(loss_sum, want_loss, atol=1e-5)  # the TP ranks' shares add up
