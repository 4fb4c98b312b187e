"""
export.py's tests: a run written as a Hugging Face Llama folder (Pre-LN) or in the authors' release layout (any
design), then loaded by the programs that read those formats: transformers' own from_pretrained, and
depthbench/files/official.py. Logits are compared, not names and shapes alone (open-instruct #1839: a converter whose
names and shapes checked out gave 38% logit error).

    python -m pytest -q tests/test_export.py

CPU, fp32, tiny models with every tensor random. Tests of the HF side skip where transformers is not installed.
"""
import dataclasses
import json
import struct
import warnings
from pathlib import Path

import pytest
import torch

import export
from depthbench.files import common, official, runlog
from model import GPT, GPTConfig
from test_official import WIDE, release_names

ROOT = Path(__file__).resolve().parents[1]  # the repository root
TIKTOKEN_DIR = ROOT.parent / "shared" / "data" / "tiktoken"
AUSTEN = ROOT.parent / "shared" / "data" / "austen" / "emma.txt"
TEXT = "It is a truth universally acknowledged, — naïve café ☕ 1234  5\n\n  x"
STEP = 7


def make_run(folder, residual="preln", args=None, tokenizer="bytes", V=320, L=3, n_kv_head=None, seed=0):
    """A finished run folder as train.py leaves it (ckpt.pt with model, model_config, config, step; run.json) of a
    model whose every tensor is random (norm gains, AttnRes queries, HC gates: nothing is 1 or 0)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=V, n_layer=L, d_model=32, n_head=2, d_ff=64, residual=residual,
                    residual_args=args or {}, n_kv_head=n_kv_head)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    folder = Path(folder)
    common.save_checkpoint(folder / "ckpt.pt", {"model": model.state_dict(), "model_config": dataclasses.asdict(cfg),
                                                "config": {"tokenizer": tokenizer, "seq_len": 16}, "step": STEP})
    common.write_json(folder / "run.json", run_log(cfg, seed, finished=True))
    return model.eval()


def run_log(cfg, seed, finished):
    """The fields of a run.json that every reader checks (depthbench/files/runlog.py), for a run that reached STEP."""
    config = {"residual": cfg.residual, "n_layer": cfg.n_layer, "d_model": cfg.d_model, "lr": 3e-3, "seed": seed}
    return {"schema": runlog.SCHEMA, "config": config, "steps": [{"step": STEP}], "evals": [],
            "final": {"val_loss": None}, "diverged": False, "finished": finished, "wall_s": 1.0}


def tokens(V=300, seed=1):
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))


def run_export(capsys, *argv):
    """export.main(argv) in this process -> (exit code, stdout, stderr)."""
    code = 0
    try:
        export.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def max_diff(a, b):
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- --format official

READ_AS = {  # what the official layout cannot tell apart, read back as the design that computes the same
    ("block_attnres", "{}"): ("attnres", {}),   # n_groups 8 at 2L = 6: every sublayer its own group, block size 1
    ("block_attnres", "{'n_groups': 3}"): ("block_attnres", {"block_size": 2}),   # three groups of 2: block size 2
}
CASES = [(r, {}) for r in official.RESIDUALS if r in official.RELEASED] + [
    ("hc", {"collapse": "norm_each", "forward": "unmixed"}), ("hc", {"collapse": "mean"}),   # the other readings
    ("mhc", {"collapse": "sum"}), ("mhc", {"sinkhorn_iters": 7, "n_streams": 3}), ("moda", {"norm": "post"}),
    ("block_attnres", {"block_size": 4}), ("block_attnres", {"n_groups": 3}),
    ("preln_mup", WIDE), ("preln_completep", {"base_depth": 5}),
    ("lns", {"scale": "depth"}), ("attnres", {"topk_fraction": 0.25, "learn_logit_scale": True}),   # the release's
    ("block_attnres", {"block_size": 2, "topk_fraction": 0.5})]                                     # variants


@pytest.mark.parametrize("residual, args", CASES, ids=[f"{r}{a or ''}" for r, a in CASES])
def test_official_export_loads_back_to_the_same_logits(tmp_path, capsys, residual, args):
    """Every design: the exported step folder loads with official.load (no --residual-args: the export names what
    config.json cannot tell) to our logits within 1e-6; the readings only change where config.json is silent."""
    src = make_run(tmp_path / "run", residual, args)
    code, out, err = run_export(capsys, tmp_path / "run", "--format", "official", "--out", tmp_path / "off")
    assert code == 0 and err == "" and f"step{STEP}/" in out
    loaded, info = official.load(str(tmp_path / "off"))
    x = tokens()
    with torch.no_grad():
        assert max_diff(loaded(x)[0], src(x)[0]) <= 1e-6
    assert info["step"] == STEP and info["tokenizer"] == str(tmp_path / "off" / "tokenizer" / "tokenizer.json")
    assert info["eos_token_id"] == 256 and json.loads((tmp_path / "off" / "tokenizer" / "tokenizer.json").read_text())
    want = READ_AS.get((residual, str(args)), (residual, args))
    assert (loaded.cfg.residual, loaded.cfg.residual_args) == want


def test_official_export_holds_every_name_the_release_model_loads(tmp_path):
    """What the authors' loaders do (OLMo-core's load_state_dict: a DCP load of {"model": model.state_dict()}):
    a DCP load of the release's names (release_names, written from its block code), HC's connector-branch aliases
    and LNS's ln_scale buffers included, finds every one at its shape and value, and the export holds no other."""
    import torch.distributed.checkpoint as dcp
    for residual in ("preln", "hc", "mhc", "attnres", "moda", "keel", "lns"):
        src = make_run(tmp_path / residual, residual)
        export.main([str(tmp_path / residual), "--format", "official", "--out", str(tmp_path / f"{residual}-off")])
        names = release_names(residual, 3)
        ours = src.state_dict()
        want = {off: (ours[k] if row is None else ours[k][row]) for (k, row), off in names.items()}
        if residual in ("hc", "mhc"):   # the connectors hold the block's norm and sublayer as `branch`
            want.update(branch_aliases(want))
        if residual == "lns":           # block.py @fd0cc945: a buffer 1/sqrt(b + 1) per block
            want.update({f"blocks.{b}.ln_scale": torch.tensor((b + 1) ** -0.5) for b in range(3)})
        state = {"model": {off: torch.empty(shape_of(off, t)) for off, t in want.items()}}
        folder = tmp_path / f"{residual}-off" / f"step{STEP}" / "model_and_optim"
        with warnings.catch_warnings():   # "torch.distributed is disabled": one process, as intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
        for off, t in want.items():
            assert torch.equal(state["model"][off].reshape(t.shape), t), (residual, off)
        stored = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        assert set(stored) == {f"model.{off}" for off in want}, residual


