"""Continue batches of prompts: a compiled prefill per prompt-length bucket, then decode steps in one
compiled loop, greedy or sampled, on a layout of its own.

Prompts of any lengths run as one batch: each is right-padded to the bucket, and its tokens keep
their own positions (:mod:`shardkit.models.kv_cache`), so a prompt continues as it would alone.
shardkit's GPT keeps keys and values for every layer (the work of one token per step); other
models run whole rows per step (:func:`shardkit.models.kv_cache.recompute_decoder`).

Random draws are keyed by the seed, the prompt's index and the token's number, never by the
batch or the layout: the same prompts sample the same tokens on any layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.core.errors import InputError, LayoutError, short_repr
from shardkit.core.inputs import vocab_size
from shardkit.core.mesh import Layout, as_layout
from shardkit.core.partition import constrain, named, specs_for, use_sharding
from shardkit.core.rules import Rules, default_rules, resolve
from shardkit.models.kv_cache import Decoder, recompute_decoder
from shardkit.models.model import Model, Params

# Prompts are padded to a power of two of at least this many tokens: one prefill program serves
# every prompt length up to it.
MIN_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits: greedy at ``temperature`` 0, else drawn
    from ``softmax(logits / temperature)`` restricted to the ``top_k`` likeliest tokens and to the
    smallest set whose probability reaches ``top_p`` (in that order, as transformers does).

    Example:
      >>> Sampling(temperature=0.7, top_p=0.9).greedy
      False
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = []
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            bad.append(f"temperature={self.temperature!r} must be >= 0 (0: greedy)")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            bad.append(f"top_k={self.top_k!r} must be a whole number >= 1 (or None: every token)")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad.append(f"top_p={self.top_p!r} must be in (0, 1] (or None: every token)")
        if not all(isinstance(i, (int, np.integer)) and i >= 0 for i in self.eos_ids):
            bad.append(f"eos_ids={self.eos_ids!r} must be token ids >= 0")
        if bad:
            raise InputError("generate: " + "; ".join(bad) + ".")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def choose(logits: jax.Array, keys: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token of each row: ``logits (B, V)`` float32, one key per row -> ``(B,)`` int32.

    Example:
      >>> choose(jnp.array([[0.0, 2.0, 1.0]]), jax.random.split(jax.random.key(0), 1), Sampling()).tolist()
      [1]
    """
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]  # (B, 1)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p is not None and sampling.top_p < 1:
        ranked = jnp.sort(logits, axis=-1)[:, ::-1]  # (B, V), likeliest first
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the probability of the tokens ranked above
        floor = jnp.min(jnp.where(before < sampling.top_p, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < floor, -jnp.inf, logits)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where generation runs: a mesh and rules (a layout of its own), or None for one device."""

    mesh: Mesh | None
    rules: Rules

    @classmethod
    def of(cls, layout: Layout | str | Mapping[str, int] | None, rules: Rules | None = None) -> Placement:
        """A layout's placement (on its own count of devices), or one device for None."""
        rules = rules if rules is not None else default_rules()
        return cls(None if layout is None else _mesh(as_layout(layout)), rules)

    def params(self, model: Model) -> Any:
        """Where the model's parameters live: split as the layout's rules say, or on the first
        device without a mesh (a tree of shardings matching the parameters)."""
        abstract = model.abstract_params()
        if self.mesh is None:
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            return jax.tree.map(lambda _: one, abstract)
        return named(specs_for(model.axes, abstract, self.rules, self.mesh), self.mesh)

    def batch_multiple(self) -> int:
        """The row count the batch axes split: rows are padded to a multiple of it."""
        if self.mesh is None:
            return 1
        sizes = dict(self.mesh.shape)
        return math.prod(sizes.get(axis, 1) for axis in dict(self.rules.rules).get("batch", ()))

    def context(self) -> contextlib.AbstractContextManager[None]:
        """The sharding context activations are constrained in (none without a mesh)."""
        return contextlib.nullcontext() if self.mesh is None else use_sharding(self.mesh, self.rules)

    def rows(self) -> Any:
        """The sharding of a ``(B, ...)`` array split over the batch axes."""
        if self.mesh is None:
            return None
        axes = tuple(a for a in dict(self.rules.rules).get("batch", ()) if dict(self.mesh.shape).get(a, 1) > 1)
        return NamedSharding(self.mesh, PartitionSpec(axes or None))


def _constrained(placement: Placement, decoder: Decoder, cache: Any) -> Any:
    if placement.mesh is None:
        return cache
    return jax.tree.map(lambda x, names: constrain(x, names), cache, decoder.names, is_leaf=lambda x: x is None)


def _keys(seed: int, rows: jax.Array, step: jax.Array) -> jax.Array:
    """One key per row: the seed, the prompt's index and the token's number (never the layout)."""
    base = jax.random.key(seed)
    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), step))(rows)


