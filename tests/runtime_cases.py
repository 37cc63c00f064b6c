"""Rank bodies for the runtime tests (run in forked gloo ranks by `run_ranks`)."""

from __future__ import annotations

import random

import torch

from plait import ops
from plait.runtime.context import Runtime, close_all, runtime_of

AG_SCHEDULES = ["seq/sm", "seq/dma", "p2p/sm/M", "p2p/dma/M", "fine/sm/c2/g1/M",
                "fine/dma/c2/g1/M", "fine/dma/c2/peer/M", "fine/sm/c4/g2/M", "fine/dma/c1/g1/M",
                "fine/sm/c2/peer/M"]
K_SCHEDULES = ["seq/sm", "seq/dma", "p2p/sm/K", "p2p/dma/K", "fine/dma/c2/g1/K",
               "fine/sm/c2/peer/K", "fine/sm/c4/g2/K"]
TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 6e-2}


def _rand(shape, seed, dtype):  # identical on every rank for the same seed
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _err(x: torch.Tensor, ref: torch.Tensor) -> float:
    scale = max(1.0, float(ref.abs().max()))
    return float((x.detach().cpu().double() - ref.detach().cpu().double()).abs().max()) / scale


def all_gather_matmul_case(rank, world, seed, dtype, schedule, gather_dim, nweights, k_axis,
                           device="cpu"):
    """Forward and gradients of all_gather_matmul vs autograd on the gathered reference
    (computed on the CPU; the op's tensors on `device`)."""
    rng = random.Random(seed)
    c = 4
    rows = world * c * rng.randint(1, 3)  # divisible by world * chunks
    K = world * c * rng.randint(1, 2) if k_axis else rng.randint(3, 9)
    shape = [rows, K] if gather_dim == 0 else [rng.randint(1, 3), rows, K]
    gd = len(shape) - 1 if k_axis else gather_dim
    full = _rand(shape, seed, dtype)
    ns = [rng.randint(2, 7) for _ in range(nweights)]
    # Column-parallel style: every rank has its own weights and output gradient.
    ws = [[_rand((K, n), seed * 100 + 10 * q + i, dtype) for i, n in enumerate(ns)]
          for q in range(world)]
    a_shard = full.chunk(world, dim=gd)[rank].to(device, copy=True).requires_grad_(True)
    my_w = [w.to(device, copy=True).requires_grad_(True) for w in ws[rank]]
    g, ys = ops.all_gather_matmul(a_shard, my_w, gather_dim=gd, schedule=schedule)
    gouts = [[_rand((*shape[:-1], n), seed * 7 + 10 * q + i, dtype)
              for i, n in enumerate(ns)] for q in range(world)]
    sum((y * go.to(device)).sum() for y, go in zip(ys, gouts[rank], strict=True)).backward()
    # Reference on the full tensors, every rank's loss summed.
    ref_a = full.double().clone().requires_grad_(True)
    ref_ws = [[w.double().clone().requires_grad_(True) for w in wq] for wq in ws]
    total = 0
    for q in range(world):
        for w, go in zip(ref_ws[q], gouts[q], strict=True):
            total = total + ((ref_a @ w) * go.double()).sum()
    total.backward()
    errs = {"gathered": _err(g, full)}
    for i, (y, w) in enumerate(zip(ys, ref_ws[rank], strict=True)):
        errs[f"y{i}"] = _err(y, full.double() @ w.detach())
        errs[f"dw{i}"] = _err(my_w[i].grad, w.grad)
    errs["da"] = _err(a_shard.grad, ref_a.grad.chunk(world, dim=gd)[rank])
    rec = runtime_of(None).records[0]
    close_all()
    return errs, TOL[dtype], (rec.schedule, rec.engine)