def shape_of(name, t):
    """The release's shape of a tensor: AttnRes' queries are nn.Linear(d, 1) weights, (1, d)."""
    return (1, t.numel()) if name.endswith("res_proj.weight") else tuple(t.shape)


def branch_aliases(names):
    """The second names of HC/mHC's block norms and sublayers: `{side}_hyper_connection.branch.{norm, side}`."""
    out = {}
    for off, t in names.items():
        parts = off.split(".")
        b, rest = parts[1], ".".join(parts[2:])
        for side in ("attention", "feed_forward"):
            if rest == f"{side}_norm.weight":
                out[f"blocks.{b}.{side}_hyper_connection.branch.norm.weight"] = t
            elif rest.startswith(f"{side}."):
                out[f"blocks.{b}.{side}_hyper_connection.branch.{rest}"] = t
    return out


def test_block_attnres_with_uneven_groups_is_refused_in_one_line(tmp_path, capsys):
    """n_groups 8 over 2L = 10 sublayers makes groups of 1 and 2: no official block size gives them."""
    make_run(tmp_path / "run", "block_attnres", L=5)
    code, out, err = run_export(capsys, tmp_path / "run", "--format", "official", "--out", tmp_path / "off")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "groups of unequal size" in err
    assert not (tmp_path / "off").exists()


