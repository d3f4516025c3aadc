"""`optkit speculator train`: self-distillation of an EAGLE head for one target (a base model or
an optkit artifact, whose dequantized or int8 layers are what the head learns from), on CPU.

Every step draws `batch_size` windows of the text (a fresh seeded order each epoch), runs the
frozen target for its features, and trains the head on them: EAGLE-1 (head_model.py, distill.py)
on the last hidden state with feature regression and noise, EAGLE-3 (eagle3_model.py, distill3.py)
on three layers' residual streams with the training-time test and its own draft vocabulary (the
most frequent tokens of the windows the steps read). The window order and the feature noise of
step n derive from the seed and n alone, and a checkpoint holds the rest (weights, AdamW's
moments), so a resumed run equals an uninterrupted one.
"""

import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from optkit.artifacts import check_output_dir, check_replaceable
from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream_prefix
from optkit.errors import OptkitError
from optkit.modeldir import load_tokenizer, resolve_model_dir
from optkit.progress import progress_bar
from optkit.quant.formats.load import load_model
from optkit.speculative.acceptance import eval_prompts, mean_acceptance_length
from optkit.speculative.checkpoint import (
    CHECKPOINT_FILES,
    load_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
)
from optkit.speculative.distill import DistillLoss, chain_length_estimate, distillation_loss, head_inputs
from optkit.speculative.distill3 import draft_vocabulary, residual_streams, ttt_chain_estimate, ttt_loss
from optkit.speculative.eagle3_model import Eagle3HeadModel, new_eagle3_head
from optkit.speculative.eagle_head import eagle3_feature_layers, target_digest
from optkit.speculative.head_files import HEAD_FILES, write_head
from optkit.speculative.head_model import EagleHeadModel, first_layer_embedding, new_head
from optkit.speculative.options import SpeculatorTrainOptions

GRAD_CLIP = 0.5  # EAGLE's


@dataclass(frozen=True)
class TrainResult:
    path: Path
    num_parameters: int
    steps: int
    seconds: float
    mean_acceptance_length: float  # offline, greedy chains at options.num_speculative_tokens
    top1: float  # running agreement of the head's next token with the target's, at the end


