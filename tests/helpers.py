"""Shared pieces of the tests: an independent single-device reference trainer."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx

import shardkit as sk

# XLA_FLAGS of the test processes and of the processes they start. The tests' programs are tiny,
# so their time goes to compiling the CPU code, not to running it:
# - LLVM's optimisation of the CPU code off: halves the suite's time on 2 cores;
# - XLA's elemental emitters instead of its MLIR fusion emitters: the tiny GPT's step compiles in
#   2 s instead of 5-10 s (the fusion emitters were 97% of the compile; `jax.profiler` trace).
# The SPMD partitioner, fusion decisions and the collectives run before either and do not change;
# the emitters can move temp bytes by a few (128 of 3.9 MB in one dry run), so a test comparing
# two compiles' bytes exactly compiles both sides alike (tests/test_extrapolate.py). Benchmarks
# run by hand (and users) compile with XLA's defaults.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

# The layouts of the core issue on 8 simulated devices: (layout, devices used).
CORE_LAYOUTS = [
    ("data=1", 1),
    ("data=8", 8),
    ("fsdp=8", 8),
    ("tensor=4", 4),
    ("data=2,tensor=4", 8),
    ("fsdp=2,tensor=4", 8),
    ("data=2,fsdp=2,tensor=2", 8),
]


def reference_training(
    init_params: Callable[[jax.Array], dict],
    forward: Callable[[dict, jax.Array], jax.Array],
    loss_fn: Callable[[jax.Array, dict], jax.Array],
    optimizer: optax.GradientTransformation,
    batches: list[dict],
    seed: int = 0,
) -> tuple[list[float], dict]:
    """Plain jax + optax on one device, no shardkit code on the path.

    Seed semantics documented in sk.TrainState: parameters come from split(key(seed))[0].
    """
    device = jax.devices()[0]
    init_key = jax.random.split(jax.random.key(seed))[0]
    params = jax.device_put(init_params(init_key), device)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(forward(p, batch), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, jax.device_put(b, device))
        losses.append(float(loss))
    return losses, jax.device_get(params)


def gpt_reference(
    cfg: sk.models.GPTConfig, optimizer: optax.GradientTransformation, batches: list[dict], microbatches: int = 1
) -> tuple[list[float], dict]:
    """The GPT trained by :func:`reference_training`: flax and optax only, optax's cross-entropy
    plus the load-balancing loss of a mixture of experts. With ``microbatches`` the batch is
    split as shardkit splits it (microbatch i: rows i::m) and the losses averaged, which matters
    only where the microbatch is part of the maths (the routing capacity of experts)."""
    graphdef = nnx.graphdef(sk.models.GPT(cfg, rngs=nnx.Rngs(0)))

    def one(params: dict, tokens: jax.Array) -> jax.Array:
        out = nnx.merge(graphdef, params)(tokens[:, :-1])
        logits, aux = out if isinstance(out, tuple) else (out, 0.0)
        aux = getattr(aux, "loss", aux)  # a mixture of experts' ExpertLoad: its weighted loss
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean() + aux

    def loss(params: dict, batch: dict) -> jax.Array:
        m = microbatches
        return sum(one(params, batch["tokens"][i::m]) for i in range(m)) / m

    return reference_training(
        init_params=lambda key: nnx.to_pure_dict(nnx.state(sk.models.GPT(cfg, rngs=nnx.Rngs(key)), nnx.Param)),
        forward=lambda params, batch: params,  # the loss runs the model itself, microbatch by microbatch
        loss_fn=loss,
        optimizer=optimizer,
        batches=batches,
    )


def run_trainer(trainer: sk.Trainer, batches: list[dict], seed: int = 0) -> tuple[list[float], dict]:
    state = trainer.init(seed)
    losses = []
    for b in batches:
        state, metrics = trainer.step(state, trainer.shard_batch(b))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def assert_adam_params_close(a, b, lr: float, steps: int, rtol=1e-3, atol=1e-4, outlier_share=1e-3):
    """Parameters after ``steps`` Adam steps of learning rate ``lr`` agree up to Adam's own noise.

    Adam divides each gradient by its running RMS, so a gradient element near zero whose sign
    differs by rounding moves its parameter by up to ``2 * lr`` per step in the other direction,
    whatever the size of the rounding. Elementwise ``rtol``/``atol`` therefore holds for all but
    a few elements on one machine and not on another (reduction order is CPU-dependent). This
    asserts what is machine-independent: every element within the bound of such sign flips
    (``2 * lr * steps`` plus ``atol``), and at most ``outlier_share`` of all elements outside
    ``rtol``/``atol``. Compare gradients, or parameters after SGD, where a test can.
    """
    assert jax.tree.structure(a) == jax.tree.structure(b)
    bound = 2 * lr * steps + atol
    outside = total = 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        err = np.abs(x - y)
        assert err.max(initial=0.0) <= bound, f"an element moved {err.max():.3g} apart, more than Adam's {bound:.3g}"
        outside += int(np.sum(err > atol + rtol * np.abs(y)))
        total += x.size
    assert outside <= outlier_share * total, f"{outside} of {total} elements differ beyond rtol={rtol}, atol={atol}"


def run_python(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run a fresh Python process (its own JAX backend and device count)."""
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=full_env)


def installed_command() -> str:
    """The ``shardkit`` script pip installed beside this interpreter (never whatever ``PATH``
    holds: the tests may run without the virtual environment activated)."""
    return str(pathlib.Path(sys.executable).parent / "shardkit")


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m shardkit.cli ARGS`` in a fresh process that picks its own device count
    (``env``: variables added to the tests' own)."""
    return subprocess.run(
        [sys.executable, "-m", "shardkit.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS, **(env or {})},
    )


def start_cli(*args: str, env: dict | None = None, stdout: int | None = subprocess.DEVNULL) -> subprocess.Popen:
    """``python -m shardkit.cli ARGS`` started, not awaited (to signal it mid-run); stderr dropped."""
    return subprocess.Popen(
        [sys.executable, "-m", "shardkit.cli", *args],
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS, **(env or {})},
    )


def wait_for_log_lines(path: pathlib.Path, lines: int, timeout: float = 300) -> None:
    """Wait until a run's ``--json-log`` holds ``lines`` steps (or ``timeout`` seconds pass)."""
    deadline = time.time() + timeout
    while time.time() < deadline and (not path.exists() or len(path.read_text().splitlines()) < lines):
        time.sleep(0.05)


def json_log_losses(path: pathlib.Path) -> dict[int, float]:
    """Step -> loss of a ``--json-log``; a step run again after a resume keeps the rerun's loss."""
    return {record["step"]: record["loss"] for record in map(json.loads, path.read_text().splitlines())}