@pytest.mark.parametrize("residual, args, message", [
    ("mudd", {}, "a mudd model has no block in the authors' release"),
    ("hybrid", {}, "a hybrid model has no block in the authors' release"),
    ("block_attnres", {"grouping": "doubling"}, "groups that grow with depth over 6 sublayers")])
def test_what_the_release_cannot_hold_is_refused_in_one_line(tmp_path, capsys, residual, args, message):
    """A design beyond the paper has no release block, and groups that grow with depth no block size: exit 2, one
    line, nothing written."""
    make_run(tmp_path / "run", residual, args)
    code, out, err = run_export(capsys, tmp_path / "run", "--format", "official", "--out", tmp_path / "off")
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "off").exists()


def test_an_interrupted_export_leaves_nothing(tmp_path, monkeypatch):
    """A failure (a full disk, Ctrl-C) half-way leaves neither the output folder nor its partial copy."""
    make_run(tmp_path / "run", "hc")

    def dies(folder, tensors, config, optim=None):
        Path(folder).mkdir(parents=True)
        (Path(folder) / "config.json").write_text("{")
        raise KeyboardInterrupt
    monkeypatch.setattr(official, "write_checkpoint", dies)
    with pytest.raises(KeyboardInterrupt):
        export.main([str(tmp_path / "run"), "--format", "official", "--out", str(tmp_path / "x" / "off")])
    assert list((tmp_path / "x").iterdir()) == []


# ----------------------------------------------------------------------------- --format hf

