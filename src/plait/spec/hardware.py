"""The hardware: a GPU (`GpuSpec`), how GPUs connect (`Topology`, `NicSpec`), a cluster
(`ClusterSpec`), and the cost model's physical parameters (`CostParams`), which calibration
overrides. Presets are named functions; every number's public source, or `estimate:` and why,
is in `plait.spec.sources` (`plait presets --show NAME`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from plait.errors import SpecError
from plait.spec.io import read_mapping, validate

T = TypeVar("T")
GB = 1e9
TB = 1e12
MiB, GiB = 2**20, 2**30
# Device memory as CUDA reports it: an HBM part's "80 GB" is 80 GiB of stacks, less what the
# driver keeps (an H100 80 GB shows 81,559 of 81,920 MiB); parts without a published
# `memory.total` take that share of their nominal GiB.
VISIBLE = 81559 / 81920
# Physical bounds, far outside any real machine, that keep every simulated time finite: a
# bandwidth below 1 MB/s or a fixed cost above one second is a typo, not hardware.
MIN_BYTES_PER_S = 1e6
MAX_FIXED_S = 1.0
# Counts a hardware file may ask for: the simulator holds a queue per copy engine and a route
# per peer, so an absurd count would be memory before it is a result (real GPUs have under a
# dozen copy engines and a few hundred compute units; NVLink domains reach 72 GPUs).
MAX_COPY_ENGINES = 64
MAX_COUNT = 4096
MIN_FLOPS = 1e6
US = 1e-6


# The lowest sustained clock a part may have, as a fraction of its rated one
# (`CostParams.clock_fraction`; the `--measured` fit's bracket)
LOWEST_CLOCK = 0.05

class FrozenSpec(BaseModel):
    # Physical quantities are finite: an inf or NaN in a file is refused by name, never fed to
    # the simulator.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    _derived: dict[object, object] = PrivateAttr(default_factory=dict)
    _derived_owner: int = PrivateAttr(default=0)

    def cached(self, key: object, build: Callable[[], T]) -> T:
        """`build()`, once per instance and `key`: what is built from these (frozen) values,
        such as interpolation tables, the GEMM tile table, routes and slowdown maps.
        `model_copy` copies private attributes by reference, so the memo is reset for a new
        owner."""
        private = self.__pydantic_private__  # direct: the attribute route costs microseconds
        assert private is not None
        if private["_derived_owner"] != id(self):
            private["_derived"], private["_derived_owner"] = {}, id(self)
        memo: dict[object, object] = private["_derived"]
        if key not in memo:
            memo[key] = build()
        return cast(T, memo[key])


class DmaSpec(FrozenSpec):
    """The GPU's DMA / copy engines, which move data without using compute units."""

    engines: int = Field(gt=0, le=MAX_COPY_ENGINES,
        description="Copy engines usable for peer transfers")
    bytes_per_s: float = Field(ge=MIN_BYTES_PER_S,
        description="Bandwidth one engine sustains, bytes/s")
    command_overhead_s: float = Field(ge=0, le=MAX_FIXED_S,
        description="Fixed cost of one copy command, s")


