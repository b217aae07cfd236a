"""Step time and memory of a layout: predicted from a dry run's facts, or estimated before compiling.

Two ways to price a layout on a hardware profile:

- :func:`predict` reads a *compiled* dry run (its matmul FLOPs and the bytes each mesh axis
  moved) and turns them into seconds at the device's peak and the links' bandwidths;
- :func:`analytic` needs no compiler at all: it counts the model's FLOPs (6N per token plus
  attention), the bytes each axis must move (ring collectives: ZeRO, Megatron, ring attention,
  pipeline sends, expert all-to-alls) and the memory a device holds (model state, gradients and
  Korthikanti et al.'s activation count per layer). The planner uses it to rank and prune
  hundreds of layouts in milliseconds and compiles only the few that survive.

The analytic figures are estimates, good to a small factor (XLA on CPU keeps more temporaries
than the formulas; some layouts move more than the bound), which is all ranking needs: every
plan the planner recommends is compiled and priced by :func:`predict`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from shardkit.analysis.hardware import Hardware
from shardkit.core.mesh import Layout
from shardkit.core.precision import Precision, as_precision
from shardkit.parallel.expert_tensor import dispatch_bytes, experts_under_tensor

# Extra compute of a rematerialised backward pass (the forward runs again: 4/3 of 6N).
REMAT_COMPUTE = {"none": 1.0, "full": 4 / 3, "dots": 1.1, "dots_no_batch": 1.15}
# The compiled step holds about this multiple of the activations Korthikanti et al. count: the
# ratio of compiled temporary memory to the formula, measured on this toolchain from 1.5 (a
# 4-layer byte model, fp32) to 2.1 (Llama-2 70B, bf16, remat full, 512 devices).
ACTIVATION_OVERHEAD = 1.75


def optimizer_bytes_per_param(optimizer: optax.GradientTransformation, dtype: Any = jnp.float32) -> float:
    """Bytes of optimizer state per parameter, read from the optimizer itself: its state for a
    256 x 256 ``dtype`` weight matrix (the shape most of a model's parameters have, so factored
    optimizers such as Adafactor count as they run), scalars such as step counts left out.

    Example:
      >>> optimizer_bytes_per_param(optax.adamw(1e-3)), optimizer_bytes_per_param(optax.sgd(0.1))
      (8.0, 0.0)
      >>> optimizer_bytes_per_param(optax.sgd(0.1, momentum=0.9))
      4.0
    """
    side = 256
    n = side * side
    state = jax.eval_shape(optimizer.init, {"w": jax.ShapeDtypeStruct((side, side), dtype)})
    leaves = [x for x in jax.tree.leaves(state) if hasattr(x, "shape") and math.prod(x.shape) > 1]
    return float(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)) / n


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """What the analytic estimate needs of a model (a transformer language model's sizes).

    ``dim``, ``heads`` and ``vocab`` may be 0 when unknown (a model that does not say): the
    terms that need them (activations, tensor-parallel traffic, logits) then drop out.
    """

    params: int
    layers: int
    dim: int = 0
    heads: int = 0
    kv_dim: int = 0  # dimension of the keys (and of the values): heads x head size, grouped
    vocab: int = 0
    matmul_params: int = 0  # parameters in matmuls (6 FLOPs per token each); 0: all of them
    expert_params: int = 0  # parameters inside the experts (split by the expert axis)
    experts: int = 0
    top_k: int = 0
    # Expert slots a token's dispatch holds with a capacity: top_k x the capacity factor (1.25 x
    # top_k when 0).
    routed: float = 0.0
    # Routing that drops no token: "sorted" (each device sends each expert device room for its
    # tokens' most there, min(top_k, E / n) a token: n x that slots under an expert axis of n),
    # "einsum" (every expert padded to the whole group: E slots); "" with a capacity.
    dropless: str = ""
    expert_dim: int = 0  # each expert's hidden units (its buffers' width)
    moe_layers: int = 0  # layers with a mixture (0: all of them, where there are experts)

    def slots_per_token(self, expert_axis: int = 1) -> float:
        """Expert slots a token's dispatch holds (and sends), under an expert axis of that size."""
        if self.dropless == "sorted":
            return expert_axis * min(self.top_k, max(1, self.experts // expert_axis))
        if self.dropless == "einsum":
            return float(self.experts)
        return self.routed or max(self.top_k, 1) * 1.25

    @property
    def mixture_layers(self) -> int:
        return (self.moe_layers or self.layers) if self.experts else 0


@dataclasses.dataclass(frozen=True)
class Estimate:
    """An analytic estimate of one training step per device (bytes and seconds)."""

    memory_bytes: float  # the three below and the gradients
    state_bytes: float  # parameters, optimizer moments, master copy
    activation_bytes: float
    compute_seconds: float
    comm_seconds: float
    bytes_by_axes: dict[str, float]

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds


def axis_links(layout_shape: dict[str, int], hw: Hardware) -> dict[str, str]:
    """``"intra"`` or ``"inter"`` for each mesh axis: does stepping along it leave the node?

    Devices are numbered node by node and the mesh is laid out in canonical axis order, so an
    axis stays inside a node when its stride times its size fits in (and divides) a node.

    Example:
      >>> from shardkit.analysis.hardware import PROFILES
      >>> axis_links({"data": 4, "tensor": 8}, PROFILES["h100"])
      {'tensor': 'intra', 'data': 'inter'}
    """
    links, stride = {}, 1
    for axis in reversed(list(layout_shape)):
        size = layout_shape[axis]
        span = stride * size
        inside = span <= hw.devices_per_node and hw.devices_per_node % span == 0
        links[axis] = "intra" if inside or size == 1 else "inter"
        stride = span
    return links


def comm_seconds(bytes_by_axes: dict[str, float], layout_shape: dict[str, int], hw: Hardware) -> float:
    """Seconds to move ``bytes_by_axes`` (keys: an axis or ``"a+b"``), each at its slowest link."""
    links = axis_links(layout_shape, hw)
    total = 0.0
    for axes, moved in bytes_by_axes.items():
        if axes == "-" or not moved:
            continue
        inter = any(links.get(a, "intra") == "inter" for a in axes.split("+"))
        total += moved / (hw.inter_node_bandwidth if inter else hw.intra_node_bandwidth)
    return total


def predict(result: dict[str, Any], hw: Hardware, compute_dtype: str) -> dict[str, float]:
    """Predicted seconds of one step from a dry run's report dict on hardware ``hw``.

    Args:
      result: :meth:`shardkit.analysis.report.Report.to_dict` output (a dry run).
      hw: the hardware profile.
      compute_dtype: dtype of the matmuls (``bfloat16`` or ``float32``).

    Returns:
      ``compute_seconds``, ``comm_seconds``, ``step_seconds`` (no overlap), ``step_seconds_overlap``,
      ``mfu`` (model FLOPs over the whole machine's peak in the no-overlap step time).

    Example:
      >>> from shardkit.analysis.hardware import PROFILES
      >>> facts = {"layout": "data=8", "devices": 8, "flops_per_device": 989e12, "bytes_by_axes": {}}
      >>> predict(facts, PROFILES["h100"], "bfloat16")["step_seconds"]
      1.0
    """
    shape = dict(Layout.parse(result["layout"]).sizes)
    peak = hw.peak_flops(compute_dtype)
    compute = result["flops_per_device"] / peak
    comm = comm_seconds(result["bytes_by_axes"], shape, hw)
    step = compute + comm
    model_flops = result.get("model_flops_per_step") or result["flops_per_device"] * result["devices"]
    return {
        "compute_seconds": compute,
        "comm_seconds": comm,
        "step_seconds": step,
        "step_seconds_overlap": max(compute, comm),
        "mfu": model_flops / (result["devices"] * peak * step),
    }


def _ring(kind: str, size: float, n: int) -> float:
    """Bytes one device sends in a ring collective over ``n`` devices of an array of ``size`` bytes."""
    if n <= 1:
        return 0.0
    return (2 if kind == "all-reduce" else 1) * (n - 1) / n * size


def _tokens_per_microbatch(shape: dict[str, int], batch: int, seq: int, microbatches: int) -> float:
    """Tokens one device sees per microbatch (rows split over data, fsdp and expert; the sequence
    over sequence)."""
    rows_split = shape.get("data", 1) * shape.get("fsdp", 1) * shape.get("expert", 1)
    return batch * seq / (rows_split * shape.get("sequence", 1) * microbatches)


def _activation_bytes(
    sizes: ModelSizes,
    shape: dict[str, int],
    batch: int,
    seq: int,
    c: int,
    remat: str,
    mb: int,
    schedule: str | None,
) -> float:
    """Activations a device keeps for the backward pass (Korthikanti et al. 2022, tensor
    parallelism without sequence parallelism), with the pipeline's microbatches in flight."""
    if not sizes.dim:
        return 0.0
    t, sq, p = shape.get("tensor", 1), shape.get("sequence", 1), shape.get("stage", 1)
    tokens_mb = _tokens_per_microbatch(shape, batch, seq, mb)
    heads = sizes.heads or max(1, sizes.dim // 128)
    full = tokens_mb * sizes.dim * (10 + 24 / t + 5 * heads * (seq / sq) / (sizes.dim * t)) * c / 2
    if sizes.experts:
        # A mixture's slots, each a row in, its expert's hidden units (gate, up, product) and a
        # row out, the mean over the layers (dense ones hold none); dropless they dominate.
        slots = tokens_mb * sizes.slots_per_token(shape.get("expert", 1))
        width = 2 * sizes.dim + 3 * (sizes.expert_dim or sizes.dim) / t
        full += slots * width * c * sizes.mixture_layers / sizes.layers
    kept = {"none": full, "full": tokens_mb * sizes.dim * c}.get(remat, full / 2)
    in_flight = 1 if p == 1 else (mb if schedule == "gpipe" else min(p, mb))
    activations = in_flight * sizes.layers / p * kept + (full if remat != "none" else 0.0)
    activations += tokens_mb * sizes.vocab / t * (c + 8)  # logits, their fp32 softmax and gradient
    return activations * ACTIVATION_OVERHEAD


def _gathered_layer_bytes(sizes: ModelSizes, shape: dict[str, int], c: int) -> float:
    """The largest layer's weights gathered over ``fsdp`` for its matmuls (ZeRO-3, at the compute
    dtype) and their fp32 gradient before its reduce-scatter: a transient the per-layer
    activations do not count, and the largest one a mixture of experts has (DeepSeek-V3's expert
    layer holds 11.3B parameters, 1.4B a device under tensor=4,expert=2: 8.5 GB)."""
    f, t, e = (shape.get(axis, 1) for axis in ("fsdp", "tensor", "expert"))
    if f == 1 or not sizes.layers:
        return 0.0
    lookups = 2 * sizes.vocab * sizes.dim  # the embedding and the head are not a layer's
    dense = max(0, sizes.params - sizes.expert_params - lookups) / sizes.layers
    experts = sizes.expert_params / sizes.mixture_layers if sizes.mixture_layers else 0.0
    return (dense / t + experts / (t * e)) * (c + 4)


def _flops_per_device(sizes: ModelSizes, shape: dict[str, int], batch: int, seq: int, remat: str, mb: int) -> float:
    """Model FLOPs split over every device, with recomputation and the pipeline's idle slots."""
    matmul = float(sizes.matmul_params or sizes.params)
    if sizes.experts and sizes.top_k:  # each expert computes its slots, used or padded
        slots = sizes.slots_per_token(shape.get("expert", 1))
        matmul -= sizes.expert_params * (1 - min(1.0, slots / sizes.experts))
    flops = batch * seq * (6 * matmul + 12 * sizes.layers * sizes.dim * seq) / math.prod(shape.values())
    return flops * REMAT_COMPUTE.get(remat, 1.2) * (1 + (shape.get("stage", 1) - 1) / mb)


def _moved_bytes(
    sizes: ModelSizes,
    shape: dict[str, int],
    batch: int,
    seq: int,
    held: float,
    c: int,
    comm_itemsize: int | None,
    mb: int,
    stored_itemsize: int,
    zero: int,
) -> dict[str, float]:
    """Bytes each mesh axis moves per device in one step (axes that move nothing left out)."""
    d, f, t = shape.get("data", 1), shape.get("fsdp", 1), shape.get("tensor", 1)
    sq, p, e = shape.get("sequence", 1), shape.get("stage", 1), shape.get("expert", 1)
    param_bytes = held * f * (comm_itemsize or c)  # the gradients of this device's tensor/stage/expert share
    tokens_mb = _tokens_per_microbatch(shape, batch, seq, mb)
    tokens, layers_here = tokens_mb * mb, sizes.layers / p
    # Of the gradients a device reduces, the experts' (reduced over data alone under expert).
    experts_held = sizes.expert_params / (f * t * p * e)
    expert_share = experts_held / held if e > 1 and held else 1.0
    # FSDP moves the stored parameters (bf16 under bf16-master, not the fp32 master copy) three
    # times a microbatch: gathered forward, gathered backward (which a rematerialised forward
    # shares), gradients reduce-scattered; so the compiled GPT's scanned stack does (llama2-70b,
    # fsdp=256,tensor=2: 3 x 68.2 GB, each op once per layer).
    gathered = held * f * stored_itemsize
    moved = {
        "fsdp": 3 * _ring("all-gather", gathered, f) * mb,
        # The stored parameters' gradients all-reduced; under ZeRO the compiled step reduces the
        # fp32 update's share and moves more besides (not modelled: llama2-70b data=64,fsdp=8
        # ZeRO-2 moves 3x this), so comm_itemsize there.
        "data": _ring("all-reduce", (param_bytes if zero else gathered) / f * expert_share, d) * mb,
        # Every other parameter's gradient is reduced over expert too, which splits the rows.
        "data+expert": _ring("all-reduce", (param_bytes if zero else gathered) / f * (1 - expert_share), d * e) * mb
        if e > 1
        else 0.0,
        "tensor": 4 * layers_here * _ring("all-reduce", tokens * sizes.dim * c, t),
        # Ring attention: K and V go round the ring forward; K, V and their gradients backward.
        "sequence": 6 * layers_here * (sq - 1) * tokens * (sizes.kv_dim or sizes.dim) / t * c if sq > 1 else 0.0,
        # Lock-step stages send a microbatch's activation (and its gradient back) every slot.
        "stage": 2 * (mb + p - 1) * tokens_mb * sizes.dim * c if p > 1 else 0.0,
        # Dispatch and combine, forward and backward, of every expert slot of the tokens.
        "expert": sizes.mixture_layers * dispatch_bytes(tokens * sizes.slots_per_token(e) * sizes.dim * c, e)
        if sizes.experts
        else 0.0,
    }
    if sizes.experts and e > 1 and t > 1:
        # Each mixture takes the cheaper use of tensor for its experts (the report's bound does too).
        dispatch = moved["expert"] / sizes.mixture_layers
        activation = tokens * sizes.dim * c
        group_weights = sizes.expert_params / sizes.mixture_layers * stored_itemsize / e * mb
        call = experts_under_tensor(dispatch, activation, group_weights, t)
        moved["expert"] = sizes.mixture_layers * call["expert"]
        moved["tensor"] += sizes.mixture_layers * (call["tensor"] - 2 * _ring("all-reduce", activation, t))
    return {axis: b for axis, b in moved.items() if b}


def analytic(
    sizes: ModelSizes,
    shape: dict[str, int],
    hw: Hardware,
    *,
    batch: int,
    seq: int,
    precision: str | Precision,
    compute_itemsize: int,
    comm_itemsize: int | None = None,
    remat: str = "none",
    microbatches: int = 1,
    schedule: str | None = None,
    optimizer_bytes: float | None = None,
    zero: int = 0,
    activation_itemsize: int | None = None,
) -> Estimate:
    """Estimate one step of ``sizes`` under mesh axis sizes ``shape``, without compiling.

    Args:
      sizes: the model's sizes.
      shape: mesh axis sizes (``data``, ``fsdp``, ``tensor``, ``sequence``, ``stage``, ``expert``).
      hw: the hardware profile.
      batch, seq: global batch rows and sequence length.
      precision: ``fp32``, ``bf16`` or ``bf16-master`` (its bytes of parameters, master copy and
        gradients per parameter).
      compute_itemsize: bytes per element of activations.
      comm_itemsize: bytes per element of gathered parameters and reduced gradients (default
        ``compute_itemsize``; 4 where an fp32 master copy is what is gathered and reduced).
      remat: per-layer rematerialisation policy.
      microbatches: gradient-accumulation (or pipeline) microbatches.
      schedule: the pipeline schedule when ``stage > 1`` (``1f1b`` or ``gpipe``).
      optimizer_bytes: the optimizer's state per parameter (:func:`optimizer_bytes_per_param`;
        default: AdamW's, read from ``optax.adamw`` in the precision's update dtype).
      zero: ZeRO stage over ``data`` (1: optimizer state and master weights split over it, with
        an all-gather of the parameters after the update; 2: gradients reduce-scattered too).
      activation_itemsize: bytes per element of the activations held (default
        ``compute_itemsize``; 4 for bf16 compute compiled by XLA:CPU, which has no bf16
        arithmetic and holds them converted).

    Returns:
      An :class:`Estimate`. Data-parallel and FSDP traffic is counted once per microbatch, as the
      compiled step moves it today.

    Example:
      >>> from shardkit.analysis.hardware import PROFILES
      >>> sizes = ModelSizes(params=7e9, layers=32, dim=4096, heads=32, kv_dim=4096, vocab=32000)
      >>> e = analytic(sizes, {"fsdp": 8}, PROFILES["h100"], batch=8, seq=4096,
      ...              precision="bf16-master", compute_itemsize=2)
      >>> round(e.state_bytes / 1e9, 2)   # 14 bytes per parameter over 8 devices
      12.25
    """
    f, t, p, e = (shape.get(axis, 1) for axis in ("fsdp", "tensor", "stage", "expert"))
    dense = sizes.params - sizes.expert_params
    held = dense / (f * t * p) + sizes.expert_params / (f * t * p * e)  # parameters a device holds
    policy = as_precision(precision)
    if optimizer_bytes is None:
        optimizer_bytes = optimizer_bytes_per_param(optax.adamw(1e-3), policy.update_dtype)
    d = shape.get("data", 1)
    stored = held * jnp.dtype(policy.params).itemsize
    # What the optimizer updates (its moments, the master weights): split over data under ZeRO.
    updated = held * (policy.state_bytes_per_param(optimizer_bytes) - jnp.dtype(policy.params).itemsize)
    state = stored + updated / (d if zero else 1)
    grads = held * policy.grad_bytes_per_param / (d if zero >= 2 else 1)
    held_itemsize = activation_itemsize or compute_itemsize
    activations = _activation_bytes(sizes, shape, batch, seq, held_itemsize, remat, microbatches, schedule)
    activations += _gathered_layer_bytes(sizes, shape, held_itemsize)
    flops = _flops_per_device(sizes, shape, batch, seq, remat, microbatches)
    compute = flops / hw.peak_flops("bfloat16" if compute_itemsize == 2 else "float32")
    stored_itemsize = jnp.dtype(policy.params).itemsize
    moved = _moved_bytes(
        sizes, shape, batch, seq, held, compute_itemsize, comm_itemsize, microbatches, stored_itemsize, zero
    )
    if zero == 1 and d > 1:  # the gradients' all-reduce, then the updated parameters' all-gather
        moved["data"] = moved.get("data", 0.0) * 1.5
    return Estimate(
        memory_bytes=state + grads + activations,
        state_bytes=state,
        activation_bytes=activations,
        compute_seconds=compute,
        comm_seconds=comm_seconds(moved, shape, hw),
        bytes_by_axes=moved,
    )
