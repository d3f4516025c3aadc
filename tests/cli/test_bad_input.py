"""Every bad input ends in one line naming what to change, exit code 2, and nothing on disk."""

import errno
import json
import os
import shutil

import pytest

from tests.conftest import leftovers


def assert_user_error(result, *fragments):
    code, out, err = result
    assert code == 2, (code, out, err)
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in err


@pytest.fixture
def out_parent(tmp_path):
    parent = tmp_path / "outputs"
    parent.mkdir()
    return parent


def test_missing_model_dir(run_cli, tmp_path, out_parent):
    result = run_cli("quantize", tmp_path / "nope", "--out", out_parent / "q")
    assert_user_error(result, "does not exist")
    assert leftovers(out_parent, "q") == []


def test_dir_without_config(run_cli, tmp_path, out_parent, draft_dir):
    model = tmp_path / "model"
    shutil.copytree(draft_dir, model)
    (model / "config.json").unlink()
    assert_user_error(run_cli("quantize", model, "--out", out_parent / "q"), "no config.json")
    assert leftovers(out_parent, "q") == []


def test_pickle_only_checkpoint_is_refused(run_cli, tmp_path, out_parent, draft_dir):
    model = tmp_path / "model"
    shutil.copytree(draft_dir, model)
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    assert_user_error(run_cli("quantize", model, "--out", out_parent / "q"), "never loads pickle")


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors(run_cli, tmp_path, out_parent, draft_dir, damage):
    model = tmp_path / "model"
    shutil.copytree(draft_dir, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    assert_user_error(
        run_cli("quantize", model, "--out", out_parent / "q"), "truncated or corrupt", "model.safetensors"
    )
    assert leftovers(out_parent, "q") == []
    assert_user_error(run_cli("eval", model, "--baseline", draft_dir), "truncated or corrupt")


def test_artifact_file_changed_after_writing_is_caught(run_cli, tmp_path, draft_dir):
    artifact = tmp_path / "q"
    assert run_cli("quantize", draft_dir, "--out", artifact)[0] == 0
    (artifact / "tokenizer.json").write_text((artifact / "tokenizer.json").read_text() + " ")
    assert_user_error(run_cli("eval", artifact, "--baseline", draft_dir), "tokenizer.json", "sha256")


def test_unknown_method(run_cli, out_parent, draft_dir):
    assert_user_error(
        run_cli("quantize", draft_dir, "--method", "magic", "--out", out_parent / "q"), "--method 'magic'", "rtn"
    )
    assert leftovers(out_parent, "q") == []


def test_unsupported_bits(run_cli, out_parent, draft_dir):
    assert_user_error(
        run_cli("quantize", draft_dir, "--bits", "5", "--out", out_parent / "q"), "--bits 5", "2, 3, 4, 8"
    )
    assert leftovers(out_parent, "q") == []


def test_group_size_the_layers_do_not_allow(run_cli, out_parent, draft_dir):
    # the draft model's layers have 128 and 384 input features; 96 does not divide 128
    result = run_cli("quantize", draft_dir, "--group-size", "96", "--out", out_parent / "q")
    assert_user_error(result, "--group-size 96 does not divide", "input features")
    assert leftovers(out_parent, "q") == []


def test_ignore_pattern_that_matches_nothing(run_cli, out_parent, draft_dir):
    assert_user_error(
        run_cli("quantize", draft_dir, "--ignore", "*.nothing", "--out", out_parent / "q"),
        "--ignore '*.nothing' matches no layer",
    )


def test_existing_out_without_overwrite(run_cli, out_parent, draft_dir):
    existing = out_parent / "q"
    existing.mkdir()
    (existing / "keep.txt").write_text("precious")
    assert_user_error(run_cli("quantize", draft_dir, "--out", existing), "already exists", "not an optkit output")
    assert (existing / "keep.txt").read_text() == "precious"
    assert leftovers(out_parent, "q") == [existing]


def test_already_quantized_input(run_cli, tmp_path, draft_dir):
    assert run_cli("quantize", draft_dir, "--out", tmp_path / "q")[0] == 0
    assert_user_error(run_cli("quantize", tmp_path / "q", "--out", tmp_path / "qq"), "already quantized")


@pytest.mark.parametrize("content", ["", "   \n\n"])
def test_empty_eval_set(run_cli, tmp_path, draft_dir, content):
    empty = tmp_path / "empty.txt"
    empty.write_text(content)
    report = tmp_path / "report.json"
    result = run_cli("eval", draft_dir, "--baseline", draft_dir, "--eval-set", empty, "--report", report)
    assert_user_error(result, "has no text")
    assert not report.exists()


def test_eval_set_shorter_than_one_window(run_cli, tmp_path, draft_dir):
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    assert_user_error(
        run_cli("eval", draft_dir, "--baseline", draft_dir, "--eval-set", short), "shorter than one window"
    )


def test_jsonl_without_text_field(run_cli, tmp_path, draft_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"prompt": "no"}) + "\n")
    assert_user_error(run_cli("eval", draft_dir, "--baseline", draft_dir, "--eval-set", bad), "line 2", '"text" field')