def _in(tokens: jax.Array, ids: tuple[int, ...]) -> jax.Array:
    return jnp.isin(tokens, jnp.asarray(ids, jnp.int32)) if ids else jnp.zeros(tokens.shape, bool)


def _prefill(
    decoder: Decoder,
    placement: Placement,
    sampling: Sampling,
    length: int,
    max_new: int,
    params: Params,
    tokens: jax.Array,
    lengths: jax.Array,
    rows: jax.Array,
    live: jax.Array,
) -> dict[str, jax.Array]:
    """The prompts ``(B, P)`` (right-padded; ``lengths`` (B,) real tokens) through the model into
    a fresh cache of ``length`` positions, and the first new token of each row."""
    with placement.context():
        b, p = tokens.shape
        cache = _constrained(placement, decoder, decoder.empty(b, length))
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
        first_pass = decoder.prefill or decoder.forward  # every row starts at 0: nothing cached to read
        logits, cache = first_pass(params, cache, tokens, positions, lengths - 1)  # (B, V)
        cache = _constrained(placement, decoder, cache)
        first = choose(logits, _keys(sampling.seed, rows, jnp.int32(0)), sampling)  # (B,)
    out = jnp.full((b, max_new), -1, jnp.int32).at[:, 0].set(first)
    return {
        "cache": cache,
        "out": out,
        "step": jnp.int32(1),  # tokens produced so far
        "lengths": lengths,
        "rows": rows,
        "done": ~live | _in(first, sampling.eos_ids),
    }


def _decode(
    decoder: Decoder, placement: Placement, sampling: Sampling, params: Params, state: dict, until: jax.Array
) -> dict[str, jax.Array]:
    """Decode steps in one loop until ``until`` tokens exist per row or every row has stopped."""
    max_new = state["out"].shape[1]
    ready = decoder.step_params(params) if decoder.step_params else params  # once, outside the loop
    step_forward = decoder.step or decoder.forward

    def more(s: dict) -> jax.Array:
        return (s["step"] < jnp.minimum(until, max_new)) & ~jnp.all(s["done"])

    def one(s: dict) -> dict:
        step = s["step"]
        previous = jax.lax.dynamic_index_in_dim(s["out"], step - 1, axis=1)  # (B, 1)
        positions = (s["lengths"] + step - 1)[:, None]  # (B, 1): the previous token's position
        with placement.context():
            logits, cache = step_forward(ready, s["cache"], previous, positions, jnp.zeros_like(s["lengths"]))
            cache = _constrained(placement, decoder, cache)
        nxt = choose(logits, _keys(sampling.seed, s["rows"], step), sampling)
        nxt = jnp.where(s["done"], -1, nxt)
        out = jax.lax.dynamic_update_index_in_dim(s["out"], nxt[:, None], step, axis=1)
        done = s["done"] | _in(nxt, sampling.eos_ids)
        return {**s, "cache": cache, "out": out, "step": step + 1, "done": done}

    return jax.lax.while_loop(more, one, state)


def bucket(n: int, cap: int) -> int:
    """The padded prompt length for a longest prompt of ``n`` tokens: a power of two of at least
    :data:`MIN_BUCKET`, at most ``cap``.

    Example:
      >>> bucket(6, 64), bucket(11, 64), bucket(50, 40)
      (8, 16, 40)
    """
    return min(cap, max(MIN_BUCKET, 1 << (n - 1).bit_length()))


