"""What a call costs beyond its work, on real gloo ranks: the cross-rank check runs once per
signature (every call with `verify_every_call`), an input that needs no gradient costs no
backward GEMM or communication, and a column-parallel backward's weight gradients run while
its data gradient's reduce-scatter is in flight, with the gradients of the plain reference."""

import pytest
import torch

from plait.runtime.launch import run_ranks

pytestmark = pytest.mark.slow


def _checks(rank, world):
    from plait import ops
    from plait.runtime.context import Runtime

    counts = []
    for every in (False, True):
        rt = Runtime(torch.distributed.group.WORLD, verify_every_call=every)
        n = 0
        real = rt._gather

        def counting(out, inp, real=real):
            nonlocal n
            n += 1
            real(out, inp)

        rt._gather = counting
        x, w = torch.randn(4, 3), torch.randn(3, 2)
        for _ in range(3):
            ops.all_gather_matmul(x, [w], rt)
        ops.all_gather_matmul(torch.randn(8, 3), [w], rt)  # a new signature: checked
        counts.append(n)
        rt.close()
    return counts


def test_the_cross_rank_check_runs_once_per_signature():
    assert run_ranks(2, _checks, timeout_s=60) == [[2, 4]] * 2


def _no_input_grad(rank, world):
    from plait import ops
    from plait.runtime.context import runtime_of

    torch.manual_seed(0)
    full = torch.randn(8 * world, 6)
    w = torch.randn(6, 10, requires_grad=True)
    x = full.chunk(world)[rank]  # needs no gradient
    rt = runtime_of(None)
    rt.records.clear()
    _, (y,) = ops.all_gather_matmul(x, [w], schedule="seq/sm")
    (y * y).sum().backward()
    labels = [r.label for r in rt.records]
    want = 2 * full.T @ (full @ w.detach())
    return labels, bool(torch.allclose(w.grad, want, atol=1e-4))


def test_an_input_without_gradient_costs_no_backward_communication():
    for labels, ok in run_ranks(2, _no_input_grad, timeout_s=60):
        assert ok and labels == ["ag_mm"], labels  # no "ag_mm.bwd" reduce-scatter


def _weight_grads_in_flight(rank, world):
    from plait import ops
    from plait.ops import dense
    from plait.runtime import strands

    torch.manual_seed(0)
    full = torch.randn(8 * world, 6)
    w = torch.randn(6, 10, requires_grad=True)
    x = full.chunk(world)[rank].clone().requires_grad_()
    events = []
    real_idle, real_wgrad = strands.idle, dense._wgrad

    def idle():
        events.append("wait")
        return real_idle()

    def wgrad(*a):
        events.append("wgrad")
        return real_wgrad(*a)

    strands.idle, dense._wgrad = idle, wgrad
    try:
        _, (y,) = ops.all_gather_matmul(x, [w], schedule="seq/sm")
        events.clear()
        (y * y).sum().backward()
    finally:
        strands.idle, dense._wgrad = real_idle, real_wgrad
    g = 2 * full @ w.detach()  # every rank's loss holds the whole product: the reduce-
    ok = torch.allclose(w.grad, full.T @ g, atol=1e-4) and torch.allclose(  # scatter sums
        x.grad, world * (g @ w.detach().T).chunk(world)[rank], atol=1e-4)  # `world` of them
    return events, bool(ok)


def test_weight_gradients_run_while_the_data_gradient_is_reduce_scattered():
    for events, ok in run_ranks(2, _weight_grads_in_flight, timeout_s=60):
        assert ok
        assert events.index("wgrad") > events.index("wait"), events  # inside the first wait


def test_a_groups_call_log_stays_bounded():
    from plait.runtime.context import CallLog, CallRecord

    log = CallLog()
    for i in range(CallLog.KEEP * 3):
        log.append(CallRecord("op", str(i), "e", (), 2))
    assert len(log) <= CallLog.KEEP and log[-1].schedule == str(CallLog.KEEP * 3 - 1)
    assert [int(r.schedule) for r in log] == list(range(CallLog.KEEP * 3 - len(log),
                                                        CallLog.KEEP * 3))