def test_unknown_eval_set_name(run_cli, draft_dir):
    assert_user_error(
        run_cli("eval", draft_dir, "--baseline", draft_dir, "--eval-set", "wikitext"),
        "neither a bundled set",
        "heldout",
    )


def test_unknown_reference_model(run_cli, tmp_path):
    assert_user_error(run_cli("zoo", "build", "huge", "--out", tmp_path / "m"), "unknown reference model 'huge'")


def test_interrupted_quantize_leaves_nothing(monkeypatch, run_cli, out_parent, draft_dir):
    import optkit.quant.quantize as quantize_module

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(quantize_module, "save_file", crash)
    code, _, _ = run_cli("quantize", draft_dir, "--out", out_parent / "q")
    assert code == 130
    assert leftovers(out_parent, "q") == []


GPTQ = ("--method", "gptq", "--num-samples", "4", "--seq-len", "32")


def damaged_copy(source, target, key, value):
    """A copy of a model directory with one tensor's entries set to `value`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    tensors[key][0] = value
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_calibration_file_missing(run_cli, tmp_path, draft_dir):
    result = run_cli("quantize", draft_dir, *GPTQ, "--calib", tmp_path / "none.txt", "--out", tmp_path / "q")
    assert_user_error(result, "--calib", "none.txt", "is neither a bundled set", "nor an existing file")
    assert leftovers(tmp_path, "q") == []


def test_calibration_file_empty(run_cli, tmp_path, draft_dir):
    (tmp_path / "empty.jsonl").write_text("")
    result = run_cli("quantize", draft_dir, *GPTQ, "--calib", tmp_path / "empty.jsonl", "--out", tmp_path / "q")
    assert_user_error(result, "has no text")
    assert leftovers(tmp_path, "q") == []


def test_calibration_shorter_than_seq_len(run_cli, tmp_path, draft_dir):
    (tmp_path / "short.txt").write_text("import os\n")
    result = run_cli("quantize", draft_dir, *GPTQ, "--calib", tmp_path / "short.txt", "--out", tmp_path / "q")
    assert_user_error(result, "fewer than --seq-len 32")
    assert leftovers(tmp_path, "q") == []


@pytest.mark.parametrize("method", [("--method", "rtn"), GPTQ])
def test_nan_in_weights_names_the_layer(run_cli, tmp_path, draft_dir, method):
    model = damaged_copy(draft_dir, tmp_path / "m", "model.layers.1.mlp.up_proj.weight", float("nan"))
    result = run_cli("quantize", model, *method, "--out", tmp_path / "q")
    assert_user_error(result, "model.layers.1.mlp.up_proj", "NaN")
    assert leftovers(tmp_path, "q") == []


def test_inf_in_activations_names_the_layer(run_cli, tmp_path, draft_dir):
    model = damaged_copy(draft_dir, tmp_path / "m", "model.layers.0.input_layernorm.weight", float("inf"))
    result = run_cli("quantize", model, *GPTQ, "--out", tmp_path / "q")
    assert_user_error(result, "model.layers.0.self_attn.q_proj", "activations contain NaN or inf")
    assert leftovers(tmp_path, "q") == []


def test_act_order_with_a_format_that_cannot_store_it(run_cli, tmp_path, draft_dir):
    result = run_cli("quantize", draft_dir, *GPTQ, "--act-order", "--out", tmp_path / "q")
    assert_user_error(result, "g_idx", "--static-groups", "--format gptq")
    assert leftovers(tmp_path, "q") == []


def test_gptq_options_without_gptq(run_cli, tmp_path, draft_dir):
    assert_user_error(run_cli("quantize", draft_dir, "--act-order", "--out", tmp_path / "q"), "--method gptq")


def test_gptq_layout_with_asymmetric_weights(run_cli, tmp_path, draft_dir):
    result = run_cli("quantize", draft_dir, "--format", "gptq", "--asym", "--out", tmp_path / "q")
    assert_user_error(result, "--format gptq stores symmetric weights only", "--sym")


def test_w8a8_with_a_weight_only_format(run_cli, tmp_path, draft_dir):
    result = run_cli("quantize", draft_dir, "--method", "smoothquant", "--format", "gptq", "--out", tmp_path / "q")
    assert_user_error(result, "--format gptq stores weight-only", "compressed-tensors")
    assert leftovers(tmp_path, "q") == []


@pytest.mark.parametrize(
    "args,fragment",
    [
        (("--alpha", "1.5"), "--alpha 1.5 is invalid"),
        (("--bits", "4"), "quantizes to w8 per-channel sym"),
        (("--act-quant", "sometimes"), "--act-quant 'sometimes'"),
    ],
)
def test_bad_smoothquant_options(run_cli, tmp_path, draft_dir, args, fragment):
    assert_user_error(
        run_cli("quantize", draft_dir, "--method", "smoothquant", *args, "--out", tmp_path / "q"), fragment
    )


# Unwritable outputs. Tests run as root here, and root ignores permission bits, so an output is made
# unwritable by a regular file standing where a directory must be (or by /proc, where nobody may
# create one); the permission-bit test runs wherever the user is not root.


@pytest.fixture
def blocker(tmp_path):
    """A regular file where an output's parent directory should be."""
    path = tmp_path / "not-a-dir"
    path.write_text("precious")
    return path


