"""Drafters across layouts: dspark <-> speculators (vLLM) bit for bit, DeepSpec (SGLang) checkpoints that
draft exactly like an independent reference of DeepSpec's Qwen3DSparkModel and losslessly in the engine."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dspark import LLM, SamplingParams
from dspark.cli import main as cli_main
from dspark.drafters import DrafterConfig, DSparkDrafter
from dspark.interop import (convert, detect_format, from_deepspec, from_speculators, load_any_drafter,
                            load_deepspec, to_deepspec, to_speculators)
from dspark.models.loader import load_decoder
from tests.conftest import make_tiny_model

BLOCK, IDS = 4, (0, 1)  # drafter block size; target layers 0 and 1 of the 3-layer tiny target
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [99, 98, 97, 96, 95, 94, 93]]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def target(qwen3_dir):
    dec = load_decoder(qwen3_dir)
    return dec.embed_tokens.weight, dec.lm_head.weight


@pytest.fixture(scope="module")
def plain(qwen3_dir):
    return [o.token_ids for o in LLM(qwen3_dir, kv_cache_mb=8).generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def ctx(qwen3_dir):
    return context(qwen3_dir)


def target_cfg(qwen3_dir: Path) -> dict:
    return json.loads((qwen3_dir / "config.json").read_text())


def context(qwen3_dir: Path, n: int = 10, seed: int = 0) -> tuple[torch.Tensor, int]:
    """HF transformers' hidden_states[i + 1] (output of decoder layer i) for n prompt tokens, and the anchor."""
    from transformers import Qwen3ForCausalLM

    ids = torch.randint(10, 4000, (n + 1,), generator=torch.Generator().manual_seed(seed))
    model = Qwen3ForCausalLM.from_pretrained(str(qwen3_dir)).eval()
    with torch.no_grad():
        hs = model(ids[None, :n], output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in IDS], dim=-1), int(ids[n])


def draft(drafter: DSparkDrafter, feats: torch.Tensor, anchor: int):
    """One greedy block after the context feats [L, m*d], anchored at position L."""
    cache = drafter.new_cache()
    drafter.extend(cache, feats.to(drafter.fc.weight.dtype), 0)
    return drafter.draft([cache], [anchor], [feats.shape[0]])


# ---- dspark <-> speculators ----------------------------------------------------------------------
def random_dspark(qwen3_dir: Path, out: Path, *, seed: int = 0, dtype=torch.float32, draft_vocab: int | None = None,
                  **over) -> Path:
    """A random dspark drafter dir for the tiny Qwen3 target (random norms too, so swaps show)."""
    dec = load_decoder(qwen3_dir)
    embed, head = dec.embed_tokens.weight, dec.lm_head.weight
    fields = dict(num_layers=2, block_size=BLOCK, target_layer_ids=IDS, markov_rank=16, draft_vocab_size=draft_vocab)
    cfg = DrafterConfig.for_target(target_cfg(qwen3_dir), **{**fields, **over})
    g = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab].sort().values if draft_vocab else None
    model = DSparkDrafter(cfg, embed, head, d2t=d2t)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if "norm" in name else 0.1) + ("norm" in name))
    model.to(dtype).save_pretrained(out, metadata={"trained_for": {"model": "tiny-qwen3", "num_hidden_layers": 3}})
    (out / "sts.json").write_text(json.dumps({"temperatures": [1.5, 2.0, 2.5, 3.0],
                                              "survival_rate": [0.6, 0.4, 0.25, None]}))  # the planner prior
    return out


CASES = {
    "dspark-vanilla-fp32": dict(),
    "dspark-rnn-bf16-draft-vocab": dict(markov_head_type="rnn", dtype=torch.bfloat16, draft_vocab=4096),
    "dspark-gated-no-conf": dict(markov_head_type="gated", confidence_head=False),
    "dflash": dict(markov_rank=0, confidence_head=False),
}