class Generator:
    """A model's parameters placed for generation, and its compiled prefill and decode programs.

    Args:
      model: the model; shardkit's GPT continues with a KV cache, any other model by running its
        ``apply`` over whole rows.
      params: its parameters (sharded or not; they are placed for generation, once).
      layout: generation's own layout (``"data=2,tensor=2"``): rows over the batch axes (``data``,
        ``fsdp``), kv heads over ``tensor``. None: one device for CPU devices (no collectives per
        token), the parameters where they are on accelerators.
      rules: logical-to-mesh rules (default :func:`shardkit.default_rules`).

    Example:
      >>> import jax, shardkit as sk
      >>> model = sk.models.GPTConfig.preset("tiny").model()
      >>> gen = Generator(model, model.init(jax.random.key(0)))
      >>> [len(t) for t in gen.generate([[1, 2, 3], [4]], max_new_tokens=5)]
      [5, 5]
    """

    def __init__(
        self,
        model: Model,
        params: Params,
        layout: Layout | str | Mapping[str, int] | None = None,
        *,
        rules: Rules | None = None,
    ):
        self.model = model
        self.decoder = model.decoder or recompute_decoder(
            lambda p, x: model.apply(p, x, None), model.info.get("max_seq")
        )
        self.vocab = vocab_size(model.abstract_params(), model.axes)
        self.placement = Placement.of(layout, rules)
        if self.placement.mesh is None:
            self.params = _one_device(params)
        else:
            check_layout(self.decoder, self.placement.mesh)
            self.params = jax.device_put(params, self.placement.params(model))
        self._prefill = jax.jit(_prefill, static_argnums=(0, 1, 2, 3, 4))
        self._decode = jax.jit(_decode, static_argnums=(0, 1, 2), donate_argnums=(4,))

    def check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """The prompts as lists of ints, or an :class:`InputError` naming the bad one."""
        if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise InputError(f"generate: max_new_tokens={max_new_tokens!r} must be a whole number >= 1.")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise InputError(
                f"generate: prompts must be a non-empty list of token-id lists, got {short_repr(prompts)} "
                "(one prompt: [[1, 2, 3]])."
            )
        out = []
        for i, prompt in enumerate(prompts):
            ids = np.asarray(prompt)
            if ids.size == 0:
                raise InputError(f"generate: prompt {i} is empty; a prompt needs at least 1 token (e.g. a BOS id).")
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise InputError(f"generate: prompt {i} must be a list of token ids, got {short_repr(prompt)}.")
            if self.vocab is not None and ((ids < 0) | (ids >= self.vocab)).any():
                bad = int(ids[(ids < 0) | (ids >= self.vocab)][0])
                raise InputError(
                    f"generate: prompt {i} holds token id {bad}, outside the model's vocabulary [0, {self.vocab}). "
                    "Fix: encode the prompt with the checkpoint's own tokenizer."
                )
            limit = self.decoder.max_seq
            if limit is not None and len(ids) + max_new_tokens > limit:
                raise InputError(
                    f"generate: prompt {i} has {len(ids)} tokens and {max_new_tokens} new ones are asked for, "
                    f"{len(ids) + max_new_tokens} positions; the model has {limit} (max_seq). Fix: a shorter prompt "
                    f"or max_new_tokens <= {max(limit - len(ids), 0)}."
                )
            out.append([int(t) for t in ids])
        return out

    def cache_bytes_per_device(self, batch: int, length: int) -> int:
        """Bytes of the cache of ``batch`` rows of ``length`` positions on each device of this
        generation's layout (computed from shapes; allocates nothing)."""
        rows = -(-batch // self.placement.batch_multiple()) * self.placement.batch_multiple()
        return cache_bytes_per_device(self.decoder, rows, length, self.placement)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        eos_ids: Sequence[int] = (),
        on_tokens: Callable[[list[list[int]]], None] | None = None,
        chunk: int = 16,
    ) -> list[list[int]]:
        """The new tokens of each prompt (see :func:`generate`).

        ``on_tokens``: called with each row's new tokens so far after the prefill and after every
        ``chunk`` decode steps (streaming); without it the whole continuation is one loop.
        """
        sampling = Sampling(float(temperature), top_k, top_p, int(seed), tuple(int(i) for i in eos_ids))
        prompts = self.check(prompts, max_new_tokens)
        n = len(prompts)
        multiple = self.placement.batch_multiple()
        b = -(-n // multiple) * multiple  # padded rows repeat the first prompt and are dropped
        longest = max(len(p) for p in prompts)
        limit = self.decoder.max_seq or longest + max_new_tokens
        length = min(limit, bucket(longest, limit) + max_new_tokens)
        width = bucket(longest, length)
        tokens = np.zeros((b, width), np.int32)
        lengths = np.full(b, len(prompts[0]), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)], lengths[i] = p, len(p)
        tokens[n:, : len(prompts[0])] = prompts[0]
        live = np.arange(b) < n
        rows = self.placement.rows()
        put = (lambda x: jax.device_put(x, rows)) if rows is not None else jnp.asarray
        state = self._prefill(
            self.decoder,
            self.placement,
            sampling,
            length,
            max_new_tokens,
            self.params,
            put(tokens),
            put(lengths),
            put(np.arange(b, dtype=np.int32)),
            put(live),
        )
        step = chunk if on_tokens is not None else max_new_tokens
        while True:
            if on_tokens is not None:
                on_tokens(_rows(state["out"], n))
            if int(_host(state["step"])) >= max_new_tokens or bool(np.all(_host(state["done"]))):
                break
            until = min(int(_host(state["step"])) + step, max_new_tokens)
            state = self._decode(self.decoder, self.placement, sampling, self.params, state, jnp.int32(until))
        return _rows(state["out"], n)