def matmul_reduce_scatter_case(rank, world, seed, dtype, schedule, scatter_dim, device="cpu"):
    rng = random.Random(seed)
    c = 4
    rows = world * c * rng.randint(1, 3)
    K, N = rng.randint(3, 9), rng.randint(2, 7)
    shape = [rows, K] if scatter_dim == 0 else [rng.randint(1, 3), rows, K]
    a_all = [_rand(shape, seed + 31 * q, dtype) for q in range(world)]
    w_all = [_rand((K, N), seed + 57 * q, dtype) for q in range(world)]
    a = a_all[rank].to(device, copy=True).requires_grad_(True)
    w = w_all[rank].to(device, copy=True).requires_grad_(True)
    out = ops.matmul_reduce_scatter(a, w, scatter_dim=scatter_dim, schedule=schedule)
    g_full = _rand([*shape[:-1], N], seed + 99, dtype)
    (out * g_full.chunk(world, dim=scatter_dim)[rank].to(device)).sum().backward()
    ref_a = [x.double().clone().requires_grad_(True) for x in a_all]
    ref_w = [x.double().clone().requires_grad_(True) for x in w_all]
    y = sum(x @ v for x, v in zip(ref_a, ref_w, strict=True))
    (y * g_full.double()).sum().backward()
    errs = {"out": _err(out, y.detach().chunk(world, dim=scatter_dim)[rank]),
            "da": _err(a.grad, ref_a[rank].grad), "dw": _err(w.grad, ref_w[rank].grad)}
    close_all()
    return errs, TOL[dtype]


def _failure(call):
    """(exception type, message) of `call(rt)` on a fresh runtime, or (None, "no error")."""
    rt = Runtime(torch.distributed.group.WORLD, timeout_s=10)
    try:
        call(rt)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        rt.close()
    return None, "no error"


def mismatched_shapes(rank, world):
    a = torch.randn(4 + 4 * rank, 3)
    return _failure(lambda rt: ops.all_gather_matmul(a, [torch.randn(3, 2)], rt))


def absent_peer(rank, world, engine, verify):
    """Rank 1 never calls; rank 0 must fail within its timeout, not hang."""
    import time

    rt = Runtime(torch.distributed.group.WORLD, timeout_s=3, verify_shapes=verify)
    ops.all_gather_matmul(torch.randn(4, 3), [torch.randn(3, 2)], rt, schedule=f"seq/{engine}")
    if rank == 1:  # joined once (engines set up), then never again
        time.sleep(8)
        return None, "absent", 0.0
    t0 = time.monotonic()
    try:
        ops.all_gather_matmul(torch.randn(4, 3), [torch.randn(3, 2)], rt,
                              schedule=f"seq/{engine}")
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    finally:
        rt.close()
    return None, "no error", time.monotonic() - t0


def gathering_copies_case(rank, world, schedule, direction, k_axis):
    """How many gathering copies (`_cat` of several blocks) one call of the executor makes."""
    from plait.runtime import execute
    from plait.schedule.schedule import Schedule
    from plait.workload.operators import Axis

    cats = []
    real = execute._cat
    execute._cat = lambda parts, dim: (cats.append(len(parts)) if len(parts) > 1 else None,
                                       real(parts, dim))[1]
    rt = runtime_of(None)
    s, c = Schedule.parse(schedule), 4
    try:
        if direction == "in":
            shard = torch.randn(8, c * 2) if k_axis else torch.randn(c * 2, 8)
            w = torch.randn(world * c * 2 if k_axis else 8, 3)
            execute.all_gather_matmul(rt, shard, [w], s, Axis.K if k_axis else Axis.M, False,
                                      "t")
        else:
            execute.matmul_reduce_scatter(rt, torch.randn(world * c * 2, 8), torch.randn(8, 3),
                                          s, "t")
    finally:
        execute._cat = real
        close_all()
    return len(cats)


def exchange_case(rank, world, seed, schedule, direction):
    """The all-to-all executors against all_to_all + matmul computed from every rank's data."""
    from plait.runtime import execute
    from plait.schedule.schedule import Schedule
    from plait.workload.operators import Axis

    rng = random.Random(seed)
    m, K, N = 4 * rng.randint(1, 3), rng.randint(2, 6), rng.randint(2, 5)
    xs = [_rand((world * m, K), seed * 10 + q, torch.float64) for q in range(world)]
    ws = [_rand((K, N), seed * 10 + 100 + q, torch.float64) for q in range(world)]
    rt = runtime_of(None)
    s = Schedule.parse(schedule)
    try:
        if direction == "in":
            got, (y,) = execute.all_gather_matmul(rt, xs[rank], [ws[rank]], s, Axis.M, True, "t",
                                                  exchange=True)
            received = torch.cat([xs[q][rank * m:(rank + 1) * m] for q in range(world)])
            errs = {"received": _err(got, received), "y": _err(y, received @ ws[rank])}
        else:
            y = execute.matmul_reduce_scatter(rt, xs[rank], ws[rank], s, "t", exchange=True)
            ref = torch.cat([(xs[q] @ ws[q])[rank * m:(rank + 1) * m] for q in range(world)])
            errs = {"y": _err(y, ref)}
        record = rt.records[-1]
    finally:
        close_all()
    return errs, 1e-9, (record.schedule, record.engine)


