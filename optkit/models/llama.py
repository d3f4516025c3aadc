"""The runtime's decoder (Llama, Mistral, Qwen2, Qwen3, Granite, OLMo 2): RMSNorm, RoPE, grouped-query
attention over the paged KV cache, SwiGLU MLP; the families' differences are ModelConfig fields.
Module names follow transformers (`model.layers.{i}.self_attn.q_proj` ...), so checkpoints load by
key and quantized layers keep their names.

A step runs T packed tokens (docs/runtime.md): input_ids and positions are [T], no batch dim.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from optkit.kernels import cpu_decode
from optkit.kernels.paged_attention import AttentionMetadata, fused_decode_attention, paged_attention, write_kv
from optkit.models import decode_steps, fused_layer, fused_stack
from optkit.models.config import SLIDING, ModelConfig
from optkit.models.moe import SparseMoE

KVCache = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [num_blocks, block_size, Hkv, D]


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """The shape of one layer's k_cache (and v_cache)."""
    return (num_blocks, block_size, config.num_key_value_heads, config.head_dim)


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> list[KVCache]:
    shape = kv_cache_shape(config, num_blocks, block_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_hidden_layers)
    ]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, weight_in_float32: bool = False, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.weight_in_float32 = weight_in_float32
        self.offset = offset  # Gemma scales by (1 + weight), in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / rms(x) in float32, cast back before the weight (as transformers' LlamaRMSNorm), or
        # after it (Olmo2RMSNorm)
        if cpu_decode.enabled(x):  # one C++ call rather than six, rounded alike
            fast = cpu_decode.rms_norm(x, self.weight, self.eps, self.cast_first, self.offset)
            if fast is not None:
                return fast
        if x.dtype == torch.float32 and not self.offset:
            # the same float32 operations in one call (in bf16, F.rms_norm scales before its cast)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = F.rms_norm(x.float(), x.shape[-1:], None, self.eps)  # x·rsqrt(mean(x²) + eps): the same ops, one call
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        if self.weight_in_float32:
            return (self.weight * x).to(dtype)
        return self.weight * x.to(dtype)

    @property
    def cast_first(self) -> bool:
        """Whether a bfloat16 x is cast back before the weight multiplies it (LlamaRMSNorm), not after."""
        return not (self.weight_in_float32 or self.offset)

    def cpu_operator_args(self, dtype: torch.dtype) -> cpu_decode.NormArgs | None:
        """This norm as forward hands it to the C++ operator for activations of `dtype`; None where
        forward takes the PyTorch code."""
        if not cpu_decode.rms_norm_takes(dtype, self.weight.dtype, self.cast_first, self.offset):
            return None
        return cpu_decode.NormArgs(self.weight, self.eps, self.cast_first, self.offset)


