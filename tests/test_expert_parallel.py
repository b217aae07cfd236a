"""Expert parallelism on any mixture of experts: the bound (the experts' dispatch and combine,
gradients reduced over the axes that split the rows) checked against the published formulas by
hand; the mixtures a traced program holds, whatever its style; and steps that keep the experts'
matmuls on the ``expert`` axis, moving tokens rather than weights, with one device's losses."""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_zoo import STEPS, abstract_batch, batches, one_device, quiet_trainer, report
from zoo import DIM, MLP, VOCAB, ZOO, LlamaStyleLM

import shardkit as sk
from shardkit.analysis import hlo, mixtures
from shardkit.analysis.estimate import ModelSizes, analytic
from shardkit.analysis.hardware import PROFILES
from shardkit.analysis.report import lower_bound
from shardkit.models import GPTConfig
from shardkit.parallel.expert_placement import place_experts
from shardkit.parallel.expert_tensor import experts_under_tensor

MOE_ZOO = ["user_moe", "linen_moe", "shared_expert_moe"]
LOOP_ZOO = ["looped_moe", "rolled_moe", "linen_scanned_moe"]  # loops over the experts: unrolled, rolled
SORT_ZOO = ["sorted_moe", "linen_sorted_moe"]  # the batch's pairs sorted by expert, ragged_dot
EXPERT_LAYOUT = "data=2,expert=4"


def test_the_expert_term_is_gshards_four_all_to_alls_of_the_routed_tokens():
    # GShard / DeepSpeed-MoE / Megatron-Core's all-to-all dispatcher, by hand: T tokens a device,
    # top-k, capacity factor c, model dimension h, bf16, n devices on the expert axis; dispatch and
    # combine, forward and backward, each (n-1)/n of T*k*c*h values.
    t, k, c, h, n, layers, rows_split = 4096, 2, 1.25, 1024, 8, 3, 16
    by_hand = layers * 4 * (n - 1) / n * t * k * c * h * 2
    layer = mixtures.MixtureLayer("mlp", experts=64, slots=t * rows_split * k * c, dim=h, style="routed", count=layers)
    assert mixtures.expert_traffic([layer], rows_split, n, itemsize=2) == pytest.approx(by_hand)
    # Dropless: exactly the routed tokens, however the dispatch pads.
    padded = mixtures.MixtureLayer("mlp", experts=64, slots=t * rows_split * 64, dim=h, style="routed", count=layers)
    routed = layers * 4 * (n - 1) / n * t * k * h * 2
    assert mixtures.expert_traffic([padded], rows_split, n, 2, top_k=k, tokens=t * rows_split) == pytest.approx(routed)
    # A dense mixture: each expert group gathers its rows and reduce-scatters the sums, each way.
    dense = mixtures.MixtureLayer("mlp", experts=16, slots=t * rows_split * 16, dim=h, style="dense", count=layers)
    assert mixtures.expert_traffic([dense], rows_split, n, 2) == pytest.approx(layers * 4 * (n - 1) * t * h * 2)


def test_the_bound_reduces_shared_gradients_over_every_row_axis_and_experts_over_the_rest():
    # data=2, fsdp=2, expert=4, tensor=2: shared parameters S and experts' X bytes (all split over tensor).
    shape, shared, experts, expert_bytes = {"data": 2, "fsdp": 2, "tensor": 2, "expert": 4}, 6e6, 24e6, 3e6
    bound = lower_bound(shape, shared + experts, 0.0, expert_param_bytes=experts, expert_bytes=expert_bytes)
    s, x = shared / 2, experts / 2 / 4  # what a device's tensor (and expert) group holds
    assert bound["bytes_fsdp"] == pytest.approx(3 * 1 / 2 * (s + x))  # ZeRO-3 over fsdp
    assert bound["bytes_data"] == pytest.approx(2 * 7 / 8 * s / 2 + 2 * 1 / 2 * x / 2)  # over data+expert; data
    assert bound["bytes_expert"] == expert_bytes
    assert bound["bytes_per_device"] == pytest.approx(sum(bound[f"bytes_{t}"] for t in ("fsdp", "data", "expert")))
    # Without an expert axis nothing moves for the experts' dispatch, and a dense model reduces over data only.
    assert lower_bound({"data": 8}, shared, 0.0)["bytes_data"] == pytest.approx(2 * 7 / 8 * shared)
    assert lower_bound({"data": 8}, shared, 0.0, expert_bytes=1e6)["bytes_expert"] == 0.0