def exchange_ops_case(rank, world, seed, schedule, combine, experts=1, device="cpu"):
    """plait.ops all_to_all_matmul / matmul_all_to_all: outputs and gradients against torch
    autograd over every rank's data (dispatch: received = A2A(x), y = received @ W; combine:
    y = A2A(a @ W)). `experts` > 1: W is (E, K, N), each rank's chunk E groups of rows, group
    e multiplied by expert e. `schedule` may be a list: each is run in turn."""
    errs = {}
    for s in [schedule] if isinstance(schedule, str) else schedule:
        errs |= {f"{s} {k}": v for k, v in _exchange_ops(rank, world, seed, s, combine,
                                                         experts, device).items()}
    close_all()
    return errs, 1e-9


def _exchange_ops(rank, world, seed, schedule, combine, experts, device="cpu"):
    rng = random.Random(seed)
    cap, K, N = 4 * rng.randint(1, 3), rng.randint(2, 6), rng.randint(2, 5)
    m, E = experts * cap, experts  # rows per rank chunk
    wshape = (K, N) if E == 1 else (E, K, N)
    xs = [_rand((world * m, K), seed * 10 + q, torch.float64) for q in range(world)]
    ws = [_rand(wshape, seed * 10 + 100 + q, torch.float64) for q in range(world)]
    gs = [_rand((world * m, N), seed * 10 + 200 + q, torch.float64) for q in range(world)]
    x = xs[rank].to(device, copy=True).requires_grad_(True)
    w = ws[rank].to(device, copy=True).requires_grad_(True)
    if combine:
        y = ops.matmul_all_to_all(x, w, schedule=schedule)
    else:
        _, y = ops.all_to_all_matmul(x, w, schedule=schedule, return_received=False)
    (y * gs[rank].to(device)).sum().backward()
    ref_x = [t.clone().requires_grad_(True) for t in xs]
    ref_w = [t.clone().requires_grad_(True) for t in ws]

    def chunk(t, q):
        return t[q * m:(q + 1) * m]

    def experts_mm(rows, weight):  # rows ordered (rank, expert, slot), expert e by weight[e]
        if E == 1:
            return rows @ weight
        return torch.einsum("pesk,ekn->pesn", rows.view(world, E, cap, K), weight).reshape(-1, N)
    if combine:
        prods = [experts_mm(ref_x[q], ref_w[q]) for q in range(world)]
        ys = [torch.cat([chunk(prods[q], r) for q in range(world)]) for r in range(world)]
    else:
        ys = [experts_mm(torch.cat([chunk(ref_x[q], r) for q in range(world)]), ref_w[r])
              for r in range(world)]
    sum((ys[r] * gs[r]).sum() for r in range(world)).backward()
    return {"y": _err(y, ys[rank]), "dx": _err(x.grad, ref_x[rank].grad),
            "dw": _err(w.grad, ref_w[rank].grad)}


def mismatched_backward(rank, world, op):
    """Ranks agree on the forward schedule but not on the backward one: a SpecError on every
    rank at the call (it used to mismatch gloo's collectives in backward: SIGABRT)."""
    bwd = "seq/sm" if rank == 0 else "fine/sm/c2/g1/M"

    def call(rt):
        if op == "ag":
            ops.all_gather_matmul(torch.randn(4, 3), [torch.randn(3, 2)], rt,
                                  schedule="seq/sm", backward_schedule=bwd)
        else:
            ops.matmul_all_to_all(torch.randn(8, 3), torch.randn(3, 2), rt,
                                  schedule="seq/sm", backward_schedule=bwd)
    return _failure(call)


