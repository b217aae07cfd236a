"""Packed rows never cross a document (shardkit.models.segments): a row holding several documents
(``batch["segments"]``) has the loss of those documents run one by one, token-weighted, under
hybrid layouts, ring attention included, and in every attention path of the GPT (plain, sliding
window and soft cap);
``batch["loss_mask"]`` scores only the tokens it weighs; and what cannot pack is refused."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import shardkit as sk
from shardkit.core.errors import InputError

T = 32  # tokens a row predicts: rows of T + 1


def documents(seed: int = 0, count: int = 12) -> list[np.ndarray]:
    """Windows of the built-in corpus of 3 to 20 tokens: documents of unequal lengths."""
    tokens = np.asarray(sk.TextDataset.builtin().tokens)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(3, 21))
        start = int(rng.integers(0, len(tokens) - n))
        out.append(tokens[start : start + n].astype(np.int32))
    return out


def pack(docs: list[np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Greedy packing, documents whole, padding (segment 0) at the end of each row."""
    tokens, segments = np.zeros((rows, T + 1), np.int32), np.zeros((rows, T + 1), np.int32)
    row, used, index = 0, 0, 0
    for doc in docs:
        if used + len(doc) > T + 1:
            row, used, index = row + 1, 0, 0
        assert row < rows, "more documents than rows"
        index += 1
        tokens[row, used : used + len(doc)], segments[row, used : used + len(doc)] = doc, index
        used += len(doc)
    return {"tokens": tokens, "segments": segments}


def one_by_one(model: sk.Model, params, docs: list[np.ndarray]) -> float:
    """Each document alone through the model on one device: the token-weighted mean loss."""
    params = jax.device_put(jax.device_get(params), jax.devices()[0])
    total, count = 0.0, 0
    for doc in docs:
        logits = np.asarray(model.apply(params, doc[None, :-1], None), np.float64)[0]
        logits = logits - logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total -= float(logp[np.arange(len(doc) - 1), doc[1:]].sum())
        count += len(doc) - 1
    return total / count


CONFIGS = {
    "plain": sk.models.GPTConfig.preset("tiny"),
    "sliding-softcap": dataclasses.replace(sk.models.GPTConfig.preset("tiny"), sliding_window=6, attn_softcap=30.0),
}


@pytest.mark.parametrize("layout", ["data=2,fsdp=2,tensor=2", "data=4,tensor=2", "data=2,sequence=2,tensor=2"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_packed_row_has_the_loss_of_its_documents_one_by_one(kind, layout):
    docs = documents()
    batch = pack(docs, rows=8)
    model = CONFIGS[kind].model()
    trainer = sk.Trainer(model, optax.adamw(1e-3), layout)
    params = trainer.init(0).params
    result = trainer.evaluate(params, trainer.shard_batch(batch))
    assert int(result["tokens"]) == sum(len(d) - 1 for d in docs)
    np.testing.assert_allclose(float(result["loss"]), one_by_one(model, params, docs), rtol=1e-5)
    unpacked = trainer.evaluate(params, trainer.shard_batch({"tokens": batch["tokens"]}))
    assert abs(float(unpacked["loss"]) - float(result["loss"])) > 1e-3  # without segments: another loss


def test_a_packed_step_trains_as_one_device():
    docs = documents(1)
    batch = pack(docs, rows=8)
    losses = {}
    for layout in ("data=1", "data=2,fsdp=2,tensor=2"):
        devices = jax.devices()[:1] if layout == "data=1" else None
        trainer = sk.Trainer(CONFIGS["plain"].model(), optax.adamw(1e-2), layout, devices=devices)
        state, seen = trainer.init(0), []
        for _ in range(3):
            state, metrics = trainer.step(state, trainer.shard_batch(batch))
            seen.append(float(metrics["loss"]))
        losses[layout] = seen
    np.testing.assert_allclose(losses["data=2,fsdp=2,tensor=2"], losses["data=1"], rtol=1e-5)


def test_the_loss_mask_scores_only_what_it_weighs():
    data = sk.TextDataset.builtin().batch(0, 8, T)
    mask = np.zeros_like(data["tokens"], np.float32)
    mask[:, T // 2 :] = 1.0  # the first half of each row is a prompt
    model = CONFIGS["plain"].model()
    trainer = sk.Trainer(model, optax.adamw(1e-3), "data=2,fsdp=2,tensor=2")
    params = trainer.init(0).params
    result = trainer.evaluate(params, trainer.shard_batch({**data, "loss_mask": mask}))
    assert int(result["tokens"]) == 8 * (T + 1 - T // 2)
    logits = np.asarray(model.apply(jax.device_get(params), data["tokens"][:, :-1], None), np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    picked = np.take_along_axis(logp, data["tokens"][:, 1:, None], -1)[..., 0]
    want = -(picked * mask[:, 1:]).sum() / mask[:, 1:].sum()
    np.testing.assert_allclose(float(result["loss"]), want, rtol=1e-5)


def test_what_cannot_pack_is_refused_by_name():
    batch = pack(documents(), rows=8)
    trainer = sk.Trainer(CONFIGS["plain"].model(), optax.adamw(1e-3), "data=2,fsdp=2,tensor=2")
    with pytest.raises(InputError, match=r"batch\['segments'\] has shape \(8, 32\)"):
        trainer.shard_batch({**batch, "segments": batch["segments"][:, :-1]})
    with pytest.raises(InputError, match="integers >= 0"):
        trainer.shard_batch({**batch, "segments": -batch["segments"]})
    with pytest.raises(InputError, match=r"batch\['loss_mask'\] must hold weights >= 0"):
        trainer.shard_batch({**batch, "loss_mask": np.full(batch["tokens"].shape, -0.5, np.float32)})
