"""Where every number of a hardware preset comes from: a public source, or `estimate:` and why.

`sources(name)` maps each numeric field of preset `name` (a dotted path of its `ClusterSpec`:
`gpu.peak_flops.bf16`, `topology.link_bytes_per_s`, `params.sm_link_fraction`) to its source;
`plait presets --show NAME` prints them beside the values. The cost-model parameters that no
preset sets have the defaults' sources (`PARAMS`). A test checks that every number has one.
"""

from __future__ import annotations

from typing import Any

_CALIBRATE = "`plait profile` measures it"
_VISIBLE = ("; as CUDA reports it: nominal GiB x 81,559 / 81,920 (the share an H100 80 GB "
            "shows), an estimate")

_FA3 = ("fitted: cuDNN's fused attention (TransformerEngine's kernel on Hopper), head dim 128, "
        "measured on H100 SXM5 at 512-16k tokens in the FlashAttention-3 paper (Shah et al., "
        "arXiv 2407.08608, Figs. 5-6; data/published/fa3_h100_attention.json); other GPUs "
        "take H100's fractions (estimate), `python bench/attention_check.py`")

ATTENTION = ("fitted: FlashAttention-2 (PyTorch SDPA's flash backend) measured on H100 SXM5, "
             "head dim 128, 512-16k tokens, in the FlashAttention-3 paper (Shah et al., arXiv "
             "2407.08608, Figs. 5-6; data/published/fa3_h100_attention.json), `python "
             "bench/attention_check.py --fit --kernel fa2`; other GPUs take H100's fractions "
             "(estimate)")

PARAMS = {  # CostParams defaults, and the topology's
    "topology.sockets": "1: no GPU's peer traffic crosses a link between CPUs (NVLink, "
    "Infinity Fabric or a PCIe switch joins the GPUs)",
    "params.gemm_peak_fraction": "estimate: large dense GEMMs of vendor libraries reach "
    "roughly 70-80% of data-sheet peak; the tile/wave model takes the rest; " + _CALIBRATE,
    "params.gemm_sustained_fraction": "1: no ceiling beyond the tile model where no maximum "
    "achievable matmul rate is published for the GPU",
    "params.fp8_split_accumulator_slowdown": "0: Blackwell's tensor cores accumulate FP8 in "
    "FP32 (cuBLAS has no fast-accumulation mode on sm_100, NVIDIA/TransformerEngine#2748); "
    "AMD's and Ampere's presets: no split-accumulator option in their stacks (estimate)",
    "params.clock_fraction": "1: the part runs at the power limit its GEMM and attention "
    "parameters were measured at",
    "params.hbm_fraction": "estimate: streaming kernels reach ~80-90% of peak HBM bandwidth; "
    + _CALIBRATE,
    "params.sm_link_fraction": "estimate: NCCL/RCCL bus bandwidth of large all-gathers is "
    "~75-85% of link bandwidth; " + _CALIBRATE,
    "params.dma_link_fraction": "estimate: copy engines stream at ~90% of link bandwidth for "
    "large copies; " + _CALIBRATE,
    "params.nvls_allreduce_fraction": "0: no in-switch reduction unless the preset's switch "
    "has one (NVLink SHARP)",
    "params.sm_reduce_slowdown": "estimate: a reduce-scatter kernel also reads, adds and "
    "writes; " + _CALIBRATE + " (reduce-scatter vs all-gather of the same bytes)",
    "params.attention_fwd_peak_fraction": _FA3 + "; forward, 12 points (causal and not)",
    "params.attention_fwd_half_keys": _FA3 + "; forward, 12 points (causal and not)",
    "params.attention_causal_factor": _FA3 + "; forward, 12 points (causal and not); the "
    "backward takes the forward's (estimate: no causal backward is published there)",
    "params.attention_bwd_peak_fraction": _FA3 + "; backward, 6 points (no causal mask)",
    "params.attention_bwd_half_keys": _FA3 + "; backward, 6 points (no causal mask)",
    "params.comm_compute_units": "estimate: NCCL runs large collectives on ~8-32 channels "
    "(one SM each); no calibration yet",
    "params.comm_kernel_overhead_s": "estimate: a few µs of launch plus the protocol's "
    "synchronization per collective step; " + _CALIBRATE,
    "params.host_call_s": "PyTorch's operator micro-benchmarks: ~2-3.3 µs of eager dispatch "
    "per op on CUDA tensors (benchmarks/overrides_benchmark; `split`, pytorch/pytorch#32194), "
    "plus a kernel launch: ~5 µs. Consistent with the floor of PyTorch's decomposed "
    "reduce-scatter, ~0.245 ms at every M of 32-512 on 8 GPUs for ~50 host calls "
    "(pytorch/pytorch#179770); host-dependent: " + _CALIBRATE.replace("measures it", "can "
    "measure plait's own executor"),
    "params.gemm_slowdown_sm_comm": "estimate: a GEMM beside a collective kernel loses cache and "
    "HBM bandwidth; " + _CALIBRATE + " (contention runs)",
    "params.gemm_slowdown_dma": "estimate: copy engines take HBM bandwidth only; "
    + _CALIBRATE + " (contention runs)",
    "params.sm_comm_slowdown_under_compute": "estimate: " + _CALIBRATE + " (contention runs)",
    "params.dma_slowdown_under_compute": "estimate: " + _CALIBRATE + " (contention runs)",
}
_TILES = "estimate: a typical GEMM output tile of the vendor library for bf16"
_LAUNCH = "estimate: kernel launch and dispatch, a few µs"
_NIC = "latency: estimate, a few µs through one switch"
_XLA_SM90 = ("fitted: OpenXLA's measured sm_90 matmul table (kDefaultMatmulPTable in "
             "xla/service/gpu/model/matmul_interpolator_data.h; data/published/"
             "xla_sm90_bf16_matmul.json): its 125 bf16 GEMMs, M, N, K 256..4096, are met best by "
             "6 µs per kernel and 85% of peak under the tile/wave model (RMS log error 9.5%; "
             "25% with the earlier estimates 4 µs and 75%), `python bench/gemm_check.py`")

