"""Expert parallelism on every style of mixture of experts: bytes moved against the bound (the
experts' dispatch and combine, gradients over the axes that split the rows), with shardkit's
placement of the experts' matmuls off ("before": XLA's partitioner alone) and on ("after"),
the share of the excess the report names, and memory per device against ``data=8``.

The models: shardkit's ``tiny-moe`` GPT (``gpt``: its default sorted dispatch, tokens sorted by
expert and grouped matmuls with capacity 1.25; ``gpt_einsum``: GShard's einsum dispatch, the same
tokens dropped; ``gpt_dropless``: sorted with room for every pair), and the zoo's ``user_moe``
(GShard einsums), ``linen_moe`` (every expert runs every token),
``sorted_moe`` (every pair of the batch sorted by expert, ``jax.lax.ragged_dot``: run as
routed pairs where the traced program proves it), ``shared_expert_moe`` (sigmoid scores, a
one-hot einsum, a shared expert), ``looped_moe`` (a Python loop over ``w[e]``: re-rolled
into one stacked mixture), ``rolled_moe`` (the loop as ``jax.lax.fori_loop``) and
``linen_scanned_moe`` (Linen, a ``jax.lax.scan`` over the experts): both re-rolled likewise;
``linen_sorted_moe`` (Linen, ``sorted_moe``'s global sort).
4 experts, 8 under ``expert=8``. Each row is one compiled train step on 8 simulated CPU devices.

    python benchmarks/experts.py                         # every style, the four expert layouts and data=8
    python benchmarks/experts.py --model user_moe --layout data=2,expert=4
"""

import argparse
import dataclasses
import pathlib
import sys
import warnings

from _results import write_json

import shardkit as sk

sk.simulate_devices(8)
sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from byo_models import LinenLM
from zoo import (
    LINEN_MOE_CONFIG,
    LINEN_SCANNED_MOE_CONFIG,
    LINEN_SORTED_MOE_CONFIG,
    ZOO,
    LlamaStyleLM,
    LoopedExperts,
    RolledLoopExperts,
    SharedAndRoutedExperts,
    SortedExperts,
    Top2Experts,
)

LAYOUTS = ("data=2,expert=4", "expert=8", "tensor=2,expert=4", "data=2,fsdp=2,expert=2", "data=8")
MODELS = (
    "gpt", "gpt_einsum", "gpt_dropless", "user_moe", "linen_moe", "sorted_moe", "shared_expert_moe", "looped_moe",
    "rolled_moe", "linen_scanned_moe", "linen_sorted_moe",
)  # fmt: skip


def model(name: str, experts: int) -> tuple[sk.Model, object, dict]:
    """``(model, loss, abstract batch)`` of style ``name`` with ``experts`` experts."""
    if name.startswith("gpt"):
        dispatch = {"gpt": {}, "gpt_einsum": {"moe_dispatch": "einsum"}, "gpt_dropless": {"moe_dropless": True}}[name]
        cfg = sk.models.GPTConfig.preset("tiny-moe", n_experts=experts, **dispatch)
        return cfg.model(), sk.next_token_loss, {"tokens": jax.ShapeDtypeStruct((16, 129), jnp.int32)}
    batch = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in ZOO[name].batch(0).items()}
    if name.startswith("linen"):
        config = {"linen_moe": LINEN_MOE_CONFIG, "linen_scanned_moe": LINEN_SCANNED_MOE_CONFIG}.get(
            name, LINEN_SORTED_MOE_CONFIG
        )
        linen = LinenLM(dataclasses.replace(config, experts=experts))
        return sk.from_linen(linen, jnp.zeros((2, 32), jnp.int32)), ZOO[name].loss, batch
    layer = {
        "user_moe": Top2Experts,
        "sorted_moe": SortedExperts,
        "shared_expert_moe": SharedAndRoutedExperts,
        "looped_moe": LoopedExperts,
        "rolled_moe": RolledLoopExperts,
    }[name]
    make = lambda rngs: LlamaStyleLM(rngs, mlp=lambda r: layer(r, experts=experts))
    return sk.from_nnx(make), ZOO[name].loss, batch


def measure(name: str, layout: str) -> dict:
    experts = 8 if "expert=8" in layout else 4
    m, loss, batch = model(name, experts)
    out: dict = {"model": name, "layout": layout, "experts": experts}
    for when, place in (("before", False), ("after", True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an expert axis of data=8: none
            r = sk.Trainer(m, optax.adamw(1e-3), layout, loss=loss, place_experts=place).report(batch)
        excess = r.moved_bytes - r.lower_bound["bytes_per_device"]
        named = sum(e.moved_bytes for e in r.beyond())
        out[when] = {
            "bytes_ratio": r.ratios["bytes"],
            "moved_mb": r.moved_bytes / 1e6,
            "bound_mb": r.lower_bound["bytes_per_device"] / 1e6,
            "bound_expert_mb": r.lower_bound.get("bytes_expert", 0.0) / 1e6,
            "named_share": named / excess if excess > 0 else None,
            "largest_named": r.beyond()[0].op if r.beyond() else None,
            "memory_total_mb": r.memory.total / 1e6,
            "state_mb": (r.memory.params + r.memory.optimizer + r.memory.master) / 1e6,
            "temp_mb": r.memory.temp / 1e6,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=MODELS, help="a style to measure (repeat; default all)")
    parser.add_argument("--layout", action="append", help=f"a layout (repeat; default {', '.join(LAYOUTS)})")
    parser.add_argument("--json", default="benchmarks/results/experts.json")
    args = parser.parse_args()
    print(
        f"{'model':18s} {'layout':24s} {'before':>7s} {'after':>7s} {'moved MB':>9s} {'bound MB':>9s} "
        f"{'expert MB':>9s} {'named':>6s} {'mem MB':>7s} {'state MB':>8s}  largest named"
    )
    rows = []
    for name in args.model or MODELS:
        for layout in args.layout or LAYOUTS:
            r = measure(name, layout)
            rows.append(r)
            a, b = r["after"], r["before"]
            share = "-" if a["named_share"] is None or a["bytes_ratio"] <= 1.02 else f"{a['named_share']:.2f}"
            print(
                f"{name:18s} {layout:24s} {b['bytes_ratio']:7.2f} {a['bytes_ratio']:7.2f} {a['moved_mb']:9.3f} "
                f"{a['bound_mb']:9.3f} {a['bound_expert_mb']:9.3f} {share:>6s} {a['memory_total_mb']:7.2f} "
                f"{a['state_mb']:8.3f}  {a['largest_named'] or ''}",
                flush=True,
            )
    write_json(args.json, {"versions": {"jax": jax.__version__, "flax": flax.__version__}, "rows": rows})


if __name__ == "__main__":
    main()