def test_the_planner_prices_expert_layouts_with_the_same_terms():
    sizes = ModelSizes(
        params=int(1e9), layers=4, dim=1024, heads=8, kv_dim=1024, vocab=1000, expert_params=int(8e8), experts=8,
        top_k=2, routed=2.5,
    )  # fmt: skip
    e = analytic(sizes, {"data": 2, "expert": 4}, PROFILES["h100"], batch=16, seq=1024, precision="fp32",
                 compute_itemsize=4)  # fmt: skip
    tokens = 16 * 1024 / 8
    assert e.bytes_by_axes["expert"] == pytest.approx(4 * mixtures.dispatch_bytes(tokens * 2.5 * 1024 * 4, 4))
    held_shared, held_experts = 2e8 * 4, 8e8 / 4 * 4
    assert e.bytes_by_axes["data+expert"] == pytest.approx(2 * 7 / 8 * held_shared)
    assert e.bytes_by_axes["data"] == pytest.approx(2 * 1 / 2 * held_experts)


@functools.cache
def traced_layers(name: str) -> list:
    if name == "gpt":
        model, loss = GPTConfig.preset("tiny-moe").model(), sk.next_token_loss
        batch = {"tokens": jax.ShapeDtypeStruct((16, 129), jnp.int32)}
    else:
        model, loss, batch = quiet_trainer(name, "data=8").model, ZOO[name].loss, abstract_batch(name)
    return mixtures.mixture_layers(mixtures.traced_forward(model, loss, batch), mixtures.parameter_leaves(model))


@pytest.mark.parametrize(
    "name, style, slots_per_token",
    [
        ("gpt", "routed", 2 * 1.25),  # capacity: top-2 x 1.25
        ("user_moe", "routed", 4),  # capacity factor 2.0 of top-2 over 4 experts: every token's slot
        ("linen_moe", "dense", 4),  # every expert runs every token
        ("sorted_moe", "routed", 2),  # ragged_dot over the sorted (token, choice) pairs: exactly top-2
        ("shared_expert_moe", "routed", 4),  # one-hot einsum: every expert's buffer holds every token
    ],
)
def test_the_traced_program_shows_each_style_of_mixture(name, style, slots_per_token):
    layers = traced_layers(name)
    tokens = 16 * 128 if name == "gpt" else math.prod(ZOO[name].batch(0)["tokens"][:, 1:].shape)
    assert sum(layer.count for layer in layers) == 2, layers  # one mixture a layer
    for layer in layers:
        assert (layer.style, layer.experts, layer.dim) == (style, 4, 64)
        assert layer.slots / tokens == pytest.approx(slots_per_token)


def test_a_mixtures_later_projection_in_a_module_of_its_own_moves_no_tokens_of_its_own():
    # Flax's nn.vmap over an expert MLP names each projection apart (experts/wi, experts/wo); the
    # second reads the first's hidden units on the same devices. The bound counts one dense
    # mixture at the model dimension, not a second, routed one at the hidden units' (which made
    # the bound 5x too large: its expert term 1.97 MB where the mixture needs 0.39 MB).
    import flax.linen as nn

    class Expert(nn.Module):
        @nn.compact
        def __call__(self, x):
            named = lambda *names: nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
            h = nn.silu(nn.Dense(4 * DIM, use_bias=False, kernel_init=named("embed", "mlp"), name="wi")(x))
            return nn.Dense(DIM, use_bias=False, kernel_init=named("mlp", "embed"), name="wo")(h)

    class Mixture(nn.Module):
        @nn.compact
        def __call__(self, x):
            gates = jax.nn.softmax(nn.Dense(4, use_bias=False, name="router")(x))  # (B, T, E)
            experts = nn.vmap(
                Expert,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=None,
                out_axes=2,
                axis_size=4,
                metadata_params={nn.PARTITION_NAME: "expert"},
            )(name="experts")
            return jnp.einsum("bted,bte->btd", experts(x), gates)

    x = jnp.ones((2, 8, DIM))
    params = Mixture().init(jax.random.key(0), x)
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda v: isinstance(v, nn.Partitioned))
    path_of = lambda path: "/".join(str(k.key) for k in path[1:])  # experts/wi/kernel, as a model's leaves
    leaves = [(path_of(path), np.shape(nn.unbox(v)), getattr(v, "names", None)) for path, v in flat]
    closed = jax.make_jaxpr(lambda p, x: Mixture().apply(p, x))(nn.unbox(params), x)
    layers = mixtures.mixture_layers(closed, leaves)
    assert [(layer.style, layer.experts, layer.dim, layer.slots) for layer in layers] == [("dense", 4, DIM, 4 * 16)]


