"""kvblend's KV handed to transformers: `BlendEngine.prepare` and `BlendEngine.transformers_model`.

`prepare` fills a prompt's cache the way a request would (full, prefix, reuse or blend: a
`prefill` task on the engine's scheduler) and hands its first T-1 positions over as a
transformers `DynamicCache`, so that the model's own `generate` continues from kvblend's KV:

    prepared = engine.prepare(question, documents, mode="blend")
    model = engine.transformers_model()
    out = model.generate(prepared.input_ids, past_key_values=prepared.past_key_values,
                         max_new_tokens=32, do_sample=False)   # (1, T + new)

Keys sit at their prompt positions (slot i = position i, rotated there); a layer the
model's config calls sliding is transformers' `DynamicSlidingWindowLayer` (it keeps the last
window - 1 keys, and counts all T-1 positions), every other layer a `DynamicLayer`.

Blend leaves a logit correction on the stale keys it did not recompute (`KVCache.bias`, one
value per layer, KV head and key), which every later attention adds. A transformers cache has
no place for it and its attention masks are one per layer type, not per layer; so the cache
that carries it is a `KVBlendCache` (a `DynamicCache` holding the bias beside the keys) and
the model's attention is `ATTENTION` (registered with transformers' `AttentionInterface`): SDPA
over the model's own causal or sliding-window mask, plus the bias of the keys a
`KVBlendCache` handed to that very call. `transformers_model()` (and `prepare`, when it hands
a bias over) switches the engine's model to it; a cache without a bias attends as plain SDPA.
What leaving the bias out costs (`carry_bias=False`) is measured in docs/EVAL.md.

The model is the engine's own (same weights, nothing copied); the runner does not use its
attention modules' forward, so switching its attention implementation leaves kvblend's
requests as they were. Batch size 1; beam search and cropping are not supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary
from transformers import DynamicCache

from blend.decode.generation import Prefilled
from blend.engine.layout import RequestLayout
from blend.engine.request import GenerationRequest
from blend.model.cache import KVCache
from blend.model.loading import LoadedModel
from blend.prompt.builder import Prompt, PromptTemplate
from blend.prompt.conversation import Message
from blend.prompt.document import Document
from blend.stats import RequestStats

ATTENTION = "kvblend_sdpa"  # the attention implementation name registered with transformers

# the bias (Hkv, K) of the keys a KVBlendCache returned to an attention call, keyed by that key
# tensor itself: the attention function finds the bias of exactly the keys it is given
_KEY_BIAS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Engine(Protocol):
    """What the hand-off uses of a `BlendEngine` (blend.engine.engine imports this module)."""

    lm: LoadedModel
    layout: RequestLayout

    def request(self, query: object, documents: object = (), **kwargs: Any) -> GenerationRequest: ...

    def prefill(self, prompt: Prompt, *, mode: str, ratio: float = ..., capacity: int | None = ...,
                selection: str | None = ...) -> Prefilled: ...


@dataclass(frozen=True)
class Prepared:
    """A prompt prefilled by kvblend, ready for `model.generate(input_ids, past_key_values=...)`."""

    input_ids: torch.Tensor  # (1, T) the prompt's ids; transformers computes the last one
    past_key_values: DynamicCache  # K/V of positions 0..T-2 as kvblend computed them
    logits: torch.Tensor  # (vocab,) kvblend's own logits after the prompt (its first token's)
    stats: RequestStats  # the prefill's (lookups, loads, selection, times)
    bias_carried: bool  # True: a KVBlendCache carries blend's stale-key bias


class KVBlendCache(DynamicCache):
    """A `DynamicCache` that also carries blend's stale-key bias: `bias[layer]` (Hkv, n) float32
    for positions 0..n-1 (None: that layer has none). On each `update` it notes the bias of the
    keys it returns (later positions: 0) for `ATTENTION` to add."""

    def __init__(self, config: Any, bias: Sequence[torch.Tensor | None]):
        super().__init__(config=config)
        self.bias = list(bias)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        bias = self.bias[layer_idx] if layer_idx < len(self.bias) else None
        if bias is not None:
            end = self.layers[layer_idx].get_seq_length()  # positions seen (a sliding layer: all of them)
            start = end - keys.shape[-2]  # the first returned key's position
            lo, hi = max(start, 0), min(end, bias.shape[1])
            if lo < hi:
                row = torch.zeros((keys.shape[1], keys.shape[-2]), dtype=torch.float32, device=keys.device)
                row[:, lo - start:hi - start] = bias[:, lo:hi].to(keys.device)  # (Hkv, K)
                _KEY_BIAS[keys] = row
        return keys, values


def biased_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention call (query (B, H, q, D), key/value (B, Hkv, K, D), the layer's own
    float mask (B, 1, q, K) from `eager_mask`): SDPA with the mask plus the bias a `KVBlendCache`
    noted for these keys. Returns (B, q, H, D) and no weights."""
    if kwargs.get("softcap") is not None:
        raise ValueError(f"the {ATTENTION} attention does not soft-cap attention logits; this model needs it")
    groups = query.shape[1] // key.shape[1]
    if attention_mask is None:  # every key visible up to the query's own position
        q, k = query.shape[2], key.shape[2]
        hidden = torch.ones((q, k), dtype=torch.bool, device=query.device).triu(k - q + 1)
        attention_mask = torch.zeros((q, k), dtype=query.dtype, device=query.device).masked_fill(
            hidden, torch.finfo(query.dtype).min)[None, None]
    elif attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    mask = attention_mask[..., : key.shape[2]]
    bias = _KEY_BIAS.get(key)
    if bias is not None:
        mask = mask + bias.to(query.dtype).repeat_interleave(groups, 0)[None, :, None, :]  # (B, H, q, K)
    k = key.repeat_interleave(groups, 1) if groups > 1 else key
    v = value.repeat_interleave(groups, 1) if groups > 1 else value
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)  # (B, H, q, D)
    return out.transpose(1, 2).contiguous(), None


