"""plait's FP8 scaled ops keep the contract of PyTorch's `fused_all_gather_scaled_matmul` and
`fused_scaled_matmul_reduce_scatter`: for every schedule family on both engines, tensor-wise
and row-wise scales (sharded or replicated), several weights with their own output dtypes
and biases: `torch._scaled_mm` on the gathered operands (by hand for the all-gather: PyTorch's
fallback cannot all-gather FP8 over gloo; PyTorch's own fallback for the reduce-scatter), the
gathered A's bytes and strides as PyTorch's, on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from plait.runtime import version_of
from tests.helpers import on_every_rank

pytestmark = pytest.mark.slow
SCHEDULES = ("seq/sm", "seq/dma", "p2p/dma/M", "p2p/sm/M", "fine/sm/c2/g1/M",
             "fine/dma/c2/peer/M")
F8 = torch.float8_e4m3fn


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and torch.allclose(
        got.float(), want.float(), rtol=2e-2, atol=2e-2)


def _gathered(t: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """All ranks' `t` concatenated along `dim` (FP8 moved as bytes: gloo has no FP8)."""
    raw = t.contiguous().view(torch.uint8) if t.dtype == F8 else t.contiguous()
    parts = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(parts, raw)
    out = torch.cat(parts, dim)
    return out.view(F8) if t.dtype == F8 else out


def _scaled_ag_reference(a, bs, a_scale, b_scales, dim, biases, out_dtypes, world, kind):
    """PyTorch's `fused_all_gather_scaled_matmul` semantics, by hand: `torch._scaled_mm` on
    the gathered operands, results laid out as PyTorch's (views of dim-major storage)."""
    full = _gathered(a, dim, world)
    scale = _gathered(a_scale, dim, world) if kind == "shard rows" else a_scale
    moved = full.movedim(dim, 0).contiguous()
    rows = moved.flatten(0, -2)
    sa = scale if scale.numel() == 1 else scale.movedim(dim, 0).reshape(-1, 1).contiguous()
    outs = [torch._scaled_mm(rows, b, sa, sb, bias, None, out_dtype=dt).unflatten(
        0, moved.shape[:-1]).movedim(0, dim)
        for b, sb, bias, dt in zip(bs, b_scales, biases, out_dtypes, strict=True)]
    return moved.movedim(0, dim), outs


# torch < 2.13's `_scaled_mm` on a CPU takes tensor-wise scales only (an internal assert for
# row-wise ones): there the reference itself cannot run them; a GPU runs both (test below).
_ROW_WISE_ON_CPU = version_of(torch.__version__) >= (2, 13)


def _ag_scaled(rank, world):
    from plait import ops

    name = dist.group.WORLD.group_name
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(4, 4, 8, generator=g).to(F8)  # (batch, sequence shard, K)
    bs = [torch.randn(8, 6, generator=torch.Generator().manual_seed(9)).to(F8),
          torch.randn(8, 4, generator=torch.Generator().manual_seed(10)).to(F8)]
    tensor_wise = [torch.tensor(0.5), torch.tensor(1.5)]
    row_wise = [torch.rand(1, 6, generator=torch.Generator().manual_seed(11)) + 0.5,
                torch.rand(1, 4, generator=torch.Generator().manual_seed(12)) + 0.5]
    biases = [None, torch.randn(4, generator=torch.Generator().manual_seed(3)).bfloat16()]
    out_dtypes = [torch.float32, torch.bfloat16]
    cases = 0
    for gather_dim in (0, 1):
        rows = list(a.shape[:-1])
        full = list(rows)
        full[gather_dim] *= world
        scales = {"tensor": torch.tensor(0.25),
                  "shard rows": torch.rand(*rows, 1, generator=g) + 0.5,
                  "replicated rows": torch.rand(*full, 1, generator=torch.Generator()
                                                .manual_seed(5)) + 0.5}
        if not _ROW_WISE_ON_CPU:
            scales = {"tensor": scales["tensor"]}
        for kind, a_scale in scales.items():
            b_scales = tensor_wise if kind == "tensor" else row_wise  # _scaled_mm: one mode
            want_a, want = _scaled_ag_reference(a, bs, a_scale, b_scales, gather_dim, biases,
                                                out_dtypes, world, kind)
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode() as mode:  # the fake kernel: shapes, strides, dtypes
                fake = [mode.from_tensor(t) for t in (a, *bs, a_scale, *b_scales)]
                fa, fys = ops.all_gather_scaled_matmul(
                    fake[0], fake[1:3], fake[3], fake[4:], gather_dim, name, None, None,
                    out_dtypes)
            assert (fa.shape, fa.stride(), fa.dtype) == (want_a.shape, want_a.stride(), F8)
            assert [(y.shape, y.stride(), y.dtype) for y in fys] == [
                (w.shape, w.stride(), w.dtype) for w in want]
            for schedule in SCHEDULES:
                got_a, got = ops.all_gather_scaled_matmul(
                    a, bs, a_scale, b_scales, gather_dim, name, biases, None, out_dtypes,
                    schedule=schedule)
                assert torch.equal(got_a.view(torch.uint8), want_a.view(torch.uint8)), \
                    (kind, schedule)
                assert got_a.stride() == want_a.stride()
                for y, w in zip(got, want, strict=True):
                    assert _close(y, w), (gather_dim, kind, schedule, (y.float() - w.float())
                                          .abs().max())
                cases += 1
    return cases == 2 * (3 if _ROW_WISE_ON_CPU else 1) * len(SCHEDULES)


