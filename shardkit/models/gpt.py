"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-KV attention, SwiGLU MLP, dropout.

Every parameter and the key activations carry logical axis names, so any layout shards it.
Shapes: B batch, T sequence, D embed, H query heads, N kv heads, K head dim, F mlp, V vocab,
L layers.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 16), jnp.int32)).shape
  (2, 16, 256)
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardkit.core.errors import InputError, ModelError, short_repr
from shardkit.core.partition import constrain, constrain_to, current_rules, free_mesh_shape, logical, without_axes
from shardkit.core.rules import resolve
from shardkit.models.dropout import dropout
from shardkit.models.kv_cache import KV_NAMES, Decoder, LayerCaches, after_reads, pick_rows, write_layer
from shardkit.models.lora import TARGETS, LoRA, is_adapter
from shardkit.models.model import Model
from shardkit.models.nnx_adapter import from_nnx
from shardkit.models.rope import RopeScaling, angles, inverse_frequencies
from shardkit.models.segments import current_segments, positions_in_rows, same_document
from shardkit.parallel.attention import BLOCKED_FROM, attention
from shardkit.parallel.experts import ExpertLoad, MoE
from shardkit.parallel.ring_attention import ring_attention

_PRESETS: dict[str, dict[str, Any]] = {
    # vocab 256: byte-level tokens of the built-in corpus.
    "tiny": dict(vocab=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, mlp_dim=128, max_seq=128),
    "mini": dict(vocab=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, mlp_dim=384, max_seq=256),
    # GPT-2 shapes (vocab padded 50257 -> 50304 so it divides, as nanoGPT does).
    "gpt2-small": dict(vocab=50304, dim=768, n_layers=12, n_heads=12, n_kv_heads=12, mlp_dim=3072, max_seq=1024),
    "gpt2-medium": dict(vocab=50304, dim=1024, n_layers=24, n_heads=16, n_kv_heads=16, mlp_dim=4096, max_seq=1024),
    "llama-1b": dict(vocab=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, mlp_dim=5632, max_seq=2048),
    "llama2-7b": dict(vocab=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_dim=11008, max_seq=4096),
    "llama2-13b": dict(vocab=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, mlp_dim=13824, max_seq=4096),
    "llama2-70b": dict(vocab=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, mlp_dim=28672, max_seq=4096),
    # Mixtures of experts: 4 (tiny) and 8 (Mixtral 8x7B shapes) experts, top-2.
    "tiny-moe": dict(vocab=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, mlp_dim=128, max_seq=128, n_experts=4),
    "mixtral-8x7b": dict(
        vocab=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, mlp_dim=14336, max_seq=4096, n_experts=8
    ),
}


# Rematerialisation policies by name: what the backward pass may keep from the forward pass of
# each layer (the rest it recomputes). "none" keeps everything; "full" keeps only the layer input.
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,  # save every matmul output
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


ATTENTION_CHOICES = (None, "blocked", "xla", "cudnn")

MLP_ACTIVATIONS: dict[str, Any] = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # Hugging Face's gelu_pytorch_tanh
}


