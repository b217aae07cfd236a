"""The decoder's layers, each its own module: what a family composes (:mod:`shardkit.models.gpt`).

- :mod:`~shardkit.models.layers.norms`: parameters with logical names, RMSNorm.
- :mod:`~shardkit.models.layers.rotary`: rotary embeddings (default, linear, llama3, yarn; interleaved pairs).
- :mod:`~shardkit.models.layers.latent_attention`: multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

Grouped-KV attention (with windows, soft caps and sinks), the gated MLP and the decoder block are
in :mod:`shardkit.models.gpt`; the mixture of experts in :mod:`shardkit.parallel.experts`.
"""
