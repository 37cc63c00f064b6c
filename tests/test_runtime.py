"""The runtime on real gloo process groups (CPU, world sizes 1-4): equivalence with the plain
reference (all-gather then matmul; matmul then reduce-scatter; torch autograd) for every schedule
and engine, bad input, absent peers, and shared-memory hygiene."""

import glob
import os
import random
import signal

import pytest
import torch

from plait.errors import InfeasibleError, SpecError
from plait.runtime.launch import RankError, run_ranks
from plait.schedule.schedule import Schedule
from tests import runtime_cases as cases
from tests.helpers import on_every_rank, seed_of

pytestmark = pytest.mark.slow  # every test here runs forked ranks


def _assert_close(results):
    for rank, (errs, tol, *_) in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= tol}
        assert not bad, f"rank {rank}: errors over {tol}: {bad}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("schedule", cases.AG_SCHEDULES)
def test_all_gather_matmul_matches_reference(world, schedule):
    seed = seed_of(world, schedule)
    gather_dim = seed % 2  # 0: rows of a 2-d input; 1: the sequence dim of a 3-d input
    results = run_ranks(world, cases.all_gather_matmul_case, seed, torch.float32, schedule,
                        gather_dim, 1 + seed % 3, False)
    _assert_close(results)
    expected = "seq/sm" if world == 1 else schedule
    assert results[0][2][0] == expected
    engine = results[0][2][1]
    if world > 1:
        assert engine.startswith("peer_copy" if "/dma" in schedule else "collective")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", cases.K_SCHEDULES)
def test_all_gather_matmul_along_k_matches_reference(world, schedule):
    _assert_close(run_ranks(world, cases.all_gather_matmul_case, 7, torch.float32, schedule,
                            0, 2, True))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("schedule", cases.AG_SCHEDULES)
def test_matmul_reduce_scatter_matches_reference(world, schedule):
    seed = seed_of(world, schedule, "rs")
    _assert_close(run_ranks(world, cases.matmul_reduce_scatter_case, seed, torch.float32,
                            schedule, seed % 2))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("direction", ["in", "out"])
def test_all_to_all_executors_match_reference(world, direction):
    """Expert-parallel dispatch (all-to-all -> GEMM) and combine (GEMM -> all-to-all)."""
    for i, schedule in enumerate(cases.AG_SCHEDULES):
        results = run_ranks(world, cases.exchange_case, 11 * world + i, schedule, direction)
        _assert_close(results)
        assert results[0][2][0] == ("seq/sm" if world == 1 else schedule)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("combine", [False, True])
@pytest.mark.parametrize("schedule", ["seq/sm", "fine/dma/c2/g1/M", "p2p/sm/M",
                                      "fine/sm/c2/peer/M"])
def test_all_to_all_ops_and_gradients_match_autograd(world, combine, schedule):
    _assert_close(run_ranks(world, cases.exchange_ops_case, 3 * world + int(combine), schedule,
                            combine))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("combine", [False, True])
def test_several_local_experts_every_schedule_match_autograd(world, combine):
    """Weights (E, K, N): every schedule of the design space, both engines, 3 experts a rank."""
    _assert_close(run_ranks(world, cases.exchange_ops_case, 5 * world + int(combine),
                            cases.AG_SCHEDULES, combine, 3, timeout_s=120))


@pytest.mark.parametrize(("direction", "k_axis", "schedules"), [
    ("in", False, cases.AG_SCHEDULES), ("in", True, cases.K_SCHEDULES),
    ("out", False, cases.AG_SCHEDULES)])
