"""The bundled multiple-choice tasks through lm-eval (the `eval` extra), offline: a local YAML
task definition over the task's jsonl, run with lm-eval's Hugging Face backend."""

import tempfile
from pathlib import Path

from optkit.errors import OptkitError
from optkit.gate.tasks import load_task

TASK_TEMPLATE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def lm_eval_accuracy(model_dir: Path, task: str, *, device: str = "cpu", batch_size: int = 16) -> float:
    """lm-eval's `acc` of a model directory (one transformers can load) on a bundled or jsonl task."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise OptkitError("lm-eval is not installed: pip install 'optkit[eval]'") from e
    import json
    import os

    records = load_task(task)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "task.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        name = "optkit_task"
        (Path(tmp) / f"{name}.yaml").write_text(TASK_TEMPLATE.format(name=name, data=data))
        result = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={model_dir},dtype=float32",
            tasks=[name],
            task_manager=TaskManager(include_path=tmp),
            batch_size=batch_size,
            device=device,
        )
    return result["results"][name]["acc,none"]