@pytest.mark.parametrize("n_kv_head", [2, 1], ids=["mha", "gqa"])
def test_hf_export_is_our_model_in_transformers(tmp_path, capsys, n_kv_head):
    """transformers loads the folder as it is (from_pretrained): the logits are ours within 1e-4, and its tokenizer
    gives the byte ids the run trained on; the config's fields are the ones that give garbage when off."""
    transformers = pytest.importorskip("transformers")
    src = make_run(tmp_path / "run", n_kv_head=n_kv_head)
    code, out, err = run_export(capsys, tmp_path / "run", "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0 and err == "", err
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = tokens()
    with torch.no_grad():
        assert max_diff(hf(x).logits, src(x)[0]) <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok(TEXT)["input_ids"] == list(TEXT.encode()) and tok.decode(list(TEXT.encode())) == TEXT
    assert tok.eos_token_id == 256
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (c["rms_norm_eps"], c["rope_theta"], c["head_dim"], c["num_key_value_heads"], c["vocab_size"]) == (
        1e-6, 10000.0, 16, n_kv_head, 320)
    assert (c["tie_word_embeddings"], c["attention_bias"], c["mlp_bias"], c["eos_token_id"]) == (False, False, False, 256)


@pytest.mark.parametrize("key, value", [("rms_norm_eps", 1e-5), ("rope_theta", 500000.0)])
def test_a_wrong_config_field_would_be_caught(tmp_path, key, value):
    """The 1e-4 logit check is sharp enough for the fields that load silently when wrong: eps 1e-5 instead of
    1e-6, or another RoPE theta (torchtitan #1903's garbage), each move the logits by more than 1e-4."""
    transformers = pytest.importorskip("transformers")
    src = make_run(tmp_path / "run")
    export.main([str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")])
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    c[key] = value
    c["rope_parameters"]["rope_theta"] = c["rope_theta"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(c))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert max_diff(hf(tokens()).logits, src(tokens())[0]) > 1e-3


@pytest.mark.skipif(not TIKTOKEN_DIR.is_dir(), reason=f"no GPT-2 BPE cache at {TIKTOKEN_DIR}")
def test_hf_export_of_a_gpt2_run_tokenizes_as_tiktoken(tmp_path, monkeypatch):
    """A GPT-2 run's folder: the HF tokenizer (fast, and the slow one from vocab.json/merges.txt) gives tiktoken's
    ids on real prose and on non-ASCII text; the vocab stays padded (50304) and EOS is 50256."""
    transformers = pytest.importorskip("transformers")
    import tiktoken
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_DIR))
    make_run(tmp_path / "run", tokenizer="gpt2", V=50304, L=1)
    export.main([str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")])
    enc = tiktoken.get_encoding("gpt2")
    prose = AUSTEN.read_text()[:50_000] if AUSTEN.is_file() else TEXT * 50
    for use_fast in (True, False):
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", use_fast=use_fast)
        for text in (prose, TEXT):
            assert tok(text)["input_ids"] == enc.encode_ordinary(text)
        assert tok.eos_token_id == 50256
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (c["vocab_size"], c["eos_token_id"]) == (50304, 50256)


def test_safetensors_written_here_read_back_exactly(tmp_path):
    """export.write_safetensors: the header (8-byte length, JSON with dtype, shape, byte ranges back to back from
    0) parsed here by hand, and by the safetensors package where installed, gives back every tensor bit-exactly."""
    tensors = {"a": torch.randn(3, 5), "scalar": torch.tensor(2.5), "b.bf16": torch.randn(7).bfloat16(),
               "c": torch.arange(6, dtype=torch.float32).reshape(2, 3).t()}   # a transposed view: not contiguous
    export.write_safetensors(tmp_path / "m.safetensors", tensors)
    raw = (tmp_path / "m.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == {"format": "pt"} and n % 8 == 0
    assert [header[k]["data_offsets"][0] for k in tensors] == [0, 60, 64, 78] and len(raw) == 8 + n + 102
    for name, t in tensors.items():
        start, end = header[name]["data_offsets"]
        got = torch.frombuffer(bytearray(raw[8 + n + start:8 + n + end]), dtype=t.dtype).reshape(header[name]["shape"])
        assert torch.equal(got, t) and header[name]["dtype"] == {torch.bfloat16: "BF16"}.get(t.dtype, "F32")
    safetensors = pytest.importorskip("safetensors.torch")
    back = safetensors.load_file(tmp_path / "m.safetensors")
    assert all(torch.equal(back[k], t) for k, t in tensors.items())


def test_hf_refuses_other_designs_naming_the_official_format(tmp_path, capsys):
    make_run(tmp_path / "run", "hc")
    code, out, err = run_export(capsys, tmp_path / "run", "--format", "hf", "--out", tmp_path / "hf")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "use --format official" in err
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- a suite

def test_a_suite_exports_every_finished_run_once(tmp_path, capsys):
    """A suite folder: every finished run goes to OUT/<its path>; --format hf leaves the non-Pre-LN runs out with
    the reason, a partial run is left out, and a second call keeps what the first wrote."""
    suite = tmp_path / "suite"
    a = make_run(suite / "text" / "preln_ar32_s0")
    make_run(suite / "text-lr" / "hc_ar32" / "hc_ar32_s0", "hc")
    make_run(suite / "text" / "preln_ar16_s0", L=2)
    partial = run_log(GPTConfig(vocab_size=320, n_layer=2, d_model=32, n_head=2, d_ff=64), 0, finished=False)
    common.write_json(suite / "text" / "preln_ar16_s0" / "run.json", partial)
    code, out, err = run_export(capsys, suite, "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0 and "1 run(s)" in out and "2 left out" in out
    assert "hc run has no LlamaForCausalLM form" in out and "preln_ar16_s0: left out (partial)" in out
    assert sorted(p.name for p in (tmp_path / "hf").rglob("config.json")) == ["config.json"]
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "text" / "preln_ar32_s0")
    with torch.no_grad():
        assert max_diff(hf(tokens()).logits, a(tokens())[0]) <= 1e-4
    code, out, err = run_export(capsys, suite, "--format", "official", "--out", tmp_path / "off")
    assert code == 0 and "2 run(s)" in out
    assert official.load(str(tmp_path / "off" / "text-lr" / "hc_ar32" / "hc_ar32_s0"))[0].cfg.residual == "hc"
    code, out, err = run_export(capsys, suite, "--format", "official", "--out", tmp_path / "off")
    assert code == 0 and out.count("exists, kept") == 2


def test_a_suite_without_finished_runs_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, out, err = run_export(capsys, tmp_path / "empty", "--format", "official", "--out", tmp_path / "off")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no finished run to export" in err