def test_quantize_output_under_a_file(run_cli, draft_dir, blocker):
    assert_user_error(run_cli("quantize", draft_dir, "--out", blocker / "q"), f"--out {blocker / 'q'}", "is a file")
    assert blocker.read_text() == "precious"


@pytest.mark.parametrize("overwrite", [(), ("--overwrite",)])
def test_quantize_output_that_is_a_file(run_cli, draft_dir, blocker, overwrite):
    result = run_cli("quantize", draft_dir, "--out", blocker, *overwrite)
    assert_user_error(result, str(blocker), "is not a directory", "choose another --out")
    assert blocker.read_text() == "precious"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_quantize_output_the_system_refuses_to_create(run_cli, draft_dir):
    assert_user_error(run_cli("quantize", draft_dir, "--out", "/proc/optkit-test/q"), "/proc/optkit-test")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permission bits")
def test_quantize_into_a_read_only_parent(run_cli, draft_dir, out_parent):
    out_parent.chmod(0o555)
    try:
        assert_user_error(run_cli("quantize", draft_dir, "--out", out_parent / "q"), "cannot write in", "--out")
    finally:
        out_parent.chmod(0o755)
    assert leftovers(out_parent, "q") == []


def test_an_os_error_while_writing_is_one_line_with_exit_2(monkeypatch, run_cli, out_parent, draft_dir):
    """The backstop: an OSError that no check foresaw (here the disk filling up while a layer is
    written) is one line naming the file and what to do, exit 2, never exit 1 ("rejected")."""
    import optkit.quant.quantize as quantize_module

    def disk_full(tensors, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(quantize_module, "save_file", disk_full)
    result = run_cli("quantize", draft_dir, "--out", out_parent / "q")
    assert_user_error(result, ".safetensors", "No space left on device", "free space")
    assert leftovers(out_parent, "q") == []
    monkeypatch.setenv("OPTKIT_DEBUG", "1")
    code, _, err = run_cli("quantize", draft_dir, "--out", out_parent / "q")
    assert code == 2 and "Traceback" in err and [line[:6] for line in err.splitlines()].count("error:") == 1


def corrupt_safetensors(directory):
    from safetensors import safe_open

    (directory / "bad.safetensors").write_bytes(b"\xff" * 64)
    safe_open(directory / "bad.safetensors", framework="pt")


@pytest.mark.parametrize(
    "failure,fragment,exit_code",
    [
        (lambda directory: json.loads("{"), "not valid JSON", 2),
        (corrupt_safetensors, "safetensors file is truncated or corrupt", 2),
        (lambda directory: [][0], "internal error (IndexError", 3),  # a bug: neither 1 (rejected) nor 2
    ],
)
def test_escaping_errors_are_one_line_with_their_exit_code(
    monkeypatch, run_cli, tmp_path, draft_dir, failure, fragment, exit_code
):
    import optkit.quant.quantize as quantize_module

    monkeypatch.setattr(quantize_module, "quantize_model", lambda *a, **k: failure(tmp_path))
    code, out, err = run_cli("quantize", draft_dir, "--out", tmp_path / "q")
    assert code == exit_code, (code, out, err)
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and fragment in lines[0], err
    assert ("Traceback" in err) == (exit_code == 3)  # a bug keeps its traceback, to be reported


def write_recipe(directory, model, output) -> str:
    recipe = {
        "model": str(model),
        "quantize": {"method": "rtn", "weights": {"bits": 4, "group_size": 64}},
        "gate": {"max_windows": 2, "max_kld": 1.0},
        "output": str(output),
    }
    path = directory / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return str(path)


@pytest.fixture
def no_quantize(monkeypatch):
    """`optkit run` must fail before quantizing: if it gets that far, the test sees exit 3."""
    import optkit.pipeline.run as run_module

    def quantize_model(*args, **kwargs):
        raise AssertionError("quantized before checking the outputs")

    monkeypatch.setattr(run_module, "quantize_model", quantize_model)


def test_run_recipe_output_that_is_a_file_fails_before_any_work(run_cli, tmp_path, draft_dir, blocker, no_quantize):
    result = run_cli("run", write_recipe(tmp_path, draft_dir, blocker))
    assert_user_error(result, f"output {blocker}", "is not a directory", "choose another output")
    assert blocker.read_text() == "precious"
    assert leftovers(tmp_path, blocker.name) == [blocker]  # no work directory either


def test_run_output_under_a_file_fails_before_any_work(run_cli, tmp_path, draft_dir, blocker, no_quantize):
    assert_user_error(run_cli("run", write_recipe(tmp_path, draft_dir, blocker / "release")), "is a file", "output")
    assert_user_error(
        run_cli("run", write_recipe(tmp_path, draft_dir, tmp_path / "fine"), "--out", blocker / "release"),
        f"--out {blocker / 'release'}",
        "is a file",
    )
    assert leftovers(tmp_path, "fine") == []


def test_run_work_directory_that_is_a_file(run_cli, tmp_path, draft_dir, no_quantize):
    work = tmp_path / ".release.work"
    work.write_text("not the work directory")
    assert_user_error(run_cli("run", write_recipe(tmp_path, draft_dir, tmp_path / "release")), str(work), "move it")
    assert not (tmp_path / "release").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_run_output_the_system_refuses_to_create(run_cli, tmp_path, draft_dir, no_quantize):
    assert_user_error(run_cli("run", write_recipe(tmp_path, draft_dir, "/proc/optkit-test/release")), "/proc")


def test_compile_with_an_unwritable_cache(monkeypatch, run_cli, draft_dir, blocker):
    """`optkit compile` writes only into this machine's cache ($OPTKIT_CACHE)."""
    monkeypatch.setenv("OPTKIT_CACHE", str(blocker / "cache"))
    result = run_cli("compile", draft_dir, "--batch-sizes", "1", "--device", "cpu")
    assert_user_error(result, str(blocker), "OPTKIT_CACHE")
    assert blocker.read_text() == "precious"


@pytest.mark.parametrize("where", ["under-a-file", "a-directory"])
def test_eval_report_that_cannot_be_written_fails_before_the_gate(monkeypatch, run_cli, draft_dir, blocker, where):
    import optkit.gate.evaluate as evaluate_module

    def evaluate(*args, **kwargs):
        raise AssertionError("evaluated before checking --report")

    monkeypatch.setattr(evaluate_module, "evaluate", evaluate)
    report = blocker / "gate.json" if where == "under-a-file" else blocker.parent
    fragment = "is a file" if where == "under-a-file" else "is a directory"
    assert_user_error(
        run_cli("eval", draft_dir, "--baseline", draft_dir, "--report", report), f"--report {report}", fragment
    )