def single_expert_weights(rank, world, combine, schedule):
    """(1, K, N) expert weights: forward and gradients equal the (K, N) weight's."""
    torch.manual_seed(3 + rank)
    x = torch.randn(4 * world, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, dtype=torch.float64)
    outs = []
    for weight in (w.clone().requires_grad_(True), w[None].clone().requires_grad_(True)):
        xi = x.detach().clone().requires_grad_(True)
        if combine:
            y = ops.matmul_all_to_all(xi, weight, schedule=schedule)
        else:
            _, y = ops.all_to_all_matmul(xi, weight, schedule=schedule)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, weight.grad.reshape(3, 2)))
    (y1, gx1, gw1), (y2, gx2, gw2) = outs
    return bool(torch.allclose(y1, y2) and torch.allclose(gx1, gx2)
                and torch.allclose(gw1, gw2))


def edge_shapes(rank, world):
    """Empty dimensions give empty results (and gradients of the right shape), and a schedule
    with more blocks than the copy engine has flags is a named error, on every rank."""
    from plait.errors import InfeasibleError

    ok = []
    for engine in ("sm", "dma"):
        _, (y,) = ops.all_gather_matmul(torch.randn(0, 3), [torch.randn(3, 2)],
                                        schedule=f"seq/{engine}")
        ok.append(y.shape == (0, 2))
        z = ops.matmul_reduce_scatter(torch.randn(0, 3), torch.randn(3, 2),
                                      schedule=f"seq/{engine}")
        ok.append(z.shape == (0, 2))
    for k, n in ((0, 2), (3, 0)):  # an empty reduction, an empty output
        a = torch.randn(4, k, requires_grad=True)
        w = torch.randn(k, n, requires_grad=True)
        _, (y,) = ops.all_gather_matmul(a, [w])
        y.sum().backward()
        ok.append(y.shape == (4 * world, n) and a.grad.shape == a.shape
                  and w.grad.shape == w.shape and not a.grad.any())
        b = torch.randn(4 * world, k, requires_grad=True)
        v = torch.randn(k, n, requires_grad=True)
        ops.matmul_reduce_scatter(b, v).sum().backward()
        ok.append(b.grad.shape == b.shape and v.grad.shape == v.shape)
    try:
        ops.matmul_reduce_scatter(torch.randn(world * 4096, 2), torch.randn(2, 2),
                                  schedule="fine/dma/c4096/g1/M")
        ok.append(False)
    except InfeasibleError as exc:
        ok.append("flags" in str(exc))
    return ok


def reinitialized_group(rank, world, store_dir):
    """A process group destroyed and made again (same name) without closing plait's runtime:
    the ops run on the new group."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    def gather():
        _, (y,) = ops.all_gather_matmul(torch.full((2, 3), float(rank)), [torch.eye(3)],
                                        schedule="fine/dma/c2/g1/M")
        return y

    first = gather()
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(store_dir, "again"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    second = gather()
    return bool(torch.equal(first, second))


def absent_at_first_use(rank, world):
    """The copy engine's first call (its shared-memory setup) with the shape check off, and
    rank 1 never calling: rank 0 fails within the runtime's timeout, not the group's."""
    import time

    rt = Runtime(torch.distributed.group.WORLD, timeout_s=3, verify_shapes=False)
    if rank == 1:
        time.sleep(8)
        return None, "absent", 0.0
    t0 = time.monotonic()
    try:
        ops.all_gather_matmul(torch.randn(4, 3), [torch.randn(3, 2)], rt, schedule="seq/dma")
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    finally:
        rt.close()
    return None, "no error", time.monotonic() - t0


def spawned_rank(rank, world, store):
    """A rank started by torch.multiprocessing spawn (every rank shares the parent's resource
    tracker): one copy-engine call, then a clean exit."""
    import torch.distributed as dist

    from plait.runtime.context import close_all

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    _, (y,) = ops.all_gather_matmul(torch.ones(2, 3), [torch.eye(3)], schedule="seq/dma")
    assert y.shape == (2 * world, 3)
    close_all()
    dist.barrier()
    dist.destroy_process_group()
