"""A stand-in for SGLang's model runner, built from a tiny Hugging Face Llama's own modules.

It calls the model the way SGLang 0.5.21 does (``sglang/srt/models/llama.py``):
``LlamaForCausalLM.forward(input_ids, positions, forward_batch)`` -> ``self.model(input_ids,
positions, forward_batch, input_embeds, pp_proxy_tensors=...)`` -> each decoder layer as
``layer(positions, hidden_states, forward_batch, residual)`` returning ``(hidden, residual)``
with the residual kept apart (fused add+RMSNorm), EAGLE-3 capture of ``hidden + residual``
before layer ``i`` for ``i`` in ``layers_to_capture``, then ``self.norm(hidden, residual)``.
Attention runs over a per-request KV cache, so packed batches, chunked prefill and prefix
reuse behave as on a server. Module names match SGLang's (``model.layers.N``, ``model.norm``).
The ForwardBatch double carries the same field names as SGLang's.

``register_forward_hooks`` reproduces SGLang 0.5.21's hook manager algorithm for the core venv
(no sglang there); the conformance test runs the same stand-in through the real one.
"""

from __future__ import annotations

import enum
import fnmatch
import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4


@dataclass
class ForwardBatch:
    """Same field names as ``sglang.srt.model_executor.forward_batch_info.ForwardBatch``."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    rids: list[str]
    extend_seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    kv: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)


def make_batch(
    items: list[tuple[str, list[int], int]],
    kv: dict[str, Any],
    mode: ForwardMode = ForwardMode.EXTEND,
    pad: int = 0,
) -> ForwardBatch:
    """items: (rid, ids of this extend, prefix length already in the KV cache)."""
    lens = [len(ids) for _, ids, _ in items]
    prefixes = [p for _, _, p in items]
    starts = [sum(lens[:j]) for j in range(len(lens))]
    ids = [t for _, x, _ in items for t in x] + [0] * pad  # pad rows: like DP/graph padding
    pos = [p + k for (_, x, p) in items for k in range(len(x))] + [0] * pad
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(items),
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        rids=[r for r, _, _ in items],
        extend_seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefixes, dtype=torch.int32),
        extend_start_loc=torch.tensor(starts, dtype=torch.int32),
        extend_seq_lens_cpu=lens,
        extend_prefix_lens_cpu=prefixes,
        kv=kv,
    )


class RMSNorm(nn.Module):
    """SGLang's RMSNorm contract: ``norm(x)`` or ``norm(x, residual) -> (normed, x + residual)``."""

    def __init__(self, hf_norm: nn.Module):
        super().__init__()
        self.hf = hf_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, **_: Any) -> Any:
        if residual is None:
            return self.hf(x)
        s = x + residual
        return self.hf(s), s


class Attention(nn.Module):
    """Per-request causal attention over a KV cache, with Hugging Face's projections and rope."""

    def __init__(self, hf_attn: nn.Module, rotary: nn.Module, layer_id: int, cfg: Any):
        super().__init__()
        self.hf = hf_attn
        self.rotary = rotary
        self.layer_id = layer_id
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        fb = forward_batch
        out = torch.zeros(
            hidden_states.shape[0], self.heads * self.head_dim, dtype=hidden_states.dtype
        )
        for j in range(fb.batch_size):
            rid = fb.rids[j] if fb.rids else f"#{j}"  # KV slot; real SGLang uses req_pool_indices
            s, n = fb.extend_start_loc[j].item(), fb.extend_seq_lens_cpu[j]
            x = hidden_states[s : s + n]
            pos = positions[s : s + n]
            q = self.hf.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1)[None]
            k = self.hf.k_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)[None]
            v = self.hf.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)[None]
            cos, sin = self.rotary(x[None], pos[None])
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            cache = fb.kv.setdefault(rid, [])
            if len(cache) <= self.layer_id:
                cache.append((k[:, :, :0], v[:, :, :0]))
            pk, pv = cache[self.layer_id]
            if pk.shape[2] != fb.extend_prefix_lens_cpu[j]:
                raise RuntimeError(
                    f"{rid}: KV cache holds {pk.shape[2]} tokens, prefix says {fb.extend_prefix_lens_cpu[j]}"
                )
            k = torch.cat([pk, k], dim=2)
            v = torch.cat([pv, v], dim=2)
            cache[self.layer_id] = (k, v)
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            total = k.shape[2]
            qpos = torch.arange(total - n, total)[:, None]
            mask = torch.arange(total)[None, :] <= qpos
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out[s : s + n] = att[0].transpose(0, 1).reshape(n, -1)
        return self.hf.o_proj(out)