def use_kvblend_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Register `ATTENTION` with transformers (once) and make it `model`'s attention; returns the
    model. Side effect: the model's config names `ATTENTION` from then on."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, biased_sdpa)
        AttentionMaskInterface.register(ATTENTION, eager_mask)  # a float mask for every layer type
    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)
    return model


def transformers_model(engine: Engine) -> torch.nn.Module:
    """The engine's transformers model (its weights, eval mode) with `ATTENTION` as its attention."""
    return use_kvblend_attention(engine.lm.model)


def to_transformers_cache(cache: KVCache, n: int, config: Any, *, carry_bias: bool = True) -> DynamicCache:
    """Positions 0..n-1 of `cache` as a transformers cache laid out for `config` (a sliding layer
    as transformers' sliding-window layer); with `carry_bias` and a bias on some of those keys, a
    `KVBlendCache` carrying it. ValueError when the config's layers are not the cache's."""
    biases: list[torch.Tensor | None] = [None] * len(cache.k)
    if carry_bias and cache.bias is not None:
        biases = [b[:, :n].clone() if bool(b[:, :n].any()) else None for b in cache.bias]
    out = KVBlendCache(config, biases) if any(b is not None for b in biases) else DynamicCache(config=config)
    if len(out.layers) != len(cache.k):
        raise ValueError(f"the model's config has {len(out.layers)} layers, the cache {len(cache.k)}")
    for i, layer in enumerate(out.layers):
        window = cache.windows[i]
        if layer.is_sliding != (window is not None) or (window is not None and layer.sliding_window != window):
            raise ValueError(f"layer {i}: the model's config says sliding window "
                             f"{getattr(layer, 'sliding_window', None)}, kvblend's cache {window}")
        k, v = cache.window(i, 0, n)  # (Hkv, n, D) each, in position order
        layer.update(k[None].clone(), v[None].clone())  # a sliding layer keeps its last window - 1
    return out


def prepare(engine: Engine, query: str | Sequence[Message | dict], documents: Sequence[Document | str], *,
            mode: str = "blend", recompute_ratio: float | None = None, selection: str | None = None,
            template: PromptTemplate | None = None, carry_bias: bool = True) -> Prepared:
    """The prompt of `query` over `documents` prefilled in `mode` on the engine's scheduler (misses
    computed and stored, as a request would) and handed over (see the module docstring). Arguments
    are checked as `generate` checks them; a prompt that cannot fit the model's positions is
    refused the same way (ValueError saying what to shorten)."""
    if not isinstance(carry_bias, bool):
        raise TypeError(f"carry_bias must be a bool, got {type(carry_bias).__name__}")
    req = engine.request(query, documents, mode=mode, recompute_ratio=recompute_ratio, selection=selection,
                         template=template)
    prompt = engine.layout.checked_prompt(req)
    pre = engine.prefill(prompt, mode=req.mode, ratio=req.recompute_ratio, selection=req.selection)
    model = engine.lm.model
    n = len(prompt) - 1
    past = to_transformers_cache(pre.cache, n, model.config, carry_bias=carry_bias)
    carried = isinstance(past, KVBlendCache)
    if carried:
        use_kvblend_attention(model)
    ids = torch.tensor([prompt.token_ids], dtype=torch.long, device=engine.lm.device)  # (1, T)
    return Prepared(ids, past, pre.logits, pre.stats, carried)
