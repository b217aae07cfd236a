"""Layout parsing and the resolver's semantics, against hand-worked expectations."""

import jax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.core.rules import Rules, default_rules, resolve

MESH = {"data": 2, "fsdp": 2, "tensor": 2, "sequence": 1, "stage": 1, "expert": 1}


def test_parse_orders_canonical_axes_and_fills_the_rest():
    layout = sk.Layout.parse(" tensor=2, data=2 ,fsdp=-1").resolve(8)
    assert layout.axis_names == sk.MESH_AXES
    assert layout.shape == {"data": 2, "fsdp": 2, "tensor": 2, "sequence": 1, "stage": 1, "expert": 1}
    assert layout.spec() == "data=2,fsdp=2,tensor=2"
    assert sk.Layout.parse("data=-1").resolve(8).shape["data"] == 8


def test_custom_axes_come_after_the_canonical_ones():
    layout = sk.Layout.parse("replica=2,data=4,custom=replica")
    assert layout.axis_names == (*sk.MESH_AXES, "replica")
    assert sk.Layout.parse(layout.spec()) == layout


@pytest.mark.parametrize(
    "text,guess",
    [
        ("dat=8", "data"),
        ("Data=8", "data"),
        ("dta=8", "data"),
        ("tensr=4,data=2", "tensor"),
        ("tp=4,dp=2", "tensor"),
        ("rows=8", None),
    ],
)
def test_a_misspelt_or_undeclared_axis_is_refused_with_a_suggestion(text, guess):
    with pytest.raises(sk.ShardkitError, match="is not a mesh axis") as err:
        sk.Layout.parse(text)
    assert (f"Did you mean {guess!r}" in str(err.value)) if guess else "Did you mean" not in str(err.value)
    assert "custom=" in str(err.value)


def test_mesh_has_auto_axes_in_layout_order():
    mesh = sk.Layout.parse("data=2,tensor=4").make_mesh()
    assert mesh.axis_names == sk.MESH_AXES
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert dict(mesh.shape)["tensor"] == 4
    # tensor is the inner axis: neighbouring devices form a tensor group.
    assert [d.id for d in mesh.devices[0, 0, :, 0, 0, 0]] == [0, 1, 2, 3]


def test_mesh_on_a_subset_of_devices():
    mesh = sk.Layout.parse("tensor=4").make_mesh(jax.devices()[4:])
    assert mesh.devices.size == 4


def test_presets_compose_by_joining_mesh_axes():
    rules = sk.rules.data_parallel() + sk.rules.fsdp() + sk.rules.tensor_parallel()
    assert rules["batch"] == ("data", "fsdp")
    assert rules["embed"] == ("fsdp",)
    assert rules["mlp"] == ("tensor",)
    # Joining is order-free for the mesh axes: canonical order always.
    assert (sk.rules.fsdp() + sk.rules.data_parallel())["batch"] == ("data", "fsdp")


def test_resolve_weights_and_activations():
    rules = default_rules()
    assert resolve(("embed", "mlp"), (64, 128), rules, MESH) == P("fsdp", "tensor")
    # Activation: batch takes data and fsdp first (priority), so embed cannot reuse fsdp.
    assert resolve(("batch", "seq", "embed"), (8, 16, 64), rules, MESH) == P(("data", "fsdp"), None, None)
    assert resolve((None, "vocab"), (4, 256), rules, MESH) == P(None, "tensor")
    assert resolve(None, (4, 4), rules, MESH) == P()


def test_priority_is_rule_order_not_dimension_order():
    rules = Rules.of(embed="tensor", mlp="tensor")
    # embed comes first in the rules, so it wins the tensor axis even as the second dimension.
    assert resolve(("mlp", "embed"), (8, 8), rules, {"tensor": 2}) == P(None, "tensor")
    rules = Rules.of(mlp="tensor", embed="tensor")
    assert resolve(("mlp", "embed"), (8, 8), rules, {"tensor": 2}) == P("tensor", None)


def test_size_one_axes_drop_out():
    assert resolve(("batch", "embed"), (8, 64), default_rules(), {**MESH, "fsdp": 1, "data": 8}) == P("data", None)


def test_non_dividing_dimension_replicated_only_on_request_and_reported():
    fallbacks = []
    spec = resolve(
        ("kv_heads", "kv"), (3, 8), default_rules(), MESH, what="wk", allow_replicate=True, fallbacks=fallbacks
    )
    assert spec == P(None, None)
    assert len(fallbacks) == 1 and fallbacks[0].logical == "kv_heads" and fallbacks[0].shards == 2
    assert "replicated" in str(fallbacks[0])


def test_trainer_reports_fallbacks():
    cfg = sk.models.GPTConfig.preset("tiny", n_kv_heads=2, n_heads=2, dim=64)
    model = sk.from_nnx(lambda rngs: sk.models.GPT(cfg, rngs=rngs))
    import optax

    trainer = sk.Trainer(model, optax.sgd(0.1), "data=2,tensor=4", allow_replicate=True)
    replicated = {(f.what, f.logical) for f in trainer.fallbacks}
    assert ("blocks/attn/wqkv", "kv_heads") in replicated
    assert ("blocks/attn/wo", "heads") in replicated
