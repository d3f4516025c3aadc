"""The serve: section and the flags over it: what they accept, and the errors that name the fix."""

import json
import shutil

import pytest
import yaml

from optkit.cli.serve_flags import ServeFlags, apply_flags, parse_threshold, read_serve_section, resolve_options
from optkit.errors import OptkitError
from optkit.pipeline.recipe import load_recipe
from optkit.routing.config import serve_options


def options(data: dict | None = None, **flags):
    return serve_options(apply_flags(data or {}, ServeFlags(**flags)))


def test_flags_build_the_options():
    got = options(
        models=["a=small", "b=draft"],
        kv_cache_blocks=["64", "b=32"],
        kv_cache_fraction=[],
        route="tiered",
        shadow=["a=b"],
        shadow_rate=0.5,
        fallback_threshold="kld=0.5, top1=80",
        fallback_window=4,
        fallback_recovery="auto",
        max_queue_wait=2.0,
    )
    assert {n: (s.path, s.kv_cache_blocks) for n, s in got.models.items()} == {"a": ("small", 64), "b": ("draft", 32)}
    assert got.route == "tiered" and got.spill_over.max_queue_wait_s == 2.0
    assert got.shadow.pairs == {"a": "b"} and got.shadow.rate == 0.5
    threshold = got.fallback.threshold
    assert (threshold.kld, threshold.top1, threshold.ppl_increase) == (0.5, 80.0, None)
    assert (got.fallback.window, got.fallback.recovery) == (4, "auto")


def test_flags_override_the_recipe_key_by_key():
    data = {
        "models": {"a": {"path": "small", "task": "chat"}, "b": {"path": "draft"}},
        "shadow": {"pairs": {"a": "b"}, "rate": 0.1, "window": 7},
    }
    got = options(data, models=["a=out/a"], shadow_rate=0.2, kv_cache_fraction=["a=0.25"])
    assert got.models["a"].path == "out/a" and got.models["a"].task == "chat"  # the path replaced, the rest kept
    assert got.models["a"].kv_cache_fraction == 0.25 and got.models["b"].path == "draft"
    assert (got.shadow.rate, got.shadow.window, got.shadow.pairs) == (0.2, 7, {"a": "b"})


def test_the_model_argument_is_one_more_model(tmp_path):
    got = resolve_options("draft", None, None, ServeFlags())
    assert list(got.models) == ["draft"] and got.route == "model"
    got = resolve_options("draft", "d", None, ServeFlags(models=["s=small"]))
    assert list(got.models) == ["d", "s"]
    with pytest.raises(OptkitError, match="write NAME=PATH"):
        resolve_options(None, "x", None, ServeFlags(models=["s=small"]))


