"""Each kind of bad input raises a ShardkitError that names the fix, before any compile."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import run_python
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.core.rules import Rules, default_rules, resolve

MESH = {"data": 2, "fsdp": 2, "tensor": 2, "sequence": 1, "stage": 1, "expert": 1}
TINY = sk.models.GPTConfig.preset("tiny")


def gpt():
    return sk.from_nnx(lambda rngs: sk.models.GPT(TINY, rngs=rngs))


@pytest.mark.parametrize(
    "text,fix",
    [
        ("data:2", "write axis=size"),
        ("data=two", "write axis=size"),
        ("data=2,data=4", "name each axis once"),
        ("data=-1,fsdp=-1", "Give explicit sizes"),
        ("data=0", "positive integer"),
        ("data-x=2", "identifier"),
    ],
)
def test_malformed_layouts(text, fix):
    with pytest.raises(sk.ShardkitError, match=fix):
        sk.Layout.parse(text)


def test_layout_product_must_match_devices():
    with pytest.raises(sk.ShardkitError, match=r"needs 16 devices but 8.*fsdp=-1|needs 16 devices but 8"):
        sk.Layout.parse("data=4,fsdp=4").resolve(8)
    with pytest.raises(sk.ShardkitError, match="does not divide 8"):
        sk.Layout.parse("data=3,fsdp=-1").resolve(8)
    with pytest.raises(sk.ShardkitError, match="simulate_devices"):
        sk.Trainer(gpt(), optax.sgd(0.1), "data=4,fsdp=4")


def test_unknown_logical_axis():
    with pytest.raises(sk.ShardkitError, match=r"'embd'.*has no rule.*Rules.of\(embd="):
        resolve(("embd", "mlp"), (8, 8), default_rules(), MESH, what="w")


def test_duplicate_mesh_axis_in_a_rule():
    with pytest.raises(sk.ShardkitError, match=r"names a mesh axis twice.*\('data',\)"):
        Rules.of(batch=("data", "data"))


def test_duplicate_mesh_axis_in_one_partition_spec():
    model = sk.annotate(
        sk.from_linen(nn.Dense(8), jnp.zeros((1, 8))), [(r"kernel$", P("tensor", "tensor")), (r".*", None)]
    )
    with pytest.raises(sk.ShardkitError, match="uses mesh axis 'tensor' twice"):
        sk.Trainer(model, optax.sgd(0.1), "data=4,tensor=2", loss=sk.mse_loss)


def test_partition_spec_with_unknown_mesh_axis():
    model = sk.annotate(sk.from_linen(nn.Dense(8), jnp.zeros((1, 8))), [(r"kernel$", P("model")), (r".*", None)])
    with pytest.raises(sk.ShardkitError, match="not in the mesh"):
        sk.Trainer(model, optax.sgd(0.1), "data=8", loss=sk.mse_loss)


def test_non_divisible_dimension():
    with pytest.raises(sk.ShardkitError, match="allow_replicate=True"):
        resolve(("mlp",), (6,), default_rules(), {**MESH, "tensor": 4}, what="w")
    cfg = sk.models.GPTConfig.preset("tiny", n_kv_heads=2, n_heads=2)
    model = sk.from_nnx(lambda rngs: sk.models.GPT(cfg, rngs=rngs))
    with pytest.raises(sk.ShardkitError, match=r"blocks/attn/w.*: dimension \d \((kv_)?heads=2"):
        sk.Trainer(model, optax.sgd(0.1), "data=2,tensor=4")


def test_wrong_number_of_names():
    with pytest.raises(sk.ShardkitError, match="one name .or None. per dimension"):
        resolve(("embed",), (8, 8), default_rules(), MESH)


def test_rule_to_a_mesh_axis_the_mesh_lacks():
    with pytest.raises(sk.ShardkitError, match="does not have"):
        resolve(("embed",), (8,), Rules.of(embed="model"), MESH)


def test_batch_that_does_not_divide():
    trainer = sk.Trainer(gpt(), optax.sgd(0.1), "data=8")
    with pytest.raises(sk.ShardkitError, match=r"batch\['tokens'\] has 6 rows.*multiple of 8, e\.g\. 8 \("):
        trainer.shard_batch({"tokens": jnp.zeros((6, 17), jnp.int32)})


def test_activation_constraint_that_does_not_divide():
    mesh = sk.Layout.parse("data=8").make_mesh()
    with sk.use_sharding(mesh, default_rules()), pytest.raises(sk.ShardkitError, match="activation"):
        sk.constrain(jnp.zeros((4, 4)), ("batch", None))


def test_not_an_optimizer():
    with pytest.raises(sk.ShardkitError, match="optax.adamw"):
        sk.Trainer(gpt(), "adam", "data=8")


def test_not_a_model():
    with pytest.raises(sk.ShardkitError, match="sk.from_nnx"):
        sk.Trainer(sk.models.GPT(TINY, rngs=nnx.Rngs(0)), optax.sgd(0.1), "data=8")


def test_nnx_model_storing_rngs_is_no_longer_refused():
    """Once refused: a module keeping its nnx.Rngs now has its streams keyed from each call's key."""

    class Stores(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.ones((4, 4)))
            self.rngs = rngs

        def __call__(self, x):
            return x @ self.w[...] + jax.random.normal(self.rngs(), x.shape)

    model = sk.from_nnx(lambda rngs: Stores(rngs))
    params = model.init(jax.random.key(0))
    x = jnp.ones((2, 4))
    a, b = (model.apply(params, x, jax.random.key(k)) for k in (1, 2))
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, model.apply(params, x, jax.random.key(1)))


