"""
Mutation testing of the maths: put one small, plausible bug at a time into the functions below and count how many the
fast tests catch (docs/contributing.md#mutation-testing). Not in CI; run it before and after touching the maths.

    pip install mutmut                               # 3.x, not a dependency of the project
    python scripts/mutation_score.py run             # mutmut over the functions below (resumes where it stopped)
    python scripts/mutation_score.py                 # the score, and the survivors grouped by function
    python scripts/mutation_score.py --diffs         # ... with each survivor's diff (mutmut show)
    python scripts/mutation_score.py run --again     # after new tests: the survivors again, and what changed
    python scripts/mutation_score.py tiers --sample 40   # the quick tier (-m "not slow") against all of mutmut's
                                                     # tests on a sample of the equations' mutants: two kill rates

mutmut (configured in setup.cfg) copies the repository into mutants/, mutates every function of the files it names
and records each mutant's result in mutants/**/*.py.meta; this script runs and scores only the mutants of the
functions that hold maths (MATHS below: each design's forward contract and init, ops.py, kernels/cpu.py, model.py's
forward passes, diagnose.py's metric functions, shapes.py's solver, costs.py's formulas, official.py's name table),
not messages, argparse or I/O. A survivor that cannot change any result (an equivalent mutant) is listed in
scripts/mutation_equivalent.txt with its reason and counts as caught; every other survivor counts against the score.

    score = (killed + timed out + crashed + equivalent) / mutants of MATHS

A mutant that changes only a string literal (outside official.py's name table) is no bug in the maths: a message, a
key of diagnose.py's JSON, an option's name. Those are left out of the score, killed or not, and counted.
"""
import argparse
import ast
import configparser
import copy
import fnmatch
import json
import os
import random
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT_FILE = ROOT / "scripts" / "mutation_equivalent.txt"

# what a design reads like its paper: the forward contract, the parameters' init, the sites it builds
DESIGN_METHODS = ("init_stream", "read", "write", "collapse", "__init__", "reset_parameters", "site", "maps",
                  "make_connector", "mix", "weights", "dense_weights", "hidden", "readout", "depth_state",
                  "input_after_skip", "skip", "skips_to_newest", "source", "groups", "newest", "deep_view",
                  "shallow_blocks", "scale_sublayer_init", "dense_module")
DIAGNOSE_METRICS = ("causal", "lens_sums", "lens", "angle_sums", "angular", "token_matrix_metrics", "perm_shares",
                    "perm", "transport", "skip_updates", "pruning", "deadzone", "share_above", "ce_sum", "collapse",
                    "dense", "attnres", "depth_weights", "triangle", "nll")

# mutmut's names: module.x_function__mutmut_N, module.xǁClassǁmethod__mutmut_N
MATHS = (
    *(f"residuals.xǁ*ǁ{method}__mutmut_*" for method in DESIGN_METHODS),
    "ops.x_*", "ops.xǁRMSNormǁforward__mutmut_*", "ops.xǁDepthBankǁ*", "ops.xǁDepthKVǁ*",
    "depthbench.kernels.cpu.*",
    "model.xǁAttentionǁforward__mutmut_*", "model.xǁMLPǁforward__mutmut_*", "model.xǁBlockǁforward__mutmut_*",
    "model.xǁGPTǁforward__mutmut_*",
    *(f"diagnose.x_{name}__mutmut_*" for name in DIAGNOSE_METRICS),
    "diagnose.xǁSumsǁ*",
    *(f"shapes.x_{name}__mutmut_*" for name in ("solve", "count_params", "backbone_params", "ffn_dim", "preln_params")),
    *(f"depthbench.training.costs.x_{name}__mutmut_*"
      for name in ("analytic", "token_bytes", "fixed_bytes", "run_params")),
    "depthbench.files.official.x_layout__mutmut_*", "depthbench.files.official.x_block_name__mutmut_*",
    "depthbench.files.official.x_official_block__mutmut_*",
)
# inside MATHS' patterns but not maths: the kernels switch (and where depthbench/kernels registers its bodies), the
# fp32 wrapper, the depth-µP control's optimiser rules
NOT_MATHS = ("ops.x_namespace__*", "ops.x_register__*", "ops.x_fp32_maths__*", "residuals.xǁSiteǁ*",
             "residuals.xǁPreLNDepthMuPǁ*")

# official.py's strings are the release's tensor names: maths for a checkpoint, so they stay in the score
NAME_TABLE = "depthbench.files.official."

CAUGHT = {1: "killed", 3: "killed", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          -11: "crashed", -9: "crashed"}


def is_maths(name):
    """Whether a mutant belongs to the functions this score covers."""
    inside = any(fnmatch.fnmatch(name, pattern) for pattern in MATHS)
    return inside and not any(fnmatch.fnmatch(name, pattern) for pattern in NOT_MATHS)


