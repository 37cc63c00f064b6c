"""A strand's units (plait.runtime.strands): two strands in a plan's blocks keep the blocks'
order, and deferred weight gradients give exactly autograd's gradients."""

import threading
import typing

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.runtime import strands
from plait.runtime.launch import run_ranks


@st.composite
def _plans(draw):
    """Blocks 0..n-1, each holding units of one strand or both, in order."""
    n = draw(st.integers(1, 6))
    block_of: dict[str, dict[str, int]] = {"F": {}, "B": {}}
    for b in range(n):
        who = draw(st.sampled_from(["F", "B", "FB"]))
        for strand in who:
            for _ in range(draw(st.integers(1, 2))):
                block_of[strand][f"u{len(block_of[strand])}"] = b
    return block_of


@settings(max_examples=40, deadline=None)
@given(_plans())
def test_a_strand_starts_a_block_only_when_the_other_is_done_with_the_blocks_before(block_of):
    blocks = strands.Blocks(block_of, timeout_s=20)
    lock = threading.Lock()
    events: list[tuple[str, str, str]] = []  # (start/end, strand, unit)

    def run(strand: str) -> None:
        for unit in block_of[strand]:
            blocks.arrive(strand, unit)
            with lock:
                events.append(("start", strand, unit))
            with lock:
                events.append(("end", strand, unit))
        blocks.finish(strand)

    worker = threading.Thread(target=run, args=("B",))
    worker.start()
    run("F")
    worker.join()
    done: set[tuple[str, str]] = set()
    for kind, strand, unit in events:
        if kind == "end":
            done.add((strand, unit))
            continue
        b = block_of[strand][unit]
        other = "B" if strand == "F" else "F"
        late = [u for u, ub in block_of[other].items() if ub < b and (other, u) not in done]
        assert not late, f"{strand} started {unit} (block {b}) before {other} ended {late}"
    assert len(done) == sum(len(v) for v in block_of.values())


def test_a_unit_the_plan_does_not_name_runs_where_it_comes_and_is_listed():
    blocks = strands.Blocks({"F": {"a#0": 0}, "B": {}}, timeout_s=5)
    blocks.finish("B")  # it has nothing planned, and ended
    blocks.arrive("F", "a#0")
    blocks.arrive("F", "b#1")
    assert blocks.stray == [("F", "b#1")]


def _deferred_grads(rank, world, defer):
    import torch.distributed as dist

    from plait.nn import ColumnParallelLinear, ExpertParallelMLP, RowParallelLinear

    torch.manual_seed(0)
    g = dist.new_group(list(range(world)))
    fc1 = ColumnParallelLinear(8, 16, g, schedule="fine/sm/c2/g1/M")
    fc2 = RowParallelLinear(16, 8, g, schedule="fine/dma/c2/g1/M")
    moe = ExpertParallelMLP(8, 16, g, experts=2, schedule="fine/sm/c2/g1/M")
    x = torch.randn(8, 8)
    ran = []
    for step in range(2):  # the second accumulates into the first's .grad
        h = fc2(F.gelu(fc1(x + step)))
        loss = (h + moe(h)).square().sum()
        names = frozenset(f"wgrad#{k}" for k in range(20)) if defer else frozenset()
        with strands.units("B", deferred=names) as u:
            loss.backward()
            queued = len(u.queue)
        ran.append((queued, [unit.name for unit in u.ran]))
    return [p.grad.clone() for p in (fc1.weight, fc2.weight, moe.fc1, moe.fc2)], ran


def test_deferred_weight_gradients_equal_autograds_exactly():
    """Every weight gradient of plait's layers (a view W.T of the parameter, an expert's
    transposed weights) deferred to the end of the backward, over two accumulating steps:
    `torch.equal` to autograd's; the strand's units are its calls, then the gradients."""
    inline = run_ranks(2, _deferred_grads, False)
    deferred = run_ranks(2, _deferred_grads, True)
    for (want, ran0), (got, ran1) in zip(inline, deferred, strict=True):
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)
        assert ran0[0][0] == 0 and ran1[0][0] == 4  # four weight gradients queued
        calls = [n for n in ran0[0][1] if not n.startswith(("wgrad", "tail"))]
        assert ran1[0][1] == [*calls, "tail", *(n for n in ran0[0][1]
                                                 if n.startswith("wgrad"))]
        assert "reduce_scatter" not in str(ran0) and "all_to_all#" not in str(ran0)  # no
        # zeros sent for the gathered or received outputs nobody used


class _Communicates(torch.autograd.Function):
    """An op whose backward communicates on group "g" and computes a weight gradient, as
    plait's ops do: it notes the thread it ran on and the group its strand was given."""

    seen: typing.ClassVar[list[tuple[str, str]]] = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        with strands.turn("op", "g") as key:
            _Communicates.seen.append((threading.current_thread().name, key))
        strands.weight_grad(g, lambda: g * 3)
        return g * 2


def test_a_backward_on_another_thread_acts_for_the_backward_strand():
    """On CUDA the autograd engine runs a device's backward nodes on a thread of its own, not
    the strand's: there the op still belongs to the backward strand (its twin communicator,
    its units). Here a thread of our own runs the backward, as the device thread would."""
    _Communicates.seen = []
    x = torch.ones(2, requires_grad=True)
    loss = _Communicates.apply(x).sum()
    ran: list[strands.TimedUnit] = []

    def backward_strand() -> None:
        with strands.strand("B"), strands.units("B") as u:
            device = threading.Thread(target=loss.backward, name="device-thread")
            device.start()
            device.join()
        ran.extend(u.ran)

    with strands.turnstile(twins={"g": "g-twin"}) as gate:
        worker = threading.Thread(target=backward_strand, name="backward-strand")
        worker.start()
        worker.join()
    assert _Communicates.seen == [("device-thread", "g-twin")]
    assert gate.own == [("B", "op")]
    assert [u.name for u in ran] == ["op#0", "wgrad#1", "tail"]
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def test_a_thread_outside_any_backward_keeps_its_own_state():
    """Only a thread running a backward acts for the backward strand: another helper thread
    (a copier, say) while the strand runs has no strand."""
    got: list[bool] = []

    def helper() -> None:
        got.append(strands.beside_other_work())

    with strands.strand("B"):
        t = threading.Thread(target=helper)
        t.start()
        t.join()
    assert got == [False]