def test_the_simulator_charges_the_copies_the_runtime_makes(direction, k_axis, schedules):
    """`copied_blocks` (what the simulator charges) names exactly the pieces the executor
    gathers through a copy (on 4 ranks, where one-step pieces straddle the own rank)."""
    from plait.schedule.lower import Compute, copied_blocks, lower
    from plait.workload.operators import Axis

    for schedule in schedules:
        if k_axis and schedule.startswith("seq"):
            continue  # charged as frameworks run it; the executor copies (see copied_blocks)
        s = Schedule.parse(schedule)
        axis = Axis.K if k_axis else Axis.M
        ops_ = lower(s, 4, direction, reduces=direction == "out")
        expected = sum((2 if k_axis else 1) for op in ops_ if isinstance(op, Compute)
                       and copied_blocks(op, s, 4, direction, axis)[0] > 0)
        made = run_ranks(4, cases.gathering_copies_case, schedule, direction, k_axis)
        assert made == [expected] * 4, (schedule, made, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("schedule", ["fine/dma/c2/g1/M", "fine/sm/c4/peer/M", "p2p/dma/M"])
def test_dtypes(dtype, schedule):
    _assert_close(run_ranks(2, cases.all_gather_matmul_case, 3, dtype, schedule, 1, 2, False))
    _assert_close(run_ranks(2, cases.matmul_reduce_scatter_case, 5, dtype, schedule, 0))


def test_random_cases():
    """Random shapes, schedules, dims and world sizes (one draw per run: ranks are forked)."""
    rng = random.Random(1234)
    for _ in range(4):
        world = rng.randint(2, 4)
        s = rng.choice(cases.AG_SCHEDULES)
        _assert_close(run_ranks(world, cases.all_gather_matmul_case, rng.randint(0, 999),
                                torch.float32, s, rng.randint(0, 1), rng.randint(1, 3), False))


def _world1(fn):
    return run_ranks(1, lambda r, w: fn())[0]


def test_bad_input_is_named():
    from plait import ops
    from plait.nn import ExpertParallelMLP

    def body():
        out = []
        for call in (
            lambda: ops.all_gather_matmul(torch.randn(4, 3), [torch.randn(3, 2)], gather_dim=5),
            lambda: ops.all_gather_matmul(torch.randn(4, 3), [torch.randn(4, 2)]),
            lambda: ops.all_gather_matmul(torch.randn(4, 3), []),
            lambda: ops.matmul_reduce_scatter(torch.randn(4, 3), torch.randn(3, 2),
                                              scatter_dim=2),
            lambda: ops.matmul_reduce_scatter(torch.randn(4, 3), torch.randn(3, 2),
                                              reduce_op="max"),
            lambda: ops.all_gather_matmul(torch.randn(4, 3), [torch.randn(3, 2)],
                                          schedule="fine/dma/c8/g1/K"),
            lambda: ops.all_gather_matmul(torch.randn(4, 3), [torch.randn(3, 2).double()]),
            lambda: ops.all_to_all_matmul(torch.randn(2, 4, 3), torch.randn(3, 2)),
            lambda: ops.matmul_all_to_all(torch.randn(4, 3), torch.randn(4, 2)),
            lambda: ops.all_to_all_matmul(torch.randn(6, 3), torch.randn(4, 3, 2)),
            lambda: ExpertParallelMLP(3, 4, experts=2).routed(torch.randn(5, 3),
                                                              torch.tensor([[0], [1], [2]])),
            lambda: ExpertParallelMLP(3, 4, experts=2).routed(torch.randn(2, 3),
                                                              torch.tensor([0, 2])),
            lambda: ExpertParallelMLP(3, 4, experts=0),
        ):
            try:
                call()
                out.append(None)
            except SpecError as e:
                out.append(e.field)
        return out

    assert _world1(body) == ["gather_dim", "weights[0]", "weights", "scatter_dim", "reduce_op",
                             "schedule", "weights[0]", "x", "weight", "x", "experts", "experts",
                             "experts"]


def test_non_divisible_sizes_are_infeasible():
    from plait import ops

    def body():
        with pytest.raises(InfeasibleError, match="sub-chunks"):
            ops.all_gather_matmul(torch.randn(6, 3), [torch.randn(3, 2)],
                                  schedule="fine/dma/c4/g1/M")
        return True

    on_every_rank(2, lambda r, w: body())

    def rs():
        with pytest.raises(SpecError, match="not divisible by the group size"):
            from plait import ops as o

            o.matmul_reduce_scatter(torch.randn(5, 3), torch.randn(3, 2))
        return True

    on_every_rank(2, lambda r, w: rs())


def test_shapes_differing_between_ranks_fail_on_every_rank():
    res = run_ranks(2, cases.mismatched_shapes, timeout_s=60)
    for kind, msg in res:
        assert kind == "SpecError" and "ranks disagree" in msg and "same shapes" in msg


@pytest.mark.parametrize(("engine", "verify"), [("sm", True), ("dma", False)])
def test_absent_peer_errors_within_timeout(engine, verify):
    res = run_ranks(2, cases.absent_peer, engine, verify, timeout_s=60,
                    collective_timeout_s=30)
    kind, msg, _ = res[0]
    # the runtime's own timeout (3 s) ended the wait, not the group's (30 s)
    assert kind == "TimeoutError" and "within 3 s" in msg, (kind, msg)


def _plait_shm() -> set[str]:
    return set(glob.glob("/dev/shm/plait_*"))


def _leaked(before: set[str]) -> set[str]:
    """Segments that appeared and stay: a test in another worker may hold one briefly (between
    creating it and every rank mapping it), a leak does not go away."""
    import time

    extra = _plait_shm() - before
    deadline = time.monotonic() + 5
    while extra and time.monotonic() < deadline:
        time.sleep(0.2)
        extra &= _plait_shm()
    return extra


def test_shared_memory_is_private_and_gone_after_a_run():
    before = _plait_shm()

    def body(rank, world):
        from plait import ops
        from plait.runtime.context import close_all, runtime_of

        ops.all_gather_matmul(torch.randn(8, 3), [torch.randn(3, 2)], schedule="seq/dma")
        buf = runtime_of(None)._peer.buffer
        info = (buf.mode, len(buf.name), os.path.exists(f"/dev/shm/{buf.name}"))
        close_all()
        return info

    for mode, name_len, exists in run_ranks(2, body):
        assert mode == 0o600 and name_len >= 38 and not exists
    assert not _leaked(before)


def test_killed_rank_leaves_nothing_in_dev_shm():
    before = _plait_shm()

    def body(rank, world):
        from plait import ops

        ops.all_gather_matmul(torch.randn(8, 3), [torch.randn(3, 2)], schedule="seq/dma")
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        ops.all_gather_matmul(torch.randn(8, 3), [torch.randn(3, 2)], schedule="seq/dma")
        return True

    with pytest.raises(RankError):
        run_ranks(2, body, timeout_s=40, collective_timeout_s=5)
    assert not _leaked(before)


def test_chunks_are_labelled_for_the_profiler():
    def body(rank, world):
        from torch.profiler import profile

        from plait import ops
        from plait.runtime.context import close_all

        with profile() as prof:
            ops.all_gather_matmul(torch.randn(8, 3), [torch.randn(3, 2)],
                                  schedule="fine/dma/c2/g1/M")
        close_all()
        return sorted({e.name for e in prof.events() if e.name.startswith("plait:")})

    names = run_ranks(2, body)[0]
    assert "plait:ag_mm:gemm.local" in names and "plait:ag_mm:x0.1" in names


def test_parallel_linear_layers_match_dense_reference():
    def body(rank, world):
        import torch.distributed as dist

        from plait.nn import ColumnParallelLinear, RowParallelLinear
        from plait.runtime.context import close_all

        torch.manual_seed(0)
        S, B, H, F = 8, 2, 6, 8
        x = torch.randn(S, B, H)
        w1 = torch.randn(F, H)
        w2 = torch.randn(H, F)
        plan = {"fc1": "fine/dma/c2/g1/M", "fc1_dgrad": "fine/sm/c2/g1/M", "fc2": "p2p/dma/M"}
        col = ColumnParallelLinear(H, F, plan=plan, name="fc1")
        row = RowParallelLinear(F, H, plan=plan, name="fc2")
        with torch.no_grad():
            col.weight.copy_(w1.chunk(world, 0)[rank])
            row.weight.copy_(w2.chunk(world, 1)[rank])
        xs = x.chunk(world, 0)[rank].clone().requires_grad_(True)
        y = row(torch.relu(col(xs)))
        y.sum().backward()
        ref_x = x.clone().requires_grad_(True)
        rw1, rw2 = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        ref = torch.relu(ref_x @ rw1.T) @ rw2.T
        ref.sum().backward()
        ok = [torch.allclose(y, ref.chunk(world, 0)[rank], atol=1e-4),
              torch.allclose(xs.grad, ref_x.grad.chunk(world, 0)[rank], atol=1e-4),
              torch.allclose(col.weight.grad, rw1.grad.chunk(world, 0)[rank], atol=1e-4),
              torch.allclose(row.weight.grad, rw2.grad.chunk(world, 1)[rank], atol=1e-4),
              str(col.schedule) == "fine/dma/c2/g1/M", row.backward_schedule is None]
        dist.barrier()
        close_all()
        return ok

    for ok in run_ranks(2, body):
        assert all(ok), ok


@pytest.mark.parametrize(("world", "experts"), [(2, 1), (3, 1), (2, 3)])
def test_expert_parallel_mlp_matches_per_expert_reference(world, experts):
    """Every rank's tokens for expert e of rank q go through that expert's MLP and come back in
    place; gradients of inputs and every expert's weights match torch autograd on the
    unsharded computation."""
    def body(rank, world):
        import torch.distributed as dist

        from plait.nn import ExpertParallelMLP
        from plait.runtime.context import close_all

        cap, H, F, E = 4, 6, 5, experts
        lead = () if E == 1 else (E,)
        torch.manual_seed(1)
        xs = [torch.randn(world * E * cap, H, dtype=torch.float64) for _ in range(world)]
        w1 = [torch.randn(*lead, 2 * F, H, dtype=torch.float64) for _ in range(world)]
        w2 = [torch.randn(*lead, H, F, dtype=torch.float64) for _ in range(world)]
        plan = {"fc1": "fine/dma/c2/g1/M", "fc1_dgrad": "fine/sm/c2/peer/M", "fc2": "p2p/sm/M",
                "fc2_dgrad": "seq/dma"}
        moe = ExpertParallelMLP(H, F, experts=E, plan=plan, dtype=torch.float64)
        with torch.no_grad():
            moe.fc1.copy_(w1[rank])
            moe.fc2.copy_(w2[rank])
        x = xs[rank].clone().requires_grad_(True)
        y = moe(x)
        (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        rx = [t.clone().requires_grad_(True) for t in xs]
        r1 = [t.clone().requires_grad_(True) for t in w1]
        r2 = [t.clone().requires_grad_(True) for t in w2]

        def mlp(t, q, e):
            a, b = (r1[q], r2[q]) if E == 1 else (r1[q][e], r2[q][e])
            gate, up = (t @ a.T).chunk(2, dim=-1)
            return (torch.nn.functional.silu(gate) * up) @ b.T
        ys = [torch.cat([mlp(rx[p][(q * E + e) * cap:(q * E + e + 1) * cap], q, e)
                         for q in range(world) for e in range(E)]) for p in range(world)]
        sum((yp * torch.arange(yp.numel(), dtype=yp.dtype).view_as(yp)).sum()
            for yp in ys).backward()
        ok = [torch.allclose(y, ys[rank]), torch.allclose(x.grad, rx[rank].grad),
              torch.allclose(moe.fc1.grad, r1[rank].grad),
              torch.allclose(moe.fc2.grad, r2[rank].grad),
              [tuple(map(str, pair)) for pair in moe.schedules] == [
                  ("fine/dma/c2/g1/M", "fine/sm/c2/peer/M"), ("p2p/sm/M", "seq/dma")]]
        dist.barrier()
        close_all()
        return ok

    for ok in run_ranks(world, body):
        assert all(ok), ok


@pytest.mark.parametrize("capacity", [None, 2])
def test_routed_moe_matches_a_per_token_reference(capacity):
    """Top-2 routing over 2 ranks x 2 experts, uneven counts: `routed` packs every choice into
    its expert's rows (dropless: padded to the largest count anywhere), runs the overlapped
    MLP and sums the gated outputs per token; outputs and gradients of tokens, gates and every
    expert's weights match autograd on a per-token computation. With a capacity, the choices
    beyond it are dropped, in token order, and counted."""
    def body(rank, world):
        import torch.distributed as dist

        from plait.nn import ExpertParallelMLP
        from plait.runtime.context import close_all

        E, H, F, T = 2, 6, 5, 7
        g = torch.Generator().manual_seed(5)
        xs = [torch.randn(T, H, generator=g, dtype=torch.float64) for _ in range(world)]
        ids = [torch.randint(0, world * E, (T, 2), generator=g) for _ in range(world)]
        ids[0][:, 0] = 1  # expert 1 gets most of rank 0's tokens: uneven counts
        gs = [torch.rand(T, 2, generator=g, dtype=torch.float64) for _ in range(world)]
        w1 = [torch.randn(E, 2 * F, H, generator=g, dtype=torch.float64) for _ in range(world)]
        w2 = [torch.randn(E, H, F, generator=g, dtype=torch.float64) for _ in range(world)]
        moe = ExpertParallelMLP(H, F, experts=E, schedule="fine/dma/c2/g1/M",
                                fc2_schedule="fine/sm/c2/peer/M", dtype=torch.float64)
        with torch.no_grad():
            moe.fc1.copy_(w1[rank])
            moe.fc2.copy_(w2[rank])
        x = xs[rank].clone().requires_grad_(True)
        gate = gs[rank].clone().requires_grad_(True)
        y, dropped = moe.routed(x, ids[rank], gate, capacity=capacity)
        (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()

        rx = [t.clone().requires_grad_(True) for t in xs]
        rg = [t.clone().requires_grad_(True) for t in gs]
        r1 = [t.clone().requires_grad_(True) for t in w1]
        r2 = [t.clone().requires_grad_(True) for t in w2]

        def mlp(t, e):
            a, b = r1[e // E][e % E], r2[e // E][e % E]
            gt, up = (t @ a.T).chunk(2, dim=-1)
            return (torch.nn.functional.silu(gt) * up) @ b.T
        total, lost = 0, [0] * world
        for p in range(world):
            seen = [0] * (world * E)  # choices of each expert so far, in token order
            yp = []
            for t in range(T):
                acc = torch.zeros(H, dtype=torch.float64)
                for k in range(2):
                    e = int(ids[p][t, k])
                    seen[e] += 1
                    if capacity is not None and seen[e] > capacity:
                        lost[p] += 1
                        continue
                    acc = acc + rg[p][t, k] * mlp(rx[p][t], e)
                yp.append(acc)
            yp = torch.stack(yp)
            total = total + (yp * torch.arange(yp.numel(), dtype=yp.dtype).view_as(yp)).sum()
            if p == rank:
                ref = yp
        total.backward()
        ok = [torch.allclose(y, ref), torch.allclose(x.grad, rx[rank].grad),
              torch.allclose(gate.grad, rg[rank].grad),
              torch.allclose(moe.fc1.grad, r1[rank].grad),
              torch.allclose(moe.fc2.grad, r2[rank].grad), dropped == lost[rank],
              capacity is not None or dropped == 0, capacity is None or sum(lost) > 0,
              # rows sent over balanced routing: experts x capacity (the largest count, rounded
              # up to the schedules' 2 sub-chunks) over the choices
              moe.capacity_factor == world * E * (capacity or 2 * -(-max(
                  int((i == e).sum()) for i in ids for e in range(world * E)) // 2)) / (T * 2)]
        dist.barrier()
        close_all()
        return ok

    for ok in run_ranks(2, body):
        assert all(ok), ok


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (GPU-only copy-engine path)")
def test_cuda_single_gpu_group_runs_locally():
    def body(rank, world):
        from plait import ops
        from plait.runtime.context import close_all

        a = torch.randn(64, 32, device="cuda")
        w = torch.randn(32, 16, device="cuda")
        _, (y,) = ops.all_gather_matmul(a, [w], schedule="fine/dma/c2/g1/M")
        close_all()
        return bool(torch.allclose(y, a @ w, atol=1e-3))

    on_every_rank(1, body)


def test_no_rank_tears_the_group_down_before_the_others_arrive():
    """The cause of "Connection closed by peer" flakes on a loaded host: a rank that finished
    first destroyed its gloo connections while a slower one still used them. `leave_group`
    (what every rank of run_ranks and torchrun path does last) waits for all of them."""
    import time

    import torch.distributed as dist

    from plait.runtime.launch import leave_group

    def body(rank, world):
        if rank == 1:
            time.sleep(0.5)  # the slow rank
        arrived = time.time()
        leave_group()
        return arrived, time.time(), dist.is_initialized()

    (_, fast_left, still), (slow_arrived, _, _) = run_ranks(2, body)
    assert fast_left >= slow_arrived and not still


@pytest.mark.parametrize("op", ["ag", "mm_a2a"])
def test_ranks_disagreeing_on_the_backward_schedule_get_a_spec_error(op):
    for kind, msg in run_ranks(2, cases.mismatched_backward, op, timeout_s=60):
        assert kind == "SpecError", msg
        assert "backward_schedule" in msg


@pytest.mark.parametrize("combine", [False, True])
@pytest.mark.parametrize("schedule", ["seq/sm", "fine/dma/c2/g1/M"])
def test_single_expert_weights_have_their_gradient(combine, schedule):
    on_every_rank(2, cases.single_expert_weights, combine, schedule)


def test_edge_shapes_give_empty_results_or_a_named_error():
    for ok in run_ranks(2, cases.edge_shapes, timeout_s=120):
        assert all(ok), ok


def test_a_reinitialized_process_group_gets_a_fresh_runtime(tmp_path):
    on_every_rank(2, cases.reinitialized_group, str(tmp_path), timeout_s=90)


def test_shared_memory_setup_waits_the_runtimes_timeout_not_the_groups():
    res = run_ranks(2, cases.absent_at_first_use, timeout_s=60, collective_timeout_s=30)
    kind, msg, _ = res[0]
    assert kind == "TimeoutError" and "within 3 s" in msg, msg  # the runtime's, not 30 s


def test_ranks_die_with_their_parent(tmp_path):
    """A killed run_ranks parent leaves no orphaned ranks (they used to run on ~30 s)."""
    import subprocess
    import sys
    import time

    pids = tmp_path / "pids"
    script = (
        "import os, time, pathlib\n"
        "from plait.runtime.launch import run_ranks\n"
        "def body(rank, world):\n"
        f"    with open({str(pids)!r}, 'a') as f: f.write(f'{{os.getpid()}}\\n')\n"
        "    time.sleep(60)\n"
        "run_ranks(2, body, timeout_s=120)\n")
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not pids.exists()
                                           or len(pids.read_text().split()) < 2):
        time.sleep(0.2)
    ranks = [int(p) for p in pids.read_text().split()]
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    alive = ranks
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in ranks if _running(p)]
    assert not alive, f"ranks {alive} outlived their parent"
    import glob
    import tempfile

    # The killed parent could not remove its rendezvous folder; the next run does (or one that
    # another test started meanwhile already did).
    on_every_rank(1, lambda r, w: True)
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"plait-ranks-{parent.pid}-*"))


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_spawned_ranks_leave_the_resource_tracker_quiet(tmp_path):
    """Under spawn all ranks share one resource tracker: a peer that unregistered a segment it
    only mapped made the tracker print a KeyError traceback at exit."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    script = ("import torch.multiprocessing as mp\n"
              "from tests.runtime_cases import spawned_rank\n"
              "if __name__ == '__main__':\n"
              f"    mp.spawn(spawned_rank, args=(2, {str(tmp_path / 'store')!r}), nprocs=2)\n")
    res = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "KeyError" not in res.stderr and "leaked" not in res.stderr, res.stderr[-2000:]


def test_orphaned_segments_of_a_killed_job_are_unlinked(tmp_path):
    """A segment whose creator is gone (the whole job killed during setup) is unlinked by the
    next buffer made on the host."""
    import subprocess
    import sys
    from multiprocessing import shared_memory

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    name = f"plait_{dead}_{'0' * 32}"
    seg = shared_memory.SharedMemory(name=name, create=True, size=4096, track=False) \
        if sys.version_info >= (3, 13) else shared_memory.SharedMemory(name=name, create=True,
                                                                         size=4096)
    seg.close()
    if sys.version_info < (3, 13):  # this process's tracker must not unlink it for us
        from multiprocessing import resource_tracker
        resource_tracker.unregister(f"/{name}", "shared_memory")
    # (a run that another test starts meanwhile may unlink it first: both are fine)

    def body(rank, world):
        from plait import ops
        ops.all_gather_matmul(torch.randn(4, 3), [torch.randn(3, 2)], schedule="seq/dma")
        return True

    on_every_rank(2, body)
    assert not os.path.exists(f"/dev/shm/{name}")


def _plan_file(tmp_path, ranks, n, k):
    import json

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({
        "model": {"name": "m"}, "parallel": {"tp": ranks}, "hardware": "mi300x-8",
        "plan": {"fc1": "fine/dma/c2/g1/M", "fc1_dgrad": "seq/sm"},
        "pairs": [{"name": "fc1", "ranks": ranks, "gemm": {"m": 64, "n": n, "k": k}}]}))
    return str(plan)


@pytest.mark.parametrize(("ranks", "n", "k", "error"), [
    (8, 4, 8, "for a group of 8 ranks, but it runs on 1"),
    (1, 16, 8, "N=16, K=8 per rank, but this layer's is N=8, K=8"),
    (1, 8, 8, None)])
def test_a_plan_runs_only_on_the_group_and_shapes_it_was_made_for(tmp_path, ranks, n, k, error):
    """A TP=8 MI300X plan ran on 1-2 CPU ranks with a warning, and on any layer shape."""
    plan = _plan_file(tmp_path, ranks, n, k)

    def body(rank, world):
        from plait.errors import SpecError
        from plait.nn import ColumnParallelLinear

        try:
            layer = ColumnParallelLinear(8, 8, plan=plan, name="fc1")
        except SpecError as exc:
            return str(exc)
        return (str(layer.schedule), str(layer.backward_schedule))

    (got,) = run_ranks(1, body)
    if error is None:
        assert got == ("fine/dma/c2/g1/M", "seq/sm")
    else:
        assert error in got and f"(m, tp={ranks}, on mi300x-8)" in got, got
        assert "plait explore" in got


def test_segment_names_of_different_lengths_are_exchanged():
    """Names carry their creator's pid, and pids differ in digits (9999, 10000): the exchange
    sent different sizes and gloo aborted ("Received data size doesn't match")."""
    import torch.distributed as dist

    from plait.runtime.shm import _exchange_names

    def body(rank, world):
        name = "plait_9999_ab" if rank == 0 else "plait_10000_abc"
        return _exchange_names(dist.group.WORLD, name, world, 30)

    assert run_ranks(2, body) == [["plait_9999_ab", "plait_10000_abc"]] * 2


def _inference_mode_calls(rank, world):
    from plait import ops

    torch.manual_seed(0)
    x, w = torch.randn(8, 4)[rank * 4:(rank + 1) * 4].clone(), torch.randn(4, 3)
    out = []
    for s in ("seq/dma", "fine/dma/c2/g1/M", "p2p/dma/M", "fine/sm/c2/g1/M"):
        with torch.inference_mode():
            a, (y,) = ops.all_gather_matmul(x, [w], schedule=s)
            z = ops.matmul_reduce_scatter(y, torch.ones(3, 2), schedule=s)
        out.append(y.is_inference() and torch.allclose(z, (a @ w @ torch.ones(3, 2)).chunk(
            world)[rank] * world, atol=1e-4))
    return out


@pytest.mark.slow
def test_inference_mode_runs_on_both_engines():
    """The copy engine's copier thread writes inference tensors under the caller's mode."""
    assert run_ranks(2, _inference_mode_calls, timeout_s=60) == [[True] * 4] * 2