def check_layout(decoder: Decoder, mesh: Mesh | None) -> None:
    """Refuse a generation layout whose ``tensor`` axis does not divide the cache's kv heads."""
    tensor = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
    heads = decoder.kv_heads
    if tensor > 1 and heads is not None and heads % tensor:
        raise LayoutError(
            f"generate: the KV cache splits its {heads} kv heads over tensor={tensor}, which does not divide "
            f"them. Fix: a generation layout whose tensor axis divides {heads} (e.g. tensor="
            f"{math.gcd(heads, tensor)}), or put the devices on data."
        )


def _mesh(layout: Layout) -> Mesh:
    """The layout's mesh: on its own count of devices (the first ones) when it names one, on
    every device when it has a -1. Generation may use fewer devices than training."""
    devices = jax.devices()
    if all(size != -1 for _, size in layout.sizes) and layout.num_devices <= len(devices):
        devices = devices[: layout.num_devices]
    return layout.resolve(len(devices)).make_mesh(devices)


def _host(x: jax.Array) -> np.ndarray:
    """A replicated or one-device array's value on this host (every process has a copy)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _rows(out: jax.Array, n: int) -> list[list[int]]:
    """The first ``n`` rows' tokens, up to the first -1 (a row that stopped)."""
    values = _host(out)[:n]
    return [[int(t) for t in row[: (row < 0).argmax() if (row < 0).any() else len(row)]] for row in values]


def cache_bytes_per_device(decoder: Decoder, batch: int, length: int, placement: Placement) -> int:
    """Bytes of a cache of ``batch`` rows x ``length`` positions held by each device of
    ``placement``: the shapes of ``decoder.empty`` split as ``decoder.names`` resolve."""
    shapes = jax.eval_shape(lambda: decoder.empty(batch, length))
    sizes = {} if placement.mesh is None else dict(placement.mesh.shape)
    total = 0
    for leaf, names in zip(jax.tree.leaves(shapes), jax.tree.leaves(decoder.names, is_leaf=_is_names), strict=True):
        spec = resolve(names, leaf.shape, placement.rules, sizes, what="KV cache") if sizes else PartitionSpec()
        shard = [
            dim // math.prod(sizes[a] for a in ((entry,) if isinstance(entry, str) else entry or ()))
            for dim, entry in zip(leaf.shape, tuple(spec) + (None,) * (leaf.ndim - len(spec)))
        ]
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def _one_device(params: Params) -> Params:
    """Where generation without a layout reads the parameters: one local device when the
    devices are CPUs.

    CPU devices (simulated, or one per process under ``jax.distributed``) keep their parameters
    in host memory, so gathering them onto one device costs no memory a real accelerator would
    lack and spares every token the training layout's per-layer collectives (the ``mini`` model,
    200 tokens: 4.2 s sharded over ``data=2,fsdp=2,tensor=2``, 1.7 s on one device). Across
    processes each one gathers the whole parameters once and samples the same tokens from the
    same seed. Real accelerators keep the parameters where they are.
    """
    leaves = jax.tree.leaves(params)
    if not leaves or not all(isinstance(x, jax.Array) for x in leaves):
        return jax.device_put(params, jax.local_devices()[0])
    devices = set().union(*(x.sharding.device_set for x in leaves))
    if any(d.platform != "cpu" for d in devices):
        return params
    if jax.process_count() > 1:
        params = multihost_utils.process_allgather(params, tiled=True)  # numpy, whole, on every process
        return jax.device_put(params, jax.local_devices()[0])
    return jax.device_put(params, min(devices, key=lambda d: d.id))


def generate(
    model: Model,
    params: Params,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_ids: Sequence[int] = (),
    layout: Layout | str | Mapping[str, int] | None = None,
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; the prompts run as one batch.

    Greedy at ``temperature`` 0 (the default), else sampled (:class:`Sampling`). A row stops
    after an ``eos_ids`` token (which it keeps). With a ``layout``, rows split over its batch axes
    and the KV cache's kv heads over ``tensor`` (:class:`Generator`).

    Args:
      model: shardkit's GPT (``GPTConfig.model()``, ``from_pretrained``) or any language model.
      params: its parameters.
      prompts: token-id lists of any lengths, each at least 1 token.
      max_new_tokens: new tokens per prompt, >= 1; prompt + new tokens <= the model's ``max_seq``.
      temperature, top_k, top_p, seed, eos_ids: see :class:`Sampling`.
      layout: generation's own layout (default: one device on CPUs).

    Returns:
      One list of new token ids per prompt (shorter where an eos token stopped it).

    Example:
      >>> import jax, shardkit as sk
      >>> model = sk.models.GPTConfig.preset("tiny").model()
      >>> params = model.init(jax.random.key(0))
      >>> out = sk.generate(model, params, [[1, 2, 3], [7]], max_new_tokens=4, temperature=0.8, seed=1)
      >>> [len(t) for t in out]
      [4, 4]
    """
    gen = Generator(model, params, layout)
    return gen.generate(
        prompts,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_ids=eos_ids,
    )
