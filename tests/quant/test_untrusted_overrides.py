"""Per-layer overrides read from someone else's checkpoint (quant/formats/mixed.py): GPTQ's
`dynamic` and compressed-tensors' `config_groups` are validated as the artifact's own scheme is,
and their regular expressions cannot hang a load (optkit/untrusted_regex.py)."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from optkit.errors import OptkitError
from optkit.quant.formats import get_format
from optkit.quant.formats.mixed import layer_schemes

PREFIXES = [
    f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")
]
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
GROUP_0 = {"targets": ["Linear"], "weights": {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": GROUP_0}}
# exponential for Python's `re` on a layer name, and past any budget for the `regex` engine too
BACKTRACKS = r"((.|..)+)+[!?]"
MATCH_BUDGET_S = 2.0  # quant/formats/mixed.py's: every pattern on every layer of one checkpoint
CHILD_LIMIT_S = 15
ISSUE_PATTERN = r"((\w|\.)*)*!"  # the issue's: over a minute in `re`; the `regex` engine sees no "!" at once


def gptq(dynamic: dict) -> dict:
    return {**GPTQ, "dynamic": dynamic}


def ct(*groups: dict) -> dict:
    return {**CT, "config_groups": {**{f"group_{i + 1}": g for i, g in enumerate(groups)}, "group_0": GROUP_0}}


def schemes_in_a_child(quant_config: dict) -> dict:
    """layer_schemes in a subprocess that SIGALRM ends CHILD_LIMIT_S after its imports (`re` holds
    the GIL while it backtracks: only a process can be given up on). Returns {"took" (CPU seconds: the
    regex engine's timeout counts CPU time, and the machine may be busy), "error", "bits"}."""
    code = textwrap.dedent(f"""
        import json, signal, sys, time
        from optkit.errors import OptkitError
        from optkit.quant.formats import get_format
        from optkit.quant.formats.mixed import layer_schemes
        config = json.loads(sys.argv[1])
        signal.alarm({CHILD_LIMIT_S})
        fmt = get_format(config["quant_method"])  # imports compressed_tensors: not the match's time
        started, error, bits = time.process_time(), None, None
        try:
            schemes = layer_schemes(fmt, config, {PREFIXES!r})
            bits = {{name: scheme.bits for name, scheme in schemes.items()}}
        except OptkitError as e:
            error = str(e)
        print(json.dumps({{"took": time.process_time() - started, "error": error, "bits": bits}}))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(quant_config)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"the child ended with {done.returncode} (-14: still matching after {CHILD_LIMIT_S} s)"
    return json.loads(done.stdout)


def test_the_issues_redos_pattern_loads_at_once():
    result = schemes_in_a_child(gptq({f"+:{ISSUE_PATTERN}": {"bits": 8}}))
    assert result["error"] is None and set(result["bits"].values()) == {4}  # it matches no layer
    assert result["took"] < 1


@pytest.mark.parametrize(
    "quant_config",
    [gptq({f"+:{BACKTRACKS}": {"bits": 8}}), ct({**GROUP_0, "targets": [f"re:{BACKTRACKS}"]})],
    ids=["gptq-dynamic", "compressed-tensors-re-target"],
)
def test_a_pattern_that_backtracks_for_ever_is_one_line_within_the_budget(quant_config):
    result = schemes_in_a_child(quant_config)
    line = result["error"]
    assert line is not None and "\n" not in line
    assert "config.json" in line and "((.|..)+)+" in line and f"over {MATCH_BUDGET_S:g} s" in line
    assert result["took"] < MATCH_BUDGET_S + 1


@pytest.mark.parametrize(
    "override, fragment",
    [
        ({"bits": 0}, "bits must be one of"),
        ({"bits": 2**40}, "bits must be one of"),
        ({"bits": "four"}, "bits"),
        ({"bits": None}, "bits"),
        ({"group_size": 0}, "group_size must be positive"),
        ({"sym": "maybe"}, "symmetric"),
    ],
)
def test_a_gptq_override_is_validated_as_the_top_level_scheme(override, fragment):
    pattern = r"model\.layers\.1\..*"
    with pytest.raises(OptkitError) as e:
        layer_schemes(get_format("gptq"), gptq({f"+:{pattern}": override}), PREFIXES)
    assert "config.json" in str(e.value) and "dynamic" in str(e.value) and fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_a_valid_gptq_override_still_applies():
    config = gptq({r"+:model\.layers\.1\..*": {"bits": "8", "group_size": 64}, r"-:.*o_proj": {}})
    schemes = layer_schemes(get_format("gptq"), config, PREFIXES)
    assert {n: (s.bits, s.group_size) for n, s in schemes.items() if ".1." in n} == dict.fromkeys(
        [p for p in PREFIXES if ".1." in p], (8, 64)
    )
    assert {s.bits for n, s in schemes.items() if ".0." in n} == {4}


@pytest.mark.parametrize(
    "dynamic, fragment",
    [
        ({"+:.*": [8]}, "must be a mapping"),
        ({"+:(": {"bits": 8}}, "does not compile"),
        ({"+:" + "a" * 5000: {"bits": 8}}, "over 4096"),
    ],
)
def test_a_malformed_dynamic_is_one_line(dynamic, fragment):
    with pytest.raises(OptkitError, match=fragment) as e:
        layer_schemes(get_format("gptq"), gptq(dynamic), PREFIXES)
    assert "config.json" in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize(
    "weights, fragment",
    [
        ({"num_bits": 0}, "bits must be one of"),
        ({"num_bits": 2**40}, "bits must be one of"),
        ({"group_size": -7}, "group_size"),
    ],
)
def test_a_compressed_tensors_group_is_validated_as_the_top_level_scheme(weights, fragment):
    group = {"targets": ["re:.*down_proj"], "weights": {**GROUP_0["weights"], **weights}}
    with pytest.raises(OptkitError, match=fragment) as e:
        layer_schemes(get_format("compressed-tensors"), ct(group), PREFIXES)
    assert "config.json" in str(e.value) and "group_1" in str(e.value)


def test_compressed_tensors_targets_by_name_and_by_pattern_still_apply():
    by_name = {"targets": ["model.layers.0.self_attn.q_proj"], "weights": {**GROUP_0["weights"], "num_bits": 8}}
    by_pattern = {"targets": [r"re:.*\.1\.mlp\..*"], "weights": {**GROUP_0["weights"], "num_bits": 2}}
    schemes = layer_schemes(get_format("compressed-tensors"), ct(by_name, by_pattern), PREFIXES)
    assert schemes["model.layers.0.self_attn.q_proj"].bits == 8
    assert schemes["model.layers.1.mlp.down_proj"].bits == 2
    assert schemes["model.layers.0.mlp.down_proj"].bits == 4


@pytest.fixture(scope="module")
def gptq_artifact(tmp_path_factory, draft_dir):
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("gptq") / "w4"
    quantize_model(draft_dir, out, QuantizeOptions(format="gptq"))
    return out


@pytest.mark.parametrize("bits", ["4x", 0, 2**40])
def test_generate_on_a_checkpoint_with_a_bad_override_is_exit_2(tmp_path, gptq_artifact, run_cli, bits):
    """A plain GPTQ checkpoint from elsewhere (no optkit.json) whose `dynamic` sets impossible bits."""
    art = tmp_path / "art"
    shutil.copytree(gptq_artifact, art)
    (art / "optkit.json").unlink()
    config = json.loads((art / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {r"+:model\.layers\.0\..*": {"bits": bits}}
    (art / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli("generate", art, "hello", "--max-tokens", "1", "--device", "cpu")
    assert code == 2, err
    [line] = err.strip().splitlines()
    assert str(art / "config.json") in line and "dynamic" in line and "bits" in line