def make_norm(config: ModelConfig, size: int | None = None) -> RMSNorm:
    return RMSNorm(
        size or config.hidden_size, config.rms_norm_eps, config.norm_weight_in_float32, config.norm_weight_offset
    )


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, signed sin [T, 1, R] (one row per token, broadcast over heads): angle
    θ_i = p·inv_freq[i] at columns i and i + R/2; cos(θ) at both, -sin(θ) at i and +sin(θ) at i + R/2,
    the signs of HF Llama's rotate_half folded in once a step rather than negated in every layer."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()  # [T, R/2]
    cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by its position; the "rotate half" pairing (i, i + R/2) of HF Llama over the
    first R = cos.shape[-1] dimensions of each head (R < D: partial rotary, the rest passes through).
    HF's x·cos + cat(-x2, x1)·sin as x·cos + roll(x, R/2)·(signed sin): roll gives cat(x2, x1), and
    -x2·s = x2·(-s) exactly, so the result is the same bit for bit in two fewer operators."""
    rotary = cos.shape[-1]
    if cos.dtype == x.dtype and cpu_decode.enabled(x) and x.stride(-1) == 1 and x.stride(1) == x.shape[-1]:
        return cpu_decode.rope(x, cos, sin)  # the same bits in one C++ call
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    return x * cos + x.roll(rotary // 2, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.window, self.softcap = config.window(layer), config.attn_logit_softcapping  # Gemma, Mistral
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5 if config.attention_multiplier is None else config.attention_multiplier
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias)
        self.qkv_proj: nn.Module | None = None  # q, k and v in one linear once fused (models/fusion.py)
        self.qkv_sizes = (q_size, kv_size, kv_size)
        self.qk_norm = config.qk_norm
        if config.qk_norm == "head":
            self.q_norm, self.k_norm = make_norm(config, self.head_dim), make_norm(config, self.head_dim)
        elif config.qk_norm == "full":  # over the whole projected q and k, before the split into heads
            self.q_norm, self.k_norm = make_norm(config, q_size), make_norm(config, kv_size)

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, hidden] -> q [T, Hq·D], k and v [T, Hkv·D] from the unfused projections."""
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def fuse_projections(self, concatenate) -> int:
        """q_proj, k_proj and v_proj -> qkv_proj (rows [q | k | v]) where `concatenate` can join them."""
        if "q_proj" not in self._modules:
            return 0  # already fused, or fused in the checkpoint (Phi-3)
        fused = concatenate([self.q_proj, self.k_proj, self.v_proj])
        if fused is None:
            return 0
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = fused
        return 1

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        num_tokens = h.shape[0]
        if self.qkv_proj is not None:  # a decode step on the CPU: norms, RoPE, cache write, attention in one call
            qkv = self.qkv_proj(h)  # [T, (Hq + 2·Hkv)·D]
            out = self.decode_from_qkv(qkv, cos, sin, meta, kv_cache)
            if out is not None:
                return self.o_proj(out.view(num_tokens, self.num_heads * self.head_dim))
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.project(h)  # q: [T, Hq·D], k, v: [T, Hkv·D]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # q: [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # k, v: [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def decode_from_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor | None:
        """forward's steps after the projection in one C++ call (kernels/cpu_decode.py's
        decode_attention_qkv), the same bits -> [T, Hq, D]; None where it does not apply."""
        norms = self.head_norm_args(qkv.dtype)
        step = self.fused_decode(qkv, cos, sin, meta, kv_cache) if norms is not None else None
        if step is None or qkv.stride(-1) != 1:
            return None
        return cpu_decode.decode_attention_qkv(qkv, *norms, step)

    def fused_decode(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> cpu_decode.DecodeAttention | None:
        """This layer's attention of a decode-only step as the C++ calls take it (None: they cannot)."""
        return fused_decode_attention(
            x, cos, sin, kv_cache, meta, num_heads=self.num_heads, scale=self.scale, window=self.window,
            softcap=self.softcap,
        )  # fmt: skip

    def head_norm_args(self, dtype: torch.dtype) -> cpu_decode.HeadNorms | None:
        """The per-head q/k norms as the C++ attention takes them for activations of `dtype`: (None,
        None) for a model without; None where it cannot (norms over all heads, OLMo 2's; PyTorch's)."""
        if self.qk_norm == "full":  # over all heads at once, before the split: not per head
            return None
        if self.qk_norm != "head":
            return (None, None)
        q_norm, k_norm = (norm.cpu_operator_args(dtype) for norm in (self.q_norm, self.k_norm))
        if q_norm is None or k_norm is None or not q_norm.same_rule(k_norm):
            return None
        return (q_norm, k_norm)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one linear once fused (models/fusion.py)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # Gemma: GeGLU with the tanh approximation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        else:
            gate, up = self.gate_proj(x), None
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * (self.up_proj(x) if up is None else up))  # SwiGLU (GeGLU)

    def fuse_projections(self, concatenate) -> int:
        """gate_proj and up_proj -> gate_up_proj (rows [gate | up]) where `concatenate` can join them."""
        if "gate_proj" not in self._modules:
            return 0
        fused = concatenate([self.gate_proj, self.up_proj])
        if fused is None:
            return 0
        del self.gate_proj, self.up_proj
        self.gate_up_proj = fused
        return 1


class DecoderLayer(nn.Module):
    """Pre-norms (h += sublayer(norm(h))), or with `post_norms` (OLMo 2) h += norm(sublayer(h)): there
    post_attention_layernorm normalizes the attention's output, post_feedforward_layernorm the MLP's.
    With `sandwich_norms` (Gemma) both: h += post_attention_layernorm(attn(input_layernorm(h))), then
    h += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))."""

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.post_norms = config.post_norms
        self.sandwich_norms = config.sandwich_norms
        self.residual_multiplier = config.residual_multiplier
        if not config.post_norms:
            self.input_layernorm = make_norm(config)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = make_norm(config)
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = make_norm(config)
        sparse = config.moe is not None and layer in config.moe.sparse_layers
        self.mlp = SparseMoE(config.hidden_size, config.moe) if sparse else MLP(config)
        if config.post_norms or config.sandwich_norms:
            self.post_feedforward_layernorm = make_norm(config)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        fast = self.decode_in_one_call(h, cos, sin, meta, kv_cache)
        if fast is not None:
            return fast
        if self.sandwich_norms:
            h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, meta, kv_cache))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.post_norms:
            h = h + self.post_attention_layernorm(self.self_attn(h, cos, sin, meta, kv_cache))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        if self.residual_multiplier != 1.0:  # Granite
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, kv_cache) * self.residual_multiplier
            return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_multiplier
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def decode_in_one_call(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor | None:
        """forward for a decode-only step in one C++ call (kernels/cpu_decode.py's decode_layer_w4a8, the
        same bits) where its four linears are W4A8 layers (a 4-bit artifact on the CPU), its norms pre- or
        sandwich norms of one rounding rule and its attention one the fused call takes; None elsewhere."""
        weights = fused_layer.w4a8_weights(self, h) if type(self.mlp) is MLP else None
        if weights is None:
            return None
        step = self.self_attn.fused_decode(h, cos, sin, meta, kv_cache)
        return None if step is None else cpu_decode.decode_layer_w4a8(h, weights, step)


def _plain_layer(layer: nn.Module) -> bool:
    """Whether `layer` is the decoder layer decode_layer_w4a8 computes (a gated MLP, no subclass)."""
    return type(layer) is DecoderLayer and type(layer.mlp) is MLP


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config)


