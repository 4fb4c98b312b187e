"""
Load the DepthBench authors' released OLMo-core checkpoints into our GPT, and evaluate them (docs/official.md).

A step folder holds `config.json` (sections `model` and `dataset.tokenizer`) and `model_and_optim/`, a torch
distributed checkpoint (DCP) of {"model": ..., "optim": ...}. We read only the `model.*` tensors, with
torch's own DCP reader (no OLMo-core), map every official name onto ours (`layout`), and refuse, in one
line, any setting our model would compute differently (or a model too large to build: checkpoints.py's bounds).
Where the official names and layouts were read: docs/official.md#provenance.

    python -m depthbench.files.official info  SOURCE [--step N]                 # design, shape and what was mapped
    python -m depthbench.files.official evaluate SOURCE --text FILES [--step N] [--seq-len 2048] [--max-tokens N]
    python diagnose.py SOURCE [--step N] --metrics ...           # every diagnostic (diagnose.py)

SOURCE: a hub id (downloaded with huggingface_hub: the chosen step and tokenizer/ only; a repository that keeps one
checkpoint at its root: that one), a local repository folder with stepN/ subfolders (default: the highest step), or
one step folder (a repository root holding config.json and model_and_optim/ is one).
"""
import itertools
import json
import os
import re
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import data
from depthbench.files.checkpoints import check_model_config
from depthbench.files.common import ArgParser, CheckpointError, fail, first_line, hub_unreachable, json_object, load_json, part_of, pick_device, positive
from model import GPT, GPTConfig
from residuals import RESIDUALS

# official block type -> our design (Block AttnRes is "attnres" with a block size > 1; `default_depth_scaled` is LNS
# with one 1/sqrt(L) in every block); the last three are the release's extra baselines (docs/official.md#release)
BLOCKS = {"default": "preln", "peri_norm": "sandwich", "default_scaled": "lns", "deepnorm": "deepnorm",
          "keel": "keel", "hc": "hc", "mhc": "mhc", "attnres": "attnres", "moda": "moda", "post_norm_moda": "moda",
          "post_norm": "postln", "depth_mup": "preln_mup", "completep": "preln_completep",
          "default_depth_scaled": "lns"}
RELEASED = sorted(set(BLOCKS.values()) | {"block_attnres"})   # our designs the release has a block for
DEPTH_ALPHA = {"depth_mup": 0.5, "completep": 1.0}   # the release's residual-branch exponent per depth block
HF_LLAMA = [("embeddings.weight", "model.embed_tokens.weight"), ("lm_head.norm.weight", "model.norm.weight"),
            ("lm_head.w_out.weight", "lm_head.weight")] + [
    (f"blocks.{{}}.{a}.weight", f"model.layers.{{}}.{b}.weight") for a, b in [
        ("attention.w_q", "self_attn.q_proj"), ("attention.w_k", "self_attn.k_proj"),
        ("attention.w_v", "self_attn.v_proj"), ("attention.w_out", "self_attn.o_proj"),
        ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w2", "mlp.down_proj"),
        ("feed_forward.w3", "mlp.up_proj"), ("attention_norm", "input_layernorm"),
        ("feed_forward_norm", "post_attention_layernorm")]]


def short(keys, n=4):
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


# ----------------------------------------------------------------------------- config.json -> GPTConfig

def refuse(cond, what):
    if cond:
        raise CheckpointError(f"unsupported official setting: {what}")


@dataclass
class Sections:
    """The parts of an official config.json that read_config checks, each a dict ({} where absent)."""
    experiment: dict     # the whole config.json
    model: dict          # "model"
    block: dict          # model.block
    attention: dict      # block.sequence_mixer (older: block.attention)
    feed_forward: dict   # block.feed_forward
    rope: dict           # attention.rope
    norm: dict           # block.layer_norm: every norm of the blocks
    head: dict           # model.lm_head
    head_norm: dict      # lm_head.layer_norm: the final norm
    hc: dict             # block.hyper_connections (HC/mHC)


# What our model computes, as data: (section, key, the values we reproduce, what it is). A missing key reads None.
ALLOWED = [
    ("attention", "name", (None, "default"), "attention type (only split w_q/w_k/w_v)"),
    ("attention", "qk_norm", (None,), "attention qk_norm"), ("attention", "gate", (None,), "attention gate"),
    ("attention", "clip_qkv", (None,), "attention clip_qkv"),
    ("attention", "sliding_window", (None,), "attention sliding_window"),
    ("attention", "bias", (None, False), "linear biases"),
    ("feed_forward", "bias", (None, False), "linear biases"),
    ("head", "bias", (None, False), "linear biases"),
    ("rope", "name", (None, "default"), "RoPE (only the default rotate-half RoPE, no scaling)"),
    ("rope", "scaling", (None, False, {}), "RoPE (only the default rotate-half RoPE, no scaling)"),
    ("feed_forward", "name", (None, "default"), "feed-forward (only SwiGLU)"),
    ("feed_forward", "activation", (None, "silu"), "feed-forward (only SwiGLU)"),
    ("norm", "bias", (None, False), "block norm bias"),
    ("head_norm", "name", ("rms",), "final norm (only RMSNorm)"),
    ("head_norm", "bias", (None, False), "final norm bias"),
    ("model", "embedding_norm", (None,), "embedding norm"),
    ("model", "embed_scale", (None, 1.0), "embedding scale"),
    ("model", "block_pattern", (None,), "block_pattern"),
    ("block", "attention_residual_alpha", (None, 1.0), "attention_residual_alpha"),
    ("block", "feed_forward_residual_alpha", (None, 1.0), "feed_forward_residual_alpha"),
    ("block", "attnres_use_bias", (None, False), "AttnRes variant (only the plain AttnRes, its top-k and logit scale)"),
]
# the last name part of every tensor the release saves as a parameter (the others are buffers, which its loader
# ignores when the model it builds has none of that name): an unexpected one of these is refused, never ignored
PARAMETER_LEAVES = {"weight", "bias", "static_alpha", "dynamic_alpha_proj", "dynamic_alpha_scale", "static_beta",
                    "dynamic_beta_proj", "dynamic_beta_scale", "phi", "b", "alpha_pre", "alpha_post", "alpha_res",
                    "attnres_logit_scale", "mlp_attnres_logit_scale", "final_attnres_logit_scale", "attn_res_bias",
                    "mlp_res_bias", "res_bias"}
