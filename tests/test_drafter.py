"""DSpark drafter: shapes, DFlash equivalence, train/inference agreement, masks, vocab, heads, I/O, batching."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dspark.drafters import IGNORE, DrafterConfig, DSparkDrafter, block_labels, default_target_layer_ids

V, D, M = 300, 64, 3  # vocab, hidden, context layers


def make(seed: int = 0, std: float = 0.2, d2t: torch.Tensor | None = None, **over) -> DSparkDrafter:
    """Tiny drafter over a random 'target' embedding / LM head."""
    kw = dict(hidden_size=D, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=V, target_layer_ids=(0, 2, 3), mask_token_id=V - 1, num_layers=2, block_size=4,
              markov_rank=16)
    kw.update(over)
    embed, head = target_weights()
    torch.manual_seed(seed)
    model = DSparkDrafter(DrafterConfig(**kw), embed, head, d2t=d2t)
    model.init_weights(std)
    return model.eval()


def target_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """The random 'target' embedding and LM head [V, D] every test drafter shares."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)


def data(b: int = 2, s: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, M * D, generator=g), torch.randint(0, V - 1, (b, s), generator=g)


def cache_for(model: DSparkDrafter, feats: torch.Tensor, n: int, chunk: int = 5):
    """A cache holding positions 0..n-1, extended in chunks like a decode loop would."""
    cache = model.new_cache(capacity=2)
    for start in range(0, n, chunk):
        model.extend(cache, feats[start:min(n, start + chunk)], start)
    return cache