class CausalLM(nn.Module):
    """forward: packed tokens -> final hidden states; compute_logits: hidden states -> fp32 logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        # tied embeddings: the logits reuse embed_tokens.weight, there is no lm_head
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)
        inv_freq, self.attention_scaling = config.rope_frequencies()  # on the CPU even under a meta device
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Gemma 3 rotates its sliding layers with another base: those layers take the local cos/sin
        self.local_rope = [layer_type == SLIDING for layer_type in config.layer_types]
        if config.local_rope_parameters is None or not any(self.local_rope):
            self.local_rope = []
        local_inv_freq, self.local_attention_scaling = config.local_rope_frequencies()
        self.register_buffer("local_inv_freq", local_inv_freq, persistent=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_context_limit(self, max_model_len: int) -> None:
        """RoPE for sequences of up to `max_model_len` tokens (LongRoPE chooses its factors by it)."""
        inv_freq, self.attention_scaling = self.config.rope_frequencies(max_model_len)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        kv_caches: list[KVCache],
        aux_layers: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: long [T] -> hidden [T, hidden_size], after the final norm. `meta`: one
        for every layer, or one per layer (its KV cache group's block tables: runtime/kv_groups.py).
        With `aux_layers` (an EAGLE-3 head's features): also the residual stream entering each of those
        layers (layer i's input: layer i-1's output, no norm; vLLM's aux_hidden_state_layers),
        concatenated in their order, [T, len(aux_layers)·hidden_size]."""
        h = self.embed(input_ids)  # h: [T, hidden]
        tables, rope_index = self.rope_tables(positions, h.dtype)
        metas = meta if isinstance(meta, list) else [meta] * len(self.model.layers)
        if not aux_layers:  # a decode step of a 4-bit artifact on the CPU: every layer in one call
            stacked = fused_stack.decode(self.model.layers, _plain_layer, h, tables, rope_index, metas, kv_caches)
            if stacked is not None:
                return self.model.norm(stacked)
        rope = [tables[i] for i in rope_index]
        entering = {}  # layer index -> the residual stream entering it
        for i, (layer, kv_cache, (cos, sin), layer_meta) in enumerate(
            zip(self.model.layers, kv_caches, rope, metas, strict=True)
        ):
            if i in aux_layers:
                entering[i] = h
            h = layer(h, cos, sin, layer_meta, kv_cache)
        if not aux_layers:
            return self.model.norm(h)
        return self.model.norm(h), torch.cat([entering[i] for i in aux_layers], dim=-1)

    def decode_steps(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: list[AttentionMetadata | list[AttentionMetadata]],
        kv_caches: list[KVCache],
        choose: Callable[[torch.Tensor, int], torch.Tensor | None],
    ) -> None:
        """n = len(metas) decode steps in a row, each as `forward` then `compute_logits`, the same bits
        (models/decode_steps.py): input_ids long [B] (each sequence's last token), positions long [n,
        B], metas[i] step i's as forward takes it; choose(logits [B, vocab] float32, i) -> long [B],
        the tokens step i chose, step i + 1's input (None: stop here)."""
        own_forward = type(self).forward is not CausalLM.forward  # a subclass's: each step through it
        decode_steps.run(self, input_ids, positions, metas, kv_caches, choose, _plain_layer, own_forward)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids long [T] -> what the first decoder layer receives [T, hidden]."""
        return self.config.scale_embeddings(self.model.embed_tokens(input_ids))

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
        """positions long [T] -> the RoPE tables (cos, signed sin [T, 1, R]: the global one, then
        Gemma 3's local one) and each layer's index into them."""
        tables = [rope_cos_sin(positions, self.inv_freq, self.attention_scaling, dtype)]
        rope_index = [0] * len(self.model.layers)
        if self.local_rope:
            tables.append(rope_cos_sin(positions, self.local_inv_freq, self.local_attention_scaling, dtype))
            rope_index = [int(is_local) for is_local in self.local_rope]
        return tables, rope_index

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:  # Granite, in the model's dtype as transformers divides
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2: cap·tanh(logits / cap), in the model's dtype as transformers
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
