"""The torchtitan settings that realize a layout (its `[parallelism]`, `[training]` and
`[activation_checkpoint]` fields) and what plait adds on top of them."""

from __future__ import annotations

from typing import Any

from plait.planner.plan.space import Layout

_SCHEDULES = {"1F1B": "1F1B", "interleaved": "Interleaved1F1B", "DualPipeV": "DualPipeV"}


def torchtitan_settings(layout: Layout, global_batch: int, layers: int) -> dict[str, Any]:
    """torchtitan's config fields for `layout`, whose busiest rank holds `layers` layers (FSDP
    for ZeRO-3; ZeRO-1 is closest to torchtitan's replicate, which holds the whole optimizer
    state: say so in `plait`)."""
    par: dict[str, Any] = {
        "tensor_parallel_degree": layout.tp,
        "enable_async_tensor_parallel": layout.overlap == "asynctp",
        "context_parallel_degree": layout.cp,
        "pipeline_parallel_degree": layout.pp,
        "expert_parallel_degree": layout.ep,
        "data_parallel_shard_degree": layout.dp if layout.zero >= 3 else 1,
        "data_parallel_replicate_degree": 1 if layout.zero >= 3 else layout.dp,
    }
    if layout.pp > 1:
        par["pipeline_parallel_schedule"] = _SCHEDULES[layout.schedule]
        par["pipeline_parallel_microbatch_size"] = layout.micro_batch
    out: dict[str, Any] = {
        "parallelism": par,
        "training": {"global_batch_size": global_batch,
                     "local_batch_size": layout.micro_batch * layout.micro_batches},
        "activation_checkpoint": {"mode": layout.ac} | (
            {"selective_ac_option": "op"} if layout.ac == "selective" else {}),
    }
    plait: list[str] = []
    if layout.ac == "full" and 0 < layout.ac_layers < layers:
        # torchtitan's layer-level SAC checkpoints every n-th block of a stage in full
        every = layers // layout.ac_layers
        out["activation_checkpoint"] = {"mode": "selective", "selective_ac_option": str(every)}
        plait.append(f"full checkpointing on every {every}th layer: {-(-layers // every)} of "
                     f"{layers} where the plan needs {layout.ac_layers} (Megatron-LM: "
                     f"recompute_method=block, recompute_num_layers={layout.ac_layers})")
    if layout.overlap == "asynctp":
        plait.append("async TP is a torch.compile pass: set [compile] enable=true")
    if layout.overlap == "ficco":
        plait.append("plait.parallel.llama_plan(model, tp_mesh, plan=\"plan.json\") (the file "
                     "--json writes): "
                     "plait's schedule per pair instead of PyTorch's TP")
    realizable = True
    if layout.overlap == "coexec" and layout.schedule == "DualPipeV":
        plait.append("plait.pipelining: the DualPipeV OVERLAP_F_B (co-execution) on every "
                     "stage")
    elif layout.overlap == "coexec":
        realizable = False
        beside = "no pipeline" if layout.pp == 1 else f"a {layout.schedule} schedule"
        plait.append(f"co-execution beside {beside}: DHelix's figure; torchtitan runs an "
                     "overlapped forward and backward only as DualPipeV's OVERLAP_F_B "
                     "(plait.pipelining), so realize it with schedule=DualPipeV and pp >= 2")
    if layout.zero < 3 and layout.dp > 1:
        plait.append("ZeRO-1 (Megatron-LM's distributed optimizer) has no torchtitan switch: "
                     "replicate holds the whole optimizer state, FSDP shards it")
    out["plait"] = plait
    out["realizable"] = realizable  # torchtitan with plait runs this layout as predicted
    return out