def test_regex_rules_bad_cases():
    model = sk.from_linen(nn.Dense(8), jnp.zeros((1, 8)))
    with pytest.raises(sk.ShardkitError, match=r"(?s)matches none of the regex rules.*\(r\"\.\*\", None\)"):
        sk.annotate(model, [(r"kernel$", ("embed", "mlp"))])
    with pytest.raises(sk.ShardkitError, match="matched no parameter"):
        sk.annotate(model, [(r"kernal$", ("embed", "mlp")), (r".*", None)], strict=True)
    with pytest.warns(UserWarning, match="'kernal\\$' matched no parameter"):
        lenient = sk.annotate(model, [(r"kernal$", ("embed", "mlp")), (r".*", None)])
    assert lenient.notes == ("regex rule 'kernal$' matched no parameter of Dense",)
    with pytest.raises(sk.ShardkitError, match="does not compile"):
        sk.annotate(model, [(r"kernel(", ("embed", "mlp"))])


def test_model_config_errors():
    with pytest.raises(sk.ShardkitError, match="Choose one of"):
        sk.models.GPTConfig.preset("gpt5")
    with pytest.raises(sk.ShardkitError, match="multiple of n_kv_heads"):
        sk.models.GPTConfig(n_heads=8, n_kv_heads=3, dim=64)


def test_run_config_errors(tmp_path):
    from shardkit.cli.run import TrainConfig, train

    with pytest.raises(sk.ShardkitError, match="--steps must be at least 1"):
        TrainConfig(steps=0)
    with pytest.raises(sk.ShardkitError, match="max_seq"):
        train(TrainConfig(model="tiny", seq=4096, steps=1))
    with pytest.raises(sk.ShardkitError, match="no such file"):
        train(TrainConfig(model="tiny", data=str(tmp_path / "missing.txt"), steps=1))
    with pytest.raises(sk.ShardkitError, match="no \\*.txt files"):
        train(TrainConfig(model="tiny", data=str(tmp_path), steps=1))


def test_simulate_devices_bad_count():
    with pytest.raises(sk.ShardkitError, match="positive integer"):
        sk.simulate_devices(0)


