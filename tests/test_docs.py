"""
What the docs say about the designs, checked against the code (issue 67): a sentence that quotes a count, a formula
or a number the code determines is parsed here and evaluated against a built model, so that the docs cannot drift.

    python -m pytest -q tests/test_docs.py

The docs read: the README's design rows (its "read these two" column), docs/designs.md, docs/diagnostics.md and the
class docstrings of residuals.py. tests/test_equations.py checks the parameter counts (`params(d, L) = ...` and the
overhead table) the same way.
"""
import functools
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from model import GPT, GPTConfig
from residuals import RESIDUALS, MoDA, MHC
from test_equations import REFERENCE, formula

ROOT = Path(__file__).resolve().parents[1]
DESIGNS_MD = ROOT / "docs" / "designs.md"


def section(path, title):
    """The text of a markdown file's `## title` section, up to the next heading of level 2 or 3."""
    text = path.read_text(encoding="utf-8")
    return re.split(r"^#{2,3} ", text.split(f"\n## {title}\n", 1)[1], flags=re.M)[0]


def learner_path():
    """scripts/learner_path.py as a module: the README row's format is defined there, once."""
    spec = importlib.util.spec_from_file_location("learner_path", ROOT / "scripts" / "learner_path.py")
    module = sys.modules["learner_path"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- the README's doors

def test_each_readme_row_names_its_class_and_its_reference_forward():
    """Every registered design has a README row whose "read these two" cell names its class in residuals.py and the
    function of tests/test_equations.py that makes its reference forward (REFERENCE[key, None], or the factory
    that returns it): the two a learner is sent to."""
    doors = learner_path().doors(ROOT)
    assert set(doors) == set(RESIDUALS)
    for key, door in doors.items():
        assert RESIDUALS[key].__name__ == door.cls, (key, door)
        made_by = REFERENCE[key, None].__qualname__.split(".")[0]
        assert made_by == door.reference, (key, door, REFERENCE[key, None].__qualname__)


def readme_rules():
    """{registry key: the update rule cell} of the README's design rows."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \| `\w+`, `\w+` \|[^|]*\|([^|]*)\|", text, flags=re.M)
    return {key: rule.strip() for key, rule in rows}


def sublayer_0_input_rms(key):
    """The RMS of sublayer 0's input, as the design's read gives it, from an embedding of RMS 0.02 (fresh model)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, n_layer=2, d_model=16, n_head=4, d_ff=40, residual=key))
    res = model.res
    with torch.no_grad():
        x0 = 0.02 * torch.randn(2, 3, 16)
        h, _ = res.read(res.init_stream(x0), res.sites[0])
    return float(h.pow(2).mean().sqrt())


def test_a_readme_rule_normalises_the_sublayer_input_where_the_design_does():
    """Each README update rule that writes F_i(...) says whether the sublayer reads a normalised input (RMSNorm( or
    LN( inside F_i) or the raw stream; the design's read agrees: at sublayer 0 of a fresh model its input has RMS 1
    (gains 1) after a norm, the embedding's 0.02 without. (HC's row once left the norm out.)"""
    rules = {key: rule for key, rule in readme_rules().items() if "F_i(" in rule}
    assert {"preln", "hc", "deepnorm", "postln"} <= set(rules), sorted(rules)
    for key, rule in rules.items():
        normed_in_readme = rule.split("F_i(", 1)[1].startswith(("RMSNorm(", "LN(", "N_i("))
        rms = sublayer_0_input_rms(key)
        assert (abs(rms - 1) < 1e-2) == normed_in_readme and (rms < 0.1) != normed_in_readme, (key, rule, rms)


# ----------------------------------------------------------------------------- MoDA's slots

MODA_COUNTS = ("slots(L)", "depth_keys(L)", "depth_values(d, L)")