_MAMF = ("Stas Bekman, ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul "
         "FLOPS comparison table' (mamf-finder.py, a brute-force search over shapes, BF16): ")

_CONCCL_SM = ("Agrawal et al., arXiv 2412.14335 (AMD, ConCCL): a GEMM beside an independent "
              "RCCL collective on MI300X realizes on average 21% of the ideal speedup; this "
              "slowdown, taken equal for the GEMM and the transfer (an assumption), gives 22% "
              "on plait's representative pairs (bench/papers.py, c3_realized)")
_CONCCL_DMA = ("Agrawal et al., arXiv 2412.14335 (AMD, ConCCL): beside DMA-engine collectives "
               "a GEMM realizes on average 72% of the ideal speedup; with the GEMM itself "
               "barely slowed (`gemm_slowdown_dma`, the FiCCO fact that large compute-bound "
               "shapes approach the ideal bound) this transfer slowdown gives 72% on plait's "
               "representative pairs (bench/papers.py, c3_realized)")

_MI300X = {
    "gpu.peak_flops.bf16": "AMD Instinct MI300X data sheet: 1307.4 TFLOPS dense BF16",
    "gpu.peak_flops.fp16": "AMD Instinct MI300X data sheet: 1307.4 TFLOPS dense FP16",
    "gpu.peak_flops.fp8": "AMD Instinct MI300X data sheet: 2614.9 TFLOPS dense FP8",
    "gpu.peak_flops.fp32": "AMD Instinct MI300X data sheet: 163.4 TFLOPS FP32 matrix",
    "gpu.hbm_bytes_per_s": "AMD Instinct MI300X data sheet: 5.3 TB/s HBM3",
    "gpu.compute_units": "AMD Instinct MI300X data sheet: 304 compute units",
    "gpu.memory_bytes": "AMD Instinct MI300X data sheet: 192 GB HBM3" + _VISIBLE,
    "gpu.tile_m": _TILES, "gpu.tile_n": _TILES,
    "gpu.launch_overhead_s": _LAUNCH + " (HIP)",
    "gpu.dma.engines": "estimate: SDMA engines usable for peer copies; calibrate",
    "gpu.dma.bytes_per_s": "estimate: one SDMA engine's peer-copy rate, below one xGMI link",
    "gpu.dma.command_overhead_s": "derived from public DMA-collective measurements (FiCCO "
    "brief): the fixed cost is ~20% of a 1 MB and ~3% of an 8 MB copy at ~50 GB/s -> ~5 µs",
    "topology.link_bytes_per_s": "AMD MI300X platform: 7 xGMI links per GPU, 128 GB/s "
    "bidirectional each -> 64 GB/s per direction",
    "topology.links_per_gpu": "AMD MI300X platform: 8 GPUs fully connected, 7 links each",
    "topology.latency_s": "estimate: one xGMI hop, ~2 µs with software",
    "gpus_per_node": "AMD MI300X platform: 8 GPUs per node",
    "nodes": "one node unless --nodes",
    "nic.bytes_per_s": "typical MI300X cluster: one 400 Gb/s NIC per GPU",
    "nic.latency_s": _NIC,
    "params.comm_compute_units": "estimate: RCCL runs collectives on more CUs than NCCL on "
    "SMs; no calibration yet",
    "params.gemm_slowdown_sm_comm": _CONCCL_SM,
    "params.sm_comm_slowdown_under_compute": _CONCCL_SM,
    "params.dma_slowdown_under_compute": _CONCCL_DMA,
}
_H100 = {
    "gpu.peak_flops.bf16": "NVIDIA H100 SXM5 data sheet: 989.4 TFLOPS dense BF16 (1979 sparse)",
    "gpu.peak_flops.fp16": "NVIDIA H100 SXM5 data sheet: 989.4 TFLOPS dense FP16",
    "gpu.peak_flops.fp8": "NVIDIA H100 SXM5 data sheet: 1978.9 TFLOPS dense FP8",
    "gpu.peak_flops.fp32": "NVIDIA H100 SXM5 data sheet: 66.9 TFLOPS FP32",
    "gpu.hbm_bytes_per_s": "NVIDIA H100 SXM5 data sheet: 3.35 TB/s HBM3",
    "gpu.compute_units": "NVIDIA H100 SXM5: 132 SMs",
    "gpu.memory_bytes": "NVIDIA H100 SXM5 data sheet: 80 GB HBM3; nvidia-smi memory.total "
    "81,559 MiB (e.g. NVIDIA/nccl and vLLM issue logs of H100 80GB HBM3)",
    "gpu.tile_m": _TILES, "gpu.tile_n": _TILES,
    "gpu.launch_overhead_s": _XLA_SM90,
    "gpu.dma.engines": "estimate: copy engines usable for NVLink peer copies",
    "gpu.dma.bytes_per_s": "public P2P cudaMemcpy figures over NVLink 4: ~370-400 GB/s with "
    "one engine",
    "gpu.dma.command_overhead_s": "estimate: one cudaMemcpyAsync, a few µs; calibrate",
    "topology.link_bytes_per_s": "NVIDIA NVLink 4 through NVSwitch: 18 links x 25 GB/s = "
    "450 GB/s per direction per GPU",
    "topology.links_per_gpu": "switched: one port per GPU",
    "topology.latency_s": "estimate: one NVSwitch hop with software, ~2 µs",
    "gpus_per_node": "NVIDIA DGX/HGX H100: 8 GPUs",
    "nodes": "one node unless --nodes",
    "nic.bytes_per_s": "NVIDIA DGX H100: 8x ConnectX-7 400 Gb/s, one per GPU",
    "nic.latency_s": _NIC,
    "params.nvls_allreduce_fraction": "NCCL maintainer, NVIDIA/nccl-tests issue #212 (2024): "
    "an all-reduce on 8 H100s with NVLink SHARP peaks at algbw ~275 GB/s (busbw ~480 GB/s); "
    "275 / 450 = 0.61",
    "params.gemm_peak_fraction": _XLA_SM90,
    "params.gemm_slowdown_sm_comm": "DHelix's successor measured a ~10% compute slowdown of "
    "kernels co-running with communication on H200 (shared/reference/techniques.md, DHelix "
    "section); 0.10",
    "params.sm_reduce_slowdown": "NVIDIA/nccl issue #1281 (2024-05): nccl-tests on H100, "
    "reduce-scatter busbw 360 GB/s, all-gather 350 GB/s: the reduction costs no bandwidth",
    "params.gemm_sustained_fraction": _MAMF + "H100 SXM 792.1 of 989 TFLOPS = 80.1% (CUDA "
    "12.1, best shape 6144x17920x2816); the H200's compute and 700 W limit are the H100's",
    "params.fp8_split_accumulator_slowdown": "pytorch/ao#2377: on H100, FP8 GEMMs with fast "
    "accumulation run 1.1-1.2x faster than without; TransformerEngine (pytorch/module/base.py: "
    "_2X_ACC_FPROP = False, _2X_ACC_DGRAD = _2X_ACC_WGRAD = True) and torchao's Float8 "
    "(use_fast_accum in the forward GEMM only) run both gradient GEMMs without it: 0.15, the "
    "midpoint",
}
_H100_500W = _H100 | {
    "gpu.hbm_bytes_per_s": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton "
    "hardware): 96 GB HBM2e, 2.4 TB/s peak",
    "gpu.memory_bytes": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e "
    "per H100 (its runs report up to 84.9 GiB); as CUDA reports it: 96 GiB x 81,559 / 81,920 "
    "(the share an H100 80 GB shows), an estimate",
    "params.clock_fraction": "pytorch/FBGEMM pull request #2546 (2024-04), GEMMs on an 'H100 "
    "500W': bf16 8192^3 585, 65536x8192x7168 575, 65536x3584x8192 546 TFLOPS; FP8 row-wise "
    "1126, 1083, 1141 TFLOPS: median 57.3% of the rated peak of either dtype, over 80.1% "
    "(the 700 W maximum achievable matmul rate, gemm_sustained_fraction): 0.715. Attention "
    "kernels taken to slow alike (estimate: no attention measurement at 500 W found)",
}
_H200 = _H100 | {
    "gpu.hbm_bytes_per_s": "NVIDIA H200 SXM data sheet: 4.8 TB/s HBM3e (141 GB); compute as "
    "H100 SXM",
    "gpu.memory_bytes": "NVIDIA H200 SXM data sheet: 141 GB HBM3e; nvidia-smi memory.total "
    "143,771 MiB, measured on the H200 lent to this project "
    "(shared/data/gpu/h200-2026-12-04/gpu_check.log)",
    "gpus_per_node": "NVIDIA HGX H200: 8 GPUs",
}
_A100 = {
    "gpu.peak_flops.bf16": "NVIDIA A100 data sheet: 312 TFLOPS dense BF16",
    "gpu.peak_flops.fp16": "NVIDIA A100 data sheet: 312 TFLOPS dense FP16",
    "gpu.peak_flops.fp32": "NVIDIA A100 data sheet: 19.5 TFLOPS FP32",
    "gpu.hbm_bytes_per_s": "NVIDIA A100 80GB SXM data sheet: 2.039 TB/s HBM2e",
    "gpu.compute_units": "NVIDIA A100: 108 SMs",
    "gpu.memory_bytes": "NVIDIA A100 80GB SXM data sheet: 80 GB HBM2e; nvidia-smi "
    "memory.total 81,920 MiB",
    "gpu.tile_m": _TILES, "gpu.tile_n": _TILES,
    "gpu.launch_overhead_s": _LAUNCH + " (CUDA)",
    "gpu.dma.engines": "estimate: copy engines usable for NVLink peer copies",
    "gpu.dma.bytes_per_s": "estimate: below the 300 GB/s NVLink 3 port",
    "gpu.dma.command_overhead_s": "estimate: one cudaMemcpyAsync, a few µs; calibrate",
    "topology.link_bytes_per_s": "NVIDIA NVLink 3 through NVSwitch: 12 links x 25 GB/s = "
    "300 GB/s per direction per GPU",
    "topology.links_per_gpu": "switched: one port per GPU",
    "topology.latency_s": "estimate: one NVSwitch hop with software, ~2 µs",
    "gpus_per_node": "NVIDIA DGX A100: 8 GPUs",
    "nodes": "one node unless --nodes",
    "nic.bytes_per_s": "NVIDIA DGX A100: 8x ConnectX-6 200 Gb/s",
    "nic.latency_s": _NIC,
    "params.gemm_sustained_fraction": _MAMF + "A100 SXM 267.9 of 312 TFLOPS = 85.9% (CUDA "
    "12.1, best shape 6912x16384x2048)",
}
_A800 = _A100 | {
    "topology.link_bytes_per_s": "A800: the export variant of A100, NVLink capped at 400 GB/s "
    "bidirectional -> 200 GB/s per direction",
}
_A40 = {
    "gpu.peak_flops.bf16": "NVIDIA A40 data sheet: 149.7 TFLOPS dense BF16 tensor",
    "gpu.peak_flops.fp16": "NVIDIA A40 data sheet: 149.7 TFLOPS dense FP16 tensor",
    "gpu.peak_flops.fp32": "NVIDIA A40 data sheet: 37.4 TFLOPS FP32",
    "gpu.hbm_bytes_per_s": "NVIDIA A40 data sheet: 696 GB/s GDDR6",
    "gpu.compute_units": "NVIDIA A40: 84 SMs",
    "gpu.memory_bytes": "NVIDIA A40 data sheet: 48 GB GDDR6",
    "gpu.tile_m": _TILES + " (smaller on a smaller GPU)", "gpu.tile_n": _TILES,
    "gpu.launch_overhead_s": _LAUNCH + " (CUDA)",
    "gpu.dma.engines": "estimate: copy engines for PCIe peer copies",
    "gpu.dma.bytes_per_s": "estimate: PCIe Gen4 x16 achievable rate",
    "gpu.dma.command_overhead_s": "estimate: one cudaMemcpyAsync over PCIe; calibrate",
    "topology.link_bytes_per_s": "PCIe Gen4 x16: 32 GB/s per direction; ~25 GB/s achievable "
    "through the host bridge (estimate)",
    "topology.links_per_gpu": "PCIe: one port per GPU",
    "topology.latency_s": "estimate: a PCIe transfer through the host bridge, ~5 µs",
    "topology.sockets": "estimate: a typical 8-GPU PCIe server has two CPUs, four GPUs on "
    "each (the DHelix paper does not describe its A40 servers' CPUs)",
    "topology.socket_link_bytes_per_s": "NCCL's figure for GPU traffic over the link between "
    "two Intel Skylake to Ice Lake CPUs, 10 GB/s (NVIDIA/nccl src/graph/topo.h, SKL_QPI_BW; "
    "its maintainers in NVIDIA/nccl#1163: the rate NCCL's own transfers reach, where the "
    "link's raw rate is 90 GB/s, and all-to-all over CPU links falls drastically under "
    "load): NCCL's ring then reaches 8 GB/s, as NCCL does on Flux's 8x L20 (7.9 GB/s)",
    "gpus_per_node": "a typical 8-GPU PCIe server",
    "nodes": "one node unless --nodes",
    "nic.bytes_per_s": "typical: 100 Gb/s Ethernet/IB per GPU",
    "nic.latency_s": _NIC,
    "params.comm_compute_units": "estimate: fewer NCCL channels on a PCIe system",
}
_FLUX_L20 = ("bytedance/flux docs/performance.md (8x L20, TP 8, fp16, M=4096, K=12288, "
             "N=49152): torch's cuBLAS GEMM 5.746 ms, NCCL all-gather 11.200 ms, "
             "reduce-scatter 12.273 ms")
