"""Does shardkit add anything at run time? Its train step against a hand-written jax.jit step.

Both compile the same model with identical shardings (the hand-written step takes shardkit's
resolved NamedShardings and nothing else from it) and donate the state. Steps alternate
between the two so that machine noise hits both alike; the ratio of medians is the result.

    python benchmarks/overhead.py                        # 8 simulated CPU devices, GPT mini
    python benchmarks/overhead.py --model tiny --steps 50 --json benchmarks/results/overhead.json
"""

import argparse
import statistics
import sys
import time

from _results import write_json

import shardkit as sk

if "--gpu" not in sys.argv:
    sk.simulate_devices(8)

import jax
import optax
from flax import nnx

from shardkit.analysis import hlo


def hand_written_step(model_cfg, optimizer, state_shardings, batch_sharding, mesh, rules):
    """A plain jax.jit train step: the usual loss, value_and_grad, optax update, and the same
    metrics shardkit reports (loss, gradient norm, token count) so both compute the same things."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: sk.models.GPT(model_cfg, rngs=nnx.Rngs(0))))

    def step(params, opt_state, count, tokens):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "tokens": tokens[:, 1:].size}
        return optax.apply_updates(params, updates), opt_state, count + 1, metrics

    p_sh, o_sh = state_shardings.params, state_shardings.opt_state
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    jitted = jax.jit(
        step,
        in_shardings=(p_sh, o_sh, replicated, batch_sharding),
        out_shardings=(p_sh, o_sh, replicated, replicated),
        donate_argnums=(0, 1),
    )
    return jitted


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mini")
    parser.add_argument("--layout", default="data=2,fsdp=2,tensor=2")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", default="benchmarks/results/overhead.json")
    parser.add_argument("--gpu", action="store_true", help="use the accelerator instead of simulated CPU devices")
    args = parser.parse_args()

    cfg = sk.models.GPTConfig.preset(args.model)
    optimizer = optax.adamw(1e-3)
    # The hand-written step has no non-finite guard, so neither does this one: like with like
    # (the guard, on by default, adds a few bytes of all-reduce; tests/golden holds its program).
    trainer = sk.Trainer(
        sk.from_nnx(lambda rngs: sk.models.GPT(cfg, rngs=rngs)), optimizer, args.layout, nonfinite=None
    )
    data = sk.TextDataset.builtin()
    batch = trainer.shard_batch(data.batch(0, args.batch, args.seq))
    state = trainer.init(0)

    with sk.use_sharding(trainer.mesh, trainer.rules):  # the model's own activation annotations
        hand = hand_written_step(
            cfg, optimizer, trainer.state_shardings, batch["tokens"].sharding, trainer.mesh, trainer.rules
        )
        hand_state = trainer.init(0)
        params, opt_state, count = hand_state.params, hand_state.opt_state, hand_state.step
        params, opt_state, count, loss = hand(params, opt_state, count, batch["tokens"])  # compile, warm up
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready((loss, metrics))

    times = {"shardkit": [], "hand_written": []}
    for _ in range(args.steps):
        t = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics)
        times["shardkit"].append(time.perf_counter() - t)
        t = time.perf_counter()
        params, opt_state, count, loss = hand(params, opt_state, count, batch["tokens"])
        jax.block_until_ready(loss)
        times["hand_written"].append(time.perf_counter() - t)

    # Same program? The two compiled steps must run the same collectives.
    with sk.use_sharding(trainer.mesh, trainer.rules):
        hand_hlo = hand.lower(params, opt_state, count, batch["tokens"]).compile().as_text()
    same_collectives = hlo.count(hand_hlo) == hlo.count(trainer.compile(batch).as_text())

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["shardkit"] / med["hand_written"]
    result = {
        "model": args.model,
        "layout": trainer.layout.spec(),
        "devices": trainer.mesh.devices.size,
        "platform": jax.devices()[0].platform,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "median_step_seconds": med,
        "ratio_shardkit_over_hand_written": ratio,
        "goal": "<= 1.02",
        "same_collectives": same_collectives,
        "jax": jax.__version__,
    }
    print(f"{'step':14s} {'median s':>10s}")
    for k, v in med.items():
        print(f"{k:14s} {v:10.5f}")
    print(f"ratio shardkit / hand-written = {ratio:.4f}  (goal <= 1.02); same collectives: {same_collectives}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