def quoted(text, name):
    """The formula quoted as `name = ...` in text (exactly once) -> a function of (d, L)."""
    found = re.findall(rf"`{re.escape(name)} = ([^`]+)`", " ".join(text.split()))
    assert len(found) == 1, (name, found)
    count = formula(found[0])
    assert count is not None, (name, found[0])
    return count


@functools.lru_cache(maxsize=None)
def moda_counts(L, d=16):
    """What a built MoDA (L blocks, width d, as many kv heads as heads) holds after a forward: the slots in its
    DepthKV, the most slots one attention read, the slots' values per token."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, n_layer=L, d_model=d, n_head=4, d_ff=40, residual="moda",
                          kernels="reference"))
    res, seen, final = model.res, [], []
    attend, collapse = res.attend, res.collapse

    def spy_attend(depth, q, k, v, rope):
        seen.append(len(depth))
        return attend(depth, q, k, v, rope)

    def spy_collapse(s):
        final.append(s[1])
        return collapse(s)

    res.attend, res.collapse = spy_attend, spy_collapse
    B, T = 2, 3
    with torch.no_grad():
        model(torch.randint(0, 32, (B, T)))
    depth = final[0]
    values = sum(k.numel() + v.numel() for k, v in zip(depth.keys, depth.values)) // (B * T)
    return len(depth), max(seen, default=0), values


@pytest.mark.parametrize("where", ["MoDA's docstring", "docs/designs.md#moda"])
def test_moda_slot_counts_quoted_in_the_docs_are_the_models(where):
    """`slots(L) = ...`, `depth_keys(L) = ...` and `depth_values(d, L) = ...`, as the MoDA docstring and
    docs/designs.md quote them, give what a built model holds at L = 2 and 4: the slots its DepthKV has after the
    last sublayer, the most slots one attention reads, the values per token they keep; and the slot said never to
    be read (2L - 2) is the one past the most any attention reads."""
    text = MoDA.__doc__ if where.startswith("MoDA") else section(DESIGNS_MD, "MoDA")
    slots, keys, values = (quoted(text, name) for name in MODA_COUNTS)
    for L in (2, 4):
        d = 16
        n_slots, most_read, n_values = moda_counts(L, d)
        assert (slots(d, L), keys(d, L), values(d, L)) == (n_slots, most_read, n_values), (where, L)
        assert n_slots - 1 == most_read == 2 * L - 2          # slot 2L - 2, the last attention's: written, not read
    assert "slot 2L - 2" in " ".join(text.split()).replace("−", "-")


# ----------------------------------------------------------------------------- mHC's start

def gap8_transport():
    """(the row softmax's diagonal, Sinkhorn's diagonal, Sinkhorn's off-diagonal) of a fresh gap-8 mHC's connector 0,
    from the model itself: the softmax of its own res logits, and the H_res its maps give (phi = 0: for any H)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, n_layer=2, d_model=16, n_head=4, d_ff=40, residual="mhc"))
    res = model.res
    n = res.n
    with torch.no_grad():
        logits = res.conn[0].b[2 * n:].view(n, n).double()
        H_res = res.maps(torch.randn(1, 1, n, 16), res.sites[0])[2][0, 0].double()
    return torch.softmax(logits, -1)[0, 0].item(), H_res[0, 0].item(), H_res[0, 1].item()


def digits_match(text, value):
    """Whether the number as written (0.998991, 4e-6, 3.36e-4) is value rounded to the digits written."""
    mantissa = text.split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exponent = int(text.split("e")[1]) if "e" in text else 0
    return abs(float(text) - value) <= 0.5 * 10 ** (exponent - decimals) * (1 + 1e-9)


