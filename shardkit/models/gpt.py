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

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.core.errors import InputError, ModelError, short_repr
from shardkit.core.partition import constrain
from shardkit.models.dropout import dropout
from shardkit.models.kv_cache import KV_NAMES, Decoder, LayerCaches, after_reads, pick_rows, write_layer
from shardkit.models.layers.adapters import ADAPTER_KEY
from shardkit.models.layers.attention import Attention
from shardkit.models.layers.latent_attention import LatentAttention, LatentConfig
from shardkit.models.layers.matmul import gathered_along_seq, token_matmul, unsplit
from shardkit.models.layers.mlp import MLP_ACTIVATIONS, SwiGLU
from shardkit.models.layers.norms import RMSNorm, param
from shardkit.models.lora import LoRA, is_adapter
from shardkit.models.model import Model
from shardkit.models.nnx_adapter import from_nnx
from shardkit.models.rope import RopeScaling
from shardkit.models.segments import current_segments
from shardkit.parallel.experts import DISPATCHES, ExpertLoad, MoE, Router, balance_bias, clamped_swiglu

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
    # How tokens reach their experts: "sorted" (grouped matmuls on top_k rows a token, dropless memory
    # linear in the sequence) or "einsum" (GShard's one-hot buffers); both drop the same tokens.
    moe_dispatch: str = "sorted"
    lora: LoRA | None = None  # low-rank adapters on a frozen base (shardkit.models.lora)
    # -- the frontier's mixtures (Qwen3-MoE, DeepSeek-V3 / Kimi K2, gpt-oss) --
    moe_mlp_dim: int | None = None  # each expert's hidden size; None: mlp_dim
    dense_layers: tuple[int, ...] = ()  # layers of a mixture whose MLP is dense, of mlp_dim (needs unscanned layers)
    shared_experts: int = 0  # experts every token passes through: a dense MLP of shared_experts * moe_mlp_dim
    router: Router = dataclasses.field(
        default_factory=Router
    )  # how experts are chosen and weighed (score, normalising, groups, biases)
    expert_bias: bool = False  # biases on the experts' units and outputs (gpt-oss)
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU in the experts (with swiglu_alpha)
    swiglu_alpha: float = 1.702
    attn_sinks: bool = False  # a learned logit per query head that joins its softmax (gpt-oss)
    attn_out_bias: bool = False  # a bias on the attention's output projection (gpt-oss)
    latent: LatentConfig | None = None  # multi-head latent attention in place of grouped (DeepSeek-V3)

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
        if self.moe_dispatch not in DISPATCHES:
            raise ModelError(
                f"GPTConfig: moe_dispatch={self.moe_dispatch!r}; choose {' or '.join(map(repr, DISPATCHES))}."
            )
        if self.n_experts and self.capacity_factor <= 0:
            raise ModelError(
                f"GPTConfig: capacity_factor={self.capacity_factor} must be > 0 (1.0: an even share of the "
                "tokens per expert; 1.25 is usual)."
            )

    def _check_families(self) -> None:
        for name in ("layer_types", "dense_layers"):
            if isinstance(getattr(self, name), list):  # from JSON
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.dense_layers and (not self.n_experts or any(not 0 <= i < self.n_layers for i in self.dense_layers)):
            raise ModelError(
                f"GPTConfig: dense_layers={self.dense_layers!r} must name layers 0..{self.n_layers - 1} of a mixture "
                "of experts (n_experts > 0)."
            )
        if self.dense_layers and self.scan_layers and self.dense_layers != tuple(range(len(self.dense_layers))):
            raise ModelError(
                f"GPTConfig: dense_layers={self.dense_layers!r} are not the first layers: scanned layers are a "
                "stack of dense layers then one of expert layers (DeepSeek's first_k_dense_replace); set "
                "scan_layers=False."
            )
        if self.latent is not None and self.lora is not None and set(self.lora.targets) - {"o_proj"}:
            raise ModelError(
                f"GPTConfig: LoRA on latent attention's {sorted(set(self.lora.targets) - {'o_proj'})}: its "
                "projections (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj) take no adapters yet; target "
                "o_proj."
            )
        if self.router.balance_rate and not self.n_experts:
            raise ModelError(
                f"GPTConfig: router balance_rate={self.router.balance_rate} balances experts, and n_experts=0; set "
                "n_experts, or leave the router's default."
            )
        if self.moe_mlp_dim is not None and self.moe_mlp_dim < 1:
            raise ModelError(f"GPTConfig: moe_mlp_dim={self.moe_mlp_dim} must be a positive integer (or None).")
        if self.latent is not None and self.n_kv_heads != self.n_heads:
            raise ModelError(
                f"GPTConfig: latent attention has one key and value per query head: n_kv_heads={self.n_kv_heads} "
                f"must equal n_heads={self.n_heads}."
            )
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
    def expert_dim(self) -> int:
        """Each expert's hidden size."""
        return self.moe_mlp_dim if self.moe_mlp_dim is not None else self.mlp_dim

    def layer_stacks(self) -> tuple[tuple[str, range], ...]:
        """Where the layers live in the parameter tree: ``(name, layers)`` per stack. One
        ``blocks`` stack (or list, unscanned), or scanned with a dense prefix (DeepSeek's first
        layers) ``dense_blocks`` for it and ``blocks`` for the expert layers after it.

        Example:
          >>> GPTConfig(n_experts=4, n_layers=3, dense_layers=(0,)).layer_stacks()
          (('dense_blocks', range(0, 1)), ('blocks', range(1, 3)))
        """
        k = len(self.dense_layers)
        if self.scan_layers and 0 < k < self.n_layers:
            return (("dense_blocks", range(k)), ("blocks", range(k, self.n_layers)))
        return (("blocks", range(self.n_layers)),)

    def routed(self, layer: int | None) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (None: the scanned body's)."""
        return bool(self.n_experts) and (layer is None or layer not in self.dense_layers)

    def expert_glu(self) -> Callable[[jax.Array, jax.Array], jax.Array] | None:
        """The experts' gated unit: gpt-oss's clamped one, or None for ``activation(gate) * up``."""
        return None if self.swiglu_limit is None else clamped_swiglu(self.swiglu_limit, self.swiglu_alpha)

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
            # a dense prefix is a stack of its own: no one stack to split into pipeline stages
            stacked_layers="blocks" if self.scan_layers and len(self.layer_stacks()) == 1 else None,
            boundaries=False,  # GPT constrains its own activations and names its own scopes
        )
        trainable: Callable[[str], bool] | None = None
        if self.lora is not None:  # LoRA: the base stays as it is
            trainable = is_adapter
        elif self.router.score_bias:  # moved by balance_bias from the load, never by an optimizer
            trainable = _not_score_bias

        after_update = functools.partial(_balanced, self) if self.router.balance_rate else None
        return dataclasses.replace(model, decoder=self.decoder(), trainable=trainable, after_update=after_update)

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
        # Latent attention keeps each token's latent and rotary key: (B, 1, C, R) and (B, 1, C, rope).
        widths = (k, k) if self.latent is None else (self.latent.kv_rank, self.latent.rope_dim)
        heads = n if self.latent is None else 1
        names = (KV_NAMES, KV_NAMES) if self.latent is None else (("batch", None, None, None),) * 2

        def empty(batch: int, length: int) -> LayerCaches:
            dtype = jnp.dtype(cfg.dtype or cfg.param_dtype)
            return tuple(
                tuple(jnp.zeros((batch, heads, length, w), dtype) for w in widths)  # type: ignore[misc]
                for _ in range(layers)
            )

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
            apart = {k: v for k, v in params.items() if k not in ("blocks", "dense_blocks")}
            apart["blocks"] = {
                i: jax.tree.map(lambda w, j=i - stack[0]: w[j], params[name])
                for name, stack in cfg.layer_stacks()
                for i in stack
            }
            return apart

        def step(params: Any, cache: Any, tokens: jax.Array, positions: jax.Array, last: jax.Array) -> Any:
            module = nnx.merge(_graphdef(apart), params)
            hidden, cache = module.decode(tokens, positions, cache)  # (B, 1, D)
            return module.head(hidden)[:, 0].astype(jnp.float32), cache

        return Decoder(
            empty,
            (names,) * layers,
            forward,
            self.max_seq,
            self.n_kv_heads if self.latent is None else None,
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
        d, k = self.dim, self.head_dim
        if self.latent is not None:
            attn = self.latent.num_params(d, self.n_heads)
        else:
            attn = d * self.n_heads * k * 2 + d * self.n_kv_heads * k * 2
            attn += (self.n_heads + 2 * self.n_kv_heads) * k if self.qkv_bias else 0
            attn += 2 * k if self.qk_norm else 0
        attn += (d if self.attn_out_bias else 0) + (self.n_heads if self.attn_sinks else 0)
        dense = 3 * d * self.mlp_dim
        routed = 0
        if self.n_experts:
            e, f = self.n_experts, self.expert_dim
            routed = e * 3 * d * f + d * e + 3 * d * f * self.shared_experts
            routed += e if self.router.logit_bias else 0  # score_bias: a buffer, not a weight (as transformers counts)
            routed += e * (2 * f + d) if self.expert_bias else 0
        n_routed = sum(self.routed(i) for i in range(self.n_layers))
        mlps = n_routed * routed + (self.n_layers - n_routed) * dense
        per_layer = attn + (4 if self.post_norms else 2) * d
        tables = 1 if self.tie_embeddings else 2
        return self.n_layers * per_layer + mlps + tables * self.vocab * d + d


def _not_score_bias(path: str) -> bool:
    return not path.endswith("score_bias")


def _balanced(cfg: GPTConfig, params: Any, sums: Mapping[str, jax.Array]) -> Any:
    """``params`` with each expert layer's score bias moved toward an even load
    (:func:`~shardkit.parallel.experts.balance_bias`), from ``sums["expert_tokens"]``, ``(L, E)``
    over every layer in order (a dense layer's row is zeros)."""
    tokens, rate = sums["expert_tokens"], cfg.router.balance_rate

    def moved(block: Any, load: jax.Array) -> Any:
        mlp = block.get("mlp", {})
        if "score_bias" not in mlp:  # a dense layer, or a stack of them
            return block
        return {**block, "mlp": {**mlp, "score_bias": balance_bias(mlp["score_bias"], load, rate)}}

    params = dict(params)
    for name, layers in cfg.layer_stacks():
        if cfg.scan_layers:  # one (layers, E) bias for the stack
            params[name] = moved(params[name], tokens[layers.start : layers.stop])
        else:  # unscanned: {layer: that layer's parameters}
            params[name] = {i: moved(params[name][i], tokens[i]) for i in layers}
    return params


class Block(nnx.Module):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU (or mixture of experts, with
    shared experts beside it), each with a residual. ``layer``: its number where layers differ
    (``cfg.dense_layers``); None for the body of a scanned stack."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs, layer: int | None = None):
        norm = functools.partial(RMSNorm, cfg.dim, cfg.norm_eps, cfg.param_dtype, rngs, cfg.norm_offset)
        self.attn_norm = norm()
        self.attn: Attention | LatentAttention = LatentAttention(cfg, rngs) if cfg.latent else Attention(cfg, rngs)
        self.mlp_norm = norm()
        if cfg.post_norms:
            self.post_attn_norm, self.post_mlp_norm = norm(), norm()
        self.mlp: MoE | SwiGLU
        if cfg.routed(layer):
            self.mlp = MoE(
                cfg.dim,
                cfg.expert_dim,
                cfg.n_experts,
                cfg.top_k,
                cfg.capacity_factor,
                cfg.param_dtype,
                rngs,
                dropless=cfg.moe_dropless,
                router=cfg.router,
                expert_bias=cfg.expert_bias,
                glu=cfg.expert_glu(),
                dispatch=cfg.moe_dispatch,
            )
            if cfg.shared_experts:
                self.shared_mlp = SwiGLU(cfg, rngs, hidden=cfg.shared_experts * cfg.expert_dim)
        else:
            self.mlp = SwiGLU(cfg, rngs)
        self.dropout, self.post_norms, self.n_experts = cfg.dropout, cfg.post_norms, cfg.n_experts
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

    def no_load(self) -> jax.Array | ExpertLoad:
        """What a dense layer reports: 0, or an empty :class:`ExpertLoad` in a mixture of experts
        (every layer of a stack reports alike)."""
        zero = jnp.zeros((), jnp.float32)
        return ExpertLoad(zero, jnp.zeros((self.n_experts,), jnp.float32), zero, zero) if self.n_experts else zero

    def residuals(
        self, x: jax.Array, key: jax.Array | None, attend: Callable[[jax.Array], jax.Array]
    ) -> tuple[jax.Array, jax.Array | ExpertLoad]:
        """The layer around an attention ``attend`` of the normed input (the plain one, or a
        KV-cached one, :mod:`shardkit.models.kv_cache`): both residual branches and their norms."""
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        # The adapters' dropout draws from its own key: k1 and k2 stay those of a model without adapters.
        adapters = None if key is None or not self.adapter_dropout else jax.random.fold_in(key, 2)
        token = ADAPTER_KEY.set(adapters)
        try:
            with jax.named_scope("attn"):
                out = attend(self.attn_norm(x))
                if self.post_norms:
                    out = self.post_attn_norm(out)
                x = x + dropout(out, self.dropout, k1)  # (B, T, D)
            with jax.named_scope("mlp"):
                normed = self.mlp_norm(x)
                mixed = self.mlp(normed)
                out, aux = mixed if isinstance(mixed, tuple) else (mixed, self.no_load())
                if hasattr(self, "shared_mlp"):
                    with jax.named_scope("shared_experts"):
                        out = out + self.shared_mlp(normed)
                if self.post_norms:
                    out = self.post_mlp_norm(out)
                x = x + dropout(out, self.dropout, k2)  # (B, T, D)
        finally:
            ADAPTER_KEY.reset(token)
        return constrain(x, ("batch", "seq", "embed")), aux


def _stacked_blocks(cfg: GPTConfig, rngs: nnx.Rngs, layers: range) -> Block:
    """The blocks of ``layers`` as one module whose parameters are stacked on a leading
    ``layers`` axis (every layer of a stack is of its first's kind)."""

    @nnx.split_rngs(splits=len(layers))
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs, layers[0])

    return make_blocks(rngs)


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
        self.embed = param(rngs, nnx.initializers.normal(0.02), (cfg.vocab, cfg.dim), ("vocab", "embed"), p)
        if cfg.scan_layers:
            for name, layers in cfg.layer_stacks():
                setattr(self, name, _stacked_blocks(cfg, rngs, layers))
        else:
            self.blocks = nnx.List([Block(cfg, rngs, i) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps, p, rngs, cfg.norm_offset)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, nnx.initializers.lecun_normal(), (cfg.dim, cfg.vocab), ("embed", "vocab"), p)

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
            stacks = []
            for name, layers in cfg.layer_stacks():
                stack = getattr(self, name)
                held = jax.tree.leaves(nnx.state(stack, nnx.Param))[0].shape[0]
                start = first_layer + layers[0]
                stack_keys = None if keys is None else jax.lax.dynamic_slice_in_dim(keys, start, held)
                flags = jax.lax.dynamic_slice_in_dim(jnp.asarray(kinds), start, held) if mixed else None

                @nnx.scan(
                    unroll=cfg.scan_unroll,
                    in_axes=(nnx.Carry, 0, 0 if stack_keys is not None else None, 0 if mixed else None),
                    out_axes=(nnx.Carry, 0),
                    transform_metadata={nnx.PARTITION_NAME: "layers"},
                )
                def run(
                    x: jax.Array, block: Block, key: jax.Array | None, flag: jax.Array | None
                ) -> tuple[jax.Array, jax.Array | ExpertLoad]:
                    return _layer(block, x, key, cfg.remat, sliding=kinds[0] if flag is None else flag)

                x, stack_aux = run(x, stack, stack_keys, flags)  # (B, T, D), (layers,)
                stacks.append(stack_aux)
            aux = jax.tree.map(lambda *parts: jnp.concatenate(parts), *stacks)  # (L, ...)
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
        routed = max(1, sum(cfg.routed(i) for i in range(cfg.n_layers)))  # the mean over the expert layers
        if isinstance(aux, ExpertLoad):
            return x, aux._replace(loss=cfg.aux_loss_weight * aux.loss.sum() / routed)
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
            written = []
            for name, layers in cfg.layer_stacks():
                stacked = None
                if not fresh:
                    stacked = tuple(jnp.stack(part) for part in zip(*cache[layers[0] : layers[-1] + 1], strict=True))

                @nnx.scan(
                    in_axes=(nnx.Carry, 0, 0 if stacked else None, 0 if mixed else None),
                    out_axes=(nnx.Carry, 0),
                    transform_metadata={nnx.PARTITION_NAME: "layers"},
                )
                def run(x: jax.Array, block: Block, kv: Any, flag: jax.Array | None):
                    return block.decode(x, positions, kv, kinds[0] if flag is None else flag, fresh)

                flags = jnp.asarray(kinds[layers[0] : layers[-1] + 1]) if mixed else None
                x, (keys, values) = run(x, getattr(self, name), stacked, flags)  # (L, B, S, N, K)
                written += [(keys[i], values[i]) for i in range(len(layers))]
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
