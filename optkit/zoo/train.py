"""Train a reference model from scratch on the standard library (deterministic, CPU-friendly)."""

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from optkit.artifacts import atomic_output_dir, check_output_dir
from optkit.cache import cache_dir
from optkit.data.corpus import read_texts
from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream
from optkit.modeldir import BUNDLED_DIR
from optkit.progress import progress_bar
from optkit.zoo.specs import VOCAB_SIZE, ZooSpec
from optkit.zoo.tokenizer import train_tokenizer


@dataclass(frozen=True)
class BuildResult:
    path: Path
    num_parameters: int
    steps: int
    heldout_perplexity: float
    seconds: float
    cpu_seconds: float  # of this process: at one thread, about its wall time on an idle core
    # a mixture of experts: [layer][expert], the share of held-out routing choices each expert gets
    expert_shares: list[list[float]] | None = None


# gemma3's vision tower: the smallest SigLIP that makes a Gemma3ForConditionalGeneration checkpoint
GEMMA3_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)

# What save_pretrained writes for a reference model and its tokenizer: a bundled model's folder
# (optkit's own, kept without an optkit.json) is replaced only when it holds nothing else.
SAVED_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    }
)


def reference_tokenizer(train_texts: list[str]) -> PreTrainedTokenizerFast:
    """The tokenizer every reference model shares, trained once per corpus and cached."""
    digest = hashlib.sha256("".join(train_texts).encode()).hexdigest()[:16]
    path = cache_dir("tokenizers") / f"stdlib-bpe{VOCAB_SIZE}-{digest}"
    if not (path / "tokenizer.json").exists():
        with atomic_output_dir(path, overwrite=True, own_files=SAVED_FILES) as tmp:  # optkit's cache
            train_tokenizer(train_texts, VOCAB_SIZE).save_pretrained(tmp)
    return PreTrainedTokenizerFast.from_pretrained(path)


def learning_rate(step: int, spec: ZooSpec, total_steps: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < spec.warmup_steps:
        return spec.learning_rate * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, total_steps - spec.warmup_steps)
    return spec.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def new_model(
    spec: ZooSpec, vocab_size: int, eos_token_id: int, *, experts_implementation: str | None = None
) -> PreTrainedModel:
    """The spec's untrained model: its family's CausalLM class (AutoModelForCausalLM's for the
    model_type; a multimodal family's whole model, gemma3's vision tower included) on its config
    class. An MoE trains with the load-balancing loss added to its loss, and with transformers'
    default experts forward (grouped_mm: bench/zoo_moe_step.py measured it fastest on CPU) unless
    `experts_implementation` names another."""
    kwargs = spec.config_kwargs(vocab_size, eos_token_id)
    if spec.model_type == "llama":  # small, draft and deep, built as they always were
        return LlamaForCausalLM(LlamaConfig(**kwargs))
    if spec.model_type == "mixtral":
        config = MixtralConfig(**kwargs, output_router_logits=True)
        return MixtralForCausalLM._from_config(config, experts_implementation=experts_implementation)
    config = family_config(spec.model_type, kwargs)
    if spec.is_moe:
        config.output_router_logits = True
        return AutoModelForCausalLM.from_config(config, experts_implementation=experts_implementation)
    return AutoModelForCausalLM.from_config(config)


def family_config(model_type: str, kwargs: dict):
    """The config of `model_type` with `kwargs` on its defaults; gemma3 (image and text) with them on
    its text config, beside a small SigLIP tower (the language model is what is trained)."""
    if model_type != "gemma3":
        return AutoConfig.for_model(model_type, **kwargs)
    text = {**kwargs, "model_type": "gemma3_text"}
    return AutoConfig.for_model("gemma3", text_config=text, vision_config=GEMMA3_VISION, mm_tokens_per_image=4)


def train_steps(model: PreTrainedModel, spec: ZooSpec, windows: torch.Tensor, total_steps: int, start: float) -> None:
    """`total_steps` of AdamW on batches of `windows` [N, T] drawn in the spec's seeded order (the
    recipe: its learning rate, warmup, weight decay off the embeddings and 1-d weights, clipping)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.learning_rate,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(len(windows), generator=generator)
    cursor = 0
    model.train()
    with progress_bar() as bar:
        task = bar.add_task(f"train {spec.name}", total=total_steps, info="")
        for step in range(total_steps):
            if cursor + spec.batch_size > len(order):
                order, cursor = torch.randperm(len(windows), generator=generator), 0
            batch = windows[order[cursor : cursor + spec.batch_size]]
            cursor += spec.batch_size
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, spec, total_steps)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens_per_s = (step + 1) * batch.numel() / (time.perf_counter() - start)
            bar.update(task, advance=1, info=f"loss {loss.item():.3f}  {tokens_per_s:,.0f} tok/s")


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token NLL) over token windows [N, T]."""
    total_nll, total_tokens = 0.0, 0
    for batch in windows.split(batch_size):
        logits = model(batch).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    return math.exp(total_nll / total_tokens)


@torch.no_grad()
def expert_token_shares(model: MixtralForCausalLM, windows: torch.Tensor, batch_size: int = 16) -> torch.Tensor:
    """[layers, experts]: the fraction of the routing choices (token, top-k slot) on `windows` [N, T]
    that go to each expert; every row sums to 1 (an even router: 1/experts each, a dead expert: 0)."""
    config = model.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts  # Mixtral's name, Qwen's
    counts = torch.zeros(config.num_hidden_layers, experts)
    top_k = config.num_experts_per_tok
    for batch in windows.split(batch_size):
        for layer, logits in enumerate(model(batch, output_router_logits=True).router_logits):  # [B·T, E] each
            counts[layer] += torch.bincount(logits.topk(top_k, dim=-1).indices.flatten(), minlength=counts.shape[1])
    return counts / counts.sum(dim=1, keepdim=True)


def build_reference_model(
    spec: ZooSpec, out_dir: Path, *, steps: int | None = None, overwrite: bool = True
) -> BuildResult:
    """Train `spec` for `steps` (default: the spec's) and save it, bf16 safetensors, to `out_dir`."""
    start, cpu_start = time.perf_counter(), time.process_time()
    bundled = Path(out_dir).resolve().parent == BUNDLED_DIR.resolve()
    own_files = SAVED_FILES if bundled else frozenset()
    check_output_dir(out_dir, overwrite, own_files=own_files)  # before the training, not after
    torch.manual_seed(spec.seed)
    train_texts = read_texts("train")
    tokenizer = reference_tokenizer(train_texts)
    windows = pack_windows(tokenize_stream(tokenizer, train_texts), spec.seq_len)
    heldout = pack_windows(tokenize_stream(tokenizer, load_text_set("heldout").texts), spec.seq_len)

    model = new_model(spec, len(tokenizer), tokenizer.eos_token_id)
    total_steps = steps if steps is not None else spec.steps
    train_steps(model, spec, windows, total_steps, start)
    model.eval()
    model.config.output_router_logits = False  # the auxiliary loss is for training only
    heldout_ppl = perplexity(model, heldout)
    shares = expert_token_shares(model, heldout).tolist() if spec.is_moe else None
    model.to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    with atomic_output_dir(out_dir, overwrite=overwrite, own_files=own_files) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return BuildResult(out_dir, model.num_parameters(), total_steps, heldout_ppl, seconds, cpu_seconds, shares)
