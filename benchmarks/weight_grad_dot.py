"""The weight gradient of a projection on CPU: JAX's autodiff against ``rows_matmul``.

JAX differentiates ``x (N, K) @ w (K, M)`` into a dot that writes the transposed weight
``(M, K)`` and a transpose after it; under data parallelism the gradient's all-reduce sits
between the two and XLA keeps both. shardkit's GPT computes the gradient with
``shardkit.models.layers.matmul.rows_matmul``, whose dot writes the orientation with fewer rows (``(K, M)``
when ``K <= M``), the one Eigen runs faster.
Both run on 2 simulated CPU devices, rows split over them (``data=2``), the steps of the two
interleaved; the SwiGLU gate/up shape of ``benchmarks/cpu_vs_pytorch.py`` by default.

    python benchmarks/weight_grad_dot.py
    python benchmarks/weight_grad_dot.py --rows 1024 --k 1024 --m 256 --json out.json
"""

import argparse
import statistics
import time

from _results import write_json

import shardkit as sk

sk.simulate_devices(2)

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.analysis import hlo
from shardkit.models.layers.matmul import rows_matmul


def weight_grad_step(matmul, mesh: jax.sharding.Mesh):
    """A jitted ``(x, w, dy) -> dw`` of ``matmul``: rows split over ``data``, ``dw`` whole."""
    rows = jax.NamedSharding(mesh, jax.P("data"))
    whole = jax.NamedSharding(mesh, jax.P())

    def weight_grad(x: jax.Array, w: jax.Array, dy: jax.Array) -> jax.Array:
        return jax.vjp(lambda w: matmul(x, w), w)[1](dy)[0]

    return jax.jit(weight_grad, in_shardings=(rows, whole, rows), out_shardings=whole)


def dot_shapes(compiled_text: str) -> list[str]:
    """The output shapes of the dots in a compiled program's text, layouts left out (``f32[256,2048]``)."""
    return [ins.shape.split("{")[0] for ins in hlo.parse(compiled_text).instructions if ins.opcode == "dot"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1024, help="rows (tokens) per device")
    parser.add_argument("--k", type=int, default=256, help="input features")
    parser.add_argument("--m", type=int, default=2048, help="output features")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    mesh = jax.make_mesh((2,), ("data",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2 * args.rows, args.k), np.float32))
    w = jnp.asarray(rng.standard_normal((args.k, args.m), np.float32))
    dy = jnp.asarray(rng.standard_normal((2 * args.rows, args.m), np.float32))
    forms = {"autodiff x @ w": lambda a, b: a @ b, "rows_matmul": rows_matmul}
    steps = {name: weight_grad_step(f, mesh).lower(x, w, dy).compile() for name, f in forms.items()}
    shapes = {name: dot_shapes(step.as_text()) for name, step in steps.items()}
    results = {name: step(x, w, dy) for name, step in steps.items()}
    np.testing.assert_allclose(*results.values(), rtol=1e-4, atol=1e-3)  # the same gradient
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):  # interleaved: the machine's drift touches both alike
        for name, step in steps.items():
            start = time.perf_counter()
            step(x, w, dy).block_until_ready()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["autodiff x @ w"])
    print(f"{'form':16s} {'dot output':14s} {'median ms':>10s} {'min ms':>8s} {'vs autodiff':>12s}")
    rows = {}
    for name, ts in times.items():
        median = statistics.median(ts)
        rows[name] = {"dots": shapes[name], "median_s": median, "min_s": min(ts), "speedup": base / median}
        print(
            f"{name:16s} {','.join(shapes[name]):14s} {1e3 * median:10.2f} {1e3 * min(ts):8.2f} {base / median:12.2f}"
        )
    if args.json:
        write_json(args.json, {"rows": args.rows, "k": args.k, "m": args.m, "steps": args.steps, "forms": rows})


if __name__ == "__main__":
    main()
