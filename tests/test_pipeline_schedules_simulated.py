"""Pipeline schedules (plait.sim.pipeline): PyTorch's own action orders, the published bubbles,
and properties of the simulated step."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.errors import SpecError
from plait.sim.pipeline import (
    Action,
    Costs,
    PipelineSchedule,
    dualpipe_v,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
)


def _torch_orders(cls, pp, m, v=None):
    """PyTorch's per-rank compute actions (its schedule's own generator), as plait prints."""
    from torch.distributed.pipelining import schedules as S

    kind = {S.FORWARD: "F", S.FULL_BACKWARD: "B", S.BACKWARD_INPUT: "I",
            S.BACKWARD_WEIGHT: "W"}

    def text(a):
        if a.computation_type == S.OVERLAP_F_B:
            return "+".join(text(x) for x in a.sub_actions)
        return f"{kind[a.computation_type]}{a.stage_index}.{a.microbatch_index}"

    sched = object.__new__(cls)  # only the fields its generator reads
    sched.pp_group_size, sched._n_microbatches = pp, m
    if v is not None:
        sched.n_local_stages, sched._num_stages = v, pp * v
        sched.number_of_rounds = max(1, m // pp)
        sched.microbatches_per_round = m // sched.number_of_rounds
    return [[text(a) for a in sched._calculate_single_rank_operations(r) if a is not None]
            for r in range(pp)]


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (2, 7), (3, 6), (3, 10), (4, 8), (4, 13)])
def test_dualpipe_v_is_pytorchs_order(pp, m):
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    mine = [[str(a) for a in acts] for acts in dualpipe_v(pp, m).ranks]
    assert mine == _torch_orders(ScheduleDualPipeV, pp, m)


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 4), (2, 3, 8), (4, 2, 8), (4, 2, 16)])
def test_interleaved_1f1b_is_pytorchs_order(pp, v, m):
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    mine = [[str(a) for a in acts] for acts in interleaved_1f1b(pp, v, m).ranks]
    assert mine == _torch_orders(ScheduleInterleaved1F1B, pp, m, v)


def _uniform(f, b, w, transfer=0.0, fb=None):
    return Costs(lambda s: f, lambda s: b, lambda s: w, transfer, fb)


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 1, 2), (4, 1, 8), (4, 2, 8), (8, 4, 16)])
def test_bubbles_are_the_published_ones(pp, v, m):
    """1F1B: (pp-1) idle slots of F+B; interleaved with v chunks: (pp-1)/v (chunks 1/v long)."""
    f, b = 1.0, 2.0
    run = simulate(interleaved_1f1b(pp, v, m), _uniform(f / v, b / v, 0.0))
    assert run.step_s == pytest.approx((m + (pp - 1) / v) * (f + b))
    assert run.bubble_s == pytest.approx((pp - 1) / v * (f + b))


def test_transfers_delay_dependent_stages_only():
    run0 = simulate(one_f_one_b(2, 2), _uniform(1.0, 2.0, 0.0))
    run1 = simulate(one_f_one_b(2, 2), _uniform(1.0, 2.0, 0.0, transfer=0.5))
    # F0.0 -> (0.5) F1.0 -> B1.0 -> (0.5) B0.0: every stage boundary crossed pays it
    assert run1.step_s == pytest.approx(run0.step_s + 2 * 0.5)
    # one DualPipeV rank holds both stages: its turn of the V crosses no rank, pays nothing
    v = dualpipe_v(1, 2)  # 2 micro-batches x 2 stages x (F + B), back to back
    assert simulate(v, _uniform(1.0, 2.0, 0.5, transfer=9.0)).step_s == pytest.approx(12.0)


def test_a_list_that_cannot_progress_is_an_error():
    stuck = PipelineSchedule("bad", 2, 1, ((Action("B", 0, 0), Action("F", 0, 0)),
                                           (Action("F", 1, 0), Action("B", 1, 0))))
    with pytest.raises(SpecError, match="cannot make progress"):
        simulate(stuck, _uniform(1.0, 1.0, 0.0))


def test_bad_layouts_are_refused():
    with pytest.raises(SpecError, match="at least 8"):
        dualpipe_v(4, 7)
    with pytest.raises(SpecError, match="multiple of 4"):
        interleaved_1f1b(4, 2, 6)


def _counts(s):
    """How often each (kind, stage, mb) runs; I + W count as one B."""
    c = Counter()
    for acts in s.ranks:
        for a in acts:
            for p in a.parts():
                c["B" if p.kind == "I" else p.kind, p.stage, p.mb] += 1
    return c


schedules = st.one_of(
    st.builds(lambda pp, m: one_f_one_b(pp, m), st.integers(1, 6), st.integers(1, 12)),
    st.integers(1, 4).flatmap(lambda pp: st.builds(
        lambda v, k: interleaved_1f1b(pp, v, pp * k), st.integers(1, 3), st.integers(1, 4))),
    st.integers(1, 4).flatmap(lambda pp: st.builds(
        lambda m: dualpipe_v(pp, m), st.integers(2 * pp, 2 * pp + 8))))


@settings(max_examples=60, deadline=None)
@given(schedules, st.floats(0.1, 3), st.floats(0.1, 3), st.floats(0, 1), st.floats(0, 1),
       st.floats(0.3, 1))
def test_every_schedule_runs_each_unit_once_and_overlap_never_slows_it(s, f, b, w, t, ratio):
    c = _counts(s)
    units = {(k, st_, m) for st_ in range(s.stages) for m in range(s.micro_batches)
             for k in ("F", "B")}
    assert {k: v for k, v in c.items() if k[0] != "W"} == dict.fromkeys(units, 1)
    assert all(v == 1 for k, v in c.items() if k[0] == "W")  # a weight gradient once, if split
    plain = simulate(s, _uniform(f, b, w * b, t))
    overlapped = simulate(s, _uniform(f, b, w * b, t, fb=lambda x, y: ratio * (f + b)))
    assert overlapped.step_s <= plain.step_s + 1e-9  # shorter actions never delay the step
    assert plain.step_s >= s.micro_batches * (f + b) * s.stages / len(s.ranks) - 1e-9
    assert 0.0 <= plain.bubble_fraction < 1.0


def test_coexec_plan_predicts_the_pipelined_step_of_each_schedule(tmp_path, monkeypatch):
    """`plait coexec plan --pp 4`: 1F1B, interleaved 1F1B and DualPipeV, PyTorch's default
    and plait's overlap; 1F1B's simulated step is the per-stage model's (one cost model)."""
    import json

    from typer.testing import CliRunner

    from plait.cli.main import app
    from plait.planner.coexec.pipelined import pipelined_rows
    from plait.planner.coexec.variants import predict_coexec
    from plait.spec.hardware import load_hardware
    from plait.spec.layout import ParallelSpec
    from plait.spec.model import load_model

    out = tmp_path / "p.json"
    # at 16k tokens plait's layers beat Megatron's on every schedule; at 8k on 8 GPUs the
    # issue of their steps takes what they would hide (only DualPipeV's pair still gains)
    res = CliRunner().invoke(app, ["coexec", "plan", "-m", "llama3-8b", "--pp", "4",
                                   "--nodes", "4", "--micro-batches", "8",
                                   "--seq-len", "16384", "--json", str(out),
                                   "--trace", str(tmp_path / "t.json"),
                                   "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output
    # the trace: one process per pipelined step that runs, one track per pipeline rank
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    steps = [pid for pid, name in procs.items() if name.endswith("(pipelined step)")]
    assert len(steps) == 6
    tracks = {e["tid"] for e in trace if e["pid"] == steps[-1] and e.get("ph") == "X"}
    assert tracks == {0, 1, 2, 3}
    assert (tmp_path / "p-pipeline.png").stat().st_size > 10_000
    rows = {(r["schedule"], r["runs"]): r for r in json.loads(out.read_text())["pipelined"]}
    assert len(rows) == 6
    for name in ("1F1B", "interleaved 1F1B (v=2)", "DualPipeV"):
        assert rows[name, "plait"]["step_s"] < rows[name, "default"]["step_s"]
    assert rows["DualPipeV", "default"]["bubble_s"] < rows["1F1B", "default"]["bubble_s"]
    # DualPipeV folds the model (two mirrored chunks a rank): fewer activations than
    # interleaving's, more than 1F1B's
    peak = {k: r["peak_activation_layers"] for k, r in rows.items()}
    assert peak["1F1B", "default"] < peak["DualPipeV", "default"] < peak[
        "interleaved 1F1B (v=2)", "default"]

    r = predict_coexec(load_model("llama3-8b"), ParallelSpec(pp=4, num_micro_batches=8),
                      load_hardware("mi300x"))
    one = next(row for row in pipelined_rows(r) if row.schedule == "1F1B" and
               row.way == "default")
    assert one.run is not None
    # the per-stage model charges no stage-to-stage transfer: without them the two agree
    from plait.planner.coexec import pipelined

    monkeypatch.setattr(pipelined, "transfer_s", lambda _r: 0.0)
    free = next(row for row in pipelined.pipelined_rows(r) if row.schedule == "1F1B")
    assert free.run is not None and free.run.step_s < one.run.step_s
    assert free.run.step_s == pytest.approx(r.step(r.variant(r.baseline)), rel=1e-9)


def test_layouts_a_schedule_cannot_run_say_why():
    from plait.planner.coexec.pipelined import pipelined_rows
    from plait.planner.coexec.variants import predict_coexec
    from plait.spec.hardware import load_hardware
    from plait.spec.layout import ParallelSpec
    from plait.spec.model import load_model

    r = predict_coexec(load_model("llama3-8b"), ParallelSpec(pp=4, num_micro_batches=6),
                      load_hardware("h100"))
    notes = {row.schedule: row.note for row in pipelined_rows(r) if row.run is None}
    assert "multiple of 4" in notes["interleaved 1F1B (v=2)"]
    assert "at least 8" in notes["DualPipeV"]


def test_coexec_plan_plans_moe_layers_and_hides_their_all_to_alls(tmp_path):
    """An expert-parallel MoE model (Mixtral, EP=8): the plan's blocks put a dispatch or
    combine beside the other strand's compute, and DualPipeV with plait beats its default."""
    import json

    from typer.testing import CliRunner

    from plait.cli.main import app

    out = tmp_path / "moe.json"
    res = CliRunner().invoke(app, ["coexec", "plan", "-m", "mixtral-8x7b", "-H", "h100",
                                   "--tp", "1", "--ep", "8", "--dp", "8", "--pp", "2",
                                   "--nodes", "2", "--seq-len", "4096", "--micro-batches", "8",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    def a2a(side):
        return any("a2a" in n for n in side)

    # a block whose one strand moves tokens while the other computes
    assert any((a2a(fwd) and bwd) or (a2a(bwd) and fwd) for fwd, bwd in data["plan"])
    rows = {(r["schedule"], r["runs"]): r for r in data["pipelined"]}
    assert rows["DualPipeV", "plait"]["step_s"] < rows["DualPipeV", "default"]["step_s"]
