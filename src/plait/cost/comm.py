"""Communication time per pattern and engine.

Rank 0 of a group stands for every rank (SPMD symmetry: what rank 0 sends over a link, it also
receives over it, full duplex). A peer is named by its offset 1..P-1 in the group; `route` maps it
to the resource its bytes cross:

- full mesh: a dedicated link per peer ("link<i>"), so one peer at a time uses 1/(P-1) of the
  GPU's links, and exchanging with all peers at once uses all of them;
- switched fabric / PCIe: the GPU's single port ("port"), which one stream can already fill;
- PCIe across CPU sockets: the link between the CPUs ("socket"). In a direct exchange every
  GPU of a socket crosses at once (SPMD), so each gets its share of the link; a ring crosses
  it once a direction, so its one crossing hop has the link to itself (`ring_route`). Direct
  all-to-all peer traffic through the CPUs thus pays (P/2)^2 / (P-1) times a ring's crossing
  (2.3x on 8 GPUs): NCCL's maintainers find all-to-all over P2P across CPUs collapsing where a
  ring does not (NVIDIA/nccl#1603);
- a peer on another node: the NIC ("nic").

Two engines move bytes. Collective (SM/CU) kernels reach `sm_link_fraction` of a link, pay
`comm_kernel_overhead_s` per kernel and occupy `comm_compute_units`; they can add (reduce-scatter
in the kernel). Copy (DMA) engines reach `dma_link_fraction`, cost `command_overhead_s` per copy
command, run at most `DmaSpec.bytes_per_s` each, take no compute units, and cannot add.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.cost.resources import Cost
from plait.spec.hardware import ClusterSpec
from plait.workload.operators import Collective, CollectiveKind


@dataclass(frozen=True, slots=True)
class Route:
    resource: str
    bytes_per_s: float
    latency_s: float


def route(cluster: ClusterSpec, peer: int, stride: int = 1) -> Route:
    """The resource between rank 0 of a group and the peer at `peer` group offsets away
    (memoized per cluster)."""
    table = _routes(cluster, stride)
    r = table.get(peer)
    if r is None:
        topo = cluster.topology
        if peer * stride >= cluster.gpus_per_node:
            r = Route("nic", cluster.nic.bytes_per_s, cluster.nic.latency_s)
        elif peer * stride >= cluster.gpus_per_socket:
            r = _socket_route(cluster, cluster.gpus_per_socket)
        else:
            name = f"link{peer}" if topo.kind == "mesh" else "port"
            r = Route(name, topo.link_bytes_per_s, topo.latency_s)
        table[peer] = r
    return r


def _socket_route(cluster: ClusterSpec, sharers: int) -> Route:
    """Through the link between the CPUs, shared by `sharers` GPUs crossing at once, or the
    GPU's port where that share is faster."""
    topo = cluster.topology
    share = (topo.socket_link_bytes_per_s or 0.0) / sharers
    if share >= topo.link_bytes_per_s:
        return Route("port", topo.link_bytes_per_s, topo.latency_s)
    return Route("socket", share, topo.latency_s)


def ring_route(cluster: ClusterSpec, peer: int, group: int, stride: int = 1) -> Route:
    """The route the bytes for `peer` take in a ring over `group` ranks: they pass hop by hop,
    and where the ring spans the node's CPU sockets every block crosses its one crossing hop,
    which has the link between the CPUs to itself; a peer on another node is the NIC's."""
    r = route(cluster, peer, stride)
    if (r.resource == "nic" or cluster.topology.sockets == 1
            or group * stride <= cluster.gpus_per_socket):
        return r
    return _socket_route(cluster, 1)


def _routes(cluster: ClusterSpec, stride: int) -> dict[int, Route]:
    """The routes worked out so far, by peer (`route`), one table per cluster and stride."""
    return cluster.cached(("routes", stride), dict)


def _hbm_use(cluster: ClusterSpec, nbytes: float, duration: float) -> float:
    # Bytes leave (read) and arrive (write) through this GPU's memory: 2 x bytes.
    bw = cluster.gpu.hbm_bytes_per_s * cluster.params.hbm_fraction
    return min(1.0, 2.0 * nbytes / duration / bw) if duration > 0 else 0.0


def sm_exchange(cluster: ClusterSpec, peers: list[int], bytes_per_peer: float,
                stride: int = 1, steps: int | None = None, reduce: bool = False,
                ring: int | None = None) -> Cost:
    """One collective kernel that exchanges `bytes_per_peer` with each of `peers` at once.

    Latency: one hop on a mesh (direct links), a ring of len(peers) hops through a switch;
    `steps` overrides the hop count. `reduce`: the kernel adds what it receives
    (reduce-scatter), which costs `sm_reduce_slowdown` more. `ring`: the group of the ring the
    kernel runs (its routes: `ring_route`); 0 for a direct exchange with each peer; by
    default a ring over the peers through a switch or PCIe, direct on a mesh."""
    if steps is None:
        steps = 1 if cluster.topology.kind == "mesh" else len(peers)
    if ring is None:
        ring = 0 if cluster.topology.kind == "mesh" or len(peers) < 2 else max(peers) + 1
    p = cluster.params
    eff = p.sm_link_fraction
    per_resource: dict[str, float] = {}
    latency = 0.0
    for peer in peers:
        r = ring_route(cluster, peer, ring, stride) if ring else route(cluster, peer, stride)
        per_resource[r.resource] = per_resource.get(r.resource, 0.0) + (
            bytes_per_peer / (r.bytes_per_s * eff))
        if r.latency_s > latency:
            latency = r.latency_s
    data = max(per_resource.values(), default=0.0)
    duration = p.comm_kernel_overhead_s + steps * latency + data
    if reduce:
        duration *= 1.0 + p.sm_reduce_slowdown
    uses = {res: t / duration for res, t in per_resource.items()}
    uses["hbm"] = _hbm_use(cluster, bytes_per_peer * len(peers), duration)
    cus = min(1.0, p.comm_compute_units / cluster.gpu.compute_units)
    return Cost(duration, uses, {"compute": cus} if cus > 0 else {})