def test_a_mixtures_hidden_units_end_where_they_join_the_residual_stream():
    # Experts of one projection each (D -> D), looped and summed into the residual: the next
    # layer's matmul reads the residual stream, not hidden units, so it is a mixture of its own.
    def forward(params, x):
        for w in params:
            gates = jax.nn.softmax(x[..., :4])  # (B, T, E)
            x = x + sum(gates[..., e : e + 1] * jnp.tanh(x @ w[e]) for e in range(4))
        return x

    params = [jnp.ones((4, DIM, DIM)) / DIM] * 2
    leaves = [(f"layers/{i}/w", (4, DIM, DIM), ("expert", "embed", "mlp")) for i in range(2)]
    layers = mixtures.mixture_layers(jax.make_jaxpr(forward)(params, jnp.ones((2, 8, DIM))), leaves)
    assert [(layer.path, layer.dim) for layer in layers] == [("layers/0", DIM), ("layers/1", DIM)]


def test_a_placed_forward_pass_computes_what_was_traced():
    # einsum dispatch, a dense mixture and top_k: the same values, only shardings change.
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def moe(params, x):
        gates, index = jax.lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        dense = jnp.einsum("btd,edf->btef", x, params["w"])  # (B, T, E, F)
        buffers = jnp.einsum("bte,btd->ebtd", jax.nn.one_hot(index[..., 0], 4), x)
        routed = jnp.einsum("ebtd,edf->ebtf", buffers, params["w"]).sum(0)
        return dense.sum(2) * gates[..., :1] + routed + index[..., 1:].astype(x.dtype)

    keys = jax.random.split(jax.random.key(0), 3)
    params = {"router": jax.random.normal(keys[0], (8, 4)), "w": jax.random.normal(keys[1], (4, 8, 8))}
    x = jax.random.normal(keys[2], (8, 6, 8))
    placed = jax.jit(place_experts(moe, {1: 0}, mesh))  # leaves in tree order: router, w
    np.testing.assert_allclose(placed(params, x), moe(params, x), rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(lambda p: place_experts(moe, {1: 0}, mesh)(p, x).sum()))(params)
    expected = jax.grad(lambda p: moe(p, x).sum())(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), grads, expected)


def expert_traffic(r) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in r.collectives:
        if "expert" in c.axes and c.moved_bytes:
            out[c.kind] = out.get(c.kind, 0.0) + c.moved_bytes
    return out


