"""Operator sequences of one layer: shapes, collectives, and the dependent pairs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.errors import SpecError
from plait.spec.layout import ParallelSpec
from plait.spec.model import load_model
from plait.workload.operators import Attention, Axis, Collective, CollectiveKind, Elementwise, Gemm
from plait.workload.transformer import build_layer


def test_llama70b_tp8_sp_layer():
    layer = build_layer(load_model("llama3-70b"), ParallelSpec(tp=8, seq_len=8192))
    gemms = {o.name: o for o in layer.forward + layer.backward if isinstance(o, Gemm)}
    assert (gemms["qkv"].m, gemms["qkv"].n, gemms["qkv"].k) == (8192, (8 + 2) * 128, 8192)
    assert (gemms["fc1"].n, gemms["fc2"].k) == (2 * 28672 // 8, 28672 // 8)
    assert (gemms["qkv_wgrad"].k, gemms["fc2_wgrad"].k) == (8192, 8192)  # tokens reduce
    colls = [o for o in layer.forward if isinstance(o, Collective)]
    assert [c.kind for c in colls] == [CollectiveKind.AG, CollectiveKind.RS] * 2
    assert all(c.bytes == 8192 * 8192 * 2 for c in colls)
    names = {p.name: p for p in layer.pairs}
    assert set(names) == {"qkv", "out_proj", "fc1", "fc2", "fc2_dgrad", "fc1_dgrad", "fc1_wgrad",
                          "out_proj_dgrad", "qkv_dgrad", "qkv_wgrad"}
    assert names["qkv"].direction == "in" and names["out_proj"].direction == "out"
    assert names["fc1_wgrad"].axis is Axis.K and names["qkv"].axis is Axis.M


@pytest.mark.parametrize("sp", [True, False])
def test_keeping_gathered_inputs_drops_exactly_the_backward_regathers(sp):
    """DTensor TP (torchtitan) and plait's runtime keep the forward's gathered input for the
    weight gradient: the backward loses its two re-gathers and their K pairs, nothing else."""
    from plait.sim.layer import simulate_layer
    from plait.spec.hardware import load_hardware
    from plait.workload.transformer import keeping_gathered_inputs

    layer = build_layer(load_model("llama3-8b"), ParallelSpec(tp=8, sp=sp, seq_len=4096))
    kept = keeping_gathered_inputs(layer)
    dropped = {"ag_attn_x", "ag_mlp_x"} if sp else set()
    assert kept.forward == layer.forward
    assert [o.name for o in kept.backward] == [o.name for o in layer.backward
                                               if o.name not in dropped]
    assert {p.name for p in layer.pairs} - {p.name for p in kept.pairs} == (
        {"qkv_wgrad", "fc1_wgrad"} if sp else set())
    c = load_hardware("h100")
    (_, bwd), (_, kept_bwd) = simulate_layer(layer, c, {}), simulate_layer(kept, c, {})
    assert kept_bwd.time_s < bwd.time_s if sp else kept_bwd.time_s == bwd.time_s


def test_no_sp_uses_all_reduce_and_no_pairs():
    layer = build_layer(load_model("llama3-8b"), ParallelSpec(tp=4, sp=False, seq_len=2048))
    kinds = {o.kind for o in layer.forward + layer.backward if isinstance(o, Collective)}
    assert kinds == {CollectiveKind.AR} and layer.pairs == ()


def test_tp1_has_no_communication():
    layer = build_layer(load_model("llama3-8b"), ParallelSpec(tp=1, seq_len=2048))
    assert not any(isinstance(o, Collective) for o in layer.forward + layer.backward)


def test_context_parallel_adds_kv_ring():
    layer = build_layer(load_model("llama3-8b"), ParallelSpec(tp=2, cp=4, dp=1, seq_len=8192))
    ring = [o for o in layer.forward if isinstance(o, Collective) and o.kind is CollectiveKind.P2P]
    assert len(ring) == 1 and ring[0].group == 4 and ring[0].stride == 2


def test_moe_tensor_parallel_experts_batch_gemms():
    layer = build_layer(load_model("mixtral-8x7b"), ParallelSpec(tp=8, seq_len=8192))
    fc1 = next(o for o in layer.forward if isinstance(o, Gemm) and o.name == "fc1")
    assert fc1.count == 8 and fc1.m == 8192 * 2 // 8


def test_capacity_factor_pads_expert_rows_and_all_to_all():
    """Expert rows and the tokens sent all-to-all grow with the capacity factor (padding to a
    capacity, or the imbalance a dropless layer pads to); below 1 is a named error."""
    import pytest

    from plait.errors import SpecError
    from plait.spec.io import validate

    def pairs(cf):
        par = ParallelSpec(tp=1, dp=8, ep=8, seq_len=8192, capacity_factor=cf)
        return {p.name: p for p in build_layer(load_model("mixtral-8x7b"), par).pairs}

    one, more = pairs(1.0), pairs(1.5)
    assert more["fc1"].gemm.m == 1.5 * one["fc1"].gemm.m == 1.5 * 8192 * 2
    assert more["fc1"].collective.bytes == 1.5 * one["fc1"].collective.bytes
    layer = build_layer(load_model("mixtral-8x7b"), ParallelSpec(tp=8, capacity_factor=1.25))
    fc1 = next(o for o in layer.forward if isinstance(o, Gemm) and o.name == "fc1")
    assert fc1.m == 1.25 * 8192 * 2 // 8
    with pytest.raises(SpecError, match=r"parallel\.capacity_factor"):
        validate(ParallelSpec, {"capacity_factor": 0.9}, "parallel")


@given(mb=st.integers(1, 8), seq=st.sampled_from([1024, 2048, 8192]),
       cp=st.sampled_from([1, 2]))
def test_attention_flops_are_linear_in_the_micro_batch(mb, seq, cp):
    """Tokens attend within their own sequence: a micro-batch of mb sequences costs mb times
    one sequence (it cost mb^2 times when q = kv = mb x seq tokens)."""
    model = load_model("llama3-8b")

    def attn_flops(m: int) -> float:
        layer = build_layer(model, ParallelSpec(tp=8, cp=cp, micro_batch=m, seq_len=seq))
        return sum(op.flops for op in (*layer.forward, *layer.backward)
                   if isinstance(op, Attention))

    assert attn_flops(mb) == pytest.approx(mb * attn_flops(1), rel=1e-12)


def _spans(timeline, name):
    return [(s.start, s.end) for s in timeline.spans if s.task.name == name]


def _overlap(a, b):
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


@pytest.mark.parametrize("sp", [True, False])
def test_megatron_baseline_overlaps_a_column_linears_backward_as_megatron_lm(sp):
    """In the backward of a column-parallel linear Megatron-LM runs the input's re-gather
    beside the data-gradient GEMM and the data gradient's reduction beside the weight-gradient
    GEMM; everything else as the sequential baseline."""
    from plait.sim.layer import simulate_layer
    from plait.spec.hardware import load_hardware

    cluster = load_hardware("h100")
    layer = build_layer(load_model("llama3-70b"), ParallelSpec(tp=8, sp=sp, seq_len=8192))
    (sf, sb), (mf, mb) = (simulate_layer(layer, cluster, {}, megatron=m) for m in (False, True))
    assert mf.time_s == pytest.approx(sf.time_s, rel=1e-12)  # forward: nothing more overlaps
    assert mb.time_s < sb.time_s and mb.exposed_comm_s < sb.exposed_comm_s
    t = mb.timeline
    for lin in ("fc1", "qkv"):
        dx = "rs_mlp_dx" if lin == "fc1" else "rs_attn_dx"
        assert _overlap(_spans(t, dx), _spans(t, f"{lin}_wgrad")) > 0
        # the reduction reads the data gradient: it starts after it
        assert min(s for s, _ in _spans(t, dx)) >= max(e for _, e in _spans(t, f"{lin}_dgrad"))
        if sp:
            x = "ag_mlp_x" if lin == "fc1" else "ag_attn_x"
            assert _overlap(_spans(t, x), _spans(t, f"{lin}_dgrad")) > 0
            assert min(s for s, _ in _spans(t, f"{lin}_wgrad")) >= max(
                e for _, e in _spans(t, x))


@given(cp=st.sampled_from([2, 4, 8]), seq=st.sampled_from([8192, 32768, 131072]),
       hw=st.sampled_from(["h100", "mi300x"]))
def test_ring_attention_overlaps_each_block_with_the_next_transfer(cp, seq, hw):
    """Ring attention: CP - 1 transfers beside CP attention blocks. The block takes at least
    the longer of the two and at most their sum; block j's attention starts after its keys
    and values arrived."""
    from plait.sim.layer import simulate_layer
    from plait.spec.hardware import load_hardware

    cluster = load_hardware(hw)
    layer = build_layer(load_model("llama3-8b"), ParallelSpec(tp=1, cp=cp, seq_len=seq))
    fwd, _ = simulate_layer(layer, cluster, {})
    t = fwd.timeline
    attn = [sp for sp in t.spans if sp.task.label == "attn"]
    ring = [sp for sp in t.spans if sp.task.label == "cp_kv_ring"]
    assert len(attn) == cp and len(ring) == cp - 1
    block = max(s.end for s in attn + ring) - min(s.start for s in attn + ring)
    work_attn = sum(s.task.duration for s in attn)
    work_ring = sum(s.task.duration for s in ring)
    assert max(work_attn, work_ring) * (1 - 1e-9) <= block <= (work_attn + work_ring) * (1 + 1e-9)
    for j, x in enumerate(sorted(ring, key=lambda s: s.start), start=1):
        a = next(s for s in attn if s.task.name == f"attn.{j}")
        assert a.start >= x.end - 1e-12


def test_a_ring_that_spans_nodes_waits_for_its_nic_hop():
    """A P2P ring steps all its hops at once, so a step lasts as long as the slowest hop: a
    ring over CP 4 at stride 4 on 8-GPU nodes has most next ranks in the node, but its hop into
    the next node (and the wrap back) crosses the NIC; within one node it runs on the link."""
    from plait.cost.comm import collective_cost, ring_step_cost, route
    from plait.spec.hardware import load_hardware
    from plait.workload.operators import Collective, CollectiveKind

    cluster = load_hardware("h100")
    nbytes = 3 * 2**30
    spans = Collective("ring", CollectiveKind.P2P, nbytes, 4, stride=4)
    inside = Collective("ring", CollectiveKind.P2P, nbytes, 2, stride=4)
    nic = cluster.nic.bytes_per_s * cluster.params.sm_link_fraction
    link = route(cluster, 1, 4).bytes_per_s * cluster.params.sm_link_fraction
    assert collective_cost(spans, cluster).duration == pytest.approx(nbytes / nic, rel=1e-3)
    assert ring_step_cost(spans, cluster).duration == pytest.approx(nbytes / 3 / nic, rel=1e-3)
    assert collective_cost(inside, cluster).duration == pytest.approx(nbytes / link, rel=3e-3)


def test_pipeline_bubble_of_1f1b_and_interleaved_1f1b():
    """A pipelined step: every micro-batch plus (pp - 1) / v idle micro-batch slots of one
    stage's layers (1F1B: v = 1; interleaved 1F1B with v chunks per rank)."""
    from plait.planner.explore import explore
    from plait.spec.hardware import load_hardware

    model, cluster = load_model("llama3-8b"), load_hardware("h100")
    flat = explore(model, ParallelSpec(tp=8, seq_len=2048, num_micro_batches=8), cluster,
                   fast=True).totals("megatron")
    for pp, v in ((1, 1), (4, 1), (4, 2)):
        par = ParallelSpec(tp=8, pp=pp, virtual_stages=v, seq_len=2048, num_micro_batches=8)
        t = explore(model, par, cluster, fast=True).totals("megatron")
        assert t.layers == 32 // pp and t.bubble_slots == (pp - 1) / v
        assert t.step_s == pytest.approx(flat.layer_s * (32 // pp) * (8 + (pp - 1) / v))
        assert t.bubble_s == pytest.approx(t.step_s * ((pp - 1) / v) / (8 + (pp - 1) / v))
    with pytest.raises(SpecError, match="virtual_stages"):
        build_layer(model, ParallelSpec(tp=8, pp=4, virtual_stages=3, seq_len=2048))
    with pytest.raises(SpecError, match="num_micro_batches"):
        build_layer(model, ParallelSpec(tp=8, pp=4, virtual_stages=2, seq_len=2048,
                                        num_micro_batches=6))


@pytest.mark.parametrize(("model", "par"), [
    ("llama3-8b", ParallelSpec(tp=8, seq_len=4096)),
    ("examples/tiny_moe.json", ParallelSpec(tp=2, seq_len=64)),  # experts tensor-parallel
    ("examples/tiny_moe.json", ParallelSpec(tp=1, dp=2, ep=2, seq_len=64)),  # expert parallel
])
def test_every_forward_weight_gemm_has_a_weight_gradient(model, par):
    """Training updates every weight: each forward GEMM of a weight (the router's too) has
    its data gradient (but the first GEMM's input, which is the layer's norm) and its weight
    gradient in the backward, with the weight's shape."""
    layer = build_layer(load_model(model), par)
    fwd = {op.name: op for op in layer.forward if isinstance(op, Gemm)}
    bwd = {op.name: op for op in layer.backward if isinstance(op, Gemm)}
    for name, g in fwd.items():
        w = bwd.get(f"{name}_wgrad")
        assert w is not None, f"{name} has no weight gradient"
        assert (w.m, w.n, w.count) == (g.n, g.k, g.count) or (w.m, w.n) == (g.k, g.n), name
        assert f"{name}_dgrad" in bwd, f"{name} has no data gradient"


def test_fp8_training_runs_only_the_linear_layers_in_fp8():
    """TransformerEngine's FP8 recipe: the linear layers' GEMMs and the inputs they gather in
    FP8; their outputs (the reduce-scatters), attention, the ring's keys and values and the
    memory-bound kernels stay BF16."""
    model = load_model("llama3-8b")
    par = ParallelSpec(tp=4, cp=2, seq_len=8192)
    bf16, fp8 = (build_layer(model, par.model_copy(update={"dtype": d})) for d in ("bf16", "fp8"))
    for a, b in zip(bf16.forward + bf16.backward, fp8.forward + fp8.backward, strict=True):
        if isinstance(a, Gemm):
            assert b.dtype == "fp8" and a.dtype == "bf16"
        elif isinstance(a, Attention):
            assert b == a
        elif isinstance(a, Collective):
            gathers = a.kind is CollectiveKind.AG
            assert b.bytes == (a.bytes / 2 if gathers else a.bytes), a.name
        elif isinstance(a, Elementwise):
            assert b.bytes == a.bytes