MHC_DEFAULTS = {"liger_rms_eps": 1e-6, "liger_pre_eps": 0.0, "liger_sinkhorn_eps": 1e-6, "liger_post_mult": 2.0}


def sections(step_dir):
    """config.json -> Sections; a file that is not an OLMo-core experiment config is a CheckpointError."""
    path = Path(step_dir) / "config.json"
    try:
        exp = load_json(path)  # the project's one JSON reader (a JsonError is a ValueError)
        m, blk = exp["model"], exp["model"]["block"]
        att = blk.get("sequence_mixer") or blk.get("attention")
        int(m["d_model"]), int(m["n_layers"]), int(att["n_heads"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:  # int(1e999), a block no object
        why = getattr(e, "cause", None) or f"{type(e).__name__}: {e}"  # a JsonError says its reader's exception
        raise CheckpointError(f"{path}: not an OLMo-core experiment config ({why})") from None
    head, part = part_of(m, "lm_head", path), lambda section, key: part_of(section, key, path)  # objects, or {}
    return Sections(experiment=exp, model=m, block=blk, attention=att, feed_forward=part(blk, "feed_forward"),
                    rope=part(att, "rope"), norm=part(blk, "layer_norm"), head=head,
                    head_norm=part(head, "layer_norm"), hc=part(blk, "hyper_connections"))


def block_name(sec):
    """The block type, with the older spellings renamed as the official loaders do: AttnRes by its block size,
    HC/mHC by a hyper_connections section on a default block."""
    name = sec.block.get("name") or "default"
    if name == "attn_res" or name == "default" and sec.block.get("attnres_block_size") is not None:
        name = "attnres"
    if name == "default" and sec.block.get("hyper_connections") is not None:
        name = "hc" if (sec.hc.get("kind") or "hc") == "hc" else "mhc"
    refuse(name not in BLOCKS, f"block type {name!r} (known: {', '.join(BLOCKS)})")
    refuse(sec.block.get("hyper_connections") is not None and name not in ("hc", "mhc"),
           f"hyper_connections on a {name} block")
    for key in ("attnres_topk_fraction", "attnres_learn_logit_scale"):
        refuse(sec.block.get(key) not in (None, False) and name != "attnres", f"{key} on a {name} block")
    return name


def check_backbone(sec, name):
    """Refuse, in one line, any backbone setting our model would compute differently (ALLOWED and the relations)."""
    for part, key, allowed, what in ALLOWED:
        value = getattr(sec, part).get(key)
        refuse(value not in allowed, f"{what}: {key} = {value!r}")
    d, H = int(sec.model["d_model"]), int(sec.attention["n_heads"])
    kv = sec.attention.get("n_kv_heads") or H
    refuse(H % int(kv), f"n_kv_heads {kv} does not divide n_heads {H}")
    refuse(sec.attention.get("head_dim") not in (None, d // H) or d % H,
           f"head_dim {sec.attention.get('head_dim')} != d_model/n_heads")
    refuse(not sec.rope, "no RoPE (only the default rotate-half RoPE, no scaling)")
    want = "default" if name == "deepnorm" else "rms"        # DeepNorm's block norms are true LayerNorms
    refuse((sec.norm.get("name") or "default") != want, f"{name} block norm {sec.norm}")
    eps = float(sec.norm.get("eps", 1e-5))
    head_eps = float(sec.head_norm.get("eps", 1e-5))
    refuse(abs(head_eps - eps) > 1e-12, f"final norm eps {sec.head_norm.get('eps')} != {eps}")
    for i, o in (sec.model.get("block_overrides") or {}).items():   # MoDA's last block skips its unused W_kv
        same = {k: v for k, v in o.items() if k != "moda_skip_ffn_kv"}
        refuse(same != {k: v for k, v in sec.block.items() if k != "moda_skip_ffn_kv"}, f"block_overrides[{i}]")


def streams_args(sec, name):
    """HC/mHC: (options, unknown readings). Code versions differ in the "sum" collapse: sum, then the norm
    (newer) or the norm on each stream, then the sum; and HC's forward: with A's residual columns (newer) or not."""
    hc = sec.hc
    mode = hc.get("collapse") or "auto"
    if mode == "auto":
        mode = "mean" if hc.get("kind") == "liger_mhc" else "sum"
    refuse(mode not in ("sum", "mean"), f"collapse {mode!r}")
    args = {"collapse": mode, "n_streams": int(hc.get("num_residual_streams", 4))}
    unknown = {"collapse": ("sum", "norm_each")} if mode == "sum" else {}
    if name == "hc":
        refuse((hc.get("kind") or "hc") != "hc" or hc.get("tanh") is False, f"HC kind/tanh {hc}")
        unknown["forward"] = ("mixed", "unmixed")
    else:
        refuse(hc.get("kind") != "liger_mhc", f"mHC kind {hc.get('kind')!r} (only the paper's liger_mhc)")
        for key, v in MHC_DEFAULTS.items():
            refuse(float(hc.get(key, v)) != v, f"mHC {key} = {hc.get(key)} (ours: {v})")
        args["sinkhorn_iters"] = int(hc.get("sinkhorn_iters", 20))
    return args, unknown


def attnres_design(sec):
    """AttnRes: (design, options). Block size S = 1 is Full AttnRes; S > 1 is Block AttnRes with boundaries every S
    sublayers (the official block's rule: any S, the last group short when S does not divide 2L). The release's
    top-k fraction and learnt logit scale are options of both."""
    S = int(sec.block.get("attnres_block_size") or 1)
    refuse(S < 1, f"AttnRes block size {S}")
    args = attnres_variants(sec)
    if S == 1:
        return "attnres", args
    return "block_attnres", {"block_size": S, **args}


def attnres_variants(sec):
    """The release's AttnRes variants as our options: attnres_topk_fraction (None: all), attnres_learn_logit_scale."""
    frac, learn = sec.block.get("attnres_topk_fraction"), sec.block.get("attnres_learn_logit_scale")
    refuse(frac not in (None, False) and not 0.0 < float(frac) <= 1.0, f"attnres_topk_fraction = {frac!r}")
    refuse(learn not in (None, False, True), f"attnres_learn_logit_scale = {learn!r}")
    args = {"topk_fraction": float(frac)} if frac not in (None, False) else {}
    return {**args, "learn_logit_scale": True} if learn else args


def moda_args(sec, name):
    moda = sec.block.get("moda") or {}
    refuse(moda.get("extra_ffn_kv_proj") is False or moda.get("extra_attn_kv_proj"), f"MoDA K/V projections {moda}")
    refuse(moda.get("attention_scale") is not None, f"MoDA attention_scale {moda.get('attention_scale')}")
    norm = "post" if name == "post_norm_moda" else "pre"
    return {"norm": norm}


def depth_args(sec, name):
    """depth-muP / CompleteP: the base depth from config.json; the scaling axis from the init, which depth_width
    alone changes (hidden init std x m_N^(-1/2), the embedding's kept): m_N = (embedding std / init std)^2."""
    alpha = sec.block.get("residual_scaling_alpha")
    refuse(alpha not in (None, DEPTH_ALPHA[name]), f"{name} residual_scaling_alpha = {alpha}")
    args = {"base_depth": int(sec.block.get("residual_scaling_base_depth") or 24)}
    emb_std = sec.model.get("embedding_init_std")
    if emb_std is not None:
        m_N = (float(emb_std) / float(sec.model.get("init_std") or 0.02)) ** 2
        args.update(scaling="depth_width", base_width=round(int(sec.model["d_model"]) / m_N))
    return args


def design_of(sec, name):
    """-> (our design, its options, {option: the readings config.json allows} for what it cannot tell)."""
    if name in ("hc", "mhc"):
        args, unknown = streams_args(sec, name)
        return BLOCKS[name], args, unknown
    if name == "attnres":
        residual, args = attnres_design(sec)
        return residual, args, {}
    if name in ("moda", "post_norm_moda"):
        return "moda", moda_args(sec, name), {}
    if name in DEPTH_ALPHA:
        return BLOCKS[name], depth_args(sec, name), {}
    if name == "default_depth_scaled":
        return "lns", {"scale": "depth"}, {}
    return BLOCKS[name], {}, {}


def read_config(step_dir, forced=None):
    """config.json -> (GPTConfig computing what the checkpoint's model computes, notes dict). forced: the
    design options that config.json cannot tell (HC's forward and collapse readings, `--residual-args`); a
    config.json that export.py wrote names them itself, in its EXPORT_KEY section (forced wins)."""
    sec, forced = sections(step_dir), forced or {}
    name = block_name(sec)
    check_backbone(sec, name)
    residual, args, unknown = design_of(sec, name)
    refuse(set(forced) - set(unknown), f"--residual-args {sorted(set(forced) - set(unknown))}: config.json says it")
    where = Path(step_dir) / "config.json"
    exported = part_of(part_of(sec.experiment, EXPORT_KEY, where), "readings", where)  # what export.py wrote
    forced = {**{k: v for k, v in exported.items() if k in unknown}, **forced}
    if any(forced.get(k) not in v for k, v in unknown.items()):
        choices = ", ".join(f'"{k}": ' + " or ".join(f'"{x}"' for x in v) for k, v in unknown.items())
        raise CheckpointError(f"config.json cannot tell which official code version trained this {name}: choose with "
                              f"--residual-args '{{{choices}}}' (newer code: the first; docs/official.md)")
    args.update(forced)
    args = {k: v for k, v in args.items() if RESIDUALS[residual].options.get(k) != v}  # only what differs
    m, att = sec.model, sec.attention
    H = int(att["n_heads"])
    gqa = {"n_kv_head": int(att["n_kv_heads"])} if att.get("n_kv_heads") not in (None, H) else {}
    cfg = GPTConfig(vocab_size=int(m["vocab_size"]), n_layer=int(m["n_layers"]), d_model=int(m["d_model"]),
                    n_head=H, d_ff=int(sec.feed_forward["hidden_size"]), rope_theta=float(sec.rope.get("theta", 10000)),
                    norm_eps=float(sec.norm.get("eps", 1e-5)), residual=residual, residual_args=args, **gqa)
    dataset = part_of(sec.experiment, "dataset", where)
    tok = part_of(dataset, "tokenizer", where)
    refuse(int(tok.get("vocab_size") or 0) > cfg.vocab_size, f"tokenizer vocab {tok.get('vocab_size')} > model's")
    notes = {"block": name, "tokenizer_vocab": tok.get("vocab_size"), "eos_token_id": tok.get("eos_token_id"),
             "tokenizer_id": tok.get("identifier"), "seq_len": dataset.get("sequence_length")}
    return cfg, notes


# ----------------------------------------------------------------------------- names: ours <-> official

def layout(cfg):
    """[(our state-dict key, row or None, official key)] for every tensor of our model with cfg.
    A row maps one official tensor onto a row of a stacked parameter of ours (AttnRes' queries)."""
    r, L = cfg.residual, cfg.n_layer
    moda = r == "moda"
    att, ff = ("attention.attention", "feed_forward.feed_forward") if moda else ("attention", "feed_forward")
    out = [("wte.weight", None, "embeddings.weight"), ("lm_head.weight", None, "lm_head.w_out.weight"),
           ("res.norm_f.weight", None, "lm_head.norm.weight")]
    for b in range(L):
        p = f"blocks.{b}."
        out += [(f"{p}attn.w{x}.weight", None, f"{p}{att}.w_{'out' if x == 'o' else x}.weight") for x in "qkvo"]
        out += [(f"{p}mlp.w{x}.weight", None, f"{p}{ff}.w{x}.weight") for x in "123"]
        out += [(f"res.norms.{2 * b}.weight", None, f"{p}attention_norm.weight"),
                (f"res.norms.{2 * b + 1}.weight", None, f"{p}feed_forward_norm.weight")]
        if moda and b < L - 1:
            out += [(f"res.kv_proj.{b}.weight", None, f"{p}feed_forward.kv_proj.weight")]
        for i, side in ((2 * b, "attention"), (2 * b + 1, "feed_forward")):
            shift = int(r == "keel")                      # KEEL: post_norms[i - 1] belongs to sublayer i >= 1
            if r in ("sandwich", "keel") and i >= shift:
                out += [(f"res.post_norms.{i - shift}.weight", None, f"{p}post_{side}_norm.weight")]
            c = f"{p}{side}_hyper_connection."
            if r == "hc":
                out += [(f"res.conn.{i}.{a}", None, c + o) for a, o in [
                    ("static_alpha", "static_alpha"), ("dynamic_alpha", "dynamic_alpha_proj"),
                    ("alpha_scale", "dynamic_alpha_scale"), ("static_beta", "static_beta"),
                    ("dynamic_beta", "dynamic_beta_proj"), ("beta_scale", "dynamic_beta_scale")]]
            if r == "mhc":
                out += [(f"res.conn.{i}.{a}", None, c + a)
                        for a in ("phi", "b", "alpha_pre", "alpha_post", "alpha_res")]
            if r in ("attnres", "block_attnres") and i > 0:  # consumer i reads row i - 1
                pre = "attn" if side == "attention" else "mlp"
                out += [("res.queries", i - 1, f"{p}{pre}_res_proj.weight"),
                        ("res.key_gains", i - 1, f"{p}{pre}_res_norm.weight")]
                if cfg.residual_args.get("learn_logit_scale"):
                    out += [("res.logit_scales", i - 1, f"{p}{'' if pre == 'attn' else 'mlp_'}attnres_logit_scale")]
    if r in ("attnres", "block_attnres"):                 # the head's readout is consumer 2L
        out += [("res.queries", 2 * L - 1, "res_proj.weight"), ("res.key_gains", 2 * L - 1, "res_norm.weight")]
        if cfg.residual_args.get("learn_logit_scale"):
            out += [("res.logit_scales", 2 * L - 1, "final_attnres_logit_scale")]
    return out


def canonical(key):
    """HC/mHC connectors hold their branch (the block's own norm and sublayer) as a submodule, so a
    state dict may list the same tensor under a second name: map that name to the block's own."""
    return re.sub(r"(attention|feed_forward)_hyper_connection\.branch\.(norm|attention|feed_forward)",
                  lambda mt: f"{mt[1]}_norm" if mt[2] == "norm" else mt[2], key)


def computed_buffers(sd, cfg):
    """{name: value} of what some release versions save as a buffer and our design computes: LNS's per-block
    `ln_scale` = 1/sqrt(b + 1) (block.py @fd0cc945 registers it; @6bdf2ad9 keeps a float), or 1/sqrt(L) in every
    block for `default_depth_scaled`. The ones sd holds must hold that value (a CheckpointError otherwise);
    export.py writes them, so either version's loader finds them."""
    if cfg.residual != "lns":
        return {}
    by_depth = cfg.residual_args.get("scale") == "depth"
    rule = "1/sqrt(L)" if by_depth else "1/sqrt(b + 1)"
    out = {f"blocks.{b}.ln_scale": (cfg.n_layer if by_depth else b + 1) ** -0.5 for b in range(cfg.n_layer)}
    for key, value in out.items():
        if key in sd and abs(float(sd[key]) - value) > 1e-6:
            raise CheckpointError(f"{key} = {float(sd[key]):.6g}, not LNS's {rule} = {value:.6g}")
    return out


def unused_buffers(names):
    """Of the tensors beyond the model's, the buffers (no PARAMETER_LEAVES name), which the official loader ignores
    too: named on stderr in one line, never silently. The rest (a parameter our model lacks) stays an error."""
    buffers = sorted(n for n in names if n.rsplit(".", 1)[-1] not in PARAMETER_LEAVES)
    if buffers:
        print(f"depthbench.files.official: warning: ignored {len(buffers)} non-parameter tensor(s) the model does not use: "
              f"{short(buffers)}", file=sys.stderr)
    return set(buffers)


def from_official(sd, model):
    """Copy an official state dict (names without the 'model.' prefix) into model; every tensor must match."""
    merged = {}
    for k, t in sd.items():
        c = canonical(k)
        if c in merged and not torch.equal(merged[c], t):
            raise CheckpointError(f"{k} differs from {c}, which it should alias")
        merged[c] = t
    cfg, ours = model.cfg, model.state_dict()
    table = layout(cfg)
    want = {k for _, _, k in table}
    ignored = {f"blocks.{cfg.n_layer - 1}.feed_forward.kv_proj.weight"} if cfg.residual == "moda" else set()
    ignored |= set(computed_buffers(merged, cfg))   # (MoDA's last W_kv is never used; LNS's scales are computed)
    missing, extra = want - set(merged), set(merged) - want - ignored
    extra -= unused_buffers(extra) if not missing else set()
    if missing or extra:
        raise CheckpointError(f"checkpoint does not fit our {cfg.residual}: missing {short(missing) or 'none'}; "
                              f"unexpected {short(extra) or 'none'}")
    with torch.no_grad():
        for key, row, off in table:
            dst, src = (ours[key] if row is None else ours[key][row]), merged[off]
            if src.numel() != dst.numel() or src.squeeze().shape != dst.squeeze().shape:
                raise CheckpointError(f"{off}: shape {tuple(src.shape)}, our {key} needs {tuple(dst.shape)}")
            dst.copy_(src.reshape(dst.shape))
    return model


def to_official(model):
    """Our weights under the official names and shapes (tests write checkpoints with it)."""
    sd, out = model.state_dict(), {}
    for k, row, off in layout(model.cfg):
        t = sd[k] if row is None else sd[k][row]
        out[off] = (t[None] if k == "res.queries" else t).clone()   # AttnRes' queries are Linear(d, 1) weights
    return out


def hf_llama(sd, n_layer, reverse=False):
    """Pre-LN official names <-> HF LlamaForCausalLM names (the official converter's Llama table)."""
    table = {a.format(b): h.format(b) for a, h in HF_LLAMA for b in (range(n_layer) if "{}" in a else [0])}
    table = {h: a for a, h in table.items()} if reverse else table
    if set(sd) != set(table):
        raise CheckpointError(f"not a Pre-LN state dict: {short(set(sd) ^ set(table))}")
    return {table[k]: v for k, v in sd.items()}


# ----------------------------------------------------------------------------- ours -> the official layout (export.py)

EXPORT_KEY = "depthbench"   # the section of an exported config.json that OLMo-core does not read: source and readings
OLMO = "olmo_core.nn."      # each config section's _CLASS_, the dotted name OLMo-core's as_config_dict writes
CLASSES = {"model": "transformer.config.TransformerConfig", "block": "transformer.config.TransformerBlockConfig",
           "attention": "attention.AttentionConfig", "rope": "rope.RoPEConfig", "norm": "layer_norm.LayerNormConfig",
           "feed_forward": "feed_forward.FeedForwardConfig", "head": "lm_head.LMHeadConfig",
           "hc": "transformer.config.HyperConnectionsConfig", "moda": "transformer.config.MoDAConfig"}


def section(of, **fields):
    """A config section with its _CLASS_ (`of`: a key of CLASSES)."""
    return {**fields, "_CLASS_": OLMO + CLASSES[of]}


def official_block(cfg):
    """The official block type that computes our cfg's design (the inverse of BLOCKS); a CheckpointError for a
    design the release has no block for (the designs beyond the paper)."""
    if cfg.residual not in RELEASED:
        raise CheckpointError(f"a {cfg.residual} model has no block in the authors' release ({', '.join(RELEASED)})")
    if cfg.residual == "moda":
        return "post_norm_moda" if cfg.residual_args.get("norm") == "post" else "moda"
    if cfg.residual == "block_attnres":
        return "attnres"
    if cfg.residual == "lns" and cfg.residual_args.get("scale") == "depth":
        return "default_depth_scaled"
    return next(name for name, ours in BLOCKS.items() if ours == cfg.residual)


def attnres_block_size(cfg):
    """AttnRes' official block size S (boundaries where k % S == 0): 1 for Full AttnRes, `block_size` when given,
    else the S whose groups are our n_groups' groups; a CheckpointError when no S gives them (uneven groups)."""
    if cfg.residual == "attnres":
        return 1
    groups, n_sub, args = RESIDUALS["block_attnres"].groups, 2 * cfg.n_layer, cfg.residual_args
    if args.get("block_size"):
        return args["block_size"]
    grouping = args.get("grouping", "even")
    want = groups(n_sub, args.get("n_groups", 8), grouping=grouping)
    fits = [S for S in range(1, n_sub + 1) if groups(n_sub, block_size=S) == want]
    if not fits:
        what = "groups that grow with depth" if grouping == "doubling" else f"n_groups {args.get('n_groups', 8)}"
        raise CheckpointError(f"block_attnres with {what} over {n_sub} sublayers makes groups of unequal size, "
                              f"which no official attnres_block_size gives")
    return fits[0]


def open_readings(cfg):
    """What config.json cannot tell about our cfg (read_config's `forced`): HC's forward, and a "sum" collapse
    (sum, then the norm: the newer code; norm_each: the older)."""
    r, a = cfg.residual, cfg.residual_args
    out = {"forward": a.get("forward", "mixed")} if r == "hc" else {}
    if r in ("hc", "mhc") and a.get("collapse", RESIDUALS[r].options["collapse"]) in ("sum", "norm_each"):
        out["collapse"] = a.get("collapse", "sum")
    return out


def design_fields(cfg):
    """The block-config keys of cfg's design beyond the backbone's, in the official schema."""
    r, a = cfg.residual, cfg.residual_args
    if r in ("hc", "mhc"):   # HC: "auto" is its sum; mHC: "auto" is its mean, "sum" its (open) sum reading
        collapse = a.get("collapse", RESIDUALS[r].options["collapse"])
        fields = {"kind": "hc" if r == "hc" else "liger_mhc", "num_residual_streams": a.get("n_streams", 4)}
        if r == "hc":
            fields["collapse"] = "mean" if collapse == "mean" else "auto"
        else:
            fields.update(tanh=False, sinkhorn_iters=a.get("sinkhorn_iters", 20),
                          collapse="auto" if collapse == "mean" else "sum")
        return {"hyper_connections": section("hc", **fields)}
    if r in ("attnres", "block_attnres"):
        frac = a.get("topk_fraction", 1.0)
        return {"attnres_block_size": attnres_block_size(cfg), "attnres_topk_fraction": None if frac == 1.0 else frac,
                "attnres_learn_logit_scale": bool(a.get("learn_logit_scale"))}
    if r in ("preln_mup", "preln_completep"):
        return {"residual_scaling_base_depth": a.get("base_depth", 24)}
    if r == "moda":
        return {"moda": section("moda", backend="v17", extra_ffn_kv_proj=True, extra_attn_kv_proj=False)}
    return {}


def model_fields(cfg, block):
    """The model-level keys a design adds: MoDA's last block without its unused W_kv; depth-muP/CompleteP's
    width axis, which the release carries in the init (hidden init std x m_N^(-1/2), the embedding's kept)."""
    a = cfg.residual_args
    if cfg.residual == "moda":
        return {"block_overrides": {str(cfg.n_layer - 1): {**block, "moda_skip_ffn_kv": True}}}
    if cfg.residual in ("preln_mup", "preln_completep") and a.get("scaling") == "depth_width":
        m_N = cfg.d_model / a["base_width"]
        return {"init_std": cfg.init_std * m_N ** -0.5, "embedding_init_std": cfg.init_std}
    return {}


def official_config(cfg, tokenizer=None, seq_len=None):
    """Our GPTConfig as an official experiment config.json (sections model and dataset.tokenizer, the schema
    read_config reads and OLMo-core's TransformerConfig.from_dict builds). tokenizer: dataset.tokenizer's fields."""
    norm = section("norm", name="default" if cfg.residual == "deepnorm" else "rms", eps=cfg.norm_eps, bias=False)
    attention = section("attention", name="default", n_heads=cfg.n_head, n_kv_heads=cfg.n_kv_head, bias=False,
                        rope=section("rope", name="default", theta=cfg.rope_theta))
    block = section("block", name=official_block(cfg), layer_norm=norm, sequence_mixer=attention,
                    feed_forward=section("feed_forward", name="default", hidden_size=cfg.d_ff, bias=False),
                    **design_fields(cfg))
    head = section("head", name="default", layer_norm=dict(norm, name="rms"), bias=False)
    model = section("model", d_model=cfg.d_model, vocab_size=cfg.vocab_size, n_layers=cfg.n_layer, block=block,
                    lm_head=head, dtype="float32", **model_fields(cfg, block))
    return {"model": model, "dataset": {"tokenizer": tokenizer or {}, "sequence_length": seq_len}}


def official_state(model):
    """Every tensor under every name the official model's state_dict lists: to_official's, LNS's ln_scale buffers
    (computed_buffers), and for HC/mHC the block's norm and sublayer a second time under each connector's branch
    module (PreNorm*Branch), as the release saves them."""
    sd = to_official(model)
    sd.update({k: torch.tensor(v) for k, v in computed_buffers({}, model.cfg).items()})
    if model.cfg.residual not in ("hc", "mhc"):
        return sd
    for b in range(model.cfg.n_layer):
        for side, weights in (("attention", ["w_q", "w_k", "w_v", "w_out"]), ("feed_forward", ["w1", "w2", "w3"])):
            branch = f"blocks.{b}.{side}_hyper_connection.branch."
            sd[branch + "norm.weight"] = sd[f"blocks.{b}.{side}_norm.weight"]
            sd.update({f"{branch}{side}.{w}.weight": sd[f"blocks.{b}.{side}.{w}.weight"] for w in weights})
    return sd


def write_checkpoint(step_dir, tensors, config, optim=None):
    """A step folder as the release lays it out: config.json and model_and_optim/, a torch DCP of {"model":
    tensors} (official names), and {"optim": optim} when given. Single process; step_dir must not exist."""
    import torch.distributed.checkpoint as dcp
    step_dir = Path(step_dir)
    step_dir.mkdir(parents=True)
    (step_dir / "config.json").write_text(json.dumps(config, indent=1))
    state = {"model": tensors, **({"optim": optim} if optim is not None else {})}
    with warnings.catch_warnings():      # "torch.distributed is disabled": a single process, as intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(step_dir / "model_and_optim"), no_dist=True)
    return step_dir


# ----------------------------------------------------------------------------- reading and finding checkpoints

def read_dcp(step_dir):
    """The 'model.*' tensors of a step folder's DCP checkpoint (the optimizer state is not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    folder = Path(step_dir) / "model_and_optim"
    folder = folder if folder.is_dir() else Path(step_dir)
    if not (folder / ".metadata").is_file():
        raise CheckpointError(f"{step_dir}: no distributed checkpoint (model_and_optim/.metadata)")
    reader = dcp.FileSystemReader(str(folder))
    try:
        meta = reader.read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"{folder}: unreadable DCP metadata ({type(e).__name__})") from None
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()
          if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not sd:
        raise CheckpointError(f"{folder}: the checkpoint holds no model.* tensors")
    with warnings.catch_warnings():      # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(sd, storage_reader=reader, no_dist=True)
        except (Exception, dcp.CheckpointException) as e:  # a truncated .distcp file; DCP's error ends with the cause
            why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:160]
            raise CheckpointError(f"{folder}: unreadable DCP data ({why})") from None
    return {k[len("model."):]: v for k, v in sd.items()}


def steps_in(names):
    return sorted({int(mt[1]) for n in names if (mt := re.match(r"step(\d+)(/|$)", n))})


def pick(steps, step, where):
    if not steps:
        raise CheckpointError(f"{where}: no stepN folders")
    if step is not None and step not in steps:
        raise CheckpointError(f"{where}: no step{step} (steps: {', '.join(map(str, steps))})")
    return steps[-1] if step is None else step


def hub_layout(files, step, repo_id):
    """A hub repository's file list -> (allow_patterns, the folder in it that holds the checkpoint). The release
    keeps either stepN/ folders or one checkpoint at the root (config.json and model_and_optim/ there)."""
    steps = steps_in(files)
    if "config.json" in files and (step is None or not steps):
        if step is not None:
            raise CheckpointError(f"{repo_id}: one checkpoint at the repository root, no step{step} folder")
        return ["config.json", "model_and_optim/*", "tokenizer/*"], ""
    n = pick(steps, step, repo_id)
    return [f"step{n}/*", "tokenizer/*"], f"step{n}"


def download(repo_id, step, timeout=5.0):
    """A hub repository's checkpoint (a step folder, or the root's) and tokenizer/ -> local folder (the hub's cache)."""
    if down := hub_unreachable(timeout):
        raise CheckpointError(f"{repo_id}: no checkpoint here, and the hub at {down[0]} cannot be reached "
                              f"({down[1]}); offline, download it elsewhere and give its folder")
    from huggingface_hub import HfApi, snapshot_download
    try:
        patterns, folder = hub_layout(HfApi().list_repo_files(repo_id), step, repo_id)
        root = snapshot_download(repo_id, allow_patterns=patterns)
    except CheckpointError:
        raise
    except Exception as e:  # a wrong id, no access, a broken connection
        raise CheckpointError(f"{repo_id}: no checkpoint here, and the hub download failed "
                              f"({type(e).__name__}: {first_line(e, 160)})") from None
    return Path(root) / folder


def resolve(source, step=None):
    """SOURCE -> (step folder, tokenizer.json path or None)."""
    p = Path(source)
    if p.is_dir():
        step_dir = p if (p / "config.json").is_file() else p / f"step{pick(steps_in(os.listdir(p)), step, source)}"
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", source) and not p.exists():
        step_dir = download(source, step)
    else:
        raise CheckpointError(f"{source}: neither a checkpoint folder nor a hub id (owner/name)")
    toks = [d / "tokenizer" / "tokenizer.json" for d in (step_dir, step_dir.parent)]
    return step_dir, next((str(t) for t in toks if t.is_file()), None)


def is_official(source):
    """True when SOURCE looks like an official checkpoint rather than one of our run folders."""
    p = Path(source)
    if p.is_dir():
        return (p / "config.json").is_file() or bool(steps_in(os.listdir(p)))
    return not p.exists() and bool(re.fullmatch(r"[\w.-]+/[\w.-]+", source))


def load(source, step=None, kernels="fast", forced=None):
    """SOURCE -> (GPT in fp32, eval mode, info: step folder, tokenizer path, config notes); forced: read_config's."""
    step_dir, tok = resolve(source, step)
    cfg, notes = read_config(step_dir, forced)
    cfg.kernels = kernels
    check_model_config(asdict(cfg), step_dir / "config.json")  # GPTConfig's types, and a size this code builds
    model = from_official(read_dcp(step_dir), GPT(cfg)).float().eval()
    mt = re.fullmatch(r"step(\d+)", step_dir.name)
    return model, {"step_dir": str(step_dir), "step": int(mt[1]) if mt else None, "tokenizer": tok, **notes}


# ----------------------------------------------------------------------------- evaluate

@torch.no_grad()
def evaluate(model, tok, text, seq_len, max_tokens=None, batch_size=4, device="cpu"):
    """Mean next-token cross-entropy over non-overlapping windows of seq_len + 1 tokens of the
    documents in `text` (files/folder/glob, .txt/.jsonl/.parquet), each followed by EOS, as trained."""
    docs = (d for f in data.list_files(text) for d in data.file_documents(f, "text"))
    tokens = itertools.chain.from_iterable(data.tokenize_documents(docs, tok))
    ids = list(itertools.islice(tokens, max_tokens + 1 if max_tokens else None))
    n = (len(ids) - 1) // seq_len
    if n == 0:
        raise CheckpointError(f"{text}: {len(ids)} tokens, fewer than one window of {seq_len + 1}")
    w = torch.tensor(ids[:n * seq_len + 1])
    x, y = w[:-1].view(n, seq_len), w[1:].view(n, seq_len)
    total = 0.0
    for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
        logits, _ = model(xb.to(device))
        total += F.cross_entropy(logits.float().flatten(0, 1), yb.to(device).flatten(), reduction="sum").item()
    return {"val_loss": total / (n * seq_len), "tokens": n * seq_len, "windows": n, "seq_len": seq_len}


def main(argv=None):
    p = ArgParser(prog="depthbench.files.official",
                  description="Load (info) or evaluate an official DepthBench OLMo-core checkpoint.")
    p.add_argument("command", choices=["info", "evaluate"])
    p.add_argument("source", help="hub id, repository folder with stepN/ folders, or a step folder")
    p.add_argument("--step", type=int, help="step folder to use (default: the highest)")
    p.add_argument("--text", help="evaluate: text files, a folder or a glob (.txt/.jsonl/.parquet)")
    p.add_argument("--tokenizer", help="tokenizer.json (default: the checkpoint's tokenizer/ folder)")
    p.add_argument("--seq-len", type=positive(), help="window length (default: the run's sequence length, else 2048)")
    p.add_argument("--max-tokens", type=positive(), help="evaluate at most this many tokens")
    p.add_argument("--batch-size", type=positive(), default=4)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--residual-args", type=json_object, default={}, help="what config.json cannot tell, e.g. HC's "
                   "'{\"forward\": \"mixed\", \"collapse\": \"sum\"}' (docs/official.md)")
    p.add_kernels()
    args = p.parse_args(argv)
    if args.command == "evaluate" and not args.text:
        p.error("evaluate needs --text")
    try:
        args.device = pick_device(args.device)
    except ValueError as e:
        p.error(str(e))
    try:
        model, info = load(args.source, args.step, args.kernels, args.residual_args)
        cfg = model.cfg
        print(f"{args.source}: {info['block']} -> {cfg.residual} {cfg.residual_args or ''} L={cfg.n_layer} "
              f"d={cfg.d_model} heads={cfg.n_head} d_ff={cfg.d_ff} vocab={cfg.vocab_size} step={info['step']}, "
              f"{model.num_params():,} parameters, every tensor mapped")
        if args.command == "evaluate":
            tok = data.get_tokenizer(args.tokenizer or info["tokenizer"] or "", info["eos_token_id"])
            seq_len = args.seq_len or info["seq_len"] or 2048
            res = evaluate(model.to(args.device), tok, args.text, seq_len=seq_len, max_tokens=args.max_tokens,
                           batch_size=args.batch_size, device=args.device)
            print(json.dumps({**res, "step": info["step"], "source": args.source}))
    except (CheckpointError, data.DataError) as e:
        fail("depthbench.files.official", first_line(e, None))


if __name__ == "__main__":
    main()