def dma_copy(cluster: ClusterSpec, peer: int, nbytes: float, stride: int = 1) -> Cost:
    """One copy-engine command moving `nbytes` to or from one peer."""
    p, dma = cluster.params, cluster.gpu.dma
    r = route(cluster, peer, stride)
    eff = p.dma_link_fraction
    rate = min(dma.bytes_per_s, r.bytes_per_s * eff)
    data = nbytes / rate
    duration = dma.command_overhead_s + r.latency_s + data
    uses = {r.resource: (data / duration) * rate / (r.bytes_per_s * eff),
            "hbm": _hbm_use(cluster, nbytes, duration)}
    return Cost(duration, uses)


def collective_cost(c: Collective, cluster: ClusterSpec) -> Cost:
    """A whole collective on the library's kernels: its time and the resources it holds."""
    if c.group <= 1 or c.bytes <= 0:
        return Cost(0.0)
    peers = list(range(1, c.group))
    if c.kind is CollectiveKind.P2P:  # group - 1 ring steps, each its own kernel
        step = ring_step_cost(c, cluster)
        return Cost(step.duration * (c.group - 1), step.uses, step.reserves)
    reduces = c.kind in (CollectiveKind.RS, CollectiveKind.AR)
    # NCCL runs all-gather, reduce-scatter and all-reduce as rings, all-to-all directly
    direct = c.kind is CollectiveKind.A2A
    cost = sm_exchange(cluster, peers, c.bytes / c.group, c.stride, reduce=reduces,
                       ring=0 if direct else None)
    if c.kind is CollectiveKind.AR:  # reduce-scatter, then all-gather
        ag = sm_exchange(cluster, peers, c.bytes / c.group, c.stride)
        ring = Cost(cost.duration + ag.duration, cost.uses, cost.reserves)
        switch = _switch_all_reduce(c, cluster)
        return ring if switch is None or ring.duration <= switch.duration else switch
    return cost


def _switch_all_reduce(c: Collective, cluster: ClusterSpec) -> Cost | None:
    """An all-reduce the switch reduces (NVLink SHARP): each GPU sends its tensor to the
    switch once and reads the sum back, at `nvls_allreduce_fraction` of the port; None where
    the switch does not reduce or the group leaves the node. The library takes it where it
    beats the ring (NCCL's NVLS from about 4 GPUs on)."""
    p, topo = cluster.params, cluster.topology
    r = route(cluster, c.group - 1, c.stride)
    if p.nvls_allreduce_fraction <= 0 or topo.kind != "switched" or r.resource != "port":
        return None
    data = c.bytes / (p.nvls_allreduce_fraction * r.bytes_per_s)
    duration = p.comm_kernel_overhead_s + 2 * r.latency_s + data
    cus = min(1.0, p.comm_compute_units / cluster.gpu.compute_units)
    return Cost(duration, {"port": data / duration, "hbm": _hbm_use(cluster, c.bytes, duration)},
                {"compute": cus} if cus > 0 else {})


def ring_hop(cluster: ClusterSpec, group: int, stride: int = 1) -> int:
    """The peer offset whose route a P2P ring over `group` ranks `stride` apart waits for.

    Every rank passes its block to the next at once and a step ends with the slowest hop: once
    the ring spans more than one node, some hop (the one into the next node, and the wrap
    back) crosses the NIC, however close the next rank of most hops is."""
    if group * stride > cluster.gpus_per_node:
        return -(-cluster.gpus_per_node // stride)  # an offset into the next node
    return 1


def ring_step_cost(c: Collective, cluster: ClusterSpec, nbytes: float | None = None) -> Cost:
    """One step of the P2P ring `c`: each rank passes `nbytes` (default its share of `c.bytes`,
    one block of `c.group - 1`) to the next rank."""
    return sm_exchange(cluster, [ring_hop(cluster, c.group, c.stride)],
                       c.bytes / (c.group - 1) if nbytes is None else nbytes, c.stride, steps=1,
                       ring=c.group)


def collective_time(c: Collective, cluster: ClusterSpec) -> float:
    """Standalone time of a whole collective on the library's (SM) kernels: the plain baseline.

    AG, RS and A2A move (P-1)/P of the tensor per rank; on a mesh the library spreads that over
    all links, on a switch through the port (ring of P-1 steps). An all-reduce is an RS then an
    AG. A P2P ring (context parallel) passes one block to one neighbour per step.
    """
    return collective_cost(c, cluster).duration


def elementwise_time(nbytes: float, cluster: ClusterSpec) -> float:
    """A memory-bound kernel moving `nbytes` through HBM."""
    bw = cluster.gpu.hbm_bytes_per_s * cluster.params.hbm_fraction
    return cluster.gpu.launch_overhead_s + nbytes / bw