def _is_float_dtype(name: str) -> bool:
    try:
        return jnp.issubdtype(jnp.dtype(name), jnp.floating)
    except TypeError:
        return False


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and behaviour of :class:`GPT`. ``GPTConfig.preset(name, **overrides)`` for presets."""

    vocab: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    mlp_dim: int = 128
    max_seq: int = 128
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # logits from the embedding table (Qwen2, Gemma); no separate lm_head
    qkv_bias: bool = False  # a bias on the query, key and value projections (Qwen2)
    # -- what the families of pretrained checkpoints add (shardkit.models.hf); the defaults are Llama 2's --
    attn_head_dim: int | None = None  # per-head size K; None: dim // n_heads (Qwen3 and Gemma set their own)
    rope_scaling: RopeScaling | None = None  # scaled rotary frequencies (Llama 3.1's llama3, linear)
    rope_local_theta: float | None = None  # rotary base of sliding-window layers (Gemma 3); None: rope_theta
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + scale): Gemma's 1 + w
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotary embedding (Qwen3, Gemma 3)
    post_norms: bool = False  # an RMSNorm on the attention's and the MLP's outputs too (Gemma 2 and 3)
    mlp_activation: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False  # embeddings multiplied by sqrt(dim) (Gemma)
    query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    sliding_window: int | None = None  # a query sees itself and the window - 1 keys before it
    layer_types: tuple[str, ...] = ()  # per layer "full" or "sliding"; (): all sliding if a window is set
    dtype: str | None = None  # compute dtype; None: that of the parameters it is given
    param_dtype: str = "float32"
    scan_layers: bool = True  # one compiled layer body, scanned L times
    # Layers per iteration of that scan (True: all of them): the speed of unrolled layers, with the
    # parameters still stacked (pipelines, checkpoints); compile time grows with it.
    scan_unroll: int | bool = 1
    remat: str = "none"  # per-layer rematerialisation: see REMAT_POLICIES
    # Training attention: None (auto: cuDNN where it serves the mask on GPUs, else the blocked kernel;
    # on other backends blocked from BLOCKED_FROM tokens), "blocked" (shardkit.parallel.attention),
    # "xla" (the whole score matrix), "cudnn" (jax.nn.dot_product_attention's).
    attention: str | None = None
    n_experts: int = 0  # > 0: every MLP is a mixture of this many experts (shardkit.parallel.experts)
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.01
    moe_dropless: bool = False  # every expert has room for every token: no token is dropped (Mixtral)
    lora: LoRA | None = None  # low-rank adapters on a frozen base (shardkit.models.lora)

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "mlp_dim", "max_seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelError(f"GPTConfig: {name}={value!r} must be a positive integer.")
        for name in ("param_dtype", "dtype"):
            value = getattr(self, name)
            if value is not None and not _is_float_dtype(value):
                raise ModelError(
                    f"GPTConfig: {name}={value!r} is not a floating-point dtype; use 'float32' or 'bfloat16'."
                )
        if self.attn_head_dim is None and self.dim % self.n_heads:
            raise ModelError(f"GPTConfig: dim={self.dim} must divide by n_heads={self.n_heads}, or give attn_head_dim.")
        if self.attn_head_dim is not None and (self.attn_head_dim < 2 or self.attn_head_dim % 2):
            raise ModelError(f"GPTConfig: attn_head_dim={self.attn_head_dim} must be an even number >= 2 (rotary).")
        self._check_families()
        if self.attention not in ATTENTION_CHOICES:
            raise ModelError(
                f"GPTConfig: attention={self.attention!r}; choose one of {', '.join(map(repr, ATTENTION_CHOICES))}."
            )
        if self.n_heads % self.n_kv_heads:
            raise ModelError(
                f"GPTConfig: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(each kv head serves a whole group of query heads)."
            )
        if not isinstance(self.scan_unroll, (bool, int)) or self.scan_unroll is False or self.scan_unroll < 1:
            raise ModelError(
                f"GPTConfig: scan_unroll={self.scan_unroll!r}: give a positive number of layers per scan "
                "iteration, or True to unroll them all."
            )
        if self.remat not in REMAT_POLICIES:
            raise ModelError(f"GPTConfig: remat={self.remat!r}; choose one of {', '.join(REMAT_POLICIES)}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelError(f"GPTConfig: dropout={self.dropout} must be in [0, 1).")
        if self.lora is not None and not isinstance(self.lora, LoRA):
            raise ModelError(f"GPTConfig: lora={short_repr(self.lora)} must be a shardkit.models.LoRA.")
        if self.lora is not None and self.n_experts and self.lora.targets_any(("gate_proj", "up_proj", "down_proj")):
            raise ModelError(
                f"GPTConfig: LoRA on the MLP ({', '.join(self.lora.targets)}) of a mixture of experts is not "
                "supported; target the attention's projections (q_proj, k_proj, v_proj, o_proj)."
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ModelError(
                f"GPTConfig: top_k={self.top_k} experts per token out of n_experts={self.n_experts}; "
                f"choose top_k between 1 and {self.n_experts}."
            )
        if self.n_experts and self.capacity_factor <= 0:
            raise ModelError(
                f"GPTConfig: capacity_factor={self.capacity_factor} must be > 0 (1.0: an even share of the "
                "tokens per expert; 1.25 is usual)."
            )

    def _check_families(self) -> None:
        if isinstance(self.layer_types, list):  # from JSON
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ModelError(
                f"GPTConfig: mlp_activation={self.mlp_activation!r}; choose one of {', '.join(MLP_ACTIVATIONS)}."
            )
        if self.layer_types and (len(self.layer_types) != self.n_layers or set(self.layer_types) - {"full", "sliding"}):
            raise ModelError(
                f"GPTConfig: layer_types={self.layer_types!r} must name each of the {self.n_layers} layers "
                "'full' or 'sliding'."
            )
        if "sliding" in self.layer_types and self.sliding_window is None:
            raise ModelError("GPTConfig: layer_types has sliding layers; give sliding_window too.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelError(f"GPTConfig: sliding_window={self.sliding_window} must be a positive number of tokens.")
        for name in ("attn_softcap", "final_softcap", "query_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ModelError(f"GPTConfig: {name}={value} must be > 0 (or None).")

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim if self.attn_head_dim is not None else self.dim // self.n_heads

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its attention is limited to the sliding window."""
        if self.layer_types:
            return tuple(kind == "sliding" for kind in self.layer_types)
        return (self.sliding_window is not None,) * self.n_layers

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named size: ``tiny``, ``mini``, ``gpt2-small``, ``gpt2-medium``, ``llama-1b``,
        ``llama2-7b``, ``llama2-13b``, ``llama2-70b``; mixtures of experts ``tiny-moe``,
        ``mixtral-8x7b``."""
        if name not in _PRESETS:
            raise ModelError(
                f"Unknown GPT preset {short_repr(name)}. Choose one of: {', '.join(_PRESETS)}, or pass your own "
                "model factory ('package.module:function')."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ModelError(
                f"GPTConfig.preset({name!r}) got unknown settings {unknown}; GPTConfig has {', '.join(sorted(fields))}."
            )
        return cls(**{**_PRESETS[name], **overrides})

    @staticmethod
    def preset_names() -> tuple[str, ...]:
        return tuple(_PRESETS)

    def model(self, name: str | None = None) -> Model:
        """This GPT as a shardkit :class:`~shardkit.Model` (with the facts reports use).

        Example:
          >>> model = GPTConfig.preset("tiny").model()
        """
        lookup_only = 0 if self.tie_embeddings else self.vocab * self.dim  # a tied table is also the head
        info = {
            "layers": self.n_layers,
            "dim": self.dim,
            "matmul_params": self.num_params() - lookup_only,
            "max_seq": self.max_seq,
            "unrolled_layers": self.unrolled_layers,
            # The router's k (its top k is a sort), and whether its dispatch pads to drop nothing.
            **({"top_k": self.top_k, "moe_dropless": self.moe_dropless} if self.n_experts else {}),
        }
        model = from_nnx(
            lambda rngs: GPT(self, rngs=rngs),
            name=name or "GPT",
            info=info,
            stacked_layers="blocks" if self.scan_layers else None,
            boundaries=False,  # GPT constrains its own activations and names its own scopes
        )
        trainable = is_adapter if self.lora is not None else None  # LoRA: the base stays as it is
        return dataclasses.replace(model, decoder=self.decoder(), trainable=trainable)

    def decoder(self) -> Decoder:
        """How this GPT continues token rows with a KV cache (:mod:`shardkit.models.kv_cache`):
        each layer's own keys and values ``(B, N, C, K)``, rows over the batch axes, kv heads over
        ``tensor``. A mixture of experts routes every token to its top-k experts with no capacity
        (as inference does; a training capacity would drop tokens by what else is in the batch).

        Example:
          >>> dec = GPTConfig.preset("tiny").decoder()
          >>> [[x.shape for x in kv] for kv in dec.empty(3, 16)]  # per layer: (B, N, C, K) keys, values
          [[(3, 4, 16, 8), (3, 4, 16, 8)], [(3, 4, 16, 8), (3, 4, 16, 8)]]
        """
        cfg = dataclasses.replace(self, moe_dropless=True, dropout=0.0) if self.n_experts else self
        n, k, layers = self.n_kv_heads, self.head_dim, self.n_layers
        apart = dataclasses.replace(cfg, scan_layers=False)  # a step's model: each layer's weights its own

        def empty(batch: int, length: int) -> LayerCaches:
            shape, dtype = (batch, n, length, k), jnp.dtype(cfg.dtype or cfg.param_dtype)
            return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(layers))

        def forward(
            params: Any, cache: Any, tokens: jax.Array, positions: jax.Array, last: jax.Array, fresh: bool = False
        ) -> Any:
            module = nnx.merge(_graphdef(cfg), params)
            hidden, cache = module.decode(tokens, positions, cache, fresh)  # (B, S, D)
            logits = module.head(pick_rows(hidden, last))  # (B, 1, V)
            return logits[:, 0].astype(jnp.float32), cache

        def layers_apart(params: Any) -> Any:
            # Sliced once, before the decode loop: inside it, a stacked layer's weights were
            # sliced (copied) at every token, as many bytes again as the matmuls read.
            if not cfg.scan_layers:
                return params
            return {**params, "blocks": {i: jax.tree.map(lambda w, i=i: w[i], params["blocks"]) for i in range(layers)}}

        def step(params: Any, cache: Any, tokens: jax.Array, positions: jax.Array, last: jax.Array) -> Any:
            module = nnx.merge(_graphdef(apart), params)
            hidden, cache = module.decode(tokens, positions, cache)  # (B, 1, D)
            return module.head(hidden)[:, 0].astype(jnp.float32), cache

        return Decoder(
            empty,
            ((KV_NAMES, KV_NAMES),) * layers,
            forward,
            self.max_seq,
            self.n_kv_heads,
            prefill=functools.partial(forward, fresh=True),
            step_params=layers_apart,
            step=step,
        )

    @property
    def unrolled_layers(self) -> bool:
        """Whether the stacked layers run without a loop: ``scan_unroll`` takes all of them at
        once (``lax.scan`` keeps a loop of one trip for a single layer)."""
        if not self.scan_layers or self.n_layers == 1:
            return False
        return self.scan_unroll is True or self.scan_unroll >= self.n_layers

    def num_params(self) -> int:
        """Parameter count (embedding, and the output head unless tied, included)."""
        d, f, k = self.dim, self.mlp_dim, self.head_dim
        attn = d * self.n_heads * k * 2 + d * self.n_kv_heads * k * 2
        if self.qkv_bias:
            attn += (self.n_heads + 2 * self.n_kv_heads) * k
        if self.qk_norm:
            attn += 2 * k
        mlp = 3 * d * f if not self.n_experts else self.n_experts * 3 * d * f + d * self.n_experts
        per_layer = attn + mlp + (4 if self.post_norms else 2) * d
        tables = 1 if self.tie_embeddings else 2
        return self.n_layers * per_layer + tables * self.vocab * d + d


def _param(rngs: nnx.Rngs, init: Any, shape: tuple[int, ...], names: tuple[str | None, ...], dtype: str) -> nnx.Param:
    return nnx.Param(logical(init, names)(rngs.params(), shape, jnp.dtype(dtype)))


# The key of the adapters' dropout within a layer's training call (None: evaluating, or no LoRA).
_ADAPTER_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("shardkit_lora_key", default=None)


def _adapters(
    module: nnx.Module,
    cfg: GPTConfig,
    rngs: nnx.Rngs,
    target: str,
    inputs: tuple[tuple[int, ...], tuple[str | None, ...]],
    outputs: tuple[tuple[int, ...], tuple[str | None, ...]],
) -> None:
    """``lora_<t>_a`` (inputs..., r) and ``lora_<t>_b`` (r, outputs...) on ``module`` where
    ``cfg.lora`` targets ``target`` (``"q_proj"``): A uniform in +-1/sqrt(fan-in) as peft draws
    it, B zero; each named as its base weight's input and output dimensions."""
    if cfg.lora is None or target not in cfg.lora.targets:
        return
    short, r, (in_shape, in_names), (out_shape, out_names) = TARGETS[target], cfg.lora.rank, inputs, outputs
    fan_in = tuple(range(len(in_shape)))
    a_init = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=fan_in, out_axis=len(in_shape))
    setattr(module, f"lora_{short}_a", _param(rngs, a_init, (*in_shape, r), (*in_names, None), cfg.param_dtype))
    b_shape, b_names = (r, *out_shape), (None, *out_names)
    setattr(module, f"lora_{short}_b", _param(rngs, nnx.initializers.zeros, b_shape, b_names, cfg.param_dtype))