@pytest.mark.parametrize("where", ["MHC's docstring", "docs/designs.md#mhc"])
def test_the_gap8_transport_quoted_in_the_docs_is_the_models(where):
    """The gap-8 start as the docs give it: the diagonal after the row softmax, after Sinkhorn, what Sinkhorn takes
    off, and the off-diagonal entries, each equal to the built model's to the digits written."""
    text = " ".join((MHC.__doc__ if where.startswith("MHC") else section(DESIGNS_MD, "mHC")).split())
    soft, diag, off = gap8_transport()
    said = {"softmax": r"diagonal (\d\.\d+) after the row softmax", "sinkhorn": r"(\d\.\d+) after Sinkhorn",
            "taken": r"takes (\d+e-\d+) off", "off": r"(\d\.\d+e-\d+),? elsewhere|off the diagonal (\d\.\d+e-\d+)"}
    numbers = {}
    for name, pattern in said.items():
        found = re.search(pattern, text)
        assert found, (where, name)
        numbers[name] = next(g for g in found.groups() if g)
    real = {"softmax": soft, "sinkhorn": diag, "taken": soft - diag, "off": off}
    wrong = {name: (numbers[name], real[name]) for name in said if not digits_match(numbers[name], real[name])}
    assert not wrong, (where, wrong)


def test_digits_match_reads_the_digits_written():
    assert digits_match("0.998991", 0.9989906) and not digits_match("0.998995", 0.9989906)
    assert digits_match("4e-6", 3.97e-6) and not digits_match("4e-6", 5.6e-6)
    assert digits_match("3.36e-4", 3.361e-4) and not digits_match("3.4e-4", 3.361e-4 + 1e-5)


# ----------------------------------------------------------------------------- the index convention

CONVENTION_FILES = ("README.md", "docs/designs.md", "docs/diagnostics.md", "residuals.py", "diagnose.py")


def sentences(path):
    """The file's text as sentences (whitespace joined, split after a full stop)."""
    return re.split(r"(?<=\.)\s+(?=[A-Z(`*])", " ".join((ROOT / path).read_text(encoding="utf-8").split()))


A_THEN_OUTPUT_FIRST = r"(A_r\b|\bA\[:, 1:\]|alpha\[:, 1:\])(.{0,40}?)\[out(put)?, in(put)?\]"


def convention_offenders(text_sentences):
    """Sentences against the one index convention (residuals.py's module docstring): a stream named from 1 (h_1 ..,
    h_n), or HC's A[:, 1:] (whose rows are input streams) called [output, input] without its transpose."""
    bad = []
    for sentence in text_sentences:
        one_based = re.search(r"\bh_n\b|\bh_1\s*(\.\.|…|;)", sentence)
        # A (or A_r) named, then [output, input] within a few words, with no transpose between the two
        named_then_output_first = re.finditer(A_THEN_OUTPUT_FIRST, sentence)
        a_as_output_first = [m for m in named_then_output_first if not re.search("ᵀ|transpose", m.group(2))]
        if one_based or a_as_output_first:
            bad.append(sentence[:160])
    return bad


@pytest.mark.parametrize("path", CONVENTION_FILES)
def test_the_docs_number_streams_one_way(path):
    """No stream numbered from 1, and HC's A[:, 1:] never called [output, input] (it is H_res's transpose)."""
    assert not convention_offenders(sentences(path)), path


def test_the_convention_check_finds_what_the_docs_used_to_say():
    """The two sentences issue 67 found, as they were: each is caught."""
    old = ["For each connector take its transport matrix averaged over tokens, M = H_res (mHC) or M = A_r = A[:, 1:] "
           "(HC), as [output, input], and its singular values σ.",
           "**State**: H, n vectors h_1..h_n of width d per token, starting as n copies of e."]
    assert len(convention_offenders(old)) == 2
    assert len(convention_offenders(["M = A[:, 1:], [output, input] (for HC H_res = A_rᵀ: its rows are input).",
                                     "(HC: A_r = alpha[:, 1:]) as [out, in]; product[k] = erank(M_k ... M_0)."])) == 2
    assert not convention_offenders(["M = H_res, [output, input] (for HC H_res = A_rᵀ: A[:, 1:] has input rows).",
                                     "(so H_res = A_rᵀ, [output, input], one transpose, in `HC.maps`)."])
