import json

import pytest
import torch

from optkit.errors import OptkitError
from optkit.gate.tasks import accuracy, choice_logprobs, encode_task, load_task
from optkit.modeldir import load_tokenizer
from optkit.quant.formats.load import load_model


def test_bundled_task_loads_and_the_base_beats_chance(small_dir):
    records = load_task("next_line")
    assert len(records) == 200
    encoded = encode_task(load_tokenizer(small_dir), records[:80])
    assert accuracy(load_model(small_dir), encoded, pad_id=0) > 0.25 + 0.05  # four choices


def test_choice_scores_are_the_summed_log_probs_of_the_choice_tokens(draft_dir):
    model = load_model(draft_dir)
    context, choices = [5, 6, 7], [[8], [9, 10]]
    scores = choice_logprobs(model, [context, context], choices, pad_id=0)
    with torch.inference_mode():
        log_p = torch.log_softmax(model(torch.tensor([[5, 6, 7, 9, 10]])).logits.float(), -1)[0]
    torch.testing.assert_close(scores[1], log_p[2, 9] + log_p[3, 10])


def test_own_runtime_and_lm_eval_agree_on_the_bundled_task(small_dir):
    """The gate's task accuracy is lm-eval's `acc`, computed by optkit's own runtime."""
    from optkit.gate.lm_eval_tasks import lm_eval_accuracy

    tokenizer = load_tokenizer(small_dir)
    ours = accuracy(load_model(small_dir), encode_task(tokenizer, load_task("next_line")), tokenizer.eos_token_id)
    assert ours == pytest.approx(lm_eval_accuracy(small_dir, "next_line"), abs=1e-9)


def test_bad_task_files(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"context": "x", "choices": ["a", "b"], "gold": 5}) + "\n")
    with pytest.raises(OptkitError, match="line 1"):
        load_task(str(tmp_path / "t.jsonl"))
    with pytest.raises(OptkitError, match="a text set"):
        load_task("heldout")
    with pytest.raises(OptkitError, match="neither a bundled task"):
        load_task(str(tmp_path / "none.jsonl"))


def test_min_recovery_is_a_gate_threshold(run_cli, draft_dir, draft_w2):
    artifact = draft_w2
    code, out, _ = run_cli(
        "eval",
        artifact,
        "--baseline",
        draft_dir,
        "--max-windows",
        "4",
        "--task",
        "next_line",
        "--min-recovery",
        "1.5",
        "--json",
    )
    result = json.loads(out)
    assert code == 1 and result["checks"][0]["name"] == "min_recovery" and not result["checks"][0]["passed"]
    assert 0 <= result["metrics"]["task_acc_artifact"] <= 1
    code, _, err = run_cli("eval", artifact, "--baseline", draft_dir, "--min-recovery", "0.9")
    assert code == 2 and "--task" in err