def function_of(name):
    """The function a mutant changed: 'residuals.xǁHCǁread__mutmut_3' -> 'residuals.HC.read'."""
    stem = re.sub(r"__mutmut_\d+$", "", name)
    return stem.replace(".xǁ", ".").replace("ǁ", ".").replace(".x_", ".")


def string_only(folder):
    """The mutants whose only change is inside a string literal (a message, a JSON key, an option's name): not
    maths, so the score leaves them out, killed or not. Read from mutmut's mutated files, where every mutant is a
    function `<name>__mutmut_<n>` beside the original `<name>__mutmut_orig`: equal once every string is blanked."""
    def blanked(fn):
        fn = copy.deepcopy(fn)
        fn.name = ""
        for node in ast.walk(fn):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                node.value = ""
        return ast.dump(fn)

    found = set()
    for source in sorted(Path(folder).glob("**/*.py")):
        if not Path(str(source) + ".meta").exists():
            continue
        module = ".".join(source.relative_to(folder).with_suffix("").parts)
        defs = {n.name: n for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.FunctionDef)}
        for name, fn in defs.items():
            stem, _, number = name.rpartition("__mutmut_")
            orig = defs.get(f"{stem}__mutmut_orig")
            if stem and number.isdigit() and orig is not None and blanked(fn) == blanked(orig):
                found.add(f"{module}.{name}")
    return found


def results(folder):
    """{mutant name: mutmut's exit code, None when not run yet} over the mutants of MATHS."""
    metas = sorted(Path(folder).glob("**/*.py.meta"))
    if not metas:
        sys.exit(f"error: no mutants in {folder}/ yet: run `python scripts/mutation_score.py run` first")
    found = {}
    for meta in metas:
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        found.update({name: code for name, code in codes.items() if is_maths(name)})
    return found


def read_equivalent(path=EQUIVALENT_FILE):
    """{mutant name: reason} from lines 'NAME  reason' (# comments and blank lines skipped)."""
    equivalent = {}
    if not path.exists():
        return equivalent
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, reason = line.partition(" ")
            equivalent[name] = reason.strip()
    return equivalent


def tally(found, equivalent):
    """Counts by outcome, and the survivors that are not known equivalent."""
    outcome = Counter()
    survivors = []
    for name, code in sorted(found.items()):
        if code is None:
            outcome["not run yet"] += 1
        elif code in CAUGHT:
            outcome[CAUGHT[code]] += 1
        elif code in (0, 5, 33) and name in equivalent:
            outcome["equivalent"] += 1
        elif code == 0:
            outcome["survived"] += 1
            survivors.append(name)
        elif code in (5, 33):                          # no selected test reaches the function: a survivor too
            outcome["no test reaches it"] += 1
            survivors.append(name)
        else:
            outcome[f"other (exit {code})"] += 1
    return outcome, survivors


def report(folder, diffs):
    found = results(folder)
    strings = {name for name in string_only(folder) & set(found) if not name.startswith(NAME_TABLE)}
    found = {name: code for name, code in found.items() if name not in strings}
    print(f"left out: {len(strings)} mutants that change only a string (a message, a JSON key, an option's name)")
    equivalent = read_equivalent()
    outcome, survivors = tally(found, equivalent)
    done = len(found) - outcome["not run yet"]
    caught = sum(outcome[k] for k in ("killed", "timeout", "crashed", "equivalent"))
    print(f"{len(found)} mutants in the maths' functions, {done} run: " +
          ", ".join(f"{n} {kind}" for kind, n in sorted(outcome.items())))
    if done:
        print(f"mutation score {100 * caught / done:.1f}% ({caught} of {done} caught or equivalent)")
    by_function = defaultdict(list)
    for name in survivors:
        by_function[function_of(name)].append(name)
    for function, names in sorted(by_function.items(), key=lambda item: -len(item[1])):
        print(f"  {len(names):3d} survive in {function}")
        for name in names if diffs else ():
            print(subprocess.run(["mutmut", "show", name], cwd=ROOT, capture_output=True, text=True).stdout)
    stale = sorted(set(equivalent) - set(found))
    if stale:
        print(f"warning: {len(stale)} names in {EQUIVALENT_FILE.name} are no mutant of today's code (e.g. {stale[0]})")


def run(max_children, again=False):
    """mutmut over MATHS only. mutmut reruns every mutant it is named, so once its mutants exist (mutants/ holds
    their results) a second call names only the ones not run yet: the run resumes. again: the survivors too (after
    new tests)."""
    rerun = {None, 0, 5, 33} if again else {None}
    if has_mutants():
        pending = [name for name, code in results(ROOT / "mutants").items() if code in rerun]
        print(f"mutmut run: {len(pending)} mutants to go", flush=True)
    else:
        pending = list(MATHS)
        print(f"mutmut run: the mutants of {len(MATHS)} patterns", flush=True)
    if not pending:
        return 0
    return subprocess.run(["mutmut", "run", "--max-children", str(max_children), *pending], cwd=ROOT).returncode


# the equations a learner changes: each design, the shared maths, the fast bodies, the model's forward passes
EQUATIONS = ("residuals.", "ops.", "depthbench.kernels.", "model.")