def test_the_gpt_moves_its_bound_under_an_expert_layout():
    cfg = GPTConfig.preset("tiny-moe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model with experts: no note that the axis splits rows only
        t = sk.Trainer(cfg.model(), optax.adamw(1e-3), EXPERT_LAYOUT)
    r = t.report({"tokens": jax.ShapeDtypeStruct((16, 129), jnp.int32)})
    # 2 layers x (dispatch + combine) x (forward + backward), each 3/4 of a device's
    # 2 rows x 4 experts x 80 slots x 64 x 4 bytes; the sorted dispatch also sends each
    # destination its 2 rows' count for each of its experts, (4, 1) int32 a layer.
    all_to_alls = [c for c in r.collectives if c.kind == "all-to-all"]
    assert all(c.axes == ("expert",) for c in all_to_alls)
    assert sum(c.count * c.payload_bytes for c in all_to_alls) == 8 * 2 * 4 * 80 * 64 * 4 + 2 * 4 * 4
    assert r.lower_bound["bytes_expert"] == pytest.approx(8 * 3 / 4 * 2 * 4 * 80 * 64 * 4)
    assert r.ratios["bytes"] == pytest.approx(1.0, abs=0.02), r.table()


@pytest.mark.parametrize("layout", [EXPERT_LAYOUT, "data=2,fsdp=2,expert=2"])
@pytest.mark.parametrize("name", MOE_ZOO)
def test_a_users_mixture_moves_tokens_to_its_experts_not_weights_to_its_tokens(name, layout):
    r = report(name, layout)
    weights = 4 * 64 * 256 * 4  # a layer's stacked expert matrix (4 experts): never gathered over expert
    assert not [
        c for c in r.collectives if "expert" in c.axes and c.kind == "all-gather" and c.payload_bytes >= weights
    ]
    assert r.ratios["bytes"] <= 1.10, r.table()
    assert r.lower_bound["bytes_expert"] > 0 and expert_traffic(r), r.table()


@pytest.mark.parametrize("name", [*MOE_ZOO, *SORT_ZOO, *LOOP_ZOO])
def test_a_users_mixture_under_an_expert_layout_trains_as_one_device(name):
    t = quiet_trainer(name, EXPERT_LAYOUT)
    state, losses = t.init(seed=0), []
    for batch in batches(name):
        state, metrics = t.step(state, t.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, one_device(name), rtol=2e-5, atol=2e-5)


def test_a_users_mixture_under_tensor_and_expert_axes_moves_its_bound():
    # The experts' hidden units split over tensor reduce their partial sums at the routed
    # buffers' size (k x capacity x the tokens'); here the experts' rows are split over tensor
    # instead and their weights gathered, fewer bytes for the zoo's small experts, and each
    # tensor rank dispatches its half of the tokens, as the bound's cheaper way counts.
    r = report("user_moe", "tensor=2,expert=4")
    assert r.ratios["bytes"] <= 1.10, r.table()


@pytest.mark.parametrize("name", ["linen_moe", "looped_moe"])
def test_under_tensor_and_expert_axes_the_embeddings_gradient_is_reduced_once_and_each_byte_named_once(name):
    # The experts' rows split over tensor reach the embedding's cotangents, over which XLA
    # all-reduced the whole table over tensor and again over expert (1.20x for linen_moe). Its
    # vocabulary split over tensor, each device now reduces only its half of the table, over
    # expert. And the dense mixture's backward reduce-scatter over expert is its forward
    # gather's, in the expert term: the report's lines add up to the excess, not to 1.8x it.
    r = report(name, "tensor=2,expert=4")
    table = VOCAB * DIM * 4
    embedding = [c for c in r.collectives if "embed" in c.op and c.direction == "backward" and c.kind == "all-reduce"]
    assert [(c.axes, c.payload_bytes) for c in embedding] == [(("expert",), table // 2)], r.table()
    excess = r.moved_bytes - r.lower_bound["bytes_per_device"]
    named = sum(e.moved_bytes for e in r.beyond())
    assert 0.9 * excess <= named <= 1.1 * excess, r.table()
    assert r.ratios["bytes"] <= 1.15, r.table()


def test_a_shared_expert_beside_experts_split_by_rows_over_tensor_keeps_its_megatron_split():
    # tensor=2,expert=4: the routed experts' rows split over tensor, and XLA carried that split
    # into the shared expert beside them, gathering its three weights over tensor forward (and
    # gate's again backward): 1.39x. Its weights outweigh a row group's tokens, so its outputs
    # stay split over tensor: the tokens are gathered, the weights never are.
    r = report("shared_expert_moe", "tensor=2,expert=4")
    weight = DIM * MLP * 4
    gathered = [c for c in r.collectives if "/shared/" in c.op and c.kind == "all-gather" and c.axes == ("tensor",)]
    assert all(c.payload_bytes < weight for c in gathered), r.table()
    assert r.ratios["bytes"] <= 1.10, r.table()


def test_under_tensor_the_bound_takes_the_cheaper_use_of_tensor_for_the_experts():
    # By hand, one mixture call under tensor=2: dispatch D over expert, activation A, an expert
    # group's weights W. Hidden units split: D over expert, 2 all-reduces of A over tensor.
    # Rows split: D/2 over expert; A gathered each way and W gathered once and reduce-scattered.
    d, a, t = 8e5, 1e5, 2
    hidden = {"expert": d, "tensor": 2 * 2 * (t - 1) / t * a}
    for w in (1e5, 2e6):
        rows = {"expert": d / t, "tensor": 2 * (t - 1) / t * a + 2 * (t - 1) / t * w}
        want = rows if sum(rows.values()) < sum(hidden.values()) else hidden
        assert experts_under_tensor(d, a, w, t) == pytest.approx(want)
    assert experts_under_tensor(d, a, 1e5, t)["expert"] == d / t and experts_under_tensor(d, a, 2e6, t)["expert"] == d
    # The report's bound for user_moe: 2 layers, each the cheaper way (rows: its experts are
    # small), in place of the two Megatron all-reduces counted for each experts' block.
    shape = {"tensor": 2, "expert": 4}
    plain = lower_bound(shape, 3e6, 0.0, layers=2, activation_bytes=a, expert_param_bytes=1e6, expert_bytes=2 * d)
    both = lower_bound(
        shape, 3e6, 0.0, layers=2, activation_bytes=a, expert_param_bytes=1e6, expert_bytes=2 * d, expert_calls=2
    )
    call = experts_under_tensor(d, a, 1e6 / 2 / 4, 2)
    assert both["bytes_expert"] == pytest.approx(2 * call["expert"])
    assert both["bytes_tensor"] == pytest.approx(plain["bytes_tensor"] - 2 * hidden["tensor"] + 2 * call["tensor"])
    assert both["bytes_per_device"] < plain["bytes_per_device"]


@pytest.mark.parametrize("tokens, gathered", [(64, True), (2, False)], ids=["many tokens", "few tokens"])
def test_the_experts_rows_split_over_tensor_only_where_that_moves_fewer_bytes(tokens, gathered):
    # A routed einsum (E, B, C, D) x (E, D, F) on tensor=2, expert=4. Gathering an expert group's
    # weights over tensor (3 x 64 x 512 x 4 bytes moved, about) against reducing the routed
    # buffers' partial sums (2 x their bytes a matmul): the placement takes the cheaper.
    mesh = jax.make_mesh((2, 4), ("tensor", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    w = jax.device_put(jnp.ones((4, 64, 512)), jax.NamedSharding(mesh, jax.P("expert", None, "tensor")))
    x = jax.device_put(jnp.ones((4, 8, tokens, 64)), jax.NamedSharding(mesh, jax.P("expert")))
    experts = lambda params, x: jnp.tanh(jnp.einsum("ebcd,edf->ebcf", x, params["w"])).sum()
    placed = place_experts(experts, {0: 0}, mesh, token_axes=("expert",))
    program = jax.jit(jax.grad(placed)).lower({"w": w}, x).compile().as_text()
    weight_gathers = [c for c in hlo.collectives(program) if c.kind == "all-gather" and c.payload_bytes >= 64 * 512 * 4]
    assert bool(weight_gathers) == gathered, hlo.collectives(program)


def test_a_users_global_sort_routed_holds_less_memory_a_device():
    # memory_analysis() of the compiled step: the whole batch's sort, gather and every expert on
    # every pair (XLA alone) against each device's own pairs at their experts (measured 11.3 MB
    # against 4.6 MB on 8 CPU devices).
    from zoo_factories import trainer

    total = {}
    for place in (True, False):
        t = trainer("sorted_moe", optax.adamw(1e-3), EXPERT_LAYOUT, place_experts=place)
        total[place] = t.report(abstract_batch("sorted_moe")).memory.total
    assert total[True] < 0.6 * total[False], total


@pytest.mark.parametrize("name", [*MOE_ZOO, "sorted_moe", *LOOP_ZOO])
def test_a_users_mixture_under_tensor_and_expert_axes_trains_as_one_device(name):
    # The experts' rows split over tensor where that moves fewer bytes than their hidden units;
    # the sorted section's pairs split over tensor too.
    t = quiet_trainer(name, "tensor=2,expert=4")
    state, losses = t.init(seed=0), []
    for batch in batches(name):
        state, metrics = t.step(state, t.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, one_device(name), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", SORT_ZOO)
def test_a_users_global_sort_and_ragged_dot_moves_routed_rows_to_their_experts(name):
    # The zoo's argsort, gather, ragged_dot and scatter over the whole batch run as each device's
    # own pairs: per layer one all-to-all of (4 devices, C, 64) rows and one of the experts'
    # counts forward, one of outputs back, and the two of rows in the backward pass. Dropless
    # with static shapes, C is a device's 64 tokens x min(top-2, 1 expert a device): twice the
    # 128 pairs routed, which is all that is over the bound, and the report names it.
    r = report(name, EXPERT_LAYOUT)
    all_to_alls = [c for c in r.collectives if c.kind == "all-to-all"]
    assert all(c.axes == ("expert",) for c in all_to_alls)
    assert sum(c.count * c.payload_bytes for c in all_to_alls) == 2 * (4 * 4 * 64 * 64 * 4 + 4 * 4)
    weights = 4 * 64 * 256 * 4
    assert not [c for c in r.collectives if c.kind == "all-gather" and c.payload_bytes >= weights], r.table()
    padding = 2 * 4 * 3 / 4 * (4 * 64 - 2 * 64) * 64 * 4  # layers x exchanges x (n-1)/n x rows over routed x D x 4
    excess = r.moved_bytes - r.lower_bound["bytes_per_device"]
    assert excess == pytest.approx(padding, rel=0.01), r.table()
    assert sum(e.moved_bytes for e in r.beyond()) >= 0.9 * excess, r.table()


def per_token_mixture(x, router, w_in, w_out, top_k):
    """Each token through its top-k experts by softmax score, written token by token in numpy."""
    x, router, w_in, w_out = (np.asarray(a, np.float64) for a in (x, router, w_in, w_out))
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            logits = x[b, t] @ router
            probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            chosen = np.argsort(-probs, kind="stable")[:top_k]
            for e in chosen:
                gate, up = x[b, t] @ w_in[e, :, 0], x[b, t] @ w_in[e, :, 1]
                hidden = gate / (1 + np.exp(-gate)) * up
                out[b, t] += probs[e] / probs[chosen].sum() * (hidden @ w_out[e])
    return out


def layer_inputs(experts=4, dim=8, hidden=16, rows=2, tokens=6):
    k = jax.random.split(jax.random.key(1), 4)
    return (
        jax.random.normal(k[0], (rows, tokens, dim)),
        jax.random.normal(k[1], (dim, experts)),
        jax.random.normal(k[2], (experts, dim, 2, hidden)) / 3,
        jax.random.normal(k[3], (experts, hidden, dim)) / 4,
    )


def test_the_callable_dropless_is_each_token_through_its_top_k_experts():
    x, router, w_in, w_out = layer_inputs()
    y, routing = sk.parallel.moe_layer(x, router, w_in, w_out, top_k=2, dropless=True)
    np.testing.assert_allclose(y, per_token_mixture(x, router, w_in, w_out, 2), rtol=1e-4, atol=1e-5)
    assert int(routing.tokens_per_expert.sum()) == 2 * 6 * 2 and float(routing.dropped) == 0.0


def test_the_callables_capacity_drops_the_later_tokens_and_says_how_many():
    x, router, w_in, w_out = layer_inputs()
    router = router.at[:, 0].set(0.0) + jnp.array([9.0, 0, 0, 0])  # every token's first choice: expert 0
    x = jnp.abs(x)  # positive features: expert 0's logit is the largest for each token
    _, routing = sk.parallel.moe_layer(x, router, w_in, w_out, top_k=1, capacity_factor=1.0)
    # capacity = ceil(1.0 x 6 tokens x 1 / 4 experts) = 2 slots of expert 0 per row: 4 of 12 tokens kept.
    assert routing.tokens_per_expert.tolist() == [12, 0, 0, 0]
    assert float(routing.dropped) == pytest.approx(8 / 12)
    assert int(routing.dispatch.sum()) == 4


def test_a_score_bias_chooses_experts_without_weighing_them():
    logits = jnp.array([[[2.0, 1.0, 0.0, -1.0]]])
    plain = sk.parallel.route_tokens(logits, 2, capacity=1, score="sigmoid")
    biased = sk.parallel.route_tokens(logits, 2, capacity=1, score="sigmoid", bias=jnp.array([0.0, 0.0, 0.0, 5.0]))
    assert plain.tokens_per_expert.tolist() == [1, 1, 0, 0] and biased.tokens_per_expert.tolist() == [1, 0, 0, 1]
    scores = jax.nn.sigmoid(logits[0, 0])
    gates = biased.combine[0, 0].sum(-1)  # the sigmoid scores of experts 0 and 3, normalised: no bias in them
    np.testing.assert_allclose(gates, jnp.array([scores[0], 0, 0, scores[3]]) / (scores[0] + scores[3]), rtol=1e-6)
    load = jnp.array([10, 2, 4, 0])
    assert (sk.parallel.balance_bias(jnp.zeros(4), load, rate=0.5) == jnp.array([-0.5, 0.5, 0.0, 0.5])).all()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(top_k=5), "top_k=5 experts per token out of 4"),
        (dict(capacity_factor=0.0), "capacity_factor=0.0 leaves no slot"),
        (dict(capacity_factor=-1.0), "capacity_factor=-1.0 leaves no slot"),
        (dict(w_out=jnp.zeros((4, 16, 9))), r"w_out \(4, 16, 9\) \(E, F, D\) do not agree \(w_out\)"),
        (dict(router=jnp.zeros((8, 3))), r"router \(8, 3\) \(D, E\)"),
    ],
)
def test_the_callable_refuses_a_layer_that_cannot_route(change, message):
    x, router, w_in, w_out = layer_inputs()
    args = {"router": router, "w_in": w_in, "w_out": w_out, "top_k": 2} | change
    with pytest.raises(sk.errors.InputError, match=message):
        sk.parallel.moe_layer(x, **args)


class CallableExperts(nnx.Module):
    """A user's layer that calls the callable: top-2 of 4 gated experts, capacity 1.25."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Param(nnx.with_partitioning(init, ("embed", None))(rngs.params(), (DIM, 4)))
        self.w_in = nnx.Param(
            nnx.with_partitioning(init, ("experts", "embed", None, "mlp"))(rngs.params(), (4, DIM, 2, 32))
        )
        self.w_out = nnx.Param(nnx.with_partitioning(init, ("experts", "mlp", "embed"))(rngs.params(), (4, 32, DIM)))

    def __call__(self, x: jax.Array) -> jax.Array:
        y, _ = sk.parallel.moe_layer(x, self.router[...], self.w_in[...], self.w_out[...], top_k=2)
        return y


def test_a_users_model_calling_the_callable_trains_as_one_device_at_its_bound():
    make = lambda rngs: LlamaStyleLM(rngs, mlp=CallableExperts)
    data = [ZOO["user_moe"].batch(step) for step in range(2)]
    with jax.default_device(jax.devices()[0]), nnx.use_eager_sharding(False):
        model = make(nnx.Rngs(jax.random.split(jax.random.key(0))[0]))
        optimizer, expected = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param), []
        for batch in data:
            loss, grads = nnx.value_and_grad(lambda m, b=batch: ZOO["user_moe"].loss(m, b)[0])(model)
            optimizer.update(model, grads)
            expected.append(float(loss))
    t = sk.Trainer(sk.from_nnx(make), optax.adamw(3e-3), EXPERT_LAYOUT, loss=ZOO["user_moe"].loss)
    state, losses = t.init(seed=0), []
    for batch in data:
        state, metrics = t.step(state, t.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=2e-5, atol=2e-5)
    r = t.report(abstract_batch("user_moe"))
    assert sum(c.count for c in r.collectives if c.kind == "all-to-all") == 8 and r.ratios["bytes"] <= 1.02, r.table()


@pytest.mark.parametrize("layout, microbatches", [("data=2,expert=4", 1), ("data=8", 2), ("data=4,tensor=2", 1)])
def test_the_steps_metrics_say_where_the_tokens_went_as_one_device_routes_them(layout, microbatches):
    cfg = GPTConfig.preset("tiny-moe", capacity_factor=1.0)
    tokens = sk.TextDataset.builtin().batch(0, batch_size=16, seq_len=32)["tokens"]
    t = sk.Trainer(cfg.model(), optax.adamw(1e-3), layout, microbatches=microbatches)
    state = t.init(seed=0)
    params = jax.tree.map(np.asarray, state.params)  # the step's own parameters, on the host
    _, metrics = t.step(state, t.shard_batch({"tokens": tokens}))
    # One device, the model called as Flax calls it, on the parameters the step read.
    with jax.default_device(jax.devices()[0]), nnx.use_eager_sharding(False):
        graphdef = nnx.graphdef(sk.models.GPT(cfg, rngs=nnx.Rngs(0)))
        _, load = nnx.merge(graphdef, params)(jnp.asarray(tokens[:, :-1]))
    assert load.tokens.shape == (2, 4) and float(load.tokens.sum()) == 2 * 16 * 32 * 2  # layers x tokens x top-2
    assert float(metrics["expert_tokens_min"]) == float(load.tokens.min())
    assert float(metrics["expert_tokens_max"]) == float(load.tokens.max())
    expected = float(load.dropped.sum() / load.pairs.sum())
    assert float(metrics["dropped_fraction"]) == pytest.approx(expected, abs=1e-6) and 0.0 < expected < 1.0


@pytest.mark.parametrize("layout", [EXPERT_LAYOUT, "data=2,fsdp=2,expert=2"])
@pytest.mark.parametrize("name", LOOP_ZOO)
def test_a_loop_over_the_experts_runs_as_one_stacked_mixture_at_its_bound(name, layout):
    # w[e] for each expert e (a Python loop, a fori_loop, a scan over the weights), re-rolled:
    # each expert group computes its own experts on the tokens of its rows (a dense mixture's
    # gather and reduce-scatter over expert); no expert's weights reach another group, and no
    # gradient of theirs is summed over expert.
    r = report(name, layout)
    over_experts = sum(c.moved_bytes for c in r.collectives if c.axes == ("expert",))
    assert over_experts <= 1.10 * r.lower_bound["bytes_expert"], r.table()
    assert r.ratios["bytes"] <= 1.10, r.table()


def test_evaluation_runs_the_placed_mixture_as_the_step_does():
    # The held-out loss compiles the same placed forward pass as the step: one device's loss, and
    # the experts' weights stay where they live (unplaced, XLA gathers them over expert).
    from test_zoo import LR
    from zoo_factories import trainer

    from shardkit.analysis import hlo

    batch = batches("user_moe")[0]
    one = trainer("user_moe", optax.adamw(LR), "data=1", devices=jax.devices()[:1])
    expected = float(one.evaluate(one.init(0).params, one.shard_batch(batch))["loss"])
    weights = 4 * 64 * 256 * 4  # a layer's stacked expert matrix
    gathered = {}
    for place in (True, False):
        t = trainer("user_moe", optax.adamw(LR), EXPERT_LAYOUT, place_experts=place)
        loss = float(t.evaluate(t.init(0).params, t.shard_batch(batch))["loss"])
        np.testing.assert_allclose(loss, expected, rtol=2e-5)
        program = next(c for key, c in t._compiled.items() if key[0] == "evaluate").as_text()
        moved = hlo.collectives(program)
        gathered[place] = [c for c in moved if c.kind == "all-gather" and c.payload_bytes >= weights]
        if place:
            assert [c for c in moved if c.kind == "all-to-all"], "tokens travel to their experts"
    assert gathered[False] and not gathered[True]