# ---- config ------------------------------------------------------------------------------------
def test_config_round_trip_and_validation():
    cfg = make().config
    assert DrafterConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="markov_head_type"):
        DrafterConfig.from_dict({**cfg.to_dict(), "markov_head_type": "lstm"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DrafterConfig.from_dict({**cfg.to_dict(), "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterConfig.from_dict({**cfg.to_dict(), "mask_token_id": V})
    with pytest.raises(ValueError, match="bogus"):
        DrafterConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_for_target_copies_shapes():
    hf = dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
              head_dim=128, rms_norm_eps=1e-6, rope_parameters={"rope_theta": 1e6}, vocab_size=151936,
              num_hidden_layers=36)
    cfg = DrafterConfig.for_target(hf, num_layers=5, mask_token_id=151669)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.rope_theta == 1e6 and cfg.head_dim == 128
    small = DrafterConfig.for_target(dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                          vocab_size=V, num_hidden_layers=30, rope_theta=5e5))
    assert small.target_layer_ids == (1, 8, 15, 22, 28) and small.head_dim == 16 and small.num_key_value_heads == 4
    assert default_target_layer_ids(4) == (0, 1, 2)


# ---- shapes and DFlash ---------------------------------------------------------------------------
def test_shapes():
    model = make()
    feats, ids = data()
    anchors = torch.tensor([[3, 8, 15], [0, 5, 23]])
    out = model.forward_train(feats, ids, anchors, torch.ones_like(anchors, dtype=torch.bool))
    assert out.logits.shape == out.base_logits.shape == (2, 3, 4, V)
    assert out.conf_logits.shape == (2, 3, 4)
    assert torch.isfinite(out.logits).all()
    draft = model.draft([cache_for(model, feats[0], 8)], [int(ids[0, 8])], [8], temperature=0.0)
    assert draft.tokens.shape == (1, 4) and draft.probs is None
    assert draft.logits.shape == (1, 4, V) and draft.conf_logits.shape == (1, 4)


def test_dflash_is_heads_off():
    model = make(markov_rank=0, confidence_head=False)
    assert model.markov_head is None and model.confidence_head is None
    feats, ids = data()
    anchors = torch.tensor([[3, 8], [1, 9]])
    out = model.forward_train(feats, ids, anchors, torch.ones_like(anchors, dtype=torch.bool))
    assert torch.equal(out.logits, out.base_logits) and out.conf_logits is None
    assert model.draft([cache_for(model, feats[0], 8)], [5], [8]).conf_logits is None


def test_embedding_and_head_are_frozen_and_not_saved():
    model = make()
    names = {n for n, _ in model.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert all(p.requires_grad for p in model.parameters())
    assert "embed_weight" not in model.state_dict() and "lm_head" not in model.state_dict()


def test_gradients_reach_every_own_weight():
    model = make(markov_head_type="gated").train()
    feats, ids = data()
    anchors = torch.tensor([[3, 8], [1, 9]])
    out = model(feats, ids, anchors, torch.ones_like(anchors, dtype=torch.bool))  # forward == forward_train
    (out.logits.logsumexp(-1).mean() + out.conf_logits.mean()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert model.embed_weight.grad is None and model.lm_head.grad is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fewer_drafts_are_the_blocks_prefix(temperature: float):
    """draft(num_drafts=n) makes the first n drafts of the whole block, with the same logits and
    confidences (same seed: the same tokens when sampled); n outside 1..gamma is refused."""
    model = make()
    feats, ids = data(b=1, s=20)
    g = model.config.block_size

    def run(n=None):
        gen = torch.Generator().manual_seed(3)
        return model.draft([cache_for(model, feats[0], 9)], [int(ids[0, 9])], [9], temperature=temperature,
                           generators=[gen], num_drafts=n)

    whole, short = run(), run(2)
    assert short.tokens.shape == (1, 2) and torch.equal(short.tokens, whole.tokens[:, :2])
    torch.testing.assert_close(short.logits, whole.logits[:, :2])
    torch.testing.assert_close(short.conf_logits, whole.conf_logits[:, :2])
    for bad in (0, g + 1):
        with pytest.raises(ValueError, match="num_drafts"):
            run(bad)


# ---- training forward == inference draft ---------------------------------------------------------
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_train_matches_draft(head: str, temperature: float):
    model = make(markov_head_type=head)
    feats, ids = data(b=1, s=20)
    p = 9
    gen = torch.Generator().manual_seed(7)
    draft = model.draft([cache_for(model, feats[0], p)], [int(ids[0, p])], [p], temperature=temperature,
                        top_k=50, generators=[gen])
    forced = ids.clone()
    forced[0, p + 1:p + 4] = draft.tokens[0, :3]  # teacher-force the drafted predecessors
    out = model.forward_train(feats, forced, torch.tensor([[2, p]]), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(out.logits[0, 1], draft.logits[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.conf_logits[0, 1], draft.conf_logits[0], rtol=1e-4, atol=1e-4)
    if temperature == 0:
        assert torch.equal(draft.tokens[0], draft.logits[0].argmax(-1))
    else:
        assert torch.allclose(draft.probs.sum(-1), torch.ones(1, 4))
        assert ((draft.probs > 0).sum(-1) <= 50).all()


# ---- masks ---------------------------------------------------------------------------------------
def test_block_sees_only_context_before_its_anchor():
    model = make()
    feats, ids = data(b=1, s=24)
    anchors, valid = torch.tensor([[6, 14]]), torch.ones(1, 2, dtype=torch.bool)
    ref = model.forward_train(feats, ids, anchors, valid).logits
    after = feats.clone()
    after[0, 6:] += 1.0  # at / after block 0's anchor, before block 1's
    out = model.forward_train(after, ids, anchors, valid).logits
    assert torch.equal(out[0, 0], ref[0, 0]) and not torch.allclose(out[0, 1], ref[0, 1])
    before = feats.clone()
    before[0, 5] += 1.0
    assert not torch.allclose(model.forward_train(before, ids, anchors, valid).logits[0, 0], ref[0, 0])
    other = ids.clone()
    other[0, 14] = (other[0, 14] + 1) % (V - 1)  # block 1's anchor token must not leak into block 0
    out = model.forward_train(feats, other, anchors, valid).logits
    assert torch.equal(out[0, 0], ref[0, 0]) and not torch.allclose(out[0, 1], ref[0, 1])


def _dense_block_mask(anchor_pos: torch.Tensor, seq_len: int, gamma: int) -> torch.Tensor:
    """Reference mask [B, A*gamma, S + A*gamma]: block a sees context < anchor_pos[a] and its own slots."""
    b, a = anchor_pos.shape
    ctx = (torch.arange(seq_len) < anchor_pos.unsqueeze(-1)).repeat_interleave(gamma, dim=1)
    block_id = torch.arange(a).repeat_interleave(gamma)
    own = (block_id.unsqueeze(1) == block_id.unsqueeze(0)).expand(b, -1, -1)
    return torch.cat([ctx, own], dim=-1)


def _dense_layers(model: DSparkDrafter, x: torch.Tensor, pos: torch.Tensor, ctx: list, mask: torch.Tensor):
    """Reference drafter layers: one dense attention over [context ; block slots] under mask [B, T, S + T]
    (True = attend), then the final norm. x [B, T, d] at positions pos [B, T]."""
    import torch.nn.functional as F

    for layer, (kc, vc) in zip(model.layers, ctx):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.query(h, pos, model.rotary).transpose(1, 2)
        kb, vb = a.key_value(h, pos, model.rotary)
        k, v = torch.cat([kc, kb], 1).transpose(1, 2), torch.cat([vc, vb], 1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=a.heads != a.kv_heads)
        x = x + a.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


def test_block_attention_equals_a_dense_mask_over_all_blocks():
    """The linear-in-anchors training attention is the dense masked pass over [context ; every block]."""
    from dspark.drafters.blocks import block_positions

    model = make()
    feats, ids = data(b=2, s=20)
    anchors = torch.tensor([[0, 3, 11, 17], [5, 6, 9, 12]])
    ctx = model.context_kv(feats, torch.arange(20).expand(2, 20))
    g = model.config.block_size
    pos = block_positions(anchors, g)
    x = torch.randn(2, 4, g, D)
    fast = model.run_blocks(x, pos, ctx, anchors)
    ref = _dense_layers(model, x.flatten(1, 2), pos.flatten(1), ctx, _dense_block_mask(anchors, 20, g))
    torch.testing.assert_close(fast, ref.view_as(fast), atol=2e-5, rtol=1e-4)


def test_block_attention_is_bidirectional():
    from dspark.drafters.blocks import block_positions

    model = make()
    feats, _ = data(b=1, s=4)
    ctx = model.context_kv(feats, torch.arange(4).unsqueeze(0))
    anchors = torch.tensor([[4]])
    pos = block_positions(anchors, 4)
    x = torch.randn(1, 1, 4, D)
    ref = model.run_blocks(x, pos, ctx, anchors)
    x2 = x.clone()
    x2[0, 0, 3] += 1.0  # the last slot influences the first
    assert not torch.allclose(model.run_blocks(x2, pos, ctx, anchors)[0, 0, 0], ref[0, 0, 0])


def test_block_labels_follow_prefix_validity():
    ids = torch.arange(10).unsqueeze(0)
    loss = torch.ones(1, 10, dtype=torch.bool)
    loss[0, 5] = False
    labels, valid = block_labels(ids, torch.tensor([[2, 7]]), torch.tensor([[True, True]]), 4, loss)
    assert labels[0, 0].tolist() == [3, 4, IGNORE, IGNORE]  # position 5 breaks the prefix
    assert labels[0, 1].tolist() == [8, 9, IGNORE, IGNORE]  # sequence ends
    assert valid.sum() == 4


# ---- draft vocabulary ----------------------------------------------------------------------------
def test_draft_vocab_mapping():
    d2t = torch.randperm(V - 1, generator=torch.Generator().manual_seed(3))[:100].sort().values
    model = make(draft_vocab_size=100, d2t=d2t)
    assert torch.equal(model.lm_head, target_weights()[1][d2t])
    assert model.lm_head.shape == (100, D) and model.markov_head.markov_w1.num_embeddings == V
    feats, ids = data(b=1, s=16)
    out = model.draft([cache_for(model, feats[0], 9)], [int(ids[0, 9])], [9], temperature=0.8,
                      generators=[torch.Generator().manual_seed(0)])
    assert out.logits.shape == (1, 4, 100) and out.probs.shape == (1, 4, V)
    assert set(out.tokens.flatten().tolist()) <= set(d2t.tolist())
    outside = torch.ones(V, dtype=torch.bool)
    outside[d2t] = False
    assert (out.probs[..., outside] == 0).all() and torch.allclose(out.probs.sum(-1), torch.ones(1, 4))
    labels = torch.tensor([int(d2t[5]), int(torch.nonzero(outside)[0]), IGNORE])
    assert model.draft_labels(labels).tolist() == [5, IGNORE, IGNORE]
    greedy = model.draft([cache_for(model, feats[0], 9)], [int(ids[0, 9])], [9])
    assert torch.equal(greedy.tokens[0], d2t[greedy.logits[0].argmax(-1)])


def test_draft_vocab_head_is_sliced_target_head():
    d2t = torch.tensor([4, 0, 17, 299])
    cfg = make().config
    g = torch.Generator().manual_seed(9)
    embed, head = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)
    model = DSparkDrafter(DrafterConfig.from_dict({**cfg.to_dict(), "draft_vocab_size": 4}), embed, head, d2t=d2t)
    assert torch.equal(model.lm_head, head[d2t])
    with pytest.raises(ValueError, match="d2t"):
        DSparkDrafter(DrafterConfig.from_dict({**cfg.to_dict(), "draft_vocab_size": 4}), embed, head)


# ---- sequential heads ----------------------------------------------------------------------------
def test_gated_and_rnn_heads_differ_from_vanilla():
    feats, ids = data()
    anchors, valid = torch.tensor([[3, 8], [1, 9]]), torch.ones(2, 2, dtype=torch.bool)
    outs = {}
    vanilla = make(markov_head_type="vanilla")
    for head in ("vanilla", "gated", "rnn"):
        model = make(markov_head_type=head)
        model.load_state_dict(vanilla.state_dict(), strict=False)  # same backbone, W1, W2 and confidence
        outs[head] = model.forward_train(feats, ids, anchors, valid)
    for head in ("gated", "rnn"):
        torch.testing.assert_close(outs[head].base_logits, outs["vanilla"].base_logits)
        assert not torch.allclose(outs[head].logits, outs["vanilla"].logits)
        assert not torch.allclose(outs[head].logits, outs[head].base_logits)
    assert not torch.allclose(outs["gated"].logits, outs["rnn"].logits)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn", None])
def test_selected_slots_match_whole_blocks(head):
    """forward_train(select=...), the trainer's form (a stateless Markov head fused into the LM head's
    matmul), gives the whole-block pass's logits, confidences and gradients on the selected slots."""
    model = make(**(dict(markov_head_type=head) if head else dict(markov_rank=0, confidence_head=False)))
    feats, ids = data()
    anchors, valid = torch.tensor([[3, 8, 15], [0, 5, 23]]), torch.ones(2, 3, dtype=torch.bool)
    select = torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(0)) < 0.6
    weight = torch.randn(int(select.sum()), V, generator=torch.Generator().manual_seed(1))
    got = []
    for sel in (None, select):
        model.zero_grad()
        out = model.forward_train(feats, ids, anchors, valid, select=sel)
        logits = out.logits if sel is not None else out.logits[select]
        conf = None if out.conf_logits is None else (out.conf_logits if sel is not None else out.conf_logits[select])
        (logits * weight[:len(logits)]).sum().add(0 if conf is None else conf.sum()).backward()  # linear: no rounding feedback
        got.append((logits.detach(), conf, {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}))
    (whole, whole_conf, whole_grads), (picked, picked_conf, picked_grads) = got
    assert picked.shape == (int(select.sum()), V)
    torch.testing.assert_close(picked, whole)
    if whole_conf is not None:
        torch.testing.assert_close(picked_conf, whole_conf)
    assert picked_grads.keys() == whole_grads.keys() and "fc.weight" in whole_grads
    assert head is None or "markov_head.markov_w2.weight" in whole_grads
    for name, grad in whole_grads.items():
        scale = float(grad.abs().max())  # fp32 sums in another order: rounding relative to the largest entry
        torch.testing.assert_close(picked_grads[name], grad, rtol=1e-4, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")


# ---- checkpoints ---------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path: Path):
    d2t = torch.arange(0, V, 3)
    model = make(markov_head_type="rnn", draft_vocab_size=len(d2t), d2t=d2t)
    model.sts_temperatures = [1.2, 0.9, 1.0, 1.1]
    model.survival_prior = [0.5, 0.25]
    model.save_pretrained(tmp_path, metadata={"recipe": {"lr": 6e-4}})
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "d2t" in saved and not any("embed" in k or "lm_head" in k for k in saved)
    loaded = DSparkDrafter.from_pretrained(tmp_path, *target_weights())
    assert loaded.config == model.config and loaded.metadata == {"recipe": {"lr": 6e-4}}
    assert loaded.sts_temperatures == [1.2, 0.9, 1.0, 1.1] and loaded.survival_prior == [0.5, 0.25]
    ref, got = model.state_dict(), loaded.eval().state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    feats, ids = data(b=1, s=12)
    a = model.draft([cache_for(model, feats[0], 7)], [3], [7])
    b = loaded.draft([cache_for(loaded, feats[0], 7)], [3], [7])
    assert torch.equal(a.logits, b.logits) and torch.equal(a.conf_logits, b.conf_logits)


def test_config_json_carries_speculators_fields(tmp_path: Path):
    import json

    make(markov_rank=8).save_pretrained(tmp_path, metadata={"trained_for": {"model": "t", "num_hidden_layers": 4}})
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["enable_confidence_head"] is True
    # speculators' convention: HF hidden_states indices, one past dspark's layer ids
    assert raw["aux_hidden_state_layer_ids"] == [i + 1 for i in raw["target_layer_ids"]]
    assert raw["sample_from_anchor"] is True
    assert raw["transformer_layer_config"]["num_hidden_layers"] == raw["num_layers"]
    assert raw["target"] == {"model": "t", "num_hidden_layers": 4}
    make(markov_rank=0, confidence_head=False).save_pretrained(tmp_path / "dflash")
    assert json.loads((tmp_path / "dflash" / "config.json").read_text())["speculators_model_type"] == "dflash"
    legacy = {**raw, "aux_hidden_state_layer_ids": raw["target_layer_ids"]}  # as dspark wrote them before
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    DSparkDrafter.from_pretrained(tmp_path, *target_weights())  # still loads
    raw["aux_hidden_state_layer_ids"] = [0]  # a hand edit that contradicts target_layer_ids
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="aux_hidden_state_layer_ids"):
        DSparkDrafter.from_pretrained(tmp_path, *target_weights())


# ---- batched inference ---------------------------------------------------------------------------
def test_drafts_without_logits_are_the_same():
    """return_logits=False (the engine's call) leaves logits out and changes nothing else."""
    model = make()
    feats, ids = data(b=1, s=20)
    cache = cache_for(model, feats[0], 9)
    full = model.draft([cache], [int(ids[0, 9])], [9])
    lean = model.draft([cache], [int(ids[0, 9])], [9], return_logits=False)
    assert lean.logits is None and torch.equal(lean.tokens, full.tokens)
    assert torch.equal(lean.conf_logits, full.conf_logits)


def test_later_rounds_of_other_shapes_match_single_requests():
    """The batched context buffer is reused between rounds: a round of fewer, shorter requests after a
    wide one must not see the earlier round's rows."""
    model = make(markov_head_type="rnn")
    feats, ids = data(b=3, s=20)
    wide = [cache_for(model, feats[i], 17) for i in range(3)]
    model.draft(wide, [int(ids[i, 17]) for i in range(3)], [17] * 3)
    lengths = [3, 11]
    caches = [cache_for(model, feats[i], n) for i, n in enumerate(lengths)]
    anchors = [int(ids[i, n]) for i, n in enumerate(lengths)]
    batch = model.draft(caches, anchors, lengths)
    for i, n in enumerate(lengths):
        one = model.draft([caches[i]], [anchors[i]], [n])
        assert torch.equal(batch.tokens[i], one.tokens[0])
        torch.testing.assert_close(batch.logits[i], one.logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, [0.7, 0.0, 1.0]])
def test_padding_does_not_change_requests(temperature):
    model = make(markov_head_type="rnn")
    feats, ids = data(b=3, s=20)
    lengths = [3, 11, 17]
    temps = temperature if isinstance(temperature, list) else [temperature] * 3

    def gens():
        return [torch.Generator().manual_seed(100 + i) for i in range(3)]

    caches = [cache_for(model, feats[i], n) for i, n in enumerate(lengths)]
    anchors = [int(ids[i, n]) for i, n in enumerate(lengths)]
    batch = model.draft(caches, anchors, lengths, temperature=temperature, top_p=0.9, generators=gens())
    for i, n in enumerate(lengths):
        one = model.draft([caches[i]], [anchors[i]], [n], temperature=temps[i], top_p=0.9,
                          generators=[gens()[i]])
        assert torch.equal(batch.tokens[i], one.tokens[0])
        # fp32 up to the BLAS kernel's blocking for another batch shape (1.3e-5 seen on an AVX2 CPU);
        # drafts need not be bit-exact, verification keeps the output lossless either way
        torch.testing.assert_close(batch.logits[i], one.logits[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(batch.conf_logits[i], one.conf_logits[0], rtol=1e-4, atol=1e-4)
        if one.probs is not None:
            torch.testing.assert_close(batch.probs[i], one.probs[0], rtol=1e-4, atol=1e-5)


def test_cache_rollback_matches_fresh_cache():
    model = make()
    feats, _ = data(b=1, s=16)
    cache = cache_for(model, feats[0], 12)
    cache.truncate(8)
    noise = torch.randn(4, M * D)
    model.extend(cache, noise, 8)  # rejected tail, replaced below by re-extending from position 6
    model.extend(cache, feats[0, 6:10], 6)
    fresh = cache_for(model, feats[0], 10, chunk=10)
    assert cache.length == fresh.length == 10
    for layer in range(model.config.num_layers):
        for a, b in zip(cache.layer(layer), fresh.layer(layer)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gap"):
        model.extend(cache, noise, 12)
    with pytest.raises(ValueError, match="anchor"):
        model.draft([cache], [1], [5])


def test_proposer_feeds_context_lazily_and_replaces_reobserved_tails():
    from types import SimpleNamespace

    from dspark.speculative.block_drafter import BlockDrafterProposer

    model = make()
    feats, _ = data(b=2, s=16)
    seq = SimpleNamespace(request_id="r")
    proposer = BlockDrafterProposer(model)
    proposer.observe(seq, feats[0, :10], 0)  # prefill
    proposer.observe(seq, feats[0, 10:14], 10)  # a verify window, all kept...
    proposer.observe(seq, feats[1, 12:15], 12)  # ...then positions 12.. committed again differently
    assert proposer._caches["r"].length == 0  # nothing projected before a draft needs it
    with pytest.raises(ValueError, match="gap"):
        proposer.observe(seq, feats[0, :1], 16)
    proposer._feed(["r"])
    want = torch.cat([feats[0, :12], feats[1, 12:15]])
    eager = cache_for(model, want, 15, chunk=15)
    got = proposer._caches["r"]
    assert got.length == 15
    for i in range(model.config.num_layers):
        torch.testing.assert_close(got.layer(i), eager.layer(i))


def test_extend_many_matches_one_extend_per_request():
    model = make()
    feats, _ = data(b=3, s=16)
    one = [cache_for(model, feats[i], 6) for i in range(3)]
    many = [cache_for(model, feats[i], 6) for i in range(3)]
    rows = [(feats[0, 6:10], 6), (feats[1, 4:5], 4), (feats[2, :0], 3)]  # extend, roll back + extend, truncate only
    for cache, (h, start) in zip(one, rows):
        model.extend(cache, h, start)
    model.extend_many(many, [h for h, _ in rows], [start for _, start in rows])
    assert [c.length for c in many] == [c.length for c in one] == [10, 5, 3]
    for a, b in zip(one, many):
        for i in range(model.config.num_layers):
            torch.testing.assert_close(a.layer(i), b.layer(i), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gap"):
        model.extend_many(many, [feats[0, :1], feats[1, :1]], [10, 9])
