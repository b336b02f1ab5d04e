"""One decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3).

The architectures differ only in switches read by ``ModelConfig`` (q/k/v bias,
q/k RMSNorm, tied embeddings, rope scaling). Projections are fused (qkv, gate+up)
to halve the matmuls per layer; ``load_weights`` maps Hugging Face tensor names onto
the fused parameters. The residual stream travels beside the hidden states so that each
norm adds it in the same pass (one fused op with the native CPU kernels).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn

from seer_engine.model_executor.attention import AttentionBackend, AttentionMetadata
from seer_engine.model_executor.layers import Linear, RMSNorm, Rope, RotaryEmbedding, silu_and_mul
from seer_engine.model_executor.model_config import ModelConfig, ModelLoadError


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k)
        out = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self._act = silu_and_mul

    def use_native(self, ops: ModuleType | None) -> None:
        self._act = getattr(ops, "silu_and_mul", silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderForCausalLM(nn.Module):
    """Token ids of a flattened batch -> final hidden states; ``logits`` on selected rows."""

    # HF tensor name fragment -> (our parameter fragment, shard index within the fused tensor)
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = self.make_rotary()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self._ops: ModuleType | None = None
        self._native: object | None = None  # the layers as one C++ call (cpu_kernels.NativeDecoder)

    def tie_weights(self) -> None:
        """The LM head reads the embedding table when the checkpoint ties them (again after
        ``to_empty``, which gives every parameter its own storage)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self) -> RotaryEmbedding:
        c = self.cfg
        return RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.for_positions(positions, x.dtype)
        requests = None if self._native is None else backend.native_requests(meta, kv_caches[0])
        if requests is not None:
            inputs = self._ops.StepInputs(
                rope.positions, rope.cos, rope.sin, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, requests, meta.tree_mask,
            )  # fmt: skip
            x, residual = self._native.run(kv_caches, x, inputs)
            return self.norm(x, residual)[0]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta, backend)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def use_native(self, ops: ModuleType | None, linear_dtype: torch.dtype = torch.float32) -> None:
        """Run on a fused-op kernel set (``model_runner.fused_ops``), or on torch ops (None).
        Linear layers pack their weights now (in ``linear_dtype`` where the set has a
        ``linear``), so call it once the weights are loaded."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_native(ops, linear_dtype)
            elif module is not self and hasattr(module, "use_native"):
                module.use_native(ops)
        self._ops = ops
        self._native = self._native_decoder(ops)

    def _native_decoder(self, ops: ModuleType | None):
        """The layers as one C++ call, where the kernel set has it and runs every op of a
        layer (packed matmuls; q/k norms, Qwen3's, go through torch ops: not covered)."""
        if not hasattr(ops, "NativeDecoder") or self.cfg.qk_norm or self.lm_head._packed is None:
            return None
        c = self.cfg
        return ops.NativeDecoder(
            [
                ops.NativeLayer(
                    layer.input_layernorm.weight.detach(),
                    layer.self_attn.qkv_proj._packed,
                    layer.self_attn.qkv_proj._packed_bias,
                    layer.self_attn.o_proj._packed,
                    layer.self_attn.o_proj._packed_bias,
                    layer.post_attention_layernorm.weight.detach(),
                    layer.mlp.gate_up_proj._packed,
                    layer.mlp.gate_up_proj._packed_bias,
                    layer.mlp.down_proj._packed,
                    layer.mlp.down_proj._packed_bias,
                    c.num_heads,
                    c.num_kv_heads,
                    c.head_dim,
                    c.hidden_size,
                    c.intermediate_size,
                    c.rms_norm_eps,
                    layer.self_attn.scale,
                )
                for layer in self.layers
            ]
        )

    # -- weights -------------------------------------------------------------------

    def _shard_sizes(self, fused: str) -> list[int]:
        c = self.cfg
        if fused == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (partly fused) parameters; every one must arrive.

        With tied embeddings a stored LM head is handled as transformers does: alone, it
        fills the shared table; beside a different embedding table, it unties the two."""
        params = dict(self.named_parameters(remove_duplicate=False))
        expected: set[str] = set()
        head: torch.Tensor | None = None  # a tied model's stored LM head
        for name in params:
            if self.cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            parts = name.split(".")
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f in parts), None)
            if fused is None:
                expected.add(name)
            else:
                expected.update(f"{name}#{shard}" for shard in range(len(self._shard_sizes(fused))))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                head = tensor
                continue
            fused_hit = next((k for k in self._FUSED if f".{k}." in f".{name}"), None)
            if fused_hit is not None:
                ours, shard = self._FUSED[fused_hit]
                name = name.replace(fused_hit, ours)
                param = params.get(name)
                if param is None:
                    raise ModelLoadError(f"checkpoint tensor {hf_name!r} matches no model parameter")
                sizes = self._shard_sizes(ours)
                target = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
                key = f"{name}#{shard}"
            else:
                param = params.get(name)
                if param is None:
                    raise ModelLoadError(f"checkpoint tensor {hf_name!r} matches no model parameter")
                target, key = param.data, name
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(key)
        if head is not None:
            self._load_tied_head(head, "embed_tokens.weight" in loaded)
            loaded.add("embed_tokens.weight")
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ModelLoadError(f"checkpoint is incomplete: {len(missing)} tensors missing ({shown})")

    def _load_tied_head(self, head: torch.Tensor, embed_loaded: bool) -> None:
        """A tied model's stored LM head: the embedding table where the checkpoint has none;
        its own weight where the table differs from it (the config is wrong)."""
        table = self.embed_tokens.weight
        if tuple(head.shape) != tuple(table.shape):
            shapes = f"{tuple(head.shape)}, expected {tuple(table.shape)}"
            raise ModelLoadError(f"checkpoint tensor 'lm_head.weight' has shape {shapes}")
        if not embed_loaded:
            table.data.copy_(head)
        elif not torch.equal(table.data, head.to(device=table.device, dtype=table.dtype)):
            own = torch.empty_like(table.data).copy_(head)
            self.lm_head.weight = nn.Parameter(own, requires_grad=False)
