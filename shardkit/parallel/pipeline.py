"""Pipeline parallelism: the layer stack split into stages over the ``stage`` mesh axis.

Layout: the stacked layer parameters (leading ``layers`` dimension, ``L``) are sharded over
``stage``, so stage ``s`` holds layers ``[s L/p, (s+1) L/p)`` and their optimizer state; the
other parameters (embedding, head) are replicated over ``stage``. Every other mesh axis shards
as the rules say, inside the stages too.

Execution: one ``jax.shard_map`` island, manual over ``stage`` only (data, fsdp and tensor stay
automatic inside, so XLA still emits their collectives), runs a :class:`~shardkit.parallel.
schedule.Schedule` tick by tick. In a tick each stage runs its forward slot and/or backward slot
on the microbatch the table names; an idle slot is computed and discarded, which costs nothing
in lock step (the tick lasts as long as the busiest stage). After the forward slots activations
move one stage down, after the backward slots their gradients one stage up (``ppermute``).

The backward slot recomputes the stage's forward from the stashed stage input (``jax.vjp``), so
a stage keeps only the inputs of its microbatches in flight (``Schedule.stash`` of them) plus
one microbatch's intermediate activations; gradients accumulate in float32 as they come.

Reducing once (``row_axes``): GSPMD reduces each backward slot's gradients over the devices that
split the rows, ``m`` times a step. With ``row_axes`` the backward slot is vmapped over those
devices' blocks of rows (``spmd_axis_name=row_axes``, as ``shardkit.training.accumulation`` does for a
plain step), so its gradients come out per device, ``(n, *param)``, and are summed unreduced; the
caller reduces them once, after the schedule.

Interleaved stages (``Schedule.virtual_stages = v``): a device runs ``v`` chunks of layers, the
ring wraps round (the last device feeds the first device's next chunk), and the layer stack,
stored in layer order, is regrouped by device on the way in (its gradients on the way out).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.core.errors import PipelineError
from shardkit.core.partition import axes_taken, varying_over
from shardkit.parallel.schedule import Phase, Schedule

# (layer_params, shared_params, x_in, microbatch, virtual stage, index) -> (x_out, loss, count)
StageLoss = Callable[[Any, Any, jax.Array, Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def pipeline_value_and_grad(
    stage_loss: StageLoss,
    layer_params: Any,
    shared_params: Any,
    micro: Any,
    boundary: jax.ShapeDtypeStruct,
    schedule: Schedule,
    mesh: Mesh,
    axis: str = "stage",
    row_axes: tuple[str, ...] = (),
    micro_rows: Any = None,
    total_count: jax.Array | None = None,
    count_dtype: Any = jnp.int32,
) -> tuple[jax.Array, jax.Array, Any, Any]:
    """Mean loss over microbatches and its gradients, computed by a pipeline over ``axis``.

    Args:
      stage_loss: what one (virtual) stage computes for one microbatch:
        ``(layer_params, shared_params, x_in, microbatch, stage, index) -> (x_out, loss, count)``.
        ``stage`` is the virtual stage ``j`` in ``[0, v p)`` (the device's stage when ``v = 1``);
        ``layer_params`` are its layers ``[j L/(v p), (j+1) L/(v p))``; ``x_in`` is the previous
        stage's ``x_out`` (garbage on stage 0, which starts from the microbatch itself);
        ``loss`` is this stage's share of the microbatch loss (the head's loss on the last
        stage, auxiliary losses anywhere); ``count`` is read on the last stage only.
      layer_params: tree of arrays with a leading layer dimension ``L``, sharded over ``axis``
        (with ``v > 1`` chunks are regrouped by device each step: an all-to-all over ``axis``).
      shared_params: tree of arrays every stage needs (replicated over ``axis``).
      micro: tree of arrays with a leading microbatch dimension ``m``.
      boundary: shape and dtype of ``x_out`` (the activation passed between stages).
      schedule: the table to run (``schedule.stages`` must equal the size of ``axis``).
      mesh: the device mesh.
      axis: the mesh axis of the stages.
      row_axes: reduce once: the mesh axes that split the rows of ``micro`` and of the boundary
        activation (``n`` devices). Each backward slot then runs per device block of rows, and
        the gradients come back unreduced, with a leading ``n`` dimension split over
        ``row_axes``: their sum over it is the gradient. The loss must be a mean over rows.
      micro_rows: with ``row_axes``, a tree like ``micro`` of bools: whether a leaf has rows
        (after the microbatch dimension) or is the same for every row (a key, say). Default:
        every leaf has rows.
      total_count: the sum of the ``m`` microbatches' counts, known before the schedule runs:
        each microbatch's (or device block's) mean loss is then weighted by its count over
        this total (a token-weighted mean where microbatches score different numbers of
        tokens), instead of ``1 / m`` each.
      count_dtype: the dtype the counts are summed in (float32 for fractional loss weights).

    Returns:
      ``(mean loss, total count, gradients of layer_params, gradients of shared_params)``,
      gradients in float32, of the mean loss over the ``m`` microbatches (with ``row_axes``:
      ``(n, ...)`` per-device parts to sum).

    Example:
      >>> import jax, jax.numpy as jnp, shardkit as sk
      >>> from shardkit.parallel.schedule import make_schedule
      >>> def stage_loss(w, _, x, mb, stage, i):  # each stage multiplies by its weight
      ...     x = jnp.where(stage == 0, mb, x) * w[0]
      ...     return x, jnp.where(stage == 1, x.sum(), 0.0), jnp.int32(1)
      >>> mesh = sk.Layout.parse("stage=2").make_mesh(jax.devices()[:2])
      >>> loss, count, gw, _ = pipeline_value_and_grad(
      ...     stage_loss, jnp.array([2.0, 3.0]), {}, jnp.ones((4, 1)),
      ...     jax.ShapeDtypeStruct((1,), jnp.float32), make_schedule("1f1b", 2, 4), mesh)
      >>> float(loss), gw.tolist()
      (6.0, [3.0, 2.0])
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    if dict(mesh.shape).get(axis) != p:
        raise PipelineError(f"schedule for {p} stages on a mesh whose {axis!r} axis has {dict(mesh.shape).get(axis)}")
    slots = schedule.stash
    n = math.prod(mesh.shape[a] for a in row_axes)
    if micro_rows is None:
        micro_rows = jax.tree.map(lambda _: True, micro)
    block_axes = jax.tree.map(lambda rows: 0 if rows else None, micro_rows)

    def pin_rows(x: jax.Array) -> jax.Array:
        """``x`` with its leading dimension split over ``row_axes`` (the rest left to XLA)."""
        spec = PartitionSpec(row_axes, *(PartitionSpec.UNCONSTRAINED,) * (x.ndim - 1))
        return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), spec))

    def blocks(x: jax.Array) -> jax.Array:  # (rows, ...) -> (n, rows/n, ...): each device's own
        return pin_rows(x.reshape(n, x.shape[0] // n, *x.shape[1:]))

    def island(layers: Any, shared: Any, micro: Any, total: Any) -> tuple[jax.Array, jax.Array, Any, Any]:
        device = jax.lax.axis_index(axis)
        layers = jax.tree.map(lambda a: a[:, 0], layers)  # (v, L/(v p), ...): this device's chunks
        # Differentiate with respect to a per-stage copy of the shared parameters: a cotangent
        # of a stage-invariant input would be summed over stages at every tick, mixing
        # microbatches (and bubbles) of different stages; we sum once, at the end.
        shared = jax.tree.map(lambda a: jax.lax.pcast(a, (axis,), to="varying"), shared)
        # Interleaved stages go round the ring: the last device feeds the first one's next chunk.
        down = [(s, (s + 1) % p) for s in range(p if v > 1 else p - 1)]
        up = [((s + 1) % p, s) for s in range(p if v > 1 else p - 1)]

        def take(tree: Any, i: jax.Array) -> Any:
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)

        def keep_if(valid: jax.Array, new: Any, old: Any) -> Any:
            return jax.tree.map(lambda n, o: jnp.where(valid, n, o), new, old)

        def decode(q: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, Any]:
            """Slot entry -> (valid, microbatch, virtual stage, stash slot, the chunk's layers)."""
            valid, q = q >= 0, jnp.maximum(q, 0)
            i, chunk = q % m, q // m
            return valid, i, chunk * p + device, chunk * slots + i % slots, take(layers, chunk)

        def forward_slot(carry: dict[str, Any], q: jax.Array) -> dict[str, Any]:
            valid, i, stage, slot, chunk_layers = decode(q)
            x_in = carry["x_recv"]
            x_out, _, _ = stage_loss(chunk_layers, shared, x_in, take(micro, i), stage, i)
            old = jax.lax.dynamic_index_in_dim(carry["stash"], slot, keepdims=False)
            stash = jax.lax.dynamic_update_index_in_dim(carry["stash"], jnp.where(valid, x_in, old), slot, 0)
            return carry | {"stash": stash, "x_recv": jax.lax.ppermute(x_out, axis, down)}

        def backward_slot(carry: dict[str, Any], q: jax.Array) -> dict[str, Any]:
            valid, i, stage, slot, chunk_layers = decode(q)
            x_in = jax.lax.dynamic_index_in_dim(carry["stash"], slot, keepdims=False)
            mb = take(micro, i)

            def grads(lp: Any, sp: Any, x: jax.Array, dx_out: jax.Array, mb: Any) -> tuple[Any, ...]:
                def run(lp: Any, sp: Any, x: jax.Array) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
                    x_out, loss, count = stage_loss(lp, sp, x, mb, stage, i)
                    return (x_out, loss), count

                (_, loss), vjp, count = jax.vjp(run, lp, sp, x, has_aux=True)
                # The microbatch's mean loss is the mean of its n blocks' mean losses, or with a
                # total count the blocks' means weighted by what each scored.
                weight = 1.0 / (m * n) if total is None else count.astype(jnp.float32) / total
                seed = jnp.asarray(weight, loss.dtype)
                seed = varying_over(seed, (axis,))  # a count read from the stage's rows already varies
                if total is not None:
                    loss = loss.astype(jnp.float32) * weight
                return (*vjp((dx_out, seed)), loss, count)

            if row_axes:
                per_block = jax.vmap(grads, in_axes=(None, None, 0, 0, block_axes), spmd_axis_name=row_axes)
                blocked = jax.tree.map(lambda a, rows: blocks(a) if rows else a, mb, micro_rows)
                with axes_taken(row_axes):
                    g_layers, g_shared, dx, loss, count = per_block(
                        chunk_layers, shared, blocks(x_in), blocks(carry["dx_recv"]), blocked
                    )
                dx, loss, count = dx.reshape(boundary.shape), loss.mean() if total is None else loss.sum(), count.sum()
            else:
                g_layers, g_shared, dx, loss, count = grads(chunk_layers, shared, x_in, carry["dx_recv"], mb)
                g_layers, g_shared = jax.tree.map(lambda g: g[None], (g_layers, g_shared))

            def add(acc: Any, g: Any) -> Any:
                return keep_if(valid, jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g), acc)

            def add_chunk(acc: jax.Array, g: jax.Array) -> jax.Array:  # acc (n, v, ...), g (n, ...)
                now = jax.lax.dynamic_index_in_dim(acc, stage // p, axis=1, keepdims=False)
                new = jax.lax.dynamic_update_index_in_dim(acc, now + g.astype(jnp.float32), stage // p, 1)
                return jnp.where(valid, new, acc)

            last = valid & (stage == v * p - 1)
            g_layers = jax.tree.map(add_chunk, carry["g_layers"], g_layers)
            g_shared = add(carry["g_shared"], g_shared)
            if row_axes:
                g_layers, g_shared = jax.tree.map(pin_rows, (g_layers, g_shared))
            return carry | {
                "g_layers": g_layers,
                "g_shared": g_shared,
                "loss": carry["loss"] + jnp.where(valid, loss.astype(jnp.float32), 0.0),
                "count": carry["count"] + jnp.where(last, count, 0).astype(count_dtype),
                "dx_recv": jax.lax.ppermute(dx, axis, up),
            }

        def run_phase(carry: dict[str, Any], phase: Phase) -> dict[str, Any]:
            def tick(carry: dict[str, Any], row: tuple[jax.Array, jax.Array]) -> tuple[dict[str, Any], None]:
                fwd, bwd = row
                if "F" in phase.kind:
                    carry = forward_slot(carry, fwd[device])
                if "B" in phase.kind:
                    carry = backward_slot(carry, bwd[device])
                return carry, None

            rows = (jnp.asarray(phase.forward, jnp.int32), jnp.asarray(phase.backward, jnp.int32))
            return jax.lax.scan(tick, carry, rows)[0]

        # Gradient sums carry a leading dimension of one per device block of rows (1 without row_axes).
        zeros_f32 = lambda tree: jax.tree.map(lambda a: jnp.zeros((n, *a.shape), jnp.float32), tree)
        carry = {
            "x_recv": jnp.zeros(boundary.shape, boundary.dtype),
            "dx_recv": jnp.zeros(boundary.shape, boundary.dtype),
            "stash": jnp.zeros((v * slots, *boundary.shape), boundary.dtype),
            "g_layers": zeros_f32(layers),
            "g_shared": zeros_f32(shared),
            "loss": jnp.zeros((), jnp.float32),
            "count": jnp.zeros((), count_dtype),
        }
        # Every stage's carry differs from the others' (scan needs that said up front).
        carry = jax.tree.map(lambda a: jax.lax.pcast(a, (axis,), to="varying"), carry)
        for phase in schedule.phases:
            carry = run_phase(carry, phase)
        loss = jax.lax.psum(carry["loss"], axis) / (m if total is None else 1)  # weighted: already the mean
        count = jax.lax.psum(carry["count"], axis)
        g_layers = jax.tree.map(lambda g: g[:, :, None], carry["g_layers"])  # (n, v, 1, L/(v p), ...)
        return loss, count, g_layers, jax.lax.psum(carry["g_shared"], axis)

    # (L, ...) -> (v, p, L/(v p), ...): chunk c of device s is virtual stage c p + s, layers in order.
    def by_device(a: jax.Array) -> jax.Array:
        return a.reshape(v, p, a.shape[0] // (v * p), *a.shape[1:])

    chunked = jax.tree.map(by_device, layer_params)
    stage_spec = jax.tree.map(lambda _: PartitionSpec(None, axis), chunked)
    everywhere = lambda tree: jax.tree.map(lambda _: PartitionSpec(), tree)
    run = jax.shard_map(
        island,
        mesh=mesh,
        in_specs=(stage_spec, everywhere(shared_params), everywhere(micro), PartitionSpec()),
        out_specs=(
            PartitionSpec(),
            PartitionSpec(),
            jax.tree.map(lambda _: PartitionSpec(None, None, axis), chunked),
            everywhere(shared_params),
        ),
        axis_names={axis},
        # A vmap with spmd_axis_name inside a shard_map marks its axes as varying manual axes,
        # which row_axes (automatic here) are not: their typing is not checked then.
        check_vma=not row_axes,
    )
    loss, count, g_layers, g_shared = run(chunked, shared_params, micro, total_count)
    g_layers = jax.tree.map(lambda g, a: g.reshape(n, *a.shape), g_layers, layer_params)
    if not row_axes:  # GSPMD reduced each slot's gradients: one part
        g_layers, g_shared = jax.tree.map(lambda g: g[0], (g_layers, g_shared))
    return loss, count, g_layers, g_shared