_L20 = {k: v for k, v in _A40.items() if not k.startswith("topology.socket")} | {
    "gpu.peak_flops.bf16": "estimate: L20 (AD102) tensor rate, 119.5 TFLOPS dense FP16/BF16 as "
    "listed for the card; " + _FLUX_L20 + " -> 108 TFLOP/s measured",
    "gpu.peak_flops.fp16": "estimate: as bf16",
    "gpu.peak_flops.fp32": "L20 specifications (AD102, 11776 cores at 2.52 GHz): 59.35 TFLOPS",
    "gpu.hbm_bytes_per_s": "L20 specifications: 864 GB/s GDDR6 (384-bit)",
    "gpu.compute_units": "L20 specifications: 92 SMs",
    "gpu.memory_bytes": "L20 specifications: 48 GB GDDR6",
    "params.gemm_peak_fraction": "fitted: " + _FLUX_L20 + " (the 4096 x 6144 x 12288 GEMM at "
    "0.90 of peak)",
    "params.sm_link_fraction": "fitted: " + _FLUX_L20 + ": 88 MB received per GPU in 11.2 ms, "
    "7.9 GB/s of bus bandwidth, 0.31 of the port. NCCL over PCIe through the CPU: its "
    "maintainers bounce transfers through host memory (NVIDIA/nccl#1603: 'CPUs make very poor "
    "PCI switches'); 8-21 GB/s all-reduce bus bandwidth on 8x A100 PCIe (NVIDIA/nccl#841)",
    "params.comm_compute_units": "estimate: fewer NCCL channels on a PCIe system",
}
_MEASURED_HERE = "measured by hand on the 2-core CI host"
_LINKS_FIT = "fitted to `python bench/cpu_links.py` (2 ranks, gloo over loopback)"
_CPU = {
    "gpu.peak_flops.fp32": _MEASURED_HERE + ": one-thread fp32 matmul ~75 GFLOP/s",
    "gpu.peak_flops.bf16": "estimate: CPU bf16 matmul is emulated, ~4x slower than fp32",
    "gpu.peak_flops.fp16": "estimate: CPU fp16 matmul is emulated, ~8x slower than fp32",
    "gpu.hbm_bytes_per_s": _MEASURED_HERE + ": memcpy ~6.5 GB/s of traffic",
    "gpu.compute_units": "one core per rank",
    "gpu.memory_bytes": "0: a CPU rank has no device memory of its own",
    "gpu.tile_m": "estimate: a CPU matmul's blocking", "gpu.tile_n": "estimate: as tile_m",
    "gpu.launch_overhead_s": "estimate: PyTorch eager dispatch of one op, ~10 µs",
    "gpu.dma.engines": "plait's CPU copy engine: one copier thread per rank",
    "gpu.dma.bytes_per_s": _LINKS_FIT + ": shared-memory copier 0.9-1.7 GB/s",
    "gpu.dma.command_overhead_s": _LINKS_FIT + ": copier ~0.7-1 ms per command (flag poll, "
    "wake-up)",
    "topology.link_bytes_per_s": _LINKS_FIT + ": the host's memory/TCP path shared by the "
    "ranks",
    "topology.links_per_gpu": "one host path",
    "topology.latency_s": _LINKS_FIT + ": ~0.1 ms per hop",
    "gpus_per_node": "ranks sharing one host",
    "nodes": "one host",
    "nic.bytes_per_s": "estimate: no second host in CI",
    "nic.latency_s": "estimate: no second host in CI",
    "params.comm_compute_units": "gloo runs on its own threads, no compute units held",
    "params.comm_kernel_overhead_s": _LINKS_FIT + ": gloo all-gather ~1-2 ms per call",
    "params.sm_link_fraction": _LINKS_FIT + ": gloo 0.8-1.0 GB/s of the 2 GB/s path",
    "params.dma_link_fraction": "estimate: the copier streams near the path's rate",
    "params.gemm_slowdown_sm_comm": "estimate: gloo's threads share the two cores with the "
    "GEMMs; `plait profile` measures 0-30%",
    "params.gemm_slowdown_dma": "estimate: the copier thread shares the cores",
    "params.host_call_s": "0: a CPU rank runs each op in the thread that issues it, so the "
    "dispatch is in the op's own time (gpu.launch_overhead_s)",
}
_B200 = {
    "gpu.peak_flops.bf16": "NVIDIA DGX B200 data sheet: 72 PFLOPS FP8 training for 8 GPUs "
    "(sparse) -> 4.5 PFLOPS dense FP8 and 2.25 PFLOPS dense BF16 per GPU",
    "gpu.peak_flops.fp16": "as bf16 (NVIDIA Blackwell data sheet: FP16 = BF16 tensor rate)",
    "gpu.peak_flops.fp8": "NVIDIA DGX B200 data sheet: 72 PFLOPS FP8 (sparse) / 8 GPUs / 2",
    "gpu.peak_flops.fp32": "NVIDIA HGX B200 data sheet: 600 TFLOPS TF32 sparse for 8; FP32 "
    "~75 TFLOPS (estimate: not on the data sheet)",
    "gpu.hbm_bytes_per_s": "NVIDIA DGX B200 data sheet: 64 TB/s HBM3e for 8 GPUs -> 8 TB/s",
    "gpu.memory_bytes": "NVIDIA DGX B200 data sheet: 1,440 GB for 8 GPUs -> 180 GB; "
    "nvidia-smi memory.total 183,359 MiB (a public B200 run log)",
    "gpu.compute_units": "NVIDIA Blackwell architecture technical brief: 148 SMs on B200 "
    "(estimate: two dies of 74 enabled SMs)",
    "gpu.tile_m": _TILES, "gpu.tile_n": _TILES,
    "gpu.launch_overhead_s": _LAUNCH + " (CUDA), as H100",
    "gpu.dma.engines": "estimate: copy engines usable for NVLink peer copies, as H100",
    "gpu.dma.bytes_per_s": "estimate: one copy engine near the 900 GB/s NVLink 5 port, "
    "scaled from H100's 400 of 450 GB/s",
    "gpu.dma.command_overhead_s": "estimate: one cudaMemcpyAsync, a few µs; calibrate",
    "topology.link_bytes_per_s": "NVIDIA NVLink 5: 1.8 TB/s bidirectional per GPU (18 links "
    "x 100 GB/s) -> 900 GB/s per direction",
    "topology.links_per_gpu": "switched: one port per GPU",
    "topology.latency_s": "estimate: one NVSwitch hop with software, ~2 µs",
    "gpus_per_node": "NVIDIA DGX B200: 8 GPUs",
    "nodes": "one node unless --nodes (`plait plan --gpus` sets it)",
    "nic.bytes_per_s": "NVIDIA DGX B200: 8x ConnectX-7 400 Gb/s, one per GPU",
    "nic.latency_s": _NIC,
    "params.gemm_peak_fraction": "H100's fitted fraction (OpenXLA sm_90 table), checked "
    "against OpenXLA's sm_100 table (data/published/xla_sm100_matmul.json: 125 GEMMs, M, N, K "
    "256..4096, bf16 and FP8): median plait / measured time 0.97 for both, every M within "
    "0.92-1.01; row pieces' losses within 1.05-1.21x of measured, `python bench/gemm_check.py "
    "-H b200 [--dtype fp8]`",
    "params.gemm_sustained_fraction": "the best rate of OpenXLA's sm_100 table (data/"
    "published/xla_sm100_matmul.json, its largest GEMMs: 4 x 4096^3 bf16 at 1,670 TFLOP/s = "
    "74.2% of 2,250; FP8 3,280 of 4,500 = 72.9%), as Bekman's mamf-finder reads a maximum "
    "achievable matmul rate (on sm_90 the table's best, 783 TFLOP/s bf16, is within 1.2% of "
    "mamf's 792); the table does not say whether its sm_100 part is a B200 or a GB200: both "
    "presets take the fraction of their own peak",
}
_GB200 = _B200 | {
    "gpu.peak_flops.bf16": "NVIDIA GB200 NVL72 data sheet: 180 PFLOPS dense FP16/BF16 "
    "(360 sparse) for 72 GPUs -> 2.5 PFLOPS per GPU",
    "gpu.peak_flops.fp16": "as bf16 (NVIDIA GB200 NVL72 data sheet)",
    "gpu.peak_flops.fp8": "NVIDIA GB200 NVL72 data sheet: 720 PFLOPS FP8 sparse for 72 GPUs "
    "-> 5 PFLOPS dense per GPU",
    "gpu.peak_flops.fp32": "NVIDIA GB200 NVL72 data sheet: 5,760 TFLOPS FP32 for 72 GPUs -> 80",
    "gpu.hbm_bytes_per_s": "NVIDIA GB200 NVL72 data sheet: 576 TB/s HBM3e for 72 GPUs -> 8 TB/s",
    "gpu.memory_bytes": "NVIDIA GB200 NVL72 data sheet: 13.4 TB HBM3e for 72 GPUs -> 186 GB"
    + _VISIBLE,
    "topology.link_bytes_per_s": "NVIDIA GB200 NVL72 data sheet: 130 TB/s NVLink for 72 GPUs "
    "-> 1.8 TB/s bidirectional per GPU, 900 GB/s per direction",
    "topology.latency_s": "estimate: a hop through the NVLink switch trays of the rack, ~3 µs",
    "gpus_per_node": "NVIDIA GB200 NVL72: 72 GPUs in one NVLink domain (18 compute trays x 4 "
    "GPUs, 9 NVLink switch trays)",
    "nic.bytes_per_s": "NVIDIA GB200 NVL72 reference: one ConnectX-7 400 Gb/s NIC per GPU "
    "for the scale-out network",
}
_MI355X = _MI300X | {
    "gpu.peak_flops.bf16": "AMD Instinct MI355X data sheet: 2.5 PFLOPS dense BF16 (2516.6 "
    "TFLOPS)",
    "gpu.peak_flops.fp16": "AMD Instinct MI355X data sheet: 2.5 PFLOPS dense FP16",
    "gpu.peak_flops.fp8": "AMD Instinct MI355X data sheet: 5.0 PFLOPS dense FP8",
    "gpu.peak_flops.fp32": "AMD Instinct MI355X data sheet: 157.3 TFLOPS FP32",
    "gpu.hbm_bytes_per_s": "AMD Instinct MI355X data sheet: 8 TB/s HBM3E",
    "gpu.memory_bytes": "AMD Instinct MI355X data sheet: 288 GB HBM3E" + _VISIBLE,
    "gpu.compute_units": "AMD Instinct MI355X data sheet: 256 compute units",
    "gpu.dma.bytes_per_s": "estimate: one SDMA engine's peer-copy rate, below one Infinity "
    "Fabric link",
    "topology.link_bytes_per_s": "AMD Instinct MI355X platform: 7 Infinity Fabric links per "
    "GPU, 1,075 GB/s bidirectional in all -> 76.8 GB/s per link per direction",
    "topology.links_per_gpu": "AMD Instinct MI355X platform: 8 GPUs fully connected, 7 links each",
    "gpus_per_node": "AMD Instinct MI355X platform: 8 GPUs per node",
    "nic.bytes_per_s": "typical MI355X cluster: one 400 Gb/s NIC per GPU (AMD Pollara 400)",
    "params.comm_compute_units": "estimate: as MI300X (RCCL), no calibration yet",
    "params.gemm_slowdown_sm_comm": "estimate: MI300X's (ConCCL), same CDNA family",
    "params.sm_comm_slowdown_under_compute": "estimate: MI300X's (ConCCL), same CDNA family",
    "params.dma_slowdown_under_compute": "estimate: MI300X's (ConCCL), same CDNA family",
}
_H20 = _H100 | {
    "gpu.peak_flops.bf16": "NVIDIA H20 product brief: 148 TFLOPS dense BF16",
    "gpu.peak_flops.fp16": "NVIDIA H20 product brief: 148 TFLOPS dense FP16",
    "gpu.peak_flops.fp8": "NVIDIA H20 product brief: 296 TFLOPS dense FP8",
    "gpu.peak_flops.fp32": "NVIDIA H20 product brief: 44 TFLOPS FP32",
    "gpu.hbm_bytes_per_s": "NVIDIA H20 product brief: 4.0 TB/s HBM3",
    "gpu.memory_bytes": "NVIDIA H20 product brief: 96 GB HBM3" + _VISIBLE,
    "gpu.compute_units": "estimate: 78 SMs as reported for H20 (not on the product brief)",
    "gpus_per_node": "NVIDIA HGX H20: 8 GPUs, NVLink 900 GB/s bidirectional as H100",
    "params.gemm_sustained_fraction": "1: at a sixth of H100's rate the power limit is not "
    "what caps the GEMMs (estimate)",
}
_BY_PRESET = {"mi300x": _MI300X, "h100": _H100, "h100-500w": _H100_500W, "h200": _H200,
              "a100": _A100, "a800": _A800, "a40": _A40, "l20": _L20, "cpu": _CPU,
              "b200": _B200, "gb200-nvl72": _GB200, "mi355x": _MI355X, "h20": _H20}


def sources(name: str) -> dict[str, str]:
    """Each numeric field of preset `name` -> its source (the preset's, else the default's)."""
    return PARAMS | _BY_PRESET[name]


def numbers(doc: Any, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a `ClusterSpec.model_dump()`, by dotted path (measured GEMM
    grids are data, not parameters: left out)."""
    out: dict[str, float] = {}
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= numbers(value, path + ".")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[path] = float(value)
    return out
