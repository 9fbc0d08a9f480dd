"""The time of one collective on a link: the α–β model, per link type.

``time = α₀ + steps × α_link + wire_bytes / β_link`` for one call, where

- ``steps`` is the algorithm's number of sequential message steps (Thakur, Rabenseifner
  and Gropp 2005, "Optimization of Collective Communication Operations in MPICH"; NCCL's
  ``ncclTopoTuneModel`` counts the same): a ring all-reduce ``2(n-1)`` (reduce-scatter then
  all-gather), a ring all-gather or reduce-scatter ``n-1``, an all-to-all by pairwise
  exchange ``n-1``, a point-to-point send ``1``;
- ``wire_bytes`` is what one rank sends: ``2(n-1)/n`` of the buffer for an all-reduce,
  ``(n-1)/n`` for all-gather, reduce-scatter and all-to-all, the whole message for a send;
- ``α₀`` (once per call) and ``α_link`` (per step) are the device's, or, for an NVIDIA GPU
  (``Device`` latencies left ``None``), NCCL's own model of itself: ``src/graph/tuning.cc``
  (NVIDIA/nccl, 2.19), ring algorithm, Simple protocol (the one that reaches the bandwidth
  the β term assumes): ``baseLat`` 8.4 µs, ``hwLat`` NVLink 3.4 µs, network 14.0 µs per
  step; a group spanning ``k`` nodes pays the network's α on the steps that cross nodes
  (``k-1`` per ring pass, NCCL's ``nInterSteps``) and NVLink's on the rest;
- ``β`` is the link's bandwidth one rank sends at (:func:`bandwidth`).

Sources and what is left out (NCCL's LL protocol for tiny messages, trees, contention):
docs/search.md, "Communication".

For the dimensions other helpers add, :func:`all_to_all_time` (expert parallelism's token
dispatch and combine), :func:`ring_attention_time` and :func:`cp_all_gather_time`
(context parallelism) are the seam: each a function of bytes, group size and link alone.
Which link a mesh dimension's groups use (inside a node or across nodes, from the ranks'
layout): :func:`groups`.
"""

from __future__ import annotations

from ...plan.devices import Device

__all__ = ["NCCL_BASE_LATENCY", "NCCL_STEP_LATENCY", "steps", "wire", "latency", "bandwidth",
           "collective_time", "all_to_all_time", "ring_attention_time", "cp_all_gather_time",
           "MESH_ORDER", "groups", "links", "mesh_sizes"]

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first; tp innermost

NCCL_BASE_LATENCY = 8.4e-6  # s per call: tuning.cc baseLat, Ring/Simple
NCCL_STEP_LATENCY = {"intra": 3.4e-6, "inter": 14.0e-6}  # s per step: hwLat NVLINK/NET, Ring/Simple

PASSES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}


def steps(kind: str, n: int) -> int:
    """Sequential message steps of one ``kind`` collective over ``n`` ranks."""
    if kind in ("send", "recv"):
        return 1
    if kind not in PASSES:
        raise ValueError(f"unknown collective '{kind}'; expected one of: "
                         f"{', '.join([*PASSES, 'send'])}")
    return PASSES[kind] * (n - 1) if n > 1 else 0