def test_the_fp8_all_gather_matmul_equals_pytorchs_for_every_schedule_and_scaling():
    on_every_rank(2, _ag_scaled, timeout_s=240)


def _rs_scaled(rank, world):
    from torch.distributed._symmetric_memory import _fused_scaled_matmul_reduce_scatter_fallback

    from plait import ops

    name = dist.group.WORLD.group_name
    g = torch.Generator().manual_seed(rank)
    a = torch.randn(4 * world, 4, 8, generator=g).to(F8)
    b = torch.randn(8, 6, generator=torch.Generator().manual_seed(9)).to(F8)
    cases = 0
    for scatter_dim in (0, 1):
        if a.shape[scatter_dim] % (world * 2):
            continue
        row_wise = torch.rand(*a.shape[:-1], 1, generator=g) + 0.5
        for a_scale in (torch.tensor(0.25), *([row_wise] if _ROW_WISE_ON_CPU else [])):
            b_scale = torch.tensor(2.0) if a_scale.numel() == 1 else \
                torch.rand(1, 6, generator=torch.Generator().manual_seed(4)) + 0.5
            for op in ("sum", "avg"):
                want = _fused_scaled_matmul_reduce_scatter_fallback(
                    a, b, a_scale, b_scale, op, scatter_dim, scatter_dim, name,
                    [*a.shape[:-1], 6], None, None, torch.float32)
                for schedule in SCHEDULES:
                    got = ops.scaled_matmul_reduce_scatter(
                        a, b, a_scale, b_scale, op, scatter_dim, name,
                        out_dtype=torch.float32, schedule=schedule)
                    assert got.is_contiguous() and _close(got, want), (scatter_dim, schedule)
                    cases += 1
    return cases > 0


def test_the_fp8_matmul_reduce_scatter_equals_pytorchs_for_every_schedule_and_scaling():
    on_every_rank(2, _rs_scaled, timeout_s=240)


def _bad(rank, world):
    from plait import ops
    from plait.errors import SpecError

    a, b = torch.randn(4, 8).to(F8), torch.randn(8, 6).to(F8)
    msgs = []
    for call in (
            lambda: ops.all_gather_scaled_matmul(a, [b], torch.ones(3, 1), [torch.tensor(1.)]),
            lambda: ops.all_gather_scaled_matmul(a, [b], torch.tensor(1.), [], schedule="auto"),
            lambda: ops.all_gather_scaled_matmul(a, [b], torch.tensor(1.), [torch.tensor(1.)],
                                                 schedule="auto"),
            lambda: ops.scaled_matmul_reduce_scatter(a, b, torch.tensor(1.), torch.tensor(1.)),
            lambda: ops.all_gather_scaled_matmul(a, [b], torch.tensor(1.), [torch.tensor(1.)],
                                                 gather_dim=-1)):
        try:
            call()
            msgs.append("no error")
        except SpecError as exc:
            msgs.append(exc.field)
    return msgs


def test_bad_fp8_calls_name_the_field():
    from plait.runtime.launch import run_ranks

    for msgs in run_ranks(2, _bad, timeout_s=60):
        assert msgs == ["A_scale", "B_scales", "schedule", "out_dtype", "gather_dim"], msgs


def _on_cuda(rank, world):
    from plait import ops

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 32, generator=g).to(F8).to(dev)
    b = torch.randn(48, 32, generator=g).to(F8).to(dev).T  # column-major, as cuBLASLt wants
    sa, sb = torch.tensor(0.5, device=dev), torch.tensor(2.0, device=dev)
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    _, (y,) = ops.all_gather_scaled_matmul(a, [b], sa, [sb], out_dtypes=[torch.bfloat16],
                                           schedule="seq/sm")
    return bool(torch.equal(y, want))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FP8 GEMMs on a GPU)")
def test_the_fp8_ops_on_cuda_equal_scaled_mm():
    from plait.runtime.launch import run_ranks

    assert run_ranks(1, _on_cuda, timeout_s=120) == [True]