@pytest.mark.parametrize("case", CASES)
def test_speculators_round_trip_is_bit_exact(case, qwen3_dir, target, ctx, tmp_path):
    src = random_dspark(qwen3_dir, tmp_path / "src", **CASES[case])
    spec = to_speculators(src, tmp_path / "spec", target=qwen3_dir, verifier="Qwen/Qwen3-tiny")
    back = from_speculators(spec, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    # the config survives, and the training record gains the target the export was made against
    cfg, cfg_back = (json.loads((d / "config.json").read_text()) for d in (src, back))
    assert cfg_back["dspark"].pop("target_dir") == str(qwen3_dir.resolve()) and cfg == cfg_back
    assert json.loads((src / "sts.json").read_text()) == json.loads((back / "sts.json").read_text())
    one, two = (DSparkDrafter.from_pretrained(d, *target) for d in (src, back))
    feats, anchor = ctx
    d1, d2 = draft(one, feats, anchor), draft(two, feats, anchor)
    assert torch.equal(d1.tokens, d2.tokens) and torch.equal(d1.logits, d2.logits)


def test_speculators_round_trip_remembers_its_target(qwen3_dir, tmp_path, monkeypatch):
    """dspark -> speculators -> dspark -> speculators without --target the second time, bit for bit."""
    src = random_dspark(qwen3_dir, tmp_path / "src", draft_vocab=512, markov_head_type="gated")
    spec = to_speculators(src, tmp_path / "spec", target=qwen3_dir)
    back = from_speculators(spec, tmp_path / "back")
    spec2 = convert(back, tmp_path / "spec2", to="speculators")  # no target: the checkpoint names it
    a, b = load_file(str(spec / "model.safetensors")), load_file(str(spec2 / "model.safetensors"))
    assert a.keys() == b.keys() and "lm_head.weight" in a
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    cfg, cfg2 = (json.loads((d / "config.json").read_text()) for d in (spec, spec2))
    assert cfg["dspark"] == cfg2["dspark"] and cfg["speculators_config"]["verifier"]["architectures"] == \
        cfg2["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    # a drafter trained for the embedded model finds it by name (here the embedded model is the tiny one)
    import dspark.models.embedded as embedded

    monkeypatch.setattr(embedded, "MODEL_NAME", "tiny-qwen3")
    monkeypatch.setattr(embedded, "embedded_model_dir", lambda: qwen3_dir)
    fresh = convert(src, tmp_path / "spec3", to="speculators")
    assert torch.equal(load_file(str(fresh / "model.safetensors"))["lm_head.weight"], a["lm_head.weight"])


def test_speculators_layout_follows_the_published_schema(qwen3_dir, target, tmp_path):
    src = random_dspark(qwen3_dir, tmp_path / "src", markov_head_type="rnn", draft_vocab=4096)
    spec = to_speculators(src, tmp_path / "spec", target=qwen3_dir)
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["DSparkSpeculator"]
    assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in IDS]  # HF hidden_states indices
    assert cfg["sample_from_anchor"] is True and cfg["block_size"] == BLOCK and cfg["draft_vocab_size"] == 4096
    assert cfg["markov_head_type"] == "rnn" and cfg["confidence_head_with_markov"] is True
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    w, d2t = load_file(str(spec / "model.safetensors")), load_file(str(src / "model.safetensors"))["d2t"]
    assert "layers.1.mlp.gate_proj.weight" in w and not any("gate_up" in k or "embed_tokens" in k for k in w)
    assert torch.equal(w["d2t"] + torch.arange(4096), d2t)  # offsets
    assert w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 4096 and bool(w["t2d"][d2t].all())
    assert torch.equal(w["lm_head.weight"], target[1][d2t])
    assert w["markov_head.joint_proj.weight"].shape == (3 * 16, 2 * 16 + 64)


def test_speculators_import_refuses_what_dspark_cannot_run(qwen3_dir, tmp_path):
    spec = to_speculators(random_dspark(qwen3_dir, tmp_path / "src"), tmp_path / "spec")
    cfg = json.loads((spec / "config.json").read_text())
    bad = {"sample_from_anchor": False, "speculators_model_type": "eagle3", "aux_hidden_state_layer_ids": [0, 2]}
    for key, value in bad.items():
        (spec / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match="unsupported|not supported"):
            from_speculators(spec, tmp_path / f"out-{key}")
    with pytest.raises(ValueError, match="speculators type 'dspark'"):
        to_speculators(tmp_path / "src", tmp_path / "x", model_type="dflash")
    with pytest.raises(ValueError, match="needs the target"):
        to_speculators(random_dspark(qwen3_dir, tmp_path / "dv", draft_vocab=512), tmp_path / "y")


# ---- DeepSpec ------------------------------------------------------------------------------------
def write_deepspec(qwen3_dir: Path, out: Path, *, markov_rank: int, conf: bool, head_type: str = "vanilla",
                   seed: int = 0) -> Path:
    """A random-weight checkpoint in the exact layout DeepSpec's Qwen3DSparkModel.save_pretrained writes."""
    tc, (embed, head) = target_cfg(qwen3_dir), (lambda d: (d.embed_tokens.weight, d.lm_head.weight))(
        load_decoder(qwen3_dir))
    d, inter, h, kv, hd, v = (tc[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                              "num_key_value_heads", "head_dim", "vocab_size"))
    g = torch.Generator().manual_seed(seed)

    def w(*shape, norm=False):
        return torch.randn(shape, generator=g) * (0.2 if norm else 0.1) + float(norm)

    t = {"embed_tokens.weight": embed.clone(), "lm_head.weight": head.clone(), "fc.weight": w(d, len(IDS) * d),
         "hidden_norm.weight": w(d, norm=True), "norm.weight": w(d, norm=True)}
    for i in range(2):
        p = f"layers.{i}."
        t |= {p + "input_layernorm.weight": w(d, norm=True), p + "post_attention_layernorm.weight": w(d, norm=True),
              p + "self_attn.q_proj.weight": w(h * hd, d), p + "self_attn.k_proj.weight": w(kv * hd, d),
              p + "self_attn.v_proj.weight": w(kv * hd, d), p + "self_attn.o_proj.weight": w(d, h * hd),
              p + "self_attn.q_norm.weight": w(hd, norm=True), p + "self_attn.k_norm.weight": w(hd, norm=True),
              p + "mlp.gate_proj.weight": w(inter, d), p + "mlp.up_proj.weight": w(inter, d),
              p + "mlp.down_proj.weight": w(d, inter)}
    r = markov_rank
    extra = {"markov_rank": r, "enable_confidence_head": conf}
    if r:
        t |= {"markov_head.markov_w1.weight": w(v, r), "markov_head.markov_w2.weight": w(v, r)}
        extra["markov_head_type"] = head_type
        if head_type == "gated":
            t |= {"markov_head.gate_proj.weight": w(r, d + r), "markov_head.gate_proj.bias": w(r)}
        if head_type == "rnn":
            t |= {"markov_head.joint_proj.weight": w(3 * r, 2 * r + d), "markov_head.joint_proj.bias": w(3 * r)}
    if conf:
        t |= {"confidence_head.proj.weight": w(1, d + r), "confidence_head.proj.bias": w(1)}
        extra["confidence_head_with_markov"] = r > 0
    out.mkdir(parents=True)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**tc, "architectures": ["Qwen3DSparkModel"], "num_target_layers": tc["num_hidden_layers"],
           "num_hidden_layers": 2, "block_size": BLOCK, "tie_word_embeddings": False,
           "layer_types": ["full_attention"] * 2, "mask_token_id": v - 1, "target_layer_ids": list(IDS),
           "num_anchors": 512, **extra}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def reference_block(src: Path, feats: torch.Tensor, anchor: int):
    """DeepSpec's Qwen3DSparkModel drafting one block, written from its equations on the raw checkpoint."""
    t, c = load_file(str(src / "model.safetensors")), json.loads((src / "config.json").read_text())
    eps, theta, hd = c["rms_norm_eps"], c.get("rope_theta") or c["rope_parameters"]["rope_theta"], c["head_dim"]
    h, kv, n, b = c["num_attention_heads"], c["num_key_value_heads"], feats.shape[0], c["block_size"]

    def rms(x, wt):
        return wt * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [T, heads, hd]
        freqs = pos[:, None].double() / theta ** (torch.arange(0, hd, 2).double() / hd)
        emb = torch.cat([freqs, freqs], -1)[:, None]
        cos, sin = emb.cos().float(), emb.sin().float()
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    ctx = rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"])
    x = t["embed_tokens.weight"][[anchor] + [c["mask_token_id"]] * (b - 1)]
    pos = torch.arange(n + b)
    for i in range(c["num_hidden_layers"]):
        def p(name, i=i):
            return t[f"layers.{i}.{name}.weight"]
        a = rms(x, p("input_layernorm"))
        q = rope(rms((a @ p("self_attn.q_proj").T).view(b, h, hd), p("self_attn.q_norm")), pos[n:])
        k = rms((torch.cat([ctx, a]) @ p("self_attn.k_proj").T).view(n + b, kv, hd), p("self_attn.k_norm"))
        k = rope(k, pos).repeat_interleave(h // kv, 1)
        vv = (torch.cat([ctx, a]) @ p("self_attn.v_proj").T).view(n + b, kv, hd).repeat_interleave(h // kv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), -1)
        x = x + torch.einsum("hqk,khd->qhd", att, vv).reshape(b, h * hd) @ p("self_attn.o_proj").T
        m = rms(x, p("post_attention_layernorm"))
        x = x + (F.silu(m @ p("mlp.gate_proj").T) * (m @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    hid = rms(x, t["norm.weight"])
    base = hid @ t["lm_head.weight"].T
    r, prev, state, tokens, logits, confs = c["markov_rank"], anchor, None, [], [], []
    for k_ in range(b):
        z, emb = base[k_], None
        if r:
            emb = t["markov_head.markov_w1.weight"][prev]
            if c["markov_head_type"] == "vanilla":
                z = z + t["markov_head.markov_w2.weight"] @ emb
            elif c["markov_head_type"] == "gated":
                gate = torch.sigmoid(t["markov_head.gate_proj.weight"] @ torch.cat([hid[k_], emb])
                                     + t["markov_head.gate_proj.bias"])
                z = z + t["markov_head.markov_w2.weight"] @ (gate * emb)
            else:
                state = torch.zeros(r) if state is None else state
                gr, cr, orw = (t["markov_head.joint_proj.weight"] @ torch.cat([state, emb, hid[k_]])
                               + t["markov_head.joint_proj.bias"]).chunk(3)
                state = torch.sigmoid(gr) * state + (1 - torch.sigmoid(gr)) * torch.tanh(cr)
                z = z + t["markov_head.markov_w2.weight"] @ torch.tanh(orw)
        if c["enable_confidence_head"]:
            feat = hid[k_] if emb is None else torch.cat([hid[k_], emb])
            confs.append(float(t["confidence_head.proj.weight"][0] @ feat + t["confidence_head.proj.bias"][0]))
        prev = int(z.argmax())
        tokens.append(prev)
        logits.append(z)
    return tokens, torch.stack(logits), confs


def test_dspark_taps_are_deepspec_layer_ids(qwen3_dir, ctx):
    """dspark's target_layer_ids i = DeepSpec's hook on layers[i] = HF hidden_states[i + 1]."""
    dec = load_decoder(qwen3_dir)
    feats, _ = ctx
    ids = torch.randint(10, 4000, (11,), generator=torch.Generator().manual_seed(0))[:10]
    cache = dec.new_cache(2, block_size=16)
    cache.reserve("s", 10)
    res = dec(ids, torch.arange(10), cache, cache.prepare(["s"], [10]), hidden_layers=IDS)
    torch.testing.assert_close(res.hidden, feats, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("markov_rank,conf,head_type", [(16, True, "vanilla"), (16, True, "rnn"), (16, False, "gated"),
                                                        (0, False, "vanilla")],
                         ids=["dspark-vanilla", "dspark-rnn", "dspark-gated-no-conf", "dflash"])
def test_deepspec_checkpoint_drafts_like_the_reference(markov_rank, conf, head_type, qwen3_dir, target, ctx,
                                                       tmp_path):
    src = write_deepspec(qwen3_dir, tmp_path / "ds", markov_rank=markov_rank, conf=conf, head_type=head_type)
    assert detect_format(src) == "deepspec"
    feats, anchor = ctx
    ref_tokens, ref_logits, ref_conf = reference_block(src, feats, anchor)
    drafter = load_deepspec(src, *target)
    out = draft(drafter, feats, anchor)
    assert out.tokens[0].tolist() == ref_tokens
    torch.testing.assert_close(out.logits[0], ref_logits, atol=2e-4, rtol=1e-4)
    if conf:
        torch.testing.assert_close(out.conf_logits[0], torch.tensor(ref_conf), atol=2e-4, rtol=1e-4)
    converted = DSparkDrafter.from_pretrained(from_deepspec(src, tmp_path / "dspark"), *target)
    again = draft(converted, feats, anchor)
    assert torch.equal(again.tokens, out.tokens) and torch.equal(again.logits, out.logits)
    assert torch.equal(draft(load_any_drafter(src, *target), feats, anchor).logits, out.logits)


@pytest.mark.parametrize("algorithm,markov_rank,route", [("DSPARK", 16, "converted"), ("DFLASH", 0, "direct")])
def test_deepspec_drafter_is_lossless_in_the_engine(algorithm, markov_rank, route, qwen3_dir, plain, tmp_path,
                                                    monkeypatch):
    src = write_deepspec(qwen3_dir, tmp_path / "ds", markov_rank=markov_rank, conf=markov_rank > 0, seed=1)
    if route == "converted":
        draft_model = convert(src, tmp_path / "dspark", to="dspark")
    else:  # the factory loading through load_any_drafter: the DeepSpec dir as it is
        import dspark.drafters

        shim = type("AnyDrafter", (), {"from_pretrained": staticmethod(load_any_drafter)})
        monkeypatch.setattr(dspark.drafters, "DSparkDrafter", shim)
        draft_model = src
    llm = LLM(qwen3_dir, kv_cache_mb=8, speculative_algorithm=algorithm, draft_model=draft_model, planner="fixed")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain


def test_deepspec_export_round_trips(qwen3_dir, target, tmp_path):
    src = random_dspark(qwen3_dir, tmp_path / "src", markov_head_type="gated")
    ds = to_deepspec(src, tmp_path / "ds", target=qwen3_dir)
    cfg = json.loads((ds / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["target_layer_ids"] == list(IDS)
    assert cfg["num_target_layers"] == 3 and cfg["confidence_head_with_markov"] is True
    w = load_file(str(ds / "model.safetensors"))
    assert torch.equal(w["lm_head.weight"], target[1]) and "layers.0.mlp.up_proj.weight" in w
    back = from_deepspec(ds, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # any format to any other: speculators -> DeepSpec directly, then back to dspark, still bit for bit
    spec = to_speculators(src, tmp_path / "spec")
    ds2 = convert(spec, tmp_path / "ds2", to="deepspec", target=qwen3_dir)
    c = load_file(str(convert(ds2, tmp_path / "back2", to="dspark") / "model.safetensors"))
    assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a)


def test_deepspec_refuses_unsupported_layouts(qwen3_dir, tmp_path):
    src = write_deepspec(qwen3_dir, tmp_path / "ds", markov_rank=16, conf=True)
    cfg = json.loads((src / "config.json").read_text())
    for key, value in {"target_layer_ids": [-1, 1], "architectures": ["Gemma4DSparkModel"],
                       "confidence_head_with_markov": False}.items():
        (src / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match="unsupported"):
            from_deepspec(src, tmp_path / f"o-{key}")
    (src / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(src / "model.safetensors"))
    save_file({**w, "fc.weight": w["fc.weight"][:, :64].contiguous()}, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="shape mismatch.*fc.weight"):
        from_deepspec(src, tmp_path / "o-shape")


# ---- CLI -----------------------------------------------------------------------------------------
def test_cli_convert(qwen3_dir, tmp_path, capsys):
    src = random_dspark(qwen3_dir, tmp_path / "src")
    dst = tmp_path / "spec"
    assert cli_main(["convert", "--to", "speculators", str(src), str(dst)]) == 0
    assert detect_format(dst) == "speculators"
    assert cli_main(["convert", "--to", "speculators", str(src), str(dst)]) == 2  # non-empty DST
    assert "not empty" in capsys.readouterr().err
    assert cli_main(["convert", "--to", "speculators", "--force", str(src), str(dst)]) == 0
    assert cli_main(["convert", "--to", "dspark", str(dst), str(tmp_path / "back")]) == 0
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{}")
    assert cli_main(["convert", "--to", "dspark", str(tmp_path / "junk"), str(tmp_path / "j2")]) == 2
    assert "not a known drafter format" in capsys.readouterr().err


def test_cli_embedded_source(qwen3_dir, tmp_path, capsys, monkeypatch):
    import dspark.drafters.registry as registry

    monkeypatch.setattr(registry, "CHECKPOINTS", tmp_path / "checkpoints")
    assert cli_main(["convert", "--to", "speculators", "embedded", str(tmp_path / "out")]) == 2
    assert "SRC 'embedded': no shipped DSPARK drafter" in capsys.readouterr().err
    random_dspark(qwen3_dir, tmp_path / "checkpoints" / registry.SHIPPED["DSPARK"])
    assert cli_main(["convert", "--to", "speculators", "embedded", str(tmp_path / "out")]) == 0
    assert detect_format(tmp_path / "out") == "speculators"
