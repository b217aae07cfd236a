"""shardkit: train Flax models across many accelerators with JAX SPMD sharding.

The public API, all of it re-exported here::

    import shardkit as sk
    sk.simulate_devices(8)
    trainer = sk.Trainer(sk.from_nnx(lambda rngs: sk.models.GPT(cfg, rngs=rngs)),
                         optax.adamw(1e-3), layout="data=2,fsdp=2,tensor=2")
"""

from shardkit._lazy import install
from shardkit._moved import install as keep_old_paths

# Names resolve on first use (PEP 562), so `import shardkit` and `shardkit --help` do not start
# JAX, and sk.simulate_devices(n) can still come first. The public submodules, by the name `sk.`
# gives them (as before the package had folders), and where each lives.
_SUBMODULES = {
    "checkpoint": "training.checkpoint",
    "distributed": "runtime.distributed",
    "errors": "core.errors",
    "hardware": "analysis.hardware",
    "hlo": "analysis.hlo",
    "models": "models",
    "parallel": "parallel",
    "report": "analysis.report",
    "rules": "core.rules",
    "sharding": "core.sharding",
    "steps": "training.steps",
}
_WHERE = {
    "Checkpointer": "training.checkpoint",
    "TextDataset": "io.data",
    "builtin_corpus": "io.data",
    "load_text": "io.data",
    "simulate_devices": "runtime.devices",
    "dropout": "models.dropout",
    "Generator": "models.generate",
    "generate": "models.generate",
    "DryRunConfig": "plan.dryrun",
    "dryrun": "plan.dryrun",
    "ShardkitError": "core.errors",
    "Hardware": "analysis.hardware",
    "MESH_AXES": "core.mesh",
    "Layout": "core.mesh",
    "LoRA": "models.lora",
    "with_lora": "models.lora",
    "Model": "models.model",
    "annotate": "models.model",
    "from_functions": "models.model",
    "from_linen": "models.linen_adapter",
    "from_nnx": "models.nnx_adapter",
    "attention": "parallel.attention",
    "Axes": "core.partition",
    "constrain": "core.partition",
    "logical": "core.partition",
    "use_sharding": "core.partition",
    "PlanOptions": "plan",
    "format_plans": "plan",
    "plan": "plan",
    "Precision": "core.precision",
    "Pretrained": "training.pretrained",
    "from_pretrained": "training.pretrained",
    "Report": "analysis.report",
    "LOGICAL_AXES": "core.rules",
    "Rules": "core.rules",
    "default_rules": "core.rules",
    "NonFiniteError": "training.train",
    "Trainer": "training.train",
    "TrainState": "training.train",
    "mse_loss": "training.train",
    "next_token_loss": "training.train",
}


__getattr__, __dir__ = install(__name__, _WHERE, _SUBMODULES)
keep_old_paths()  # `from shardkit.report import ...` and the other paths from before the folders

__version__ = "0.1.0"

__all__ = [
    "LOGICAL_AXES",
    "MESH_AXES",
    "Axes",
    "Checkpointer",
    "DryRunConfig",
    "Generator",
    "Hardware",
    "Layout",
    "LoRA",
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
    "attention",
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
    "generate",
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
    "with_lora",
]