def learning_rate(step: int, options: SpeculatorTrainOptions) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < options.warmup_steps:
        return options.learning_rate * (step + 1) / options.warmup_steps
    progress = (step - options.warmup_steps) / max(1, options.steps - options.warmup_steps)
    return options.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def window_indices(step: int, batch_size: int, num_windows: int, seed: int) -> torch.Tensor:
    """The windows of `step`: epoch e is a permutation seeded by (seed, e), read in order."""
    picks = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(i, num_windows)
        order = torch.randperm(num_windows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        picks.append(order[offset])
    return torch.stack(picks)


def feature_noise(shape: torch.Size, step: int, options: SpeculatorTrainOptions) -> torch.Tensor:
    generator = torch.Generator().manual_seed(options.seed * 1_000_003 + step + 1)
    return (torch.rand(shape, generator=generator) - 0.5) * options.noise


def training_windows(tokenizer, options: SpeculatorTrainOptions) -> torch.Tensor:
    texts = load_text_set(options.data, flag="--data").texts
    used = options.steps * options.batch_size * options.seq_len  # the tokens one pass of the steps reads
    windows = pack_windows(tokenize_stream_prefix(tokenizer, texts, used), options.seq_len)
    if len(windows) == 0:
        raise OptkitError(f"--data {options.data} has fewer tokens than --seq-len {options.seq_len}: give more text")
    return windows


def frozen_target(target_dir: Path) -> torch.nn.Module:
    target = load_model(target_dir, dtype=torch.float32)
    target.eval().requires_grad_(False)
    return target


class TargetFeatures:
    """The frozen target's features of the training windows [N, T] (EAGLE-1: after the final norm,
    the LM head's input, [T, H]; with `feature_layers`, EAGLE-3's: the residual streams entering
    them and the last hidden state, [T, 3H | H]), each window run alone, so that its features never
    depend on which step asks first or what else it asks for, and kept while they fit in `max_bytes`."""

    def __init__(
        self,
        target: torch.nn.Module,
        windows: torch.Tensor,
        max_bytes: int = 1 << 30,
        feature_layers: tuple[int, ...] | None = None,
    ):
        self.target, self.windows, self.kept, self.feature_layers = target, windows, {}, feature_layers
        width = target.config.hidden_size * (1 if feature_layers is None else len(feature_layers) + 1)
        self.max_windows = max_bytes // (windows.shape[1] * width * 4)

    @torch.no_grad()
    def _window(self, i: int) -> torch.Tensor:
        if i in self.kept:
            return self.kept[i]
        window = self.windows[i : i + 1]
        if self.feature_layers is None:
            features = self.target.get_decoder()(window).last_hidden_state[0].float()  # [T, H]
        else:
            features = torch.cat(residual_streams(self.target, window, self.feature_layers), dim=-1)[0]
        if len(self.kept) < self.max_windows:
            self.kept[i] = features
        return features

    def __call__(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.stack([self._window(i) for i in indices.tolist()])


def train_step(head: EagleHeadModel, target, embed, batch: torch.Tensor, features, step: int, options) -> DistillLoss:
    """batch: [B, T] tokens, features: [B, T, H] the target's; embed: first_layer_embedding(target)."""
    with torch.no_grad():
        embeds, inputs, positions = head_inputs(embed, batch, features)
        inputs = inputs + feature_noise(inputs.shape, step, options)
    predicted = head(embeds.float(), inputs, positions)
    loss = distillation_loss(predicted, features[:, 1:], target.get_output_embeddings())
    loss.loss.backward()
    return loss


def train_step3(head: Eagle3HeadModel, target, embed, batch: torch.Tensor, features, options):
    """batch: [B, T] tokens; features [B, T, 3H | H] (TargetFeatures with feature_layers)."""
    hidden = target.config.hidden_size
    loss = ttt_loss(
        head, embed, target.get_output_embeddings(), batch, features[..., :-hidden], features[..., -hidden:],
        options.ttt_steps,
    )  # fmt: skip
    loss.loss.backward()
    return loss


def default_draft_vocab_size(vocab_size: int) -> int:
    """A quarter of the target's vocabulary (EAGLE-3: 32k of Llama 3's 128k), at least 1,024."""
    return min(vocab_size, max(1024, -(-vocab_size // 4)))


def _resume_step(checkpoint_dir: Path, head, optimizer, options, digest: str) -> tuple[int, float]:
    state = read_checkpoint_state(checkpoint_dir)
    if state is None:
        return 0, 0.0
    if state.get("target_sha256") != digest:
        raise OptkitError(f"checkpoint {checkpoint_dir} is for another target: remove it or drop --resume")
    for name, value in options.training_values().items():
        if state.get("options", {}).get(name) != value:
            raise OptkitError(
                f"checkpoint {checkpoint_dir} was written with {name}={state['options'].get(name)!r}, not "
                f"{value!r}: pass the same value or remove the checkpoint"
            )
    load_checkpoint(checkpoint_dir, head, optimizer)
    return state["step"], float(state.get("top1", 0.0))


def _head_and_features(target, windows, options: SpeculatorTrainOptions):
    """A new head of options.kind and the target's features it learns from."""
    if options.kind != "eagle3":
        return new_head(target, options.seed), TargetFeatures(target, windows)
    vocab = target.config.vocab_size
    size = options.draft_vocab_size or default_draft_vocab_size(vocab)
    if size > vocab:
        raise OptkitError(f"--draft-vocab-size {size} is more than the target's vocabulary ({vocab}): give less")
    layers = eagle3_feature_layers(target.config.num_hidden_layers)
    # the draft vocabulary: the most frequent tokens of the windows the steps read
    read = [window_indices(n, options.batch_size, len(windows), options.seed) for n in range(options.steps)]
    draft_ids = draft_vocabulary(windows[torch.cat(read).unique()], vocab, size)
    head = new_eagle3_head(target, options.seed, draft_ids, layers)
    return head, TargetFeatures(target, windows, feature_layers=layers)


def _train_one_step(head, target, embed, batch, step: int, options, steps_top1: list, top1: float):
    """One step's loss and backward pass; returns the running top-1 (per unrolled step for
    EAGLE-3, smoothed 0.95/0.05) and the progress bar's line."""
    tokens, feats = batch
    k = options.num_speculative_tokens
    if isinstance(head, Eagle3HeadModel):
        loss = train_step3(head, target, embed, tokens, feats, options)
        running = zip(steps_top1, loss.top1, strict=True)
        steps_top1 = loss.top1 if step == 0 else [0.95 * a + 0.05 * b for a, b in running]
        info = (
            f"loss {loss.loss.item():.3f} (ce {loss.distribution:.2f})  top-1 "
            f"{'/'.join(f'{a:.0%}' for a in steps_top1)}  ~{ttt_chain_estimate(steps_top1, k):.2f} "
            f"tokens/step at k={k}"
        )
        return steps_top1, steps_top1[0], info
    loss = train_step(head, target, embed, tokens, feats, step, options)
    top1 = loss.top1 if step == 0 else 0.95 * top1 + 0.05 * loss.top1
    info = (
        f"loss {loss.loss.item():.3f} (feature {loss.feature:.3f}, ce {loss.distribution:.2f})  "
        f"top-1 {top1:.0%}  ~{chain_length_estimate(top1, k):.2f} tokens/step at k={k}"
    )
    return steps_top1, top1, info


def train_speculator(
    target_name: str | Path,
    out: Path,
    options: SpeculatorTrainOptions,
    *,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    stop_after: int | None = None,
) -> TrainResult | None:
    """Train a head for the target and write it to `out` (config.json + model.safetensors).
    `stop_after`: leave after that many steps with only the checkpoint written (what an interrupted
    run leaves; for tests), returning None."""
    start = time.perf_counter()
    target_dir = resolve_model_dir(target_name)
    out = Path(out)
    checkpoint_dir = Path(checkpoint_dir or out.with_name(out.name + ".checkpoint"))
    check_output_dir(out, overwrite, own_files=HEAD_FILES)
    torch.manual_seed(options.seed)
    digest = target_digest(target_dir)
    tokenizer = load_tokenizer(target_dir)
    windows = training_windows(tokenizer, options)
    target = frozen_target(target_dir)
    embed = first_layer_embedding(target)
    head, features = _head_and_features(target, windows, options)
    optimizer = torch.optim.AdamW(head.parameters(), lr=options.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    first, top1 = _resume_step(checkpoint_dir, head, optimizer, options, digest) if resume else (0, 0.0)
    resumed = (read_checkpoint_state(checkpoint_dir) or {}) if first else {}
    steps_top1 = resumed.get("steps_top1", [top1] * options.ttt_steps)  # EAGLE-3's, per unrolled step
    last = options.steps if stop_after is None else min(options.steps, first + stop_after)
    k = options.num_speculative_tokens

    def checkpoint(step: int) -> None:
        state = {"step": step, "options": options.training_values(), "target_sha256": digest, "top1": top1}
        if isinstance(head, Eagle3HeadModel):
            state["steps_top1"] = steps_top1
        save_checkpoint(checkpoint_dir, head, optimizer, state)

    head.train()
    with progress_bar() as bar:
        task = bar.add_task("train EAGLE head", total=options.steps, completed=first, info="")
        for step in range(first, last):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, options)
            indices = window_indices(step, options.batch_size, len(windows), options.seed)
            batch = (windows[indices], features(indices))
            steps_top1, top1, info = _train_one_step(head, target, embed, batch, step, options, steps_top1, top1)
            torch.nn.utils.clip_grad_norm_(head.parameters(), GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bar.update(task, advance=1, info=info)
            if (step + 1) % options.checkpoint_every == 0 and step + 1 < options.steps:
                checkpoint(step + 1)
    if last < options.steps:
        checkpoint(last)
        return None

    prompts = eval_prompts(tokenizer, load_text_set(options.eval_set).texts, options.eval_prompts, 64)
    acceptance = mean_acceptance_length(head, target, prompts, k, options.eval_new_tokens)
    write_head(out, head, target_dir, overwrite=overwrite)
    if checkpoint_dir.exists():  # optkit's own files only (check_replaceable refuses anything else)
        check_replaceable(checkpoint_dir, "--checkpoint-dir", CHECKPOINT_FILES)
        shutil.rmtree(checkpoint_dir)
    num_parameters = sum(p.numel() for p in head.parameters())
    return TrainResult(out, num_parameters, options.steps, time.perf_counter() - start, acceptance, top1)