def mutmut_tests():
    """The test files and the -k expression mutmut runs (setup.cfg's [mutmut]): the suite the score is taken with."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    files = cfg["mutmut"]["pytest_add_cli_args_test_selection"].split()
    args = cfg["mutmut"]["pytest_add_cli_args"].split("\n")
    args = [a.strip() for a in args if a.strip()]
    return files, args[args.index("-k") + 1]


def generate_mutants():
    """mutants/ as `mutmut run` makes it (the sources copied, every function of setup.cfg's files mutated), without
    running any mutant: mutmut 3's own steps, called in order (its internals: a mutmut other than 3.x may differ)."""
    import mutmut.__main__ as mutmut_main
    from mutmut.mutation.trampoline import set_mutant_under_test
    os.chdir(ROOT)
    set_mutant_under_test("mutant_generation")
    (ROOT / "mutants").mkdir(exist_ok=True)
    mutmut_main.copy_src_dir()
    mutmut_main.copy_also_copy_files()
    mutmut_main.setup_source_paths()
    mutmut_main.store_lines_covered_by_tests()
    mutmut_main.create_mutants(2)


def tier_kills(name, tier, timeout):
    """Whether mutmut's tests of one tier ("not slow" or "slow") fail with mutant `name` active (a timeout or a
    mutant that breaks the tests' import counts as caught, as in the score); pytest's -x stops at the first failure;
    exit 5 (no test of the tier selected) is no kill."""
    files, k = mutmut_tests()
    argv = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", tier, "-k", k, *files]
    env = {**os.environ, "MUTANT_UNDER_TEST": name}
    try:
        r = subprocess.run(argv, cwd=ROOT / "mutants", env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return True
    if r.returncode == 4:  # pytest's usage error: this script's command, not the mutant
        raise RuntimeError(f"pytest exit 4 for {name}: {r.stdout[-500:]}{r.stderr[-500:]}")
    return r.returncode in (1, 2, 3)  # a test failed, or the mutant broke collection (2) or pytest itself (3)


def tiers(sample, seed, timeout):
    """The quick tier against the whole of mutmut's tests on `sample` mutants of the equations (EQUATIONS, drawn with
    `seed`; string-only and known-equivalent mutants left out): each mutant is run under the quick tier, and one it
    survives under the slow tests too. Prints both kill rates and every mutant only the slow tests kill."""
    if not has_mutants():
        print("mutants/: generating them (no mutant is run)", flush=True)
        generate_mutants()
    found = results(ROOT / "mutants")
    left_out = string_only(ROOT / "mutants") | set(read_equivalent())
    pool = sorted(n for n in found if n.startswith(EQUATIONS) and n not in left_out)
    drawn = random.Random(seed).sample(pool, min(sample, len(pool)))
    quick = full = 0
    gaps = []
    for i, name in enumerate(drawn, 1):
        killed_quick = tier_kills(name, "not slow", timeout)
        killed = killed_quick or tier_kills(name, "slow", timeout)
        quick, full = quick + killed_quick, full + killed
        if killed and not killed_quick:
            gaps.append(name)
        verdict = {(True, True): "the quick tier kills it", (False, True): "only a slow test kills it"}
        print(f"[{i}/{len(drawn)}] {name}: {verdict.get((killed_quick, killed), 'survives')}", flush=True)
    print(f"{len(drawn)} of {len(pool)} equation mutants (seed {seed}): the whole of mutmut's tests kill {full} "
          f"({100 * full / len(drawn):.0f}%), the quick tier (-m 'not slow') {quick} ({100 * quick / len(drawn):.0f}%)")
    for name in gaps:
        print(f"  killed only by a slow test: {name} ({function_of(name)})")
    return 1 if gaps else 0


def has_mutants():
    return any((ROOT / "mutants").glob("**/*.py.meta"))


def main(argv=None):
    p = argparse.ArgumentParser(description=" ".join(__doc__.strip().split("\n\n")[0].split()))
    p.add_argument("action", nargs="?", choices=("run", "report", "tiers"), default="report")
    p.add_argument("--max-children", type=int, default=2, help="mutants tested at a time (default 2)")
    p.add_argument("--diffs", action="store_true", help="print each survivor's diff")
    p.add_argument("--again", action="store_true", help="run: the survivors again too (after adding tests)")
    p.add_argument("--sample", type=int, default=40, help="tiers: equation mutants drawn (default 40)")
    p.add_argument("--seed", type=int, default=0, help="tiers: the draw's seed (default 0)")
    p.add_argument("--timeout", type=int, default=600, help="tiers: seconds a tier may take per mutant (default 600)")
    args = p.parse_args(argv)
    if args.action == "tiers":
        sys.exit(tiers(args.sample, args.seed, args.timeout))
    if args.action == "run":
        code = run(args.max_children, args.again)
        if code:
            sys.exit(code)
    report(ROOT / "mutants", args.diffs)


if __name__ == "__main__":
    main()
