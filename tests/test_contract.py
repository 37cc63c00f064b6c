"""plait's TP ops keep the contract of PyTorch's `fused_all_gather_matmul` and
`fused_matmul_reduce_scatter` (written from their documented behaviour): the positional call
forms, `return_A`, `reduce_op` sum and avg, any `scatter_dim` including the last, the group
by name, ProcessGroup or DeviceMesh, the gathered outputs' strides as PyTorch's (contiguous
reduce-scattered results); for every schedule family and both
engines, against the plain collective + matmul."""

import pytest
import torch
import torch.distributed as dist

from plait.runtime.launch import run_ranks
from tests.helpers import on_every_rank

pytestmark = pytest.mark.slow
SCHEDULES = ("seq/sm", "seq/dma", "p2p/dma/M", "fine/sm/c2/g1/M", "fine/dma/c2/peer/M")


def _reference_rs(full: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    total = full.clone()
    dist.all_reduce(total)
    return total.chunk(world, dim=dim)[rank]


def _contract(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from plait import ops

    torch.manual_seed(rank)
    name = dist.group.WORLD.group_name
    mesh = init_device_mesh("cpu", (world,))
    a_shard, bs = torch.randn(4, 3, 6), [torch.randn(6, 5), torch.randn(6, 2)]
    gathered = [torch.empty_like(a_shard) for _ in range(world)]
    dist.all_gather(gathered, a_shard)
    want_a = torch.cat(gathered, dim=1)
    for schedule in SCHEDULES:
        # PyTorch's positional form, and plait's keyword form, gathering dim 1
        a, ys = ops.all_gather_matmul(a_shard, bs, 1, name, schedule=schedule)
        a2, ys2 = ops.all_gather_matmul(a_shard, bs, mesh, gather_dim=1, schedule=schedule)
        assert torch.allclose(a, want_a) and torch.allclose(a2, want_a)
        for y, y2, b in zip(ys, ys2, bs, strict=True):
            assert torch.allclose(y, want_a @ b, atol=1e-5) and torch.allclose(y2, y)
        none, _ = ops.all_gather_matmul(a_shard, bs, 1, (mesh, 0), return_A=False)
        assert none is None
        x, w = torch.randn(4 * world, 2 * world, 6), torch.randn(6, 4 * world)
        for dim in (0, 1, -1):
            for op in ("sum", "avg"):
                got = ops.matmul_reduce_scatter(x, w, op, dim, name, schedule=schedule)
                want = _reference_rs(x @ w, dim, world, rank)
                if op == "avg":
                    want = want / world
                assert got.is_contiguous() and got.shape == want.shape, (dim, got.shape)
                assert torch.allclose(got, want, atol=1e-4), (schedule, dim, op)
    return True


def test_the_fused_ops_contract_holds_for_every_schedule_family():
    on_every_rank(2, _contract, timeout_s=240)


def _scatter_last_backward(rank, world):
    from plait import ops

    torch.manual_seed(rank)
    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(4, 2 * world, requires_grad=True)
    y = ops.matmul_reduce_scatter(x, w, scatter_dim=-1, schedule="fine/sm/c2/g1/M")
    (y * torch.arange(y.numel()).view(y.shape)).sum().backward()
    # reference: every rank's y holds its columns of sum_r x_r @ w_r; d/dx_r = G @ w_r^T with
    # G the gathered upstream gradient
    g = torch.arange(y.numel(), dtype=x.dtype).view(y.shape)
    parts = [torch.empty_like(g) for _ in range(world)]
    dist.all_gather(parts, g)
    g_full = torch.cat(parts, dim=1)
    return torch.allclose(x.grad, g_full @ w.detach().T, atol=1e-4) and torch.allclose(
        w.grad, x.detach().T @ g_full, atol=1e-4)


def test_scattering_the_last_dimension_differentiates():
    on_every_rank(2, _scatter_last_backward, timeout_s=120)


def _bad_calls(rank, world):
    from plait import ops
    from plait.errors import SpecError

    out = []
    for call in (lambda: ops.matmul_reduce_scatter(torch.randn(4, 3), torch.randn(3, 3),
                                                   scatter_dim=-1),
                 lambda: ops.matmul_reduce_scatter(torch.randn(4, 3), torch.randn(3, 2),
                                                   reduce_op="max"),
                 lambda: ops.all_gather_matmul(torch.randn(4, 3), [torch.randn(3, 2)], True)):
        try:
            call()
        except SpecError as exc:
            out.append(exc.field)
    return out


def test_bad_contract_calls_are_named():
    assert run_ranks(2, _bad_calls, timeout_s=60)[0] == ["weight", "reduce_op", "group"]


def _by_keyword_names(rank, world):
    """PyTorch's schema names (`A_shard=`, `Bs=`, `group_name=`; `A=`, `B=`) give what the
    positional forms give; an argument given twice, or not at all, is named."""
    import torch.distributed as dist

    from plait import ops
    from plait.errors import SpecError

    torch.manual_seed(rank)
    name = dist.group.WORLD.group_name
    x, w = torch.randn(4, 6), torch.randn(6, 5)
    a, (y,) = ops.all_gather_matmul(x, [w], 0, name)
    a2, (y2,) = ops.all_gather_matmul(A_shard=x, Bs=[w], gather_dim=0, group_name=name)
    h, w2 = torch.randn(4 * world, 6), torch.randn(6, 5)
    z = ops.matmul_reduce_scatter(h, w2, "sum", 0, name)
    z2 = ops.matmul_reduce_scatter(A=h, B=w2, reduce_op="sum", scatter_dim=0, group_name=name)
    # PyTorch's schema with reduce_op positional, the rest by keyword (as callers write it)
    z3 = ops.matmul_reduce_scatter(h, w2, "sum", scatter_dim=0, group_name=name)
    z4 = ops.matmul_reduce_scatter(h, w2, "sum", 0, group_name=name)
    fields = []
    for call in (lambda: ops.all_gather_matmul(x, [w], A_shard=x),
                 lambda: ops.matmul_reduce_scatter(B=w2, group_name=name)):
        try:
            call()
        except SpecError as exc:
            fields.append(exc.field)
    return (torch.equal(a, a2) and torch.equal(y, y2) and torch.equal(z, z2)
            and torch.equal(z, z3) and torch.equal(z, z4) and fields == ["a_shard", "a"])


def test_pytorchs_keyword_names_are_accepted():
    on_every_rank(2, _by_keyword_names, timeout_s=60)


def _strides_as_pytorchs(rank, world):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._symmetric_memory import _fused_all_gather_matmul_fallback

    from plait import ops

    torch.manual_seed(rank)
    name = dist.group.WORLD.group_name
    a_shard, bs = torch.randn(4, 3, 2, 6), [torch.randn(6, 5), torch.randn(6, 2)]
    cases = 0
    for dim in range(a_shard.dim()):
        if dim == a_shard.dim() - 1:  # the reduction gathered: weights of P x its rows
            bs = [torch.randn(6 * world, 5), torch.randn(6 * world, 2)]
        want_a, want_ys = _fused_all_gather_matmul_fallback(a_shard, bs, dim, name)
        with FakeTensorMode() as mode:
            fa, fys = ops.all_gather_matmul(mode.from_tensor(a_shard),
                                            [mode.from_tensor(b) for b in bs], gather_dim=dim)
        for schedule in SCHEDULES:
            if dim == a_shard.dim() - 1 and schedule != "seq/sm":
                schedule = schedule.replace("/M", "/K")
            a, ys = ops.all_gather_matmul(a_shard, bs, dim, name, schedule=schedule)
            for got, fake, want in zip((a, *ys), (fa, *fys), (want_a, *want_ys), strict=True):
                assert got.shape == want.shape and got.stride() == want.stride(), \
                    (dim, schedule, got.stride(), want.stride())
                assert fake.stride() == want.stride(), (dim, fake.stride(), want.stride())
                assert torch.allclose(got, want, atol=1e-5), (dim, schedule)
                cases += 1
    return cases == 4 * len(SCHEDULES) * 3


def test_the_gathered_outputs_have_pytorchs_strides_for_every_gather_dim():
    """For every `gather_dim`, the gathered input and the products have the shapes, strides
    and values of PyTorch's own `fused_all_gather_matmul` (its fallback, on these gloo ranks),
    under every schedule family, and the fake kernel's strides are the same."""
    on_every_rank(2, _strides_as_pytorchs, timeout_s=180)
