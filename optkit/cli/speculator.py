"""`optkit speculator`: EAGLE heads for speculative decoding, trained for the model they serve."""

from pathlib import Path
from typing import Annotated

import typer

from optkit.cli.options import JsonFlag, Overwrite, console, print_json
from optkit.errors import OptkitError

app = typer.Typer(help="Train EAGLE speculative-decoding heads.", no_args_is_help=True)


@app.command("train")
def train(
    model: Annotated[str, typer.Argument(help="The target: a base model or an optkit artifact (its own features).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The head directory to write.")],
    kind: Annotated[
        str,
        typer.Option(
            help="eagle1 (the last feature, the target's LM head) or eagle3 (three layers fused, "
            "training-time test, its own reduced-vocabulary head)."
        ),
    ] = "eagle1",
    draft_vocab_size: Annotated[
        int | None,
        typer.Option(
            help="EAGLE-3: tokens in the draft vocabulary (default: a quarter of the target's, at least 1,024)."
        ),
    ] = None,
    ttt_steps: Annotated[int, typer.Option(help="EAGLE-3: drafting steps the training-time test unrolls.")] = 3,
    data: Annotated[str, typer.Option(help="Training text: a bundled set or a .txt/.jsonl/.parquet file.")] = "distill",
    steps: Annotated[int, typer.Option(help="Training steps (windows of --seq-len, --batch-size a step).")] = 800,
    batch_size: Annotated[int, typer.Option(help="Windows per step.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = 256,
    learning_rate: Annotated[float, typer.Option(help="Peak AdamW learning rate.")] = 2e-3,
    seed: Annotated[int, typer.Option(help="Seeds the head's initialisation, the window order and the noise.")] = 0,
    num_speculative_tokens: Annotated[int, typer.Option(help="k of the final acceptance measurement.")] = 4,
    checkpoint_dir: Annotated[
        Path | None, typer.Option(help="Where checkpoints go (default: OUT.checkpoint beside --out).")
    ] = None,
    checkpoint_every: Annotated[int, typer.Option(help="Steps between checkpoints.")] = 100,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the checkpoint, if there is one.")] = False,
    overwrite: Overwrite = False,
    json_output: JsonFlag = False,
) -> None:
    """Train an EAGLE head by self-distillation: the target's features and next-token
    distributions on the text are its labels. For an artifact, the head learns the quantized
    model's features, which are what it will be served with.

    Example: optkit speculator train small --out heads/small && optkit generate small --speculative eagle:heads/small

    EAGLE-3: optkit speculator train small --kind eagle3 --out heads/small-e3
    """
    from optkit.speculative.options import SpeculatorTrainOptions
    from optkit.speculative.train import train_speculator

    if kind not in ("eagle1", "eagle3"):
        raise OptkitError(f"--kind {kind!r}: give eagle1 or eagle3")
    if draft_vocab_size is not None and draft_vocab_size < 1 or not 1 <= ttt_steps <= 16:
        raise OptkitError("--draft-vocab-size must be at least 1 and --ttt-steps 1..16")
    options = SpeculatorTrainOptions(
        kind=kind,
        draft_vocab_size=draft_vocab_size,
        ttt_steps=ttt_steps,
        data=data,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        learning_rate=learning_rate,
        seed=seed,
        num_speculative_tokens=num_speculative_tokens,
        checkpoint_every=checkpoint_every,
    )
    result = train_speculator(model, out, options, checkpoint_dir=checkpoint_dir, resume=resume, overwrite=overwrite)
    k = options.num_speculative_tokens
    if json_output:
        print_json(_train_report(result, options))
        return
    name = "EAGLE-3" if options.kind == "eagle3" else "EAGLE-1"
    console().print(
        f"[bold green]trained[/] {name} head: {result.num_parameters:,} parameters, {result.steps} steps, "
        f"{result.seconds:.0f}s; mean acceptance length {result.mean_acceptance_length:.2f} at k={k} "
        f"(greedy, {options.eval_set}) -> {result.path}"
    )


def _train_report(result, options) -> dict:
    """`speculator train --json`: the head written, its size and its measured acceptance."""
    return {
        "path": str(result.path),
        "kind": options.kind,
        "parameters": result.num_parameters,
        "steps": result.steps,
        "seconds": result.seconds,
        "num_speculative_tokens": options.num_speculative_tokens,
        "mean_acceptance_length": result.mean_acceptance_length,
        "top1": result.top1,
    }