def wire(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends for a collective of an ``nbytes`` buffer over ``n`` ranks."""
    if kind in ("send", "recv"):
        return nbytes if kind == "send" else 0.0
    return PASSES[kind] * nbytes * (n - 1) / n if n > 1 else 0.0


def _alpha(device: Device) -> tuple[float, float, float]:
    base = NCCL_BASE_LATENCY if device.collective_latency is None else device.collective_latency
    intra = NCCL_STEP_LATENCY["intra"] if device.intra_node_latency is None \
        else device.intra_node_latency
    inter = NCCL_STEP_LATENCY["inter"] if device.inter_node_latency is None \
        else device.inter_node_latency
    return base, intra, inter


def latency(kind: str, n: int, link: str, device: Device, nodes: int | None = None) -> float:
    """The α part of one call: ``α₀ + steps × α``. ``link`` ``intra`` or ``inter``;
    ``nodes``: how many nodes an inter-node group spans (``None``: one rank per node, every
    step crosses the network)."""
    s = steps(kind, n)
    if s == 0:
        return 0.0
    base, intra, inter = _alpha(device)
    if link == "intra":
        return base + s * intra
    crossing = s if nodes is None else min(s, (1 if kind in ("send", "recv") else
                                              PASSES[kind]) * max(nodes - 1, 1))
    if kind == "all_to_all" and nodes is not None:  # peers off the node: all but its own
        crossing = min(s, n - n // max(nodes, 1))
    return base + crossing * inter + (s - crossing) * intra


def bandwidth(device: Device, link: str, intra_efficiency: float = 1.0,
              inter_efficiency: float = 1.0) -> float:
    """Bytes/s one rank sends at over ``link``: NVLink's quoted figure counts both
    directions, a ring sends in one; the NIC's is one direction already."""
    if link == "intra":
        if not device.intra_node_bandwidth:
            raise ValueError(f"device {device.name} has no intra-node bandwidth")
        return device.intra_node_bandwidth / 2 * intra_efficiency
    if not device.inter_node_bandwidth:
        raise ValueError(f"device {device.name} has no inter-node bandwidth: a mesh dimension "
                         "spans nodes (raise --gpus-per-node or give the device one)")
    return device.inter_node_bandwidth * inter_efficiency


def _efficiencies(constants) -> tuple[float, float]:
    if constants is None:
        return 1.0, 1.0
    return constants.intra_node_efficiency, constants.inter_node_efficiency


def collective_time(kind: str, nbytes: float, n: int, link: str, device: Device,
                    constants=None, nodes: int | None = None) -> float:
    """Seconds of one ``kind`` call on an ``nbytes`` buffer (a send: the message) over ``n``
    ranks on ``link``: ``latency + wire / bandwidth``; ``constants`` (a
    :class:`tpplan.analysis.cost.step_time.CostConstants`) give the links' efficiencies."""
    bw = bandwidth(device, link, *_efficiencies(constants))
    return latency(kind, n, link, device, nodes) + wire(kind, nbytes, n) / bw


def all_to_all_time(nbytes: float, ranks: int, link: str, device: Device, constants=None,
                    nodes: int | None = None) -> float:
    """One all-to-all of expert parallelism (a token dispatch or combine): each of ``ranks``
    ranks holds ``nbytes`` and sends ``(ranks-1)/ranks`` of it, one message per peer by
    pairwise exchange (``ranks-1`` steps). Exposed in full unless the caller overlaps it:
    a MoE layer's experts wait for the dispatch and the next layer for the combine
    (``CostConstants.ep_overlap``, 0 by default)."""
    return collective_time("all_to_all", nbytes, ranks, link, device, constants, nodes)


def ring_attention_time(kv_bytes: float, ranks: int, link: str, attention_seconds: float,
                        device: Device, constants=None, nodes: int | None = None) -> float:
    """The exposed seconds of ring attention (context parallelism) in one pass: the ``ranks``
    ranks each hold ``kv_bytes`` of keys and values, rotated ``ranks-1`` times around the
    ring (one send each, to the next rank); each rotation overlaps the attention of the
    block already held, ``attention_seconds / ranks`` (Liu et al. 2023, "Ring Attention
    with Blockwise Transformers", section 3; torch's ``_templated_ring_attention`` sends the
    next block asynchronously while computing). So only a rotation slower than a block's
    compute shows: ``(ranks-1) × max(0, t_send - attention_seconds/ranks)``. Call it once
    for forward and once for backward (backward rotates keys, values and their gradients:
    twice the bytes, twice the compute)."""
    if ranks <= 1:
        return 0.0
    send = collective_time("send", kv_bytes, ranks, link, device, constants, nodes)
    return (ranks - 1) * max(0.0, send - attention_seconds / ranks)


def cp_all_gather_time(kv_bytes: float, ranks: int, link: str, device: Device,
                       constants=None, nodes: int | None = None) -> float:
    """Seconds of all-gather context parallelism's exchange in one pass: each rank's
    ``kv_bytes`` of keys and values all-gathered over ``ranks`` before attention runs (the
    Llama 3 paper's CP, section 3.3.2), on the critical path (attention needs every block);
    backward reduce-scatters the gradients, the same cost."""
    return collective_time("all_gather", kv_bytes * ranks, ranks, link, device, constants, nodes)


def groups(sizes: dict[str, int], gpus_per_node: int) -> dict[str, tuple[str, int]]:
    """``(link, nodes)`` for each mesh dimension of more than one rank: ranks are laid out
    ``pp × dp_replicate × dp_shard × cp × tp`` (tp innermost, consecutive ranks on one
    node), so a dimension's group spans ``stride × size`` consecutive ranks, ``stride`` the
    product of the inner dimensions; it stays in a node (``intra``) when that span is at most
    ``gpus_per_node``, else it spans ``nodes`` nodes (``inter``). ``dp`` is dp_replicate and
    dp_shard flattened; ``ep`` (tp's ranks first with ``ep_tp``), ``efsdp``, ``dp_shard_cp`` as the mesh has them."""
    out, stride = {}, 1

    def add(name: str, n: int) -> None:
        if n > 1:
            inside = stride * n <= gpus_per_node
            per_node = max(1, gpus_per_node // stride)
            out[name] = ("intra", 1) if inside else ("inter", -(-n // per_node))

    for dim in reversed(MESH_ORDER):
        n = sizes.get(dim, 1)
        add(dim, n)
        if dim == "dp_shard":
            add("dp", n * sizes.get("dp_replicate", 1))
        stride *= n
    ep, cp, etp = sizes.get("ep", 1), sizes.get("cp", 1), sizes.get("ep_tp", 1)
    stride = 1 if etp > 1 else sizes.get("tp", 1) * cp
    if ep > 1:
        add("ep", ep)
        stride *= ep
        add("efsdp", sizes.get("dp_shard", 1) * cp * etp // ep)
    if cp > 1:
        stride = sizes.get("tp", 1)
        add("dp_shard_cp", sizes.get("dp_shard", 1) * cp)
    return out


def links(sizes: dict[str, int], gpus_per_node: int) -> dict[str, str]:
    """``intra`` or ``inter`` for each mesh dimension of more than one rank (:func:`groups`)."""
    return {k: v[0] for k, v in groups(sizes, gpus_per_node).items()}


def mesh_sizes(dims) -> dict[str, int]:
    """The mesh's degrees by name; ``cp`` and ``ep`` where the mesh has them."""
    cp, ep, etp = getattr(dims, "cp", 1), getattr(dims, "ep", 1), getattr(dims, "ep_tp", 1)
    return dict(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, cp=cp, ep=ep, tp=dims.tp,
                efsdp=dims.dp_shard * cp * etp // ep, dp_shard_cp=dims.dp_shard * cp, ep_tp=etp)