def _low_rank(module: nnx.Module, cfg: GPTConfig, short: str, x: jax.Array, spec: str) -> jax.Array | None:
    """``(alpha / r) (x A) B`` of the adapter ``short`` on ``module``, or None without one.
    ``spec``: the einsum of ``x`` with A to ``r`` (``"btd,dr->btr"``); B maps ``r`` to the
    output dimensions."""
    a = getattr(module, f"lora_{short}_a", None)
    if a is None or cfg.lora is None:
        return None
    b = getattr(module, f"lora_{short}_b")[...].astype(x.dtype)
    with jax.named_scope(f"lora_{short}"):
        key = _ADAPTER_KEY.get()  # peft's lora_dropout: on the adapter's input, in training only
        if key is not None and cfg.lora.dropout:
            x = dropout(x, cfg.lora.dropout, jax.random.fold_in(key, list(TARGETS.values()).index(short)))
        xa = jnp.einsum(spec, x, a[...].astype(x.dtype))  # (B, T, r)
        return jnp.einsum("btr,r...->bt...", xa, b) * jnp.asarray(cfg.lora.scale, x.dtype)


def gathered_along_seq(x: jax.Array) -> jax.Array:
    """``(B, T, D)`` whole along the sequence over ``tensor`` (still split by the other rules).

    Under Megatron sequence parallelism a block's input arrives split along the sequence over
    ``tensor``; gathering it here, before the column-parallel projection, makes the gathered
    input what autodiff saves for the weight gradient, so the backward pass does not gather it
    again (Megatron's volume: one all-gather and one reduce-scatter per all-reduce of plain
    tensor parallelism). Without sequence parallelism this is the layer boundary's own split.
    """
    context = current_rules()
    if context is None:
        return x
    mesh, rules = context
    spec = resolve(("batch", "seq", "embed"), x.shape, rules, free_mesh_shape(mesh), what="activation")
    rest = without_axes(jax.sharding.PartitionSpec(*spec[1:]), ("tensor",))
    return constrain_to(x, jax.sharding.PartitionSpec(spec[0], *rest))


