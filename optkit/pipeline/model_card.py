"""The release's README.md: what was done, the gate's numbers, and how to load it."""

from optkit.gate.report import ROWS
from optkit.quant.ladder import parse_rung


def model_card(recipe, manifest: dict, gate: dict, verdict: str) -> str:
    q = recipe.quantize
    scheme = q.weights
    metrics = gate["metrics"]
    checks = {c["metric"]: c for c in gate["checks"]}
    rows = []
    for metric, label, fmt in ROWS:
        if metric not in metrics:
            continue
        check = checks.get(metric)
        state = check.get("state") or ("ok" if check["passed"] else "crossed") if check else ""
        rule = f"{check['rule']} ({state if state == 'ok' else state.upper()})" if check else ""
        interval = (gate.get("intervals") or {}).get("metrics", {}).get(metric)
        value = fmt.format(metrics[metric])
        if interval and interval["low"] is not None and interval["high"] is not None:
            value += f" [{fmt.format(interval['low'])}, {fmt.format(interval['high'])}]"
        rows.append(f"| {label} | {value} | {rule} |")
    confidence = (gate.get("intervals") or {}).get("confidence", 0.95)
    status = {
        "released": "RELEASED: every gate threshold holds",
        "inconclusive": "INCONCLUSIVE: the gate's eval set cannot tell whether the thresholds hold; do not ship "
        "this artifact before a larger gate decides",
    }.get(verdict, "REJECTED: a gate threshold is crossed; do not ship this artifact")
    groups = "per channel" if scheme.group_size == -1 else f"group size {scheme.group_size}"
    symmetry = "symmetric" if scheme.symmetric else "asymmetric"
    if q.activations:
        weights = f"{'FP8 E4M3' if scheme.type == 'float' else 'int8'} weights and activations (W8A8)"
    elif scheme.type == "nf4":
        nested = ", double-quantized scales" if scheme.double_quant else ""
        weights = f"NF4 weights, blocks of {scheme.group_size}{nested}"
    else:
        weights = f"{scheme.bits}-bit weights, {groups}, {symmetry}"
    return f"""# {recipe.output.rstrip("/").split("/")[-1]}

**{status}.**

Quantized from `{manifest["base_model"]["path"]}` (sha256 `{manifest["base_model"]["sha256"][:16]}…`) with
optkit {manifest.get("optkit_version", "")}: method `{q.method}`, {weights}, format `{q.format}`.
Calibration: {manifest["calibration"]["name"] or "none"}.

## Quality gate ({gate["eval_set"]["name"]}, {metrics["num_tokens"]:,} tokens)

| metric | value [{confidence:.0%} interval] | threshold |
|---|---|---|
{chr(10).join(rows)}

{_kept_at_higher_precision(manifest)}## Loading

```python
from transformers import AutoModelForCausalLM, AutoTokenizer  # needs `pip install compressed-tensors`
model = AutoModelForCausalLM.from_pretrained("PATH")
tokenizer = AutoTokenizer.from_pretrained("PATH")
```

```bash
vllm serve PATH
```

`optkit verify PATH` rechecks every file against `optkit.json`.
"""


def _kept_at_higher_precision(manifest: dict) -> str:
    """The layers repair raised (gate.repair), with the share of the KLD each caused at 4 bits."""
    raised = manifest.get("precision_overrides") or {}
    if not raised:
        return ""
    repair = manifest.get("repair") or {}
    attribution = {x["name"]: x for x in (repair.get("attribution") or {}).get("layers", [])}
    rows = []
    for name, rung in sorted(raised.items(), key=lambda item: -attribution.get(item[0], {}).get("estimate", 0)):
        layer = attribution.get(name, {})
        why = f"caused ~{100 * layer['share']:.1f}% of the KLD" if "share" in layer else "raised by repair"
        rows.append(f"| `{name}` | {parse_rung(rung).describe()} | {why} |")
    steps = repair.get("steps") or []
    weights = (manifest.get("options") or {}).get("weights") or {}
    start = f"{weights.get('bits', '?')}-bit, group size {weights.get('group_size', '?')}"
    gguf = (manifest.get("options") or {}).get("gguf")
    if isinstance(gguf, dict):  # a K mix: its linears' types, not one scheme
        start = f"GGUF {gguf.get('type', '?')}"
    history = " → ".join(f"{s['kld_mean']:.5f}" for s in steps)
    return f"""## Layers kept at higher precision

Repair started from a uniform artifact ({start}) and raised the layers that caused the most KL
divergence per byte (estimated on held-out calibration text, checked by the gate) until it passed.
Mean KLD by step: {history}.

| layer | precision | why |
|---|---|---|
{chr(10).join(rows)}

"""
