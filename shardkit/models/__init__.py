"""Models: shardkit's reference models (the GPT family, an MLP, Hugging Face checkpoints and the
shipped configs of real sizes), every parameter named by logical axes, and the adapters that take
yours (``model``: ``from_nnx``, ``from_linen``, ``annotate``; ``boundaries``: the activations'
constraints at module calls; ``model_source``: factories by name), with generation, dropout and
LoRA adapters in peft's format (``lora``, ``peft``).

May import: ``core``, ``runtime``, ``io``, ``parallel``.
"""

from shardkit.models.gpt import GPT, GPTConfig
from shardkit.models.layers.latent_attention import LatentConfig
from shardkit.models.lora import LoRA
from shardkit.models.mlp import MLP, MLPConfig

__all__ = ["GPT", "MLP", "GPTConfig", "LatentConfig", "LoRA", "MLPConfig"]