class GpuSpec(FrozenSpec):
    """One accelerator."""

    name: str = Field(description="A label for reports")
    peak_flops: dict[str, float] = Field(description="Dense peak FLOP/s per dtype (bf16, fp8...)")
    hbm_bytes_per_s: float = Field(ge=MIN_BYTES_PER_S, description="Peak memory bandwidth, bytes/s")
    compute_units: int = Field(gt=0, le=MAX_COUNT, description="SMs (NVIDIA) or CUs (AMD)")
    tile_m: int = Field(default=256, gt=0, description="GEMM output tile rows per compute unit")
    tile_n: int = Field(default=128, gt=0, description="GEMM output tile columns per compute unit")
    launch_overhead_s: float = Field(default=5 * US, ge=0, le=MAX_FIXED_S,
        description="Kernel launch cost, s")
    dma: DmaSpec = Field(description="Copy engines")
    memory_bytes: float = Field(default=0.0, ge=0, description="Device memory (HBM) capacity, "
        "bytes; 0: unknown (`plait plan` then needs --memory-gib)")

    @field_validator("peak_flops")
    @classmethod
    def _peaks_positive(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("no peak FLOP/s: give at least one dtype, e.g. {bf16: 9.9e14}")
        bad = {k: x for k, x in v.items() if not x >= MIN_FLOPS}
        if bad:
            raise ValueError(f"peak FLOP/s must be at least {MIN_FLOPS:g}, got {bad}")
        return v

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise SpecError("hardware.gpu.peak_flops", f"{self.name} has no {dtype} peak "
                            f"(it lists {', '.join(self.peak_flops)})",
                            f"use --dtype {next(iter(self.peak_flops))} or add a {dtype} peak")
        return self.peak_flops[dtype]


class Topology(FrozenSpec):
    """How the GPUs of one node connect."""

    kind: Literal["mesh", "switched", "pcie"] = Field(
        description="mesh (direct links between every pair), switched (NVSwitch) or pcie")
    link_bytes_per_s: float = Field(
        ge=MIN_BYTES_PER_S,
        description="Per direction: one link (mesh) or the GPU's port (switched, pcie)")
    links_per_gpu: int = Field(default=1, gt=0, le=MAX_COUNT,
        description="Direct links per GPU (mesh only)")
    latency_s: float = Field(default=2 * US, ge=0, le=MAX_FIXED_S,
        description="One-hop transfer latency, s")
    sockets: int = Field(default=1, gt=0, le=MAX_COUNT,
        description="CPU sockets the node's GPUs hang off in equal shares (pcie only): peer "
        "traffic between GPUs of different sockets crosses the link between the CPUs")
    socket_link_bytes_per_s: float | None = Field(default=None, ge=MIN_BYTES_PER_S,
        description="Per direction, what the link between the CPUs forwards of GPU peer "
        "traffic, all the GPUs of a socket together, bytes/s (required with sockets > 1)")


class NicSpec(FrozenSpec):
    """Inter-node network, per GPU."""

    bytes_per_s: float = Field(ge=MIN_BYTES_PER_S,
        description="NIC bandwidth per GPU per direction, bytes/s")
    latency_s: float = Field(default=5 * US, ge=0, le=MAX_FIXED_S,
        description="Inter-node latency, s")


class CostParams(FrozenSpec):
    """The cost model's parameters: physical quantities with defaults, overridable by a
    calibration file (`plait.spec.calibration`)."""

    gemm_peak_fraction: float = Field(
        default=0.75, gt=0, le=1, description="Fraction of dense peak a large GEMM reaches")
    gemm_sustained_fraction: float = Field(
        default=1.0, gt=0, le=1, description="Fraction of dense peak no GEMM exceeds: the "
        "maximum achievable matmul rate, at the clock the power limit sustains under full "
        "tensor-core load; 1: no ceiling beyond the tile model")
    fp8_split_accumulator_slowdown: float = Field(
        default=0.0, ge=0, le=1, description="Extra time of an FP8 data- or weight-gradient "
        "GEMM, which the training stacks run with the split (precise) accumulator: partial "
        "sums promoted to FP32 outside the tensor cores; 0: no extra")
    clock_fraction: float = Field(
        default=1.0, ge=LOWEST_CLOCK, le=1, description="Clock this part sustains under "
        "compute-bound load at its power limit, as a fraction of the clock of the part the "
        "GEMM and attention parameters describe (the same GPU at its rated power): scales every "
        "compute-bound kernel's rate; 1: the rated power (and on a calibration measured on "
        "the part itself; 0.05 at least: a clock below is a typo, not a power limit)")
    hbm_fraction: float = Field(
        default=0.85, gt=0, le=1, description="Fraction of peak HBM bandwidth kernels reach")
    sm_link_fraction: float = Field(
        default=0.80, gt=0, le=1,
        description="Fraction of link bandwidth collective (SM/CU) kernels reach")
    dma_link_fraction: float = Field(
        default=0.90, gt=0, le=1, description="Fraction of link bandwidth copy engines reach")
    nvls_allreduce_fraction: float = Field(
        default=0.0, ge=0, le=1, description="Algorithm bandwidth (the tensor's bytes per "
        "second) of an all-reduce the switch reduces (NVLink SHARP), as a fraction of the "
        "port's link bandwidth; 0: the switch does not reduce")
    sm_reduce_slowdown: float = Field(
        default=0.10, ge=0, description="Extra time of a reduce-scatter collective kernel over "
        "an all-gather moving the same bytes (it reads, adds and writes)")
    attention_fwd_peak_fraction: float = Field(
        default=0.648, gt=0, le=1, description="Fraction of dense peak the fused attention "
        "forward kernel approaches when each query visits many keys (no causal mask)")
    attention_bwd_peak_fraction: float = Field(
        default=0.548, gt=0, le=1, description="The same for the attention backward kernel "
        "(its FLOPs counted as 2.5 forwards)")
    attention_fwd_half_keys: float = Field(
        default=168.0, gt=0, description="Keys a query visits at which the forward kernel "
        "reaches half that rate: each query tile's fixed work (loading it, writing its output "
        "and softmax statistics) amortized over the keys it visits")
    attention_bwd_half_keys: float = Field(
        default=376.0, gt=0, description="The same for the backward kernel")
    attention_causal_factor: float = Field(
        default=0.855, gt=0, le=1, description="Rate of a causal attention kernel relative to "
        "one without the mask visiting as many keys (masked diagonal tiles, uneven work)")
    comm_compute_units: int = Field(
        default=16, ge=0, description="Compute units a collective kernel occupies while it runs")
    comm_kernel_overhead_s: float = Field(
        default=8 * US, ge=0, le=MAX_FIXED_S, description="Launch and synchronization cost "
        "of one collective "
        "kernel (step), s")
    host_call_s: float = Field(
        default=5 * US, ge=0, le=MAX_FIXED_S, description="Host time of one eager call that "
        "issues a schedule's step (dispatcher, launch), s; 0: issue costs nothing apart from "
        "the ops (a CPU rank runs its ops in the issuing thread)")
    gemm_slowdown_sm_comm: float = Field(
        default=0.10, ge=0, le=0.95, description="Extra fractional GEMM slowdown (caches, "
        "memory traffic) while SM collective kernels run")
    gemm_slowdown_dma: float = Field(
        default=0.03, ge=0, le=0.95, description="Extra fractional GEMM slowdown while copy "
        "engines run")
    sm_comm_slowdown_under_compute: float = Field(
        default=0.05, ge=0, le=0.95, description="Fractional slowdown of a collective-kernel "
        "transfer while a compute kernel runs")
    dma_slowdown_under_compute: float = Field(
        default=0.05, ge=0, le=0.95, description="Fractional slowdown of a copy-engine "
        "transfer while a compute kernel runs")
    gemm_measured: list[tuple[str, int, int, int, float]] = Field(
        default_factory=list, description="Measured GEMM times as (dtype, M, N, K, seconds) on "
        "a grid; for a dtype present here GEMM time is interpolated from them (log space) "
        "instead of the tile model")

    @field_validator("gemm_measured")
    @classmethod
    def _grid_complete(cls, v: list[tuple[str, int, int, int, float]]
                       ) -> list[tuple[str, int, int, int, float]]:
        """Positive sizes and times on a complete grid per dtype (the interpolation's input)."""
        bad = [p for p in v if min(p[1:]) <= 0]
        if bad:
            raise ValueError(f"sizes and seconds must be positive, got {list(bad[0])}")
        for dtype in sorted({p[0] for p in v}):
            have = {(m, n, k) for d, m, n, k, _ in v if d == dtype}
            axes = [sorted({x[i] for x in have}) for i in range(3)]
            missing = [(m, n, k) for m in axes[0] for n in axes[1] for k in axes[2]
                       if (m, n, k) not in have]
            if missing:
                raise ValueError(f"the {dtype} grid misses {len(missing)} of its M x N x K "
                                 f"points, e.g. {missing[0]}: measure every combination")
        return v


# The attention kernels a stack may run, as the attention model's parameters: cuDNN's fused
# attention (TransformerEngine; the CostParams defaults) and FlashAttention-2 (PyTorch SDPA's
# flash backend), each fitted on H100 to the FlashAttention-3 paper's measurements
# (`python bench/attention_check.py --fit --kernel fa2`; plait.spec.sources.ATTENTION).
ATTENTION_KERNELS: dict[str, dict[str, float]] = {
    "cudnn": {},
    "fa2": {"attention_fwd_peak_fraction": 0.395, "attention_fwd_half_keys": 172.0,
            "attention_causal_factor": 0.875, "attention_bwd_peak_fraction": 0.333,
            "attention_bwd_half_keys": 274.0},
}


class ClusterSpec(FrozenSpec):
    """GPUs, their intra-node topology, nodes and NICs, and the cost parameters."""

    name: str = Field(description="A label for reports")
    gpu: GpuSpec
    topology: Topology
    gpus_per_node: int = Field(default=8, gt=0, le=MAX_COUNT,
        description="GPUs in one node (one NVLink domain)")
    nodes: int = Field(default=1, gt=0, description="Number of nodes")
    nic: NicSpec = Field(default=NicSpec(bytes_per_s=50 * GB), description="Inter-node network")
    params: CostParams = Field(default_factory=CostParams, description="Cost model parameters")

    @property
    def gpus_per_socket(self) -> int:
        """GPUs behind one CPU socket (all of the node's where one socket or NVLink joins
        them)."""
        return self.gpus_per_node // self.topology.sockets

    @model_validator(mode="after")
    def _links_fit(self) -> ClusterSpec:
        if self.params.comm_compute_units >= self.gpu.compute_units:
            raise ValueError(f"params.comm_compute_units={self.params.comm_compute_units} "
                             f"leaves no compute units of the {self.gpu.compute_units} for the "
                             "GEMM beside a collective kernel")
        topo = self.topology
        if topo.sockets > 1 and (topo.kind != "pcie" or self.gpus_per_node % topo.sockets
                                 or topo.socket_link_bytes_per_s is None):
            raise ValueError(f"topology.sockets={topo.sockets} needs a pcie topology, "
                             f"gpus_per_node={self.gpus_per_node} divisible by it and "
                             "topology.socket_link_bytes_per_s")
        if self.topology.kind == "mesh" and self.topology.links_per_gpu < self.gpus_per_node - 1:
            raise ValueError(f"a full mesh of {self.gpus_per_node} GPUs needs "
                             f"{self.gpus_per_node - 1} links per GPU, "
                             f"topology.links_per_gpu={self.topology.links_per_gpu}")
        return self

    def with_(self, **changes: Any) -> ClusterSpec:
        """A variant with some top-level fields changed (validated again)."""
        return validate(ClusterSpec, {**self.model_dump(), **changes}, "hardware")

    def with_attention(self, kernel: str) -> ClusterSpec:
        """This cluster running attention kernel `kernel` (`ATTENTION_KERNELS`)."""
        if kernel not in ATTENTION_KERNELS:
            raise SpecError("attention", f"unknown attention kernel {kernel!r}",
                            f"use one of {', '.join(ATTENTION_KERNELS)}")
        if not ATTENTION_KERNELS[kernel]:
            return self
        return self.model_copy(update={"params": self.params.model_copy(
            update=ATTENTION_KERNELS[kernel])})


# --- Presets (each number's source: plait.spec.sources) -------------------------------------

def mi300x() -> ClusterSpec:
    gpu = GpuSpec(
        name="MI300X",
        peak_flops={"bf16": 1307.4 * TB, "fp16": 1307.4 * TB, "fp8": 2614.9 * TB,
                    "fp32": 163.4 * TB},
        hbm_bytes_per_s=5.3 * TB,
        compute_units=304,
        tile_m=256, tile_n=256,
        launch_overhead_s=6 * US,
        dma=DmaSpec(engines=14, bytes_per_s=50 * GB, command_overhead_s=5 * US),
        memory_bytes=192 * GiB * VISIBLE,
    )
    return ClusterSpec(
        name="mi300x-8",
        gpu=gpu,
        topology=Topology(kind="mesh", link_bytes_per_s=64 * GB, links_per_gpu=7),
        gpus_per_node=8,
        nic=NicSpec(bytes_per_s=50 * GB),
        # contention from published concurrent GEMM + collective runs on MI300X (ConCCL;
        # FiCCO for the GEMM beside copy engines): plait.spec.sources
        params=CostParams(comm_compute_units=32, gemm_slowdown_sm_comm=0.37,
                          sm_comm_slowdown_under_compute=0.37,
                          dma_slowdown_under_compute=0.26),
    )


def h100() -> ClusterSpec:
    gpu = GpuSpec(
        name="H100-SXM",
        peak_flops={"bf16": 989.4 * TB, "fp16": 989.4 * TB, "fp8": 1978.9 * TB,
                    "fp32": 66.9 * TB},
        hbm_bytes_per_s=3.35 * TB,
        compute_units=132,
        launch_overhead_s=6 * US,
        dma=DmaSpec(engines=4, bytes_per_s=400 * GB, command_overhead_s=3 * US),
        memory_bytes=81559 * MiB,
    )
    return ClusterSpec(
        name="h100-8",
        gpu=gpu,
        topology=Topology(kind="switched", link_bytes_per_s=450 * GB),
        gpus_per_node=8,
        nic=NicSpec(bytes_per_s=50 * GB),
        params=CostParams(nvls_allreduce_fraction=0.61, gemm_peak_fraction=0.85,
                          gemm_sustained_fraction=0.801, sm_reduce_slowdown=0.0,
                          fp8_split_accumulator_slowdown=0.15),
    )


def h100_500w() -> ClusterSpec:
    """H100 SXM with 96 GB HBM2e at a 500 W power limit (Meta's Grand Teton, where
    torchtitan's published benchmarks ran): H100's compute at a lower sustained clock."""
    base = h100()
    gpu = base.gpu.model_copy(update={"name": "H100-SXM-96GB-500W", "hbm_bytes_per_s": 2.4 * TB,
                                      "memory_bytes": 96 * GiB * VISIBLE})
    params = base.params.model_copy(update={"clock_fraction": 0.715})
    return base.model_copy(update={"name": "h100-500w-8", "gpu": gpu, "params": params})


def h200() -> ClusterSpec:
    base = h100()
    gpu = base.gpu.model_copy(update={"name": "H200-SXM", "hbm_bytes_per_s": 4.8 * TB,
                                      "memory_bytes": 143771 * MiB})
    return base.model_copy(update={"name": "h200-8", "gpu": gpu})


def a100() -> ClusterSpec:
    gpu = GpuSpec(
        name="A100-SXM-80GB",
        peak_flops={"bf16": 312 * TB, "fp16": 312 * TB, "fp32": 19.5 * TB},
        hbm_bytes_per_s=2.039 * TB,
        compute_units=108,
        launch_overhead_s=4 * US,
        dma=DmaSpec(engines=4, bytes_per_s=250 * GB, command_overhead_s=3 * US),
        memory_bytes=81920 * MiB,
    )
    return ClusterSpec(
        name="a100-8",
        gpu=gpu,
        topology=Topology(kind="switched", link_bytes_per_s=300 * GB),
        gpus_per_node=8,
        nic=NicSpec(bytes_per_s=25 * GB),
        params=CostParams(gemm_sustained_fraction=0.859),
    )


def a800() -> ClusterSpec:
    base = a100()
    gpu = base.gpu.model_copy(update={"name": "A800-SXM-80GB"})
    return base.model_copy(update={
        "name": "a800-8", "gpu": gpu,
        "topology": Topology(kind="switched", link_bytes_per_s=200 * GB)})


def b200() -> ClusterSpec:
    """NVIDIA DGX/HGX B200: 8 Blackwell GPUs on NVLink 5 through NVSwitch."""
    gpu = GpuSpec(
        name="B200",
        peak_flops={"bf16": 2250 * TB, "fp16": 2250 * TB, "fp8": 4500 * TB, "fp32": 75 * TB},
        hbm_bytes_per_s=8 * TB,
        compute_units=148,
        launch_overhead_s=6 * US,
        dma=DmaSpec(engines=4, bytes_per_s=800 * GB, command_overhead_s=3 * US),
        memory_bytes=183359 * MiB,
    )
    return ClusterSpec(
        name="b200-8", gpu=gpu,
        topology=Topology(kind="switched", link_bytes_per_s=900 * GB),
        gpus_per_node=8,
        nic=NicSpec(bytes_per_s=50 * GB),
        params=CostParams(gemm_peak_fraction=0.85, gemm_sustained_fraction=0.742),
    )


def gb200_nvl72() -> ClusterSpec:
    """NVIDIA GB200 NVL72: 72 Blackwell GPUs in one NVLink 5 domain (18 compute trays of 4
    GPUs and 9 NVLink switch trays): TP and EP may reach past 8 inside it."""
    gpu = b200().gpu.model_copy(update={
        "name": "GB200", "peak_flops": {"bf16": 2500 * TB, "fp16": 2500 * TB, "fp8": 5000 * TB,
                                        "fp32": 80 * TB},
        "memory_bytes": 186 * GiB * VISIBLE})
    return ClusterSpec(
        name="gb200-nvl72", gpu=gpu,
        topology=Topology(kind="switched", link_bytes_per_s=900 * GB, latency_s=3 * US),
        gpus_per_node=72,
        nic=NicSpec(bytes_per_s=50 * GB),
        params=CostParams(gemm_peak_fraction=0.85, gemm_sustained_fraction=0.742),
    )


def mi355x() -> ClusterSpec:
    """AMD Instinct MI355X platform: 8 GPUs fully connected by Infinity Fabric links."""
    gpu = GpuSpec(
        name="MI355X",
        peak_flops={"bf16": 2516.6 * TB, "fp16": 2516.6 * TB, "fp8": 5033.2 * TB,
                    "fp32": 157.3 * TB},
        hbm_bytes_per_s=8 * TB,
        compute_units=256,
        tile_m=256, tile_n=256,
        launch_overhead_s=6 * US,
        dma=DmaSpec(engines=14, bytes_per_s=64 * GB, command_overhead_s=5 * US),
        memory_bytes=288 * GiB * VISIBLE,
    )
    return ClusterSpec(
        name="mi355x-8", gpu=gpu,
        topology=Topology(kind="mesh", link_bytes_per_s=76.8 * GB, links_per_gpu=7),
        gpus_per_node=8,
        nic=NicSpec(bytes_per_s=50 * GB),
        params=mi300x().params,
    )


def h20() -> ClusterSpec:
    """NVIDIA HGX H20: the export Hopper, H100's NVLink and more HBM, a sixth of its compute."""
    base = h100()
    gpu = base.gpu.model_copy(update={
        "name": "H20", "peak_flops": {"bf16": 148 * TB, "fp16": 148 * TB, "fp8": 296 * TB,
                                      "fp32": 44 * TB},
        "hbm_bytes_per_s": 4.0 * TB, "compute_units": 78, "memory_bytes": 96 * GiB * VISIBLE})
    params = base.params.model_copy(update={"gemm_sustained_fraction": 1.0})
    return base.model_copy(update={"name": "h20-8", "gpu": gpu, "params": params})


def _pcie_server(cluster: str, params: CostParams, **gpu: Any) -> ClusterSpec:
    """Eight GPUs (`gpu`: the GpuSpec fields that differ) on PCIe Gen4 x16 without NVLink,
    one port each, two copy engines for peer copies at the port's rate (where no link between
    CPUs slows them), 128-wide GEMM tiles, a 100 Gb/s NIC per GPU."""
    return ClusterSpec(
        name=cluster,
        gpu=GpuSpec(tile_m=128, tile_n=128, launch_overhead_s=4 * US,
                    dma=DmaSpec(engines=2, bytes_per_s=25 * GB, command_overhead_s=4 * US),
                    **gpu),
        topology=Topology(kind="pcie", link_bytes_per_s=25 * GB, latency_s=5 * US),
        gpus_per_node=8,
        nic=NicSpec(bytes_per_s=12.5 * GB),
        params=params,
    )


def a40() -> ClusterSpec:
    """8x A40 in a two-socket server, four GPUs a CPU: peer traffic between the halves
    crosses the CPUs' link."""
    c = _pcie_server("a40-8", CostParams(comm_compute_units=8), name="A40",
                     peak_flops={"bf16": 149.7 * TB, "fp16": 149.7 * TB, "fp32": 37.4 * TB},
                     hbm_bytes_per_s=696 * GB, compute_units=84, memory_bytes=48 * GB)
    return c.model_copy(update={"topology": c.topology.model_copy(
        update={"sockets": 2, "socket_link_bytes_per_s": 10 * GB})})


def l20() -> ClusterSpec:
    """8x L20 (Ada) on PCIe: the machine of ByteDance Flux's PCIe report. NCCL reaches a third
    of the port there (its all-gather and reduce-scatter run through the host), where peer
    copies and in-kernel peer loads reach the port."""
    return _pcie_server(
        "l20-8", CostParams(comm_compute_units=8, gemm_peak_fraction=0.90, sm_link_fraction=0.31),
        name="L20", peak_flops={"bf16": 119.5 * TB, "fp16": 119.5 * TB, "fp32": 59.35 * TB},
        hbm_bytes_per_s=864 * GB, compute_units=92, memory_bytes=48 * GB)


def cpu() -> ClusterSpec:
    """A CPU host running gloo ranks, one core per rank (this project's CI machine);
    `plait profile` replaces these numbers with a calibration file."""
    gpu = GpuSpec(
        name="cpu-core",
        peak_flops={"fp32": 80e9, "bf16": 20e9, "fp16": 10e9},
        hbm_bytes_per_s=6.5 * GB,
        compute_units=1,
        tile_m=64, tile_n=64,
        launch_overhead_s=10 * US,
        dma=DmaSpec(engines=1, bytes_per_s=1.2 * GB, command_overhead_s=800 * US),
    )
    return ClusterSpec(
        name="cpu",
        gpu=gpu,
        topology=Topology(kind="switched", link_bytes_per_s=2 * GB, latency_s=100 * US),
        gpus_per_node=8,
        nic=NicSpec(bytes_per_s=1 * GB, latency_s=50 * US),
        params=CostParams(comm_compute_units=0, comm_kernel_overhead_s=1000 * US,
                          host_call_s=0.0, sm_link_fraction=0.42, dma_link_fraction=0.9,
                          gemm_slowdown_sm_comm=0.3, gemm_slowdown_dma=0.2),
    )


HARDWARE_PRESETS: dict[str, Callable[[], ClusterSpec]] = {
    "mi300x": mi300x,
    "h100": h100,
    "h100-500w": h100_500w,
    "h200": h200,
    "a100": a100,
    "a800": a800,
    "b200": b200,
    "gb200-nvl72": gb200_nvl72,
    "mi355x": mi355x,
    "h20": h20,
    "a40": a40,
    "l20": l20,
    "cpu": cpu,
}


# Which preset a device is, from its name (CUDA's device name, a trace's deviceProperties):
# the first token the name contains, upper-cased with dashes dropped.
DEVICE_PRESETS = (("GB200", "gb200-nvl72"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100"),
                  ("H800", "h100"), ("H20", "h20"), ("A100", "a100"), ("A800", "a800"),
                  ("A40", "a40"), ("L20", "l20"), ("MI355", "mi355x"), ("MI300", "mi300x"))


def preset_of_device(name: str) -> str | None:
    """The hardware preset of a device named `name` ("NVIDIA H100 80GB HBM3"), None if none."""
    key = name.upper().replace("-", "")
    return next((preset for token, preset in DEVICE_PRESETS if token in key), None)


def load_hardware(name_or_path: str) -> ClusterSpec:
    """A preset name or a YAML/JSON cluster spec file (same fields as `ClusterSpec`)."""
    if name_or_path in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[name_or_path]()
    if not Path(name_or_path).suffix:
        raise SpecError("hardware", f"unknown hardware preset {name_or_path!r}",
                        f"use one of {', '.join(HARDWARE_PRESETS)} or a path to a YAML/JSON file")
    data = read_mapping(name_or_path, "hardware")
    return validate(ClusterSpec, data, "hardware")
