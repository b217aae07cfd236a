"""Three sources of logical names (NNX metadata, Linen boxes, regex rules) give one result,
and Linen / unannotated models train sharded to the single-device numbers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_adam_params_close, reference_training, run_trainer
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.analysis import hlo
from shardkit.models import MLP, MLPConfig

D, F = 32, 128


class LinenMLP(nn.Module):
    """Two residual blocks, annotated the Linen way."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        for i in range(2):
            w_in = self.param(f"w_in_{i}", nn.with_logical_partitioning(init, ("embed", "mlp")), (D, F))
            w_out = self.param(f"w_out_{i}", nn.with_logical_partitioning(init, ("mlp", "embed")), (F, D))
            x = x + jnp.tanh(x @ w_in) @ w_out
        return x


class PlainMLP(nn.Module):
    """The same network with no annotations at all (a user's existing model)."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            h = nn.Dense(F, use_bias=True, name=f"up_{i}")(x)
            x = x + nn.Dense(D, use_bias=False, name=f"down_{i}")(jnp.tanh(h))
        return x


REGEX = [
    (r"up_\d+/kernel$", ("embed", "mlp")),
    (r"up_\d+/bias$", ("mlp",)),
    (r"down_\d+/kernel$", ("mlp", "embed")),
]


def batches(n=6, b=16):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(b, D)).astype(np.float32), "y": rng.normal(size=(b, D)).astype(np.float32)}
        for _ in range(n)
    ]


def mse(pred, batch):
    return jnp.mean((pred - batch["y"]) ** 2)


def specs(model, layout="fsdp=2,tensor=4"):
    trainer = sk.Trainer(model, optax.sgd(0.1), layout, loss=sk.mse_loss)
    return {row["path"]: row["spec"] for row in trainer.sharding_table()}


def test_three_sources_resolve_to_the_same_specs():
    x = jnp.zeros((2, D))
    nnx_specs = specs(sk.from_nnx(lambda rngs: MLP(MLPConfig(dim=D, hidden=F), rngs=rngs)))
    linen_specs = specs(sk.from_linen(LinenMLP(), x))
    regex_specs = specs(sk.annotate(sk.from_linen(PlainMLP(), x), [*REGEX, (r".*", None)]))
    # W_in[D_fsdp, F_tensor] and W_out[F_tensor, D_fsdp] from each source.
    assert nnx_specs["w_in/0"] == linen_specs["w_in_0"] == regex_specs["up_0/kernel"] == "[fsdp, tensor]"
    assert nnx_specs["w_out/1"] == linen_specs["w_out_1"] == regex_specs["down_1/kernel"] == "[tensor, fsdp]"
    assert regex_specs["up_0/bias"] == "[tensor]"


class LinenExperts(nn.Module):
    """Experts' weights named with a logical 'expert', as a Linen MoE names them."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        w = self.param("w", nn.with_logical_partitioning(init, ("expert", "embed", "mlp")), (4, D, F))
        return jnp.einsum("bd,edf->bf", x, w)


def test_a_linen_logical_expert_resolves_as_experts_unless_the_rules_name_it():
    model = sk.from_linen(LinenExperts(), jnp.zeros((2, D)))
    table = lambda **kw: {
        r["path"]: r["spec"]
        for r in sk.Trainer(model, optax.sgd(0.1), "data=2,tensor=4", loss=sk.mse_loss, **kw).sharding_table()
    }
    assert table()["w"] == "[tensor, -, -]"  # whole experts over tensor, as shardkit's own 'experts'
    assert table(rules=sk.default_rules() + sk.Rules.of(expert=None))["w"] == "[-, -, tensor]"  # the user's rule wins


@pytest.mark.parametrize("layout", ["data=8", "fsdp=2,tensor=4"])
def test_linen_model_matches_single_device(layout):
    module = LinenMLP()
    data = batches()
    ref_losses, ref_params = reference_training(
        init_params=lambda k: nn.meta.unbox(module.init({"params": k, "dropout": k}, jnp.zeros((2, D)))["params"]),
        forward=lambda p, b: module.apply({"params": p}, b["x"]),
        loss_fn=mse,
        optimizer=optax.adamw(1e-2),
        batches=data,
    )
    trainer = sk.Trainer(sk.from_linen(module, jnp.zeros((2, D))), optax.adamw(1e-2), layout, loss=sk.mse_loss)
    losses, params = run_trainer(trainer, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_adam_params_close(params, ref_params, lr=1e-2, steps=len(data), rtol=1e-4, atol=1e-5)
    kernel = trainer.init(0).params["w_in_0"]
    if layout == "fsdp=2,tensor=4":
        assert {s.data.shape for s in kernel.addressable_shards} == {(D // 2, F // 4)}


def test_unannotated_model_sharded_by_regex_matches_single_device():
    module = PlainMLP()
    data = batches()
    ref_losses, ref_params = reference_training(
        init_params=lambda k: module.init({"params": k, "dropout": k}, jnp.zeros((2, D)))["params"],
        forward=lambda p, b: module.apply({"params": p}, b["x"]),
        loss_fn=mse,
        optimizer=optax.adamw(1e-2),
        batches=data,
    )
    model = sk.annotate(sk.from_linen(module, jnp.zeros((2, D))), REGEX)
    trainer = sk.Trainer(model, optax.adamw(1e-2), "data=2,fsdp=2,tensor=2", loss=sk.mse_loss)
    losses, params = run_trainer(trainer, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_adam_params_close(params, ref_params, lr=1e-2, steps=len(data), rtol=1e-4, atol=1e-5)
    # The compiled step matches the layout: FSDP gathers weights, tensor reduces activations.
    found = hlo.collectives(trainer.compile(trainer.shard_batch(data[0])).as_text())
    kinds = {(c.kind, hlo.mesh_axes_of(c.groups, trainer.mesh)) for c in found}
    assert ("all-gather", ("fsdp",)) in kinds
    assert ("all-reduce", ("tensor",)) in kinds


def test_linen_model_hlo_data_parallel_has_no_gathers():
    trainer = sk.Trainer(sk.from_linen(LinenMLP(), jnp.zeros((2, D))), optax.sgd(0.1), "data=8", loss=sk.mse_loss)
    counts = hlo.count(trainer.compile({"x": jnp.zeros((16, D)), "y": jnp.zeros((16, D))}).as_text())
    assert counts["all-gather"] == 0 and counts["all-reduce"] >= 1


def test_regex_rule_can_pin_an_explicit_partition_spec():
    model = sk.annotate(
        sk.from_linen(PlainMLP(), jnp.zeros((2, D))), [(r"up_0/kernel$", P(None, "tensor")), (r".*", None)]
    )
    trainer = sk.Trainer(model, optax.sgd(0.1), "data=2,tensor=4", loss=sk.mse_loss)
    assert trainer.param_specs["up_0"]["kernel"] == P(None, "tensor")
    assert trainer.param_specs["down_0"]["kernel"] == P()


def test_constrain_inside_and_outside_jit():
    mesh = sk.Layout.parse("data=2,tensor=4").make_mesh()
    x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
    assert sk.constrain(x, ("batch", "mlp")) is x, "no sharding context: unchanged"
    with sk.use_sharding(mesh, sk.default_rules()):
        eager = sk.constrain(x, ("batch", "mlp"))
        traced = jax.jit(lambda a: sk.constrain(a * 2, ("batch", "mlp")))(x)
    assert eager.sharding.spec == P("data", "tensor")
    assert {s.data.shape for s in eager.addressable_shards} == {(4, 4)}
    assert traced.sharding.spec == P("data", "tensor")
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(x) * 2)
