"""
scripts/mutation_score.py, which scores mutation testing over the maths (docs/contributing.md#mutation-testing):
which of mutmut's mutants it counts, how it reads the list of equivalent mutants, and its tally.

    python -m pytest -q tests/test_mutation.py
"""
import json

from scripts import mutation_score


def test_only_the_maths_functions_are_scored():
    """A design's forward contract, ops.py, kernels/cpu.py and a metric count; messages, argparse, the kernels switch
    and a design's telemetry do not."""
    maths = ["residuals.xǁHCǁread__mutmut_3", "residuals.xǁMHCǁ__init____mutmut_1", "ops.x_sinkhorn__mutmut_12",
             "depthbench.kernels.cpu.xǁMixǁbackward__mutmut_40", "diagnose.x_angular__mutmut_2",
             "shapes.x_solve__mutmut_9", "depthbench.files.official.x_layout__mutmut_5",
             "model.xǁAttentionǁforward__mutmut_1"]
    not_maths = ["diagnose.x_build_parser__mutmut_1", "ops.x_namespace__mutmut_2", "ops.x_register__mutmut_1",
                 "residuals.xǁHCǁtelemetry__mutmut_4", "residuals.xǁSiteǁ__init____mutmut_1",
                 "depthbench.files.official.x_main__mutmut_7", "shapes.x_main__mutmut_3",
                 "model.xǁGPTǁparam_groups__mutmut_2", "depthbench.training.costs.x_print_plan__mutmut_1"]
    assert [n for n in maths if not mutation_score.is_maths(n)] == []
    assert [n for n in not_maths if mutation_score.is_maths(n)] == []
    assert mutation_score.function_of("residuals.xǁHCǁread__mutmut_3") == "residuals.HC.read"
    assert mutation_score.function_of("depthbench.kernels.cpu.x_slot_sum__mutmut_11") == \
        "depthbench.kernels.cpu.slot_sum"


def test_the_tally_counts_equivalent_survivors_as_caught_and_nothing_else(tmp_path):
    """mutmut's exit codes: 1 killed, 36 timeout, -11 crashed, 0 survived, None not run; a survivor named in the
    equivalent list is caught, one that is not is a survivor, a mutant no test reaches (33) is one too, and a killed
    mutant named there stays killed."""
    codes = {"ops.x_rms_norm__mutmut_1": 1, "ops.x_rms_norm__mutmut_2": 0, "ops.x_rms_norm__mutmut_3": 0,
             "ops.x_erank__mutmut_1": 36, "ops.x_erank__mutmut_2": -11, "ops.x_erank__mutmut_3": None,
             "ops.x_sinkhorn__mutmut_1": 1, "ops.x_sinkhorn__mutmut_2": 33, "diagnose.x_main__mutmut_1": 0}
    (tmp_path / "ops.py.meta").write_text(json.dumps({"exit_code_by_key": codes}))
    found = mutation_score.results(tmp_path)
    assert "diagnose.x_main__mutmut_1" not in found and len(found) == 8
    listed = tmp_path / "equivalent.txt"
    listed.write_text("# name  reason\n\nops.x_rms_norm__mutmut_2  eps inside a clamp that never binds\n"
                      "ops.x_sinkhorn__mutmut_1  killed anyway\n")
    equivalent = mutation_score.read_equivalent(listed)
    assert equivalent["ops.x_rms_norm__mutmut_2"] == "eps inside a clamp that never binds"
    outcome, survivors = mutation_score.tally(found, equivalent)
    assert survivors == ["ops.x_rms_norm__mutmut_3", "ops.x_sinkhorn__mutmut_2"]
    assert dict(outcome) == {"killed": 2, "equivalent": 1, "survived": 1, "timeout": 1, "crashed": 1, "not run yet": 1,
                             "no test reaches it": 1}