def test_simulate_devices_same_count_is_harmless_and_other_count_is_too_late():
    assert len(sk.simulate_devices(8)) == 8
    with pytest.raises(sk.ShardkitError, match="restart the kernel"):
        sk.simulate_devices(4)


def test_simulate_devices_if_no_accelerator_gives_cpu_devices_here():
    # This machine has no GPU or TPU: the same call that uses them on a server simulates here,
    # without forcing the platform (a server's GPUs would win), and stays harmless when repeated.
    result = run_python(
        "import jax, shardkit as sk\n"
        "devices = sk.simulate_devices(4, if_no_accelerator=True)\n"
        "assert sk.simulate_devices(4, if_no_accelerator=True) == devices\n"
        "print(len(devices), devices[0].platform, jax.config.jax_platforms or 'unforced')\n",
        env={"XLA_FLAGS": "", "JAX_PLATFORMS": ""},
    )
    assert result.stdout.split() == ["4", "cpu", "unforced"], result.stderr[-2000:]


def test_simulate_devices_too_late_in_a_fresh_process():
    result = run_python(
        "import jax, shardkit as sk\n"
        "jax.numpy.zeros(1)\n"
        "try:\n"
        "    sk.simulate_devices(4)\n"
        "except sk.ShardkitError as e:\n"
        "    print('ERR', e)\n",
        env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
    )
    assert "ERR simulate_devices(4) was called after JAX had started with 1 cpu" in result.stdout, result.stderr
    assert "first thing" in result.stdout


def test_simulate_devices_in_time_in_a_fresh_process():
    result = run_python(
        "import shardkit as sk\nsk.simulate_devices(4)\nimport jax\nprint('N', len(jax.devices()))\n",
        env={"XLA_FLAGS": ""},
    )
    assert "N 4" in result.stdout, result.stderr


def test_errors_come_before_any_compile(monkeypatch):
    """A bad layout is caught without compiling anything."""
    calls = []
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda *a, **k: calls.append(1))
    with pytest.raises(sk.ShardkitError):
        sk.Trainer(gpt(), optax.sgd(0.1), "data=3,fsdp=3")
    assert calls == []


def test_training_settings_errors():
    with pytest.raises(sk.ShardkitError, match="remat='sometimes'; choose one of none, full"):
        sk.models.GPTConfig.preset("tiny", remat="sometimes")
    with pytest.raises(sk.ShardkitError, match="Unknown precision 'fp8'; choose one of fp32, bf16, bf16-master"):
        sk.Trainer(gpt(), optax.sgd(0.1), "data=8", precision="fp8")
    with pytest.raises(sk.ShardkitError, match="microbatches must be a positive integer"):
        sk.Trainer(gpt(), optax.sgd(0.1), "data=8", microbatches=0)
    from shardkit.cli.run import TrainConfig

    with pytest.raises(sk.ShardkitError, match="--lr must be a finite positive number"):
        TrainConfig(lr=0.0)
    with pytest.raises(sk.ShardkitError, match="--optimizer 'lion' is not one of"):
        TrainConfig(optimizer="lion")


def test_data_errors():
    ds = sk.TextDataset.from_bytes(b"short text")
    with pytest.raises(sk.ShardkitError, match="too few for windows of seq_len"):
        ds.batch(0, batch_size=2, seq_len=64)
    with pytest.raises(sk.ShardkitError, match="does not divide over 3 processes"):
        sk.TextDataset.builtin().batch(0, batch_size=8, seq_len=16, process_index=0, process_count=3)


def test_a_donated_state_is_refused_before_jax_sees_it():
    trainer = sk.Trainer(gpt(), optax.sgd(0.1), "data=8")
    batch = trainer.shard_batch({"tokens": jnp.zeros((8, 17), jnp.int32)})
    state = trainer.init(0)
    new_state, _ = trainer.step(state, batch)
    with pytest.raises(sk.ShardkitError, match="donated to an earlier step"):
        trainer.step(state, batch)
    again, _ = trainer.step(new_state, batch)  # the returned state goes on
    assert int(again.step) == 2