class DecoderLayer(nn.Module):
    """``LlamaDecoderLayer.forward`` of SGLang 0.5.21, on Hugging Face's weights."""

    def __init__(self, hf_layer: nn.Module, rotary: nn.Module, layer_id: int, cfg: Any):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = Attention(hf_layer.self_attn, rotary, layer_id, cfg)
        self.mlp = hf_layer.mlp
        self.input_layernorm = RMSNorm(hf_layer.input_layernorm)
        self.post_attention_layernorm = RMSNorm(hf_layer.post_attention_layernorm)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(
            positions=positions, hidden_states=hidden_states, forward_batch=forward_batch
        )
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class LlamaModel(nn.Module):
    """``LlamaModel.forward`` of SGLang 0.5.21 (one pipeline stage)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        cfg = hf_model.config
        inner = hf_model.model
        self.config = cfg
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(
            DecoderLayer(layer, inner.rotary_emb, i, cfg) for i, layer in enumerate(inner.layers)
        )
        self.norm = RMSNorm(inner.norm)
        self.start_layer = 0
        self.end_layer = cfg.num_hidden_layers
        self.layers_to_capture: list[int] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
        pp_proxy_tensors: Any = None,
    ) -> Any:
        hidden_states = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        aux_hidden_states = []
        for i in range(self.start_layer, self.end_layer):
            if i in self.layers_to_capture:
                aux_hidden_states.append(hidden_states + residual)
            layer = self.layers[i]
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        if len(aux_hidden_states) == 0:
            return hidden_states
        return hidden_states, aux_hidden_states


class LlamaForCausalLM(nn.Module):
    """``LlamaForCausalLM`` of SGLang 0.5.21: forward and ``set_eagle3_layers_to_capture``."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.config = hf_model.config
        self.model = LlamaModel(hf_model)
        self.lm_head = hf_model.lm_head
        self.capture_aux_hidden_states = False

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden_states = self.model(input_ids, positions, forward_batch, None, pp_proxy_tensors=None)
        if self.capture_aux_hidden_states:
            hidden_states, _aux = hidden_states
        ends = [
            s + n - 1
            for s, n in zip(
                forward_batch.extend_start_loc.tolist(),
                forward_batch.extend_seq_lens_cpu,
                strict=True,
            )
        ]
        return self.lm_head(hidden_states[ends]).argmax(-1)  # one greedy token per request

    def set_eagle3_layers_to_capture(self, layer_ids: list[int] | None = None) -> None:
        self.capture_aux_hidden_states = True
        if layer_ids is None:
            num_layers = self.config.num_hidden_layers
            self.model.layers_to_capture = [2, num_layers // 2, num_layers - 3]
        else:
            self.model.layers_to_capture = [val + 1 for val in layer_ids]


def load_standin(model_dir: str) -> tuple[LlamaForCausalLM, nn.Module]:
    """(stand-in, the Hugging Face model it shares weights with), fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    hf.eval()
    return LlamaForCausalLM(hf).eval(), hf


def register_forward_hooks(model: nn.Module, hook_specs: list[dict[str, Any]]) -> None:
    """SGLang 0.5.21 ``hook_manager.register_forward_hooks``, same algorithm and local names."""
    name_to_module = dict(model.named_modules())
    for spec in hook_specs:
        target_patterns = spec.get("target_modules", [])
        config = spec.get("config") or {}
        module_name, fn_name = spec["hook_factory"].split(":", 1)
        hook_factory = getattr(importlib.import_module(module_name), fn_name)
        hook = hook_factory(config)
        if hook is None:
            continue
        matched = [
            (n, m)
            for n, m in name_to_module.items()
            if any(fnmatch.fnmatch(n, p) for p in target_patterns)
        ]
        for _name, module in matched:
            module.register_forward_hook(hook)


class Scheduler:
    """Packs requests into extend forwards under a token budget, chunking long prompts.

    ``chunk`` plays ``--chunked-prefill-size`` (None: whole prompts, one forward per batch).
    Returns one greedy token per request, like ``/generate`` with ``max_new_tokens=1``.
    """

    def __init__(self, model: LlamaForCausalLM, chunk: int | None = None):
        self.model = model
        self.chunk = chunk
        self.kv: dict[str, Any] = {}

    def run(
        self, reqs: list[tuple[str, list[int]]], cached: dict[str, int] | None = None
    ) -> dict[str, int]:
        done: dict[str, int] = {}
        filled = {rid: (cached or {}).get(rid, 0) for rid, _ in reqs}
        for rid, ids in reqs:  # a prefix cache hit: another request computed these tokens
            if filled[rid]:
                other = "cached-by-another-request"
                self.model(*self._args(make_batch([(other, ids[: filled[rid]], 0)], self.kv)))
                self.kv[rid] = self.kv.pop(other)
        while len(done) < len(reqs):
            budget = self.chunk or sum(len(ids) for _, ids in reqs)
            items = []
            for rid, ids in reqs:
                if rid in done or budget <= 0:
                    continue
                take = min(len(ids) - filled[rid], budget)
                items.append((rid, ids[filled[rid] : filled[rid] + take], filled[rid]))
                budget -= take
            out = self.model(*self._args(make_batch(items, self.kv)))
            for (rid, part, _), tok in zip(items, out.tolist(), strict=True):
                filled[rid] += len(part)
                if filled[rid] == len(dict(reqs)[rid]):
                    done[rid] = tok
                    self.kv.pop(rid, None)
        return done

    @staticmethod
    def _args(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        return fb.input_ids, fb.positions, fb
