"""shardkit: train Flax models across many accelerators with JAX SPMD sharding.

The public API, all of it re-exported here::

    import shardkit as sk
    sk.simulate_devices(8)
    trainer = sk.Trainer(sk.from_nnx(lambda rngs: sk.models.GPT(cfg, rngs=rngs)),
                         optax.adamw(1e-3), layout="data=2,fsdp=2,tensor=2")
"""

from shardkit._lazy import install

# Names resolve on first use (PEP 562), so `import shardkit` and `shardkit --help` do not start
# JAX, and sk.simulate_devices(n) can still come first.
_SUBMODULES = (
    "checkpoint",
    "distributed",
    "errors",
    "hardware",
    "hlo",
    "models",
    "parallel",
    "report",
    "rules",
    "sharding",
    "steps",
)
_WHERE = {
    "Checkpointer": "checkpoint",
    "TextDataset": "data",
    "builtin_corpus": "data",
    "load_text": "data",
    "simulate_devices": "devices",
    "dropout": "dropout",
    "DryRunConfig": "dryrun",
    "dryrun": "dryrun",
    "ShardkitError": "errors",
    "Hardware": "hardware",
    "MESH_AXES": "mesh",
    "Layout": "mesh",
    "Model": "model",
    "annotate": "model",
    "from_functions": "model",
    "from_linen": "model",
    "from_nnx": "model",
    "Axes": "partition",
    "constrain": "partition",
    "logical": "partition",
    "use_sharding": "partition",
    "PlanOptions": "plan",
    "format_plans": "plan",
    "plan": "plan",
    "Precision": "precision",
    "Pretrained": "pretrained",
    "from_pretrained": "pretrained",
    "Report": "report",
    "LOGICAL_AXES": "rules",
    "Rules": "rules",
    "default_rules": "rules",
    "NonFiniteError": "train",
    "Trainer": "train",
    "TrainState": "train",
    "mse_loss": "train",
    "next_token_loss": "train",
}


__getattr__, __dir__ = install(__name__, _WHERE, _SUBMODULES)

__version__ = "0.1.0"

__all__ = [
    "LOGICAL_AXES",
    "MESH_AXES",
    "Axes",
    "Checkpointer",
    "DryRunConfig",
    "Hardware",
    "Layout",
    "Model",
    "NonFiniteError",
    "PlanOptions",
    "Precision",
    "Pretrained",
    "Report",
    "Rules",
    "ShardkitError",
    "TextDataset",
    "TrainState",
    "Trainer",
    "annotate",
    "builtin_corpus",
    "checkpoint",
    "constrain",
    "default_rules",
    "distributed",
    "dropout",
    "dryrun",
    "errors",
    "format_plans",
    "from_functions",
    "from_linen",
    "from_nnx",
    "from_pretrained",
    "hardware",
    "hlo",
    "load_text",
    "logical",
    "models",
    "mse_loss",
    "next_token_loss",
    "parallel",
    "plan",
    "report",
    "rules",
    "sharding",
    "simulate_devices",
    "steps",
    "use_sharding",
]