def unsplit(*names: str) -> bool:
    """Whether no logical name in ``names`` splits over devices in the sharding context in force
    (true outside any, and for axes a row vmap has taken)."""
    context = current_rules()
    if context is None:
        return True
    mesh, rules = context
    sizes, known = free_mesh_shape(mesh), dict(rules.rules)
    return all(sizes.get(axis, 1) == 1 for name in names for axis in known.get(name, ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rows_matmul(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """``x (N, K) @ w (K, M) -> (N, M)``, whose weight gradient's dot writes the narrower orientation.

    ``w`` may keep more dimensions, ``(*c, *out)``: its first ``contract`` (of product K) meet
    the columns of ``x`` and the rest (of product M) make the output's columns. It is saved for
    the backward pass as given, so a layer stack scanned over stacked weights reads them back
    from the stack instead of saving a reshaped copy of every layer's weights.

    The weight gradient contracts the N rows of ``x`` and of the output gradient (a dot neither
    of whose operands is in the layout XLA's CPU matmul library takes, so Eigen runs it). Eigen
    ran such a dot about 1.5x faster when its output has the fewer rows: ``(K, M)`` when
    ``K <= M``, else ``(M, K)`` and a transpose (``benchmarks/weight_grad_dot.py``). JAX's own
    derivative always writes ``(M, K)``, and under data parallelism the gradient's all-reduce
    keeps XLA from folding the transpose away. The values are the same.

    Example:
      >>> x, w = jnp.ones((4, 3)), jnp.ones((3, 2))
      >>> jax.grad(lambda w: rows_matmul(x, w).sum())(w).shape
      (3, 2)
    """
    return x @ _as_matrix(w, contract)


def _as_matrix(w: jax.Array, contract: int) -> jax.Array:
    return w.reshape(math.prod(w.shape[:contract]), -1)  # (K, M)


def _rows_matmul_fwd(x: jax.Array, w: jax.Array, contract: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return x @ _as_matrix(w, contract), (x, w)


def _rows_matmul_bwd(contract: int, saved: tuple[jax.Array, jax.Array], dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = saved
    matrix = _as_matrix(w, contract)  # (K, M)
    rows = (((0,), (0,)), ((), ()))  # contract the N rows of both operands
    dx = jax.lax.dot_general(dy, matrix, (((1,), (1,)), ((), ())))  # (N, M) . (K, M) -> (N, K)
    narrow_first = matrix.shape[0] <= matrix.shape[1]  # the dot writes (K, M) directly, else (M, K) then .T
    dw = jax.lax.dot_general(x, dy, rows) if narrow_first else jax.lax.dot_general(dy, x, rows).T
    return dx.astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)


rows_matmul.defvjp(_rows_matmul_fwd, _rows_matmul_bwd)


def token_matmul(x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    """``x (B, T, *c) @ w (*c, *out) -> (B, T, *out)`` as one 2-D matmul ``(B T, prod c) @ (prod c, prod out)``.

    The same product as the einsum; XLA's CPU matmuls run a 2-D product with one free dimension
    per side about 1.8x faster forward and backward than the multi-dimensional einsum (whose
    weight gradient contracts two token dimensions and transposes its operands). Merging the
    dimensions is free only when none of them is split over devices: callers check that first
    (:func:`unsplit`), and keep the einsum otherwise.

    Example:
      >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 2, 5))
      >>> token_matmul(x, w, 1).shape
      (2, 3, 2, 5)
    """
    b, t = x.shape[:2]
    inner = x.shape[2:]
    outer = w.shape[contract:]
    flat = rows_matmul(x.reshape(b * t, math.prod(inner)), w, contract)
    return flat.reshape(b, t, *outer)


class RMSNorm(nnx.Module):
    """RMSNorm over the last dimension, times ``offset + scale`` (``offset`` 1: Gemma's, whose
    scale starts at 0)."""

    def __init__(
        self, dim: int, eps: float, param_dtype: str, rngs: nnx.Rngs, offset: float = 0.0, axis: str = "embed"
    ):
        init = nnx.initializers.zeros if offset else nnx.initializers.ones
        self.scale = _param(rngs, init, (dim,), (axis,), param_dtype)
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)  # (B, T, D)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (normed * (self.offset + scale if self.offset else scale)).astype(x.dtype)


def rotary(
    x: jax.Array, theta: float, scaling: RopeScaling | None = None, positions: jax.Array | None = None
) -> jax.Array:
    """Rotary position embedding of ``x`` (B, T, heads, K) in the rotate-half layout (the two
    halves of each head rotate together), by position along T, or by ``positions`` (B, T) when
    given (rows of a batched KV-cache decode, each at its own offset)."""
    inv_freq = inverse_frequencies(x.shape[-1], theta, scaling)
    if positions is None:
        cos, sin = angles(x.shape[1], inv_freq)  # (1, T, 1, K/2) each
        return _rotate(x, cos, sin)
    a = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, K/2)
    return _rotate(x, jnp.cos(a)[:, :, None, :], jnp.sin(a)[:, :, None, :])


def _rotate(x: jax.Array, cos: Any, sin: Any) -> jax.Array:
    # The angles depend only on static shapes: computed in NumPy, they enter the program as
    # constants. Traced, XLA evaluated cos and sin inside every fusion that reads them, forward
    # and backward (on CPU the fused QKV output's gradient took 8 ms per layer, 3 ms after).
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # (B, T, heads, K/2) each
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def layer_rotary(
    x: jax.Array, cfg: GPTConfig, sliding: bool | jax.Array, positions: jax.Array | None = None
) -> jax.Array:
    """:func:`rotary` with the base of this layer's kind: a sliding-window layer of a model with
    ``rope_local_theta`` (Gemma 3) uses that base, unscaled; ``sliding`` may be traced (a scanned
    stack of mixed layers), then both rotations are computed and the layer's flag picks one."""
    if cfg.rope_local_theta is None:
        return rotary(x, cfg.rope_theta, cfg.rope_scaling, positions)
    if isinstance(sliding, bool):
        if sliding:
            return rotary(x, cfg.rope_local_theta, None, positions)
        return rotary(x, cfg.rope_theta, cfg.rope_scaling, positions)
    if positions is not None:
        local, full = (
            rotary(x, cfg.rope_local_theta, None, positions),
            rotary(x, cfg.rope_theta, cfg.rope_scaling, positions),
        )
        return jnp.where(sliding, local, full)
    t, k = x.shape[1], x.shape[-1]
    cos_g, sin_g = angles(t, inverse_frequencies(k, cfg.rope_theta, cfg.rope_scaling))
    cos_l, sin_l = angles(t, inverse_frequencies(k, cfg.rope_local_theta))
    return _rotate(x, jnp.where(sliding, cos_l, cos_g), jnp.where(sliding, sin_l, sin_g))


def causal_attention_in_blocks(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    attend: Callable[[jax.Array, jax.Array, jax.Array, int], jax.Array] | None = None,
    block: int = 128,
) -> jax.Array:
    """Causal attention a block of queries at a time, each block against the keys up to its
    end: the scores above the diagonal's blocks are never formed.

    A prompt's first pass (no gradient). On XLA:CPU one layer of the mini GPT over 1,024 tokens
    took 31.7 ms whole and 5.9 ms in blocks of 128 (half the scores, and each block's fit in the
    processor's caches). Blocks grow past 128 so that no prompt takes more than 16 of them.

    Args:
      q: ``(B, T, H, K)``; k, v: ``(B, T, N, K)``, ``H`` a multiple of ``N``.
      attend: ``(queries (B, Tq, H, K), keys and values (B, S, N, K), first query's position)
        -> (B, Tq, H, K)``, the causal attention of one block (None:
        ``jax.nn.dot_product_attention`` with the causal mask).
      block: queries per block at least (the whole ``T`` when it is no longer).

    Returns:
      ``(B, T, H, K)``.

    Example:
      >>> q, kv = jnp.ones((1, 300, 4, 8)), jnp.ones((1, 300, 2, 8))
      >>> causal_attention_in_blocks(q, kv, kv).shape
      (1, 300, 4, 8)
    """
    attend = attend or _masked_dot_product_attention
    t = q.shape[1]
    block = max(block, -(-t // 16))
    starts = range(0, t, block)
    return jnp.concatenate([attend(q[:, s : s + block], k[:, : s + block], v[:, : s + block], s) for s in starts], 1)


def _masked_dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: int) -> jax.Array:
    """``jax.nn.dot_product_attention`` of queries at positions ``start ..`` against keys ``0 ..``."""
    if start == 0 and q.shape[1] == k.shape[1]:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    visible = np.arange(k.shape[1])[None, :] <= np.arange(start, start + q.shape[1])[:, None]  # (queries, keys)
    return jax.nn.dot_product_attention(q, k, v, mask=visible[None, None])


def explicit_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cfg: GPTConfig,
    sliding: bool | jax.Array,
    cached: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    documents: jax.Array | None = None,
    query_start: int = 0,
) -> jax.Array:
    """Causal grouped-KV attention written out, for what ``jax.nn.dot_product_attention`` lacks:
    a query scale of the config's, soft-capped scores, a sliding window whose use may be a
    traced per-layer flag, and the keys of earlier tokens in a KV cache.

    Args:
      q: ``(B, T, H, K)``; query head ``h`` reads kv head ``h // (H / N)``.
      k, v: ``(B, S, N, K)``, the keys and values of positions ``0 .. S - 1``, ``S = query_start
        + T`` (the same tokens' when ``query_start`` is 0: each sees itself and those before).
      cfg: the scale, soft cap and window.
      sliding: whether this layer's window applies (a bool, or a traced scalar).
      cached: ``(keys, values, positions)`` of a KV cache (:mod:`shardkit.models.kv_cache`):
        ``(B, N, C, K)`` slots of each row's earlier tokens (slot ``j``: position ``j``), and the
        ``(B, T)`` positions of the T tokens, consecutive in a row. A token sees the slots before
        its row's first new position. The cache is read, not written: the caller writes the new
        tokens' slots once, after every layer (no copy of the cache per token).
      documents: ``(B, T)`` segments of packed rows (:mod:`shardkit.models.segments`): a token
        sees the tokens of its own document only.
      query_start: the first query's position (a block of a prompt's queries,
        :func:`causal_attention_in_blocks`); 0 with ``cached`` or ``documents``.

    Returns:
      ``(B, T, H, K)``; softmax in float32, as Hugging Face's eager attention computes it.
    """
    b, t, h, d = q.shape
    n, span = k.shape[2], k.shape[1]
    qg = q.reshape(b, t, n, h // n, d)  # (B, T, N, G, K)
    if cached is not None and t == 1:
        keys, values, positions = cached
        return one_token_attention(qg[:, 0], k[:, 0], v[:, 0], keys, values, positions[:, 0], cfg, sliding)[:, None]
    queries, offsets = np.arange(query_start, query_start + t), np.arange(span)
    own = _allowed(_scores(qg, k, cfg), queries[:, None], offsets, cfg, sliding, span)  # (B, N, G, T, S)
    if documents is not None:
        own = jnp.where(same_document(documents, documents)[:, None, None], own, jnp.finfo(jnp.float32).min)
    if cached is None:
        weights = jax.nn.softmax(own, axis=-1).astype(v.dtype)
        return jnp.einsum("bngts,bsnk->btngk", weights, v).reshape(b, t, h, d)
    keys, values, positions = cached
    c = keys.shape[2]
    query_pos = positions[:, None, None, :, None]  # (B, 1, 1, T, 1)
    slots = np.arange(c)
    visible = slots < query_pos[..., :1, :]  # the slots before the row's first new token
    earlier = _allowed(
        _scores(qg, keys, cfg, "bnsk"), query_pos, slots, cfg, sliding, c + t, visible
    )  # (B, N, G, T, C)
    weights = jax.nn.softmax(jnp.concatenate([earlier, own], axis=-1), axis=-1).astype(v.dtype)  # (B, N, G, T, C+T)
    out = jnp.einsum("bngts,bnsk->btngk", weights[..., :c], values)
    out = out + jnp.einsum("bngts,bsnk->btngk", weights[..., c:], v)
    return out.reshape(b, t, h, d)


def one_token_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    position: jax.Array,
    cfg: GPTConfig,
    sliding: bool | jax.Array,
) -> jax.Array:
    """:func:`explicit_attention` of one new token per row against a KV cache (a decode step).

    The same scores, masks and float32 softmax, written without the new tokens' axis: with it,
    XLA:CPU transposed each layer's scores and values around its matmuls (a decode step at 1,088
    cached positions of the ``mini`` GPT took 0.37 ms, 0.29 ms without).

    Args:
      q: ``(B, N, G, K)``, the token's queries grouped by kv head.
      k, v: ``(B, N, K)``, its own key and value (it sees itself).
      keys, values: ``(B, N, C, K)``, the cache; slot ``j`` holds position ``j``.
      position: ``(B,)`` int32, the token's position: it sees the slots before it.
      cfg: the scale, soft cap and window.
      sliding: whether this layer's window applies (a bool, or a traced scalar).

    Returns:
      ``(B, H, K)`` with ``H = N * G``, in ``v``'s dtype.

    Example:
      >>> cfg = GPTConfig.preset("tiny")
      >>> q, kv, cache = jnp.ones((1, 2, 2, 4)), jnp.ones((1, 2, 4)), jnp.zeros((1, 2, 8, 4))
      >>> one_token_attention(q, kv, kv, cache, cache, jnp.array([0]), cfg, False).shape
      (1, 4, 4)
    """
    b, n, g, d = q.shape
    c = keys.shape[2]
    own = _scaled(jnp.einsum("bngk,bnk->bng", q, k), cfg, d)[..., None]  # (B, N, G, 1)
    query_pos, slots = position[:, None, None, None], np.arange(c)  # (B, 1, 1, 1), (C,)
    earlier = _scaled(jnp.einsum("bngk,bnsk->bngs", q, keys), cfg, d)  # (B, N, G, C)
    earlier = _allowed(earlier, query_pos, slots, cfg, sliding, c + 1, slots < query_pos)
    weights = jax.nn.softmax(jnp.concatenate([earlier, own], axis=-1), axis=-1).astype(v.dtype)  # (B, N, G, C+1)
    out = jnp.einsum("bngs,bnsk->bngk", weights[..., :c], values) + weights[..., c:] * v[:, :, None]
    return out.reshape(b, n * g, d)


def _scores(qg: jax.Array, k: jax.Array, cfg: GPTConfig, keys: str = "bsnk") -> jax.Array:
    """Scaled, soft-capped scores ``(B, N, G, T, S)`` in float32 of grouped queries against keys
    laid out as ``keys`` says (``bsnk``: tokens' keys; ``bnsk``: a cache's)."""
    return _scaled(jnp.einsum(f"btngk,{keys}->bngts", qg, k), cfg, qg.shape[-1])


def _scaled(scores: jax.Array, cfg: GPTConfig, head_dim: int) -> jax.Array:
    """Raw query-key products in float32, scaled by the config's query scale (or ``head_dim``'s
    inverse square root) and soft-capped where the config caps them."""
    scale = cfg.query_scale if cfg.query_scale is not None else head_dim**-0.5
    scores = scores.astype(jnp.float32) * scale
    if cfg.attn_softcap is not None:
        scores = cfg.attn_softcap * jnp.tanh(scores / cfg.attn_softcap)
    return scores


def _allowed(
    scores: jax.Array,
    query_pos: Any,
    key_pos: Any,
    cfg: GPTConfig,
    sliding: bool | jax.Array,
    span: int,
    visible: Any = True,
) -> jax.Array:
    """``scores`` with the keys a query may not see set to the float32 minimum: later keys, keys
    past the sliding window, and those not ``visible``. Positions broadcast: query rows
    ``(..., T, 1)`` against keys ``(S,)``; ``span``: how many positions the keys cover (a window
    at least as long changes nothing)."""
    allowed: Any = (key_pos <= query_pos) & visible
    if cfg.sliding_window is not None and cfg.sliding_window < span and sliding is not False:
        in_window = allowed & (key_pos > query_pos - cfg.sliding_window)
        allowed = in_window if sliding is True else jnp.where(sliding, in_window, allowed)
    return jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)


class Attention(nnx.Module):
    """Grouped-KV causal attention with one fused QKV projection.

    ``wqkv`` is (D, N, G + 2, K): for each kv head, its G query heads, its key and its value.
    One weight means one matmul, so under tensor parallelism the backward pass all-reduces
    the input gradient once (Megatron's count), not once per projection; sharding the kv-head
    dimension keeps whole groups on one device.
    """

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, n, k, p = cfg.dim, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        self.groups = cfg.n_heads // cfg.n_kv_heads
        qkv_init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2, 3))
        self.wqkv = _param(rngs, qkv_init, (d, n, self.groups + 2, k), ("embed", "kv_heads", None, "kv"), p)
        if cfg.qkv_bias:
            self.bqkv = _param(rngs, nnx.initializers.zeros, (n, self.groups + 2, k), ("kv_heads", None, "kv"), p)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(k, cfg.norm_eps, p, rngs, cfg.norm_offset, axis="kv")
            self.k_norm = RMSNorm(k, cfg.norm_eps, p, rngs, cfg.norm_offset, axis="kv")
        self.wo = _param(
            rngs,
            nnx.initializers.lecun_normal(in_axis=(0, 1), out_axis=2),
            (cfg.n_heads, k, d),
            ("heads", "kv", "embed"),
            p,
        )
        embed = ((d,), ("embed",))
        _adapters(self, cfg, rngs, "q_proj", embed, ((n, self.groups, k), ("kv_heads", None, "kv")))
        _adapters(self, cfg, rngs, "k_proj", embed, ((n, k), ("kv_heads", "kv")))
        _adapters(self, cfg, rngs, "v_proj", embed, ((n, k), ("kv_heads", "kv")))
        _adapters(self, cfg, rngs, "o_proj", ((cfg.n_heads, k), ("heads", "kv")), embed)
        self.cfg = cfg

    def blocked(self, t: int) -> bool:
        """Whether this config's attention over ``t`` tokens runs the blocked kernel
        (:mod:`shardkit.parallel.attention`) rather than the whole score matrix: as
        ``cfg.attention`` says; by default from :data:`BLOCKED_FROM` tokens off GPUs (on GPUs,
        wherever cuDNN does not serve the mask: see :meth:`attend`)."""
        if self.cfg.attention is not None:
            return self.cfg.attention == "blocked"
        on_gpu = jax.default_backend() == "gpu"
        return (on_gpu and (self.explicit(t) or current_segments() is not None)) or (not on_gpu and t >= BLOCKED_FROM)

    def window(self, sliding: bool | jax.Array, t: int) -> int | jax.Array | None:
        """This layer's window over ``t`` tokens for :func:`attention` (None: none; traced where
        ``sliding`` is: ``t`` keys, which hide nothing, when the layer is not sliding)."""
        w = self.cfg.sliding_window
        if w is None or w >= t or sliding is False:
            return None
        return w if sliding is True else jnp.where(sliding, w, t)

    def masks(self, sliding: bool | jax.Array, t: int, documents: jax.Array | None) -> dict[str, Any]:
        """This config's masks over ``t`` tokens as :func:`attention` and ring attention take
        them: the window, soft cap, scale and packed documents."""
        cfg = self.cfg
        return dict(window=self.window(sliding, t), softcap=cfg.attn_softcap, scale=cfg.query_scale, segments=documents)

    def blocked_attention(
        self, q: jax.Array, k: jax.Array, v: jax.Array, sliding: bool | jax.Array, documents: jax.Array | None
    ) -> jax.Array:
        """The blocked kernel with this config's masks: ``(B, T, H, K)``."""
        return attention(q, k, v, implementation="blocked", **self.masks(sliding, q.shape[1], documents))

    def explicit(self, t: int) -> bool:
        """Whether this config needs :func:`explicit_attention` at sequence length ``t``."""
        cfg = self.cfg
        window = cfg.sliding_window is not None and cfg.sliding_window < t and any(cfg.sliding_layers)
        return window or cfg.attn_softcap is not None or cfg.query_scale is not None

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(B, T, D)`` -> queries ``(B, T, H, K)``, keys and values ``(B, T, N, K)``, with the
        q/k norms applied and before the rotary embedding."""
        b, t, _ = x.shape
        g = self.groups
        with jax.named_scope("qkv_proj"):
            x = gathered_along_seq(x)
            w = self.wqkv[...].astype(x.dtype)
            flat = unsplit("seq", "kv_heads", "kv")
            qkv = token_matmul(x, w, 1) if flat else jnp.einsum("btd,dngk->btngk", x, w)  # (B, T, N, G+2, K)
            if self.cfg.qkv_bias:
                qkv = qkv + self.bqkv[...].astype(x.dtype)
            qkv = constrain(qkv, ("batch", "seq", "kv_heads", None, "kv"))  # heads split, not the sequence
        q, k, v = qkv[:, :, :, :g, :], qkv[:, :, :, g, :], qkv[:, :, :, g + 1, :]  # (B, T, N, G, K), (B, T, N, K)
        if self.cfg.lora is not None:  # adapters added before the norms, as on Hugging Face's projections
            deltas = [_low_rank(self, self.cfg, short, x, "btd,dr->btr") for short in "qkv"]
            q, k, v = (y if delta is None else y + delta for y, delta in zip((q, k, v), deltas, strict=True))
        q = q.reshape(b, t, -1, qkv.shape[-1])  # (B, T, H, K), head h -> kv head h // G
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def output(self, out: jax.Array) -> jax.Array:
        """The attention's ``(B, T, H, K)`` result projected back to ``(B, T, D)``."""
        out = constrain(out, ("batch", "seq", "heads", "kv"))
        with jax.named_scope("out_proj"):
            w = self.wo[...].astype(out.dtype)
            flat = unsplit("seq", "heads", "kv")
            y = token_matmul(out, w, 2) if flat else jnp.einsum("bthk,hkd->btd", out, w)  # (B, T, D)
            delta = _low_rank(self, self.cfg, "o", out, "bthk,hkr->btr")
            return y if delta is None else y + delta

    def decode(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: tuple[jax.Array, jax.Array],
        sliding: bool | jax.Array,
        fresh: bool = False,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of new tokens against a KV cache (:mod:`shardkit.models.kv_cache`).

        Args:
          x: ``(B, S, D)``, the new tokens' normed activations.
          positions: ``(B, S)`` int32, their positions (consecutive within a row).
          cache: keys and values ``(B, N, C, K)`` each of the earlier tokens; slot ``j`` of a row
            is its position ``j``.
          sliding: whether this layer keeps to the sliding window.
          fresh: the cache is empty and every row starts at position 0 (a prompt's first pass):
            the new tokens attend to each other only, the cache's slots are not scored.

        Returns:
          ``((B, S, D), (keys, values))``: the output and the new tokens' keys and values
          ``(B, S, N, K)``, for the caller to write into the cache.
        """
        q, k, v = self.project(x)
        q = layer_rotary(q, self.cfg, sliding, positions)  # (B, S, H, K)
        k = layer_rotary(k, self.cfg, sliding, positions)  # (B, S, N, K)
        with jax.named_scope("attention"):
            if fresh and self.blocked(x.shape[1]):  # a long prompt: linear memory, hidden blocks skipped
                out = self.blocked_attention(q, k, v, sliding, None)
            elif fresh and not self.explicit(x.shape[1]):  # the training path's attention: rows start at 0
                out = causal_attention_in_blocks(q, k, v)
            elif fresh:

                def attend(qb: jax.Array, kb: jax.Array, vb: jax.Array, start: int) -> jax.Array:
                    return explicit_attention(qb, kb, vb, self.cfg, sliding, query_start=start)

                out = causal_attention_in_blocks(q, k, v, attend)
            else:
                out = explicit_attention(q, k, v, self.cfg, sliding, (*cache, positions))
        return self.output(out), (k, v)  # out: (B, S, H, K)

    def __call__(self, x: jax.Array, sliding: bool | jax.Array = False) -> jax.Array:
        q, k, v = self.project(x)
        documents = current_segments()  # packed rows: attention within a document, positions from its start
        positions = None if documents is None else positions_in_rows(documents)
        q = constrain(layer_rotary(q, self.cfg, sliding, positions), ("batch", "seq", "heads", "kv"))
        k = constrain(layer_rotary(k, self.cfg, sliding, positions), ("batch", "seq", "kv_heads", "kv"))
        with jax.named_scope("attention"):
            out = self.attend(q, k, v, sliding, documents)  # (B, T, H, K)
        return self.output(out)

    def attend(
        self, q: jax.Array, k: jax.Array, v: jax.Array, sliding: bool | jax.Array, documents: jax.Array | None
    ) -> jax.Array:
        """Training attention of queries ``(B, T, H, K)`` against keys and values ``(B, T, N, K)``
        by the path that serves this config, mask and backend (see ``GPTConfig.attention``)."""
        cfg, t = self.cfg, q.shape[1]
        context = current_rules()
        if context is not None and dict(context[0].shape).get("sequence", 1) > 1:
            # The sequence split over devices, each step the blocked kernel.
            return ring_attention(q, k, v, *context, **self.masks(sliding, t, documents))
        if self.blocked(t):
            return self.blocked_attention(q, k, v, sliding, documents)
        if self.explicit(t):
            return explicit_attention(q, k, v, cfg, sliding, documents=documents)
        if documents is not None:
            mask = same_document(documents, documents)[:, None]  # (B, 1, T, T), causal on top
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
        if cfg.attention is None and jax.default_backend() == "gpu":
            fused = _cudnn_attention(q, k, v)  # an array: tested against None, never for truth
            return fused if fused is not None else self.blocked_attention(q, k, v, sliding, None)
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            implementation=cfg.attention,  # type: ignore[arg-type]  # checked in GPTConfig
        )


def _cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array | None:
    """cuDNN's fused causal attention, or None where it does not serve these shapes, this dtype
    (it takes 16-bit floats) or this GPU."""
    try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    except (ValueError, NotImplementedError, RuntimeError, TypeError):
        return None


class SwiGLU(nnx.Module):
    """Gated MLP (SwiGLU, or GeGLU with ``mlp_activation="gelu_tanh"``); gate and up projections
    fused in one (D, 2, F) weight (one backward all-reduce)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, f, p = cfg.dim, cfg.mlp_dim, cfg.param_dtype
        gate_up_init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
        self.w_gate_up = _param(rngs, gate_up_init, (d, 2, f), ("embed", None, "mlp"), p)
        self.w_down = _param(rngs, nnx.initializers.lecun_normal(), (f, d), ("mlp", "embed"), p)
        self.activation = MLP_ACTIVATIONS[cfg.mlp_activation]
        embed, units = ((d,), ("embed",)), ((f,), ("mlp",))
        _adapters(self, cfg, rngs, "gate_proj", embed, units)
        _adapters(self, cfg, rngs, "up_proj", embed, units)
        _adapters(self, cfg, rngs, "down_proj", units, embed)
        self.cfg = cfg

    def __call__(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("gate_up_proj"):
            x = gathered_along_seq(x)
            w = self.w_gate_up[...].astype(x.dtype)
            flat = unsplit("seq", "mlp")
            gate_up = token_matmul(x, w, 1) if flat else jnp.einsum("btd,dcf->btcf", x, w)  # (B, T, 2, F)
            gate_up = constrain(gate_up, ("batch", "seq", None, "mlp"))
        gate, up = gate_up[:, :, 0], gate_up[:, :, 1]  # (B, T, F) each
        if self.cfg.lora is not None:
            deltas = [_low_rank(self, self.cfg, short, x, "btd,dr->btr") for short in ("gate", "up")]
            gate, up = (y if delta is None else y + delta for y, delta in zip((gate, up), deltas, strict=True))
        h = self.activation(gate) * up  # (B, T, F)
        h = constrain(h, ("batch", "seq", "mlp"))
        with jax.named_scope("down_proj"):
            if unsplit("seq"):
                y = token_matmul(h, self.w_down[...].astype(x.dtype), 1)  # (B, T, D)
            else:
                y = h @ self.w_down[...].astype(x.dtype)
            delta = _low_rank(self, self.cfg, "down", h, "btf,fr->btr")
            return y if delta is None else y + delta


class Block(nnx.Module):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU, each with a residual."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, cfg.dim, cfg.norm_eps, cfg.param_dtype, rngs, cfg.norm_offset)
        self.attn_norm = norm()
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = norm()
        if cfg.post_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(), norm()
        self.mlp: MoE | SwiGLU
        if cfg.n_experts:
            self.mlp = MoE(
                cfg.dim,
                cfg.mlp_dim,
                cfg.n_experts,
                cfg.top_k,
                cfg.capacity_factor,
                cfg.param_dtype,
                rngs,
                dropless=cfg.moe_dropless,
            )
        else:
            self.mlp = SwiGLU(cfg, rngs)
        self.dropout, self.post_norms = cfg.dropout, cfg.post_norms
        self.adapter_dropout = cfg.lora.dropout if cfg.lora is not None else 0.0

    def __call__(
        self, x: jax.Array, key: jax.Array | None, sliding: bool | jax.Array = False
    ) -> tuple[jax.Array, jax.Array | ExpertLoad]:
        """``(B, T, D) -> ((B, T, D), 0 for a dense MLP, or the experts' ExpertLoad of this layer)``.

        ``sliding``: whether this layer's attention keeps to the sliding window (may be traced).
        """
        return self.residuals(x, key, lambda h: self.attn(h, sliding))

    def decode(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: tuple[jax.Array, jax.Array],
        sliding: bool | jax.Array,
        fresh: bool = False,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The layer over new tokens with a KV cache: ``(B, S, D) -> ((B, S, D), (keys, values))``,
        the new tokens' own keys and values (see :meth:`Attention.decode`, and ``fresh``); no dropout."""
        written = []

        def attend(h: jax.Array) -> jax.Array:
            out, kv = self.attn.decode(h, positions, cache, sliding, fresh)
            written.append(kv)
            return out

        x, _ = self.residuals(x, None, attend)
        return x, written[0]

    def residuals(
        self, x: jax.Array, key: jax.Array | None, attend: Callable[[jax.Array], jax.Array]
    ) -> tuple[jax.Array, jax.Array | ExpertLoad]:
        """The layer around an attention ``attend`` of the normed input (the plain one, or a
        KV-cached one, :mod:`shardkit.models.kv_cache`): both residual branches and their norms."""
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        # The adapters' dropout draws from its own key: k1 and k2 stay those of a model without adapters.
        adapters = None if key is None or not self.adapter_dropout else jax.random.fold_in(key, 2)
        token = _ADAPTER_KEY.set(adapters)
        try:
            with jax.named_scope("attn"):
                out = attend(self.attn_norm(x))
                if self.post_norms:
                    out = self.post_attn_norm(out)
                x = x + dropout(out, self.dropout, k1)  # (B, T, D)
            with jax.named_scope("mlp"):
                mixed = self.mlp(self.mlp_norm(x))
                out, aux = mixed if isinstance(mixed, tuple) else (mixed, jnp.zeros((), jnp.float32))
                if self.post_norms:
                    out = self.post_mlp_norm(out)
                x = x + dropout(out, self.dropout, k2)  # (B, T, D)
        finally:
            _ADAPTER_KEY.reset(token)
        return constrain(x, ("batch", "seq", "embed")), aux


def _layer(
    block: Block,
    x: jax.Array,
    key: jax.Array | None,
    remat: str,
    name: str = "layer",
    sliding: bool | jax.Array = False,
) -> tuple[jax.Array, jax.Array | ExpertLoad]:
    with jax.named_scope(name):  # collectives in reports say which layer they come from
        if remat == "none":
            return block(x, key, sliding)
        if isinstance(sliding, bool):
            return nnx.remat(lambda b, h, k: b(h, k, sliding), policy=REMAT_POLICIES[remat])(block, x, key)
        return nnx.remat(lambda b, h, k, s: b(h, k, s), policy=REMAT_POLICIES[remat])(block, x, key, sliding)


class GPT(nnx.Module):
    """Decoder-only language model. ``__call__(tokens (B, T) int, rngs=None) -> logits (B, T, V)``,
    or ``(logits, ExpertLoad)`` for a mixture-of-experts GPT (``n_experts > 0``): the weighted
    load-balancing loss (``.loss``, which the step adds) and each layer's routed and dropped tokens.

    ``rngs`` (an ``nnx.Rngs`` with a ``dropout`` stream) turns dropout on; None is evaluation.
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        p = cfg.param_dtype
        self.embed = _param(rngs, nnx.initializers.normal(0.02), (cfg.vocab, cfg.dim), ("vocab", "embed"), p)
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])  # type: ignore[assignment]
        self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps, p, rngs, cfg.norm_offset)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, nnx.initializers.lecun_normal(), (cfg.dim, cfg.vocab), ("embed", "vocab"), p)

    def _keys(self, key: jax.Array | None) -> jax.Array | None:
        """Dropout keys: one per layer, then one for the embedding; None when dropout is off
        (the model's, and its LoRA adapters')."""
        adapters = self.cfg.lora is not None and self.cfg.lora.dropout > 0.0
        if key is None or (self.cfg.dropout == 0.0 and not adapters):
            return None
        return jax.random.split(key, self.cfg.n_layers + 1)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """``cfg.dtype``, or the parameters' own dtype when it is None."""
        return self.embed[...].dtype if self.cfg.dtype is None else jnp.dtype(self.cfg.dtype)

    def embed_inputs(self, tokens: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """``(B, T)`` tokens -> ``(B, T, D)`` embeddings (with dropout when ``key`` is given)."""
        cfg = self.cfg
        documents = current_segments()
        if documents is not None and documents.shape != tokens.shape:
            raise InputError(
                f"batch['segments'] {tuple(documents.shape)} does not match the rows this GPT reads "
                f"{tuple(tokens.shape)}: packed rows work in one forward over the batch, not through a pipeline's "
                "microbatches. Fix: a layout without the stage axis, or rows of one document each."
            )
        if tokens.shape[-1] > cfg.max_seq:  # however the model is wrapped (sk.from_nnx too), before any compile
            raise InputError(
                f"GPT got sequences of {tokens.shape[-1]} tokens; it takes at most max_seq={cfg.max_seq} positions. "
                "Fix: shorter sequences (seq_len), or a GPTConfig with a larger max_seq."
            )
        dt = self.compute_dtype
        keys = self._keys(key)
        # Gather the table's embed dimension first (what FSDP does for every weight), so the
        # lookup is a vocab-parallel gather rather than a reshard of the (B, T, D) activations.
        with jax.named_scope("embed"):
            table = constrain(self.embed[...], ("vocab", None))  # (V, D)
            # Whole along the sequence first: under sequence parallelism the lookup is then
            # vocab-parallel and scattered to the sequence shards, never a gather of the table.
            x = gathered_along_seq(jnp.take(table, tokens, axis=0).astype(dt))  # (B, T, D)
            if cfg.embed_scale:  # the factor rounded to the compute dtype first, as Gemma's reference does
                x = x * jnp.asarray(math.sqrt(cfg.dim), dtype=dt)
        return constrain(dropout(x, cfg.dropout, None if keys is None else keys[-1]), ("batch", "seq", "embed"))

    def run_layers(
        self, x: jax.Array, key: jax.Array | None = None, first_layer: int | jax.Array = 0
    ) -> tuple[jax.Array, jax.Array]:
        """Run the layers this module holds (all of them, or one pipeline stage's slice).

        Args:
          x: ``(B, T, D)`` activations.
          key: the dropout key of the whole model; layer ``first_layer + j`` uses its own share.
          first_layer: the number of the first layer held here (a pipeline stage's offset).

        Returns:
          ``((B, T, D), weighted load-balancing loss of these layers)`` (0 for a dense MLP).
        """
        x, per_layer = self.layers_with_load(x, key, first_layer)
        return x, per_layer.loss if isinstance(per_layer, ExpertLoad) else per_layer

    def layers_with_load(
        self, x: jax.Array, key: jax.Array | None = None, first_layer: int | jax.Array = 0
    ) -> tuple[jax.Array, jax.Array | ExpertLoad]:
        """:meth:`run_layers`, and for a mixture of experts where the tokens went: ``(x, loss)``
        for a dense MLP, ``(x, ExpertLoad)`` (the weighted loss, each layer's load) otherwise."""
        cfg = self.cfg
        keys = self._keys(key)
        kinds = cfg.sliding_layers
        mixed = len(set(kinds)) > 1  # else every layer is of one kind, known while tracing
        if cfg.scan_layers:
            held = jax.tree.leaves(nnx.state(self.blocks, nnx.Param))[0].shape[0]
            if keys is not None:
                keys = jax.lax.dynamic_slice_in_dim(keys, first_layer, held)
            flags = jax.lax.dynamic_slice_in_dim(jnp.asarray(kinds), first_layer, held) if mixed else None

            @nnx.scan(
                unroll=cfg.scan_unroll,
                in_axes=(nnx.Carry, 0, 0 if keys is not None else None, 0 if mixed else None),
                out_axes=(nnx.Carry, 0),
                transform_metadata={nnx.PARTITION_NAME: "layers"},
            )
            def run(
                x: jax.Array, block: Block, key: jax.Array | None, flag: jax.Array | None
            ) -> tuple[jax.Array, jax.Array | ExpertLoad]:
                return _layer(block, x, key, cfg.remat, sliding=kinds[0] if flag is None else flag)

            x, aux = run(x, self.blocks, keys, flags)  # (B, T, D), (layers,)
        else:
            per_layer = []
            blocks: Any = self.blocks  # an nnx.List when unrolled
            if mixed and not isinstance(first_layer, int):
                raise ModelError("Unrolled layers of mixed attention kinds need a static first_layer.")
            for i, block in enumerate(blocks):
                sliding = kinds[int(first_layer) + i]
                layer_key = None if keys is None else keys[i]
                x, layer_aux = _layer(block, x, layer_key, cfg.remat, f"layer_{i}", sliding)
                per_layer.append(layer_aux)
            aux = jax.tree.map(lambda *layers: jnp.stack(layers), *per_layer)  # (L, ...)
        if isinstance(aux, ExpertLoad):
            return x, aux._replace(loss=cfg.aux_loss_weight * aux.loss.sum() / cfg.n_layers)
        return x, cfg.aux_loss_weight * aux.sum() / cfg.n_layers

    def head(self, x: jax.Array) -> jax.Array:
        """``(B, T, D)`` -> ``(B, T, V)`` logits: final norm and output projection."""
        dt = self.compute_dtype
        x = self.final_norm(x)
        with jax.named_scope("lm_head"):
            if self.cfg.tie_embeddings:
                logits = jnp.einsum("btd,vd->btv", x, self.embed[...].astype(dt))  # (B, T, V)
            elif unsplit("seq"):
                logits = token_matmul(x, self.lm_head[...].astype(dt), 1)  # (B, T, V)
            else:
                logits = x @ self.lm_head[...].astype(dt)
            if self.cfg.final_softcap is not None:
                logits = self.cfg.final_softcap * jnp.tanh(logits / self.cfg.final_softcap)
        return constrain(logits, ("batch", "seq", "vocab"))

    def decode(
        self, tokens: jax.Array, positions: jax.Array, cache: LayerCaches, fresh: bool = False
    ) -> tuple[jax.Array, LayerCaches]:
        """New tokens through every layer with a KV cache (:mod:`shardkit.models.kv_cache`).

        Args:
          tokens: ``(B, S)`` int, the new tokens of each row.
          positions: ``(B, S)`` int32, their positions.
          cache: each layer's keys and values, ``(B, N, C, K)`` each.
          fresh: the cache is empty and rows start at position 0 (a prompt's first pass): no
            layer reads it (:meth:`Attention.decode`).

        Returns:
          ``((B, S, D)`` hidden states before the final norm, the cache with the new slots written).
        """
        cfg = self.cfg
        x = self.embed_inputs(tokens)  # (B, S, D)
        kinds = cfg.sliding_layers
        mixed = len(set(kinds)) > 1
        if cfg.scan_layers:
            stacked = None if fresh else tuple(jnp.stack(part) for part in zip(*cache, strict=True))  # (L, B, N, C, K)

            @nnx.scan(
                in_axes=(nnx.Carry, 0, 0 if stacked else None, 0 if mixed else None),
                out_axes=(nnx.Carry, 0),
                transform_metadata={nnx.PARTITION_NAME: "layers"},
            )
            def run(x: jax.Array, block: Block, kv: Any, flag: jax.Array | None):
                return block.decode(x, positions, kv, kinds[0] if flag is None else flag, fresh)

            x, (keys, values) = run(x, self.blocks, stacked, jnp.asarray(kinds) if mixed else None)  # (L, B, S, N, K)
            written = [(keys[i], values[i]) for i in range(cfg.n_layers)]
        else:
            written = []
            blocks: Any = self.blocks  # an nnx.List when unrolled
            for i, block in enumerate(blocks):
                x, kv = block.decode(x, positions, cache[i], kinds[i], fresh)
                written.append(kv)
        # The new slots written after every layer read the cache, each layer's own buffer in place
        # (one stacked buffer was sliced, that is copied, by every layer at every token).
        if not fresh:
            written = after_reads(x, written)
        return x, tuple(write_layer(old, new, positions[:, 0]) for old, new in zip(cache, written, strict=True))

    def __call__(
        self, tokens: jax.Array, rngs: nnx.Rngs | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array | ExpertLoad]:
        key = None if rngs is None else rngs.dropout()
        x, aux = self.layers_with_load(self.embed_inputs(tokens, key), key)
        logits = self.head(x)
        return (logits, aux) if self.cfg.n_experts else logits


@functools.cache
def _graphdef(cfg: GPTConfig) -> Any:
    """The graph of a GPT of this config (built abstractly once), for ``nnx.merge`` with parameters."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param, ...)[0]