@pytest.mark.parametrize(
    "data, flags, fragment",
    [
        ({}, {}, "no model to serve"),
        ({"modls": {}}, {}, "'modls' is unknown: did you mean 'models'?"),
        ({"tiers": {"rules": [{"min_prompt_tokens": 9, "to": "big"}]}}, {}, "names model 'big', which is not served"),
        ({"tiers": {"order": ["a", "c"]}}, {}, "serve.tiers.order[1] names model 'c'"),
        ({"tiers": {"rules": [{"regex": "("}]}}, {}, "does not compile"),
        ({"tiers": {"rules": [{"name": "x"}]}}, {}, "needs min_prompt_tokens or regex"),
        ({"tiers": {"rules": [{"regexp": "x"}]}}, {}, "'tiers.rules.0.regexp' is unknown: did you mean 'regex'?"),
        ({}, {"shadow": ["a=c"]}, "--shadow a=c names model 'c', which is not served"),
        ({}, {"shadow": ["a=a"]}, "shadow a model with another one"),
        ({}, {"fallback_threshold": "kdl=0.5"}, "unknown key 'kdl': did you mean 'kld'?"),
        ({}, {"fallback_threshold": "accuracy=0.5"}, "use kld, top1, ppl_increase"),
        ({}, {"fallback_threshold": "kld=lots"}, "expected kld=NUMBER"),
        ({}, {"fallback_threshold": "kld=0.5"}, "needs a shadow pair"),
        ({"fallback": {"threshold": {"kdl": 1}}}, {}, "'fallback.threshold.kdl' is unknown: did you mean 'kld'?"),
        ({}, {"kv_cache_fraction": ["c=0.5"]}, "no model 'c' is served (serving: a, b)"),
        ({}, {"kv_cache_fraction": ["a=0.7", "b=0.6"]}, "adds up to more than 1"),
        ({}, {"kv_cache_fraction": ["a=half"]}, "'half' is not a number"),
        ({}, {"route": "random"}, "'route': Input should be 'model', 'tiered' or 'prefix'"),
        ({}, {"shadow_rate": 1.5}, "'shadow.rate'"),
        ({"models": {"a": {"path": "x", "kv_cache_blocks": 4, "kv_cache_fraction": 0.5}}}, {}, "not both"),
    ],
)
def test_bad_config_names_what_to_change(data, flags, fragment):
    if "models" not in data and fragment != "no model to serve":
        flags = {"models": ["a=small", "b=draft"], **flags}
    with pytest.raises(OptkitError) as error:
        options(data, **flags)
    assert fragment in str(error.value)


def test_threshold_keys():
    assert parse_threshold("kld=0.1,top1=90,ppl_increase=5") == {"kld": 0.1, "top1": 90.0, "ppl_increase": 5.0}


def test_recipe_serve_section(tmp_path):
    serve = {"models": {"a": {"path": "small"}}, "shadow": {"rate": 0.3}}
    only = tmp_path / "serve.yaml"
    only.write_text(yaml.safe_dump({"serve": serve}))
    assert read_serve_section(str(only)) == serve
    release = tmp_path / "release.yaml"
    release.write_text(yaml.safe_dump({"model": "draft", "output": "out/x", "serve": serve}))
    assert read_serve_section(str(release)) == serve
    recipe, _ = load_recipe(release)
    assert recipe.serve.shadow.rate == 0.3 and recipe.serve.models["a"].path == "small"
    release.write_text(yaml.safe_dump({"model": "draft", "output": "out/x", "serve": {"shadw": {}}}))
    with pytest.raises(OptkitError, match="'serve.shadw' is unknown: did you mean 'shadow'"):
        read_serve_section(str(release))
    none = tmp_path / "none.yaml"
    none.write_text("model: draft\n")
    with pytest.raises(OptkitError, match="has no serve: section"):
        read_serve_section(str(none))


def test_bad_config_exits_2_before_loading_anything(run_cli, tmp_path):
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(yaml.safe_dump({"rules": [{"min_prompt_tokens": 100, "to": "large"}]}))
    serve = ["serve", "--port", "0", "--model", "small-w2=draft", "--model", "small=small"]
    code, _, err = run_cli(*serve, "--route", "tiered", "--tiers", tiers)
    assert code == 2 and err.startswith("error: tier rule 1 (min_prompt_tokens=100) names model 'large'")
    assert len(err.strip().splitlines()) == 1
    code, _, err = run_cli(*serve, "--shadow", "small-w2=small", "--fallback-threshold", "kld=0.5,top5=90")
    assert code == 2 and "--fallback-threshold: unknown key 'top5': did you mean 'top1'?" in err


def test_a_shadow_pair_with_different_tokenizers_exits_2(run_cli, tmp_path, draft_dir):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(draft_dir, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = list(vocab)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(data))
    code, _, err = run_cli("serve", "--port", "0", "--model", f"q={other}", "--model", "f=draft", "--shadow", "q=f")
    assert code == 2
    assert "--shadow q=f: the two models have different tokenizers" in err and "2 tokens differ" in err
