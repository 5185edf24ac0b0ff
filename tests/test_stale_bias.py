"""The corrections of the K/V blend leaves stale: the logit correction (`stale_bias`):
biased attention against an explicit softmax, the estimator, the cache's bias through
writes and decoding, and which rows blend biases; the mean K/V offset (`stale_shift`): what
it adds and where; teacher-forced log-probs (`follow`) against decoding's own (`logprobs`)."""

from __future__ import annotations

import math

import pytest
import torch

from blend.config import EngineConfig
from blend.model.attention import AttentionPlan, biased_attention, build_plan, causal_float_masks, run_plan
from blend.model.cache import KVCache
from blend.model.runner import Runner
from blend.recompute.selector import SELECTIONS, stale_key_bias
from blend.recompute.stale import MIN_SHIFT_ROWS, StaleKeys, shift_applies
from tests.models import tiny_model
from tests.test_engine import DOCS, QUESTION, make_engine, maxdiff


def _reference(q, k, v, pos, bias, scale):
    """Explicit softmax: q (H, Tq, D) at positions pos over k, v (Hkv, Tk, D), bias (Hkv, Tk)."""
    heads, hkv = q.shape[0], k.shape[0]
    g = heads // hkv
    kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    scores = q @ kk.transpose(1, 2) * scale + bias.repeat_interleave(g, 0)[:, None, :]  # (H, Tq, Tk)
    scores.masked_fill_(torch.arange(k.shape[1])[None, None, :] > pos[None, :, None], float("-inf"))
    return (torch.softmax(scores, -1) @ vv).transpose(0, 1).reshape(q.shape[1], -1)  # (Tq, H*D)


@pytest.mark.parametrize("rows", ["scattered", "tail", "one"])
def test_biased_attention_equals_explicit_softmax(rows):
    torch.manual_seed(0)
    heads, hkv, d, tk = 6, 2, 16, 300
    pos = {"scattered": torch.tensor([3, 40, 41, 77, 150, 151, 152, 260, 299]),
           "tail": torch.arange(270, 300), "one": torch.tensor([299])}[rows]
    q, k, v = torch.randn(heads, pos.numel(), d), torch.randn(hkv, tk, d), torch.randn(hkv, tk, d)
    bias = torch.randn(hkv, tk)
    scale = d ** -0.5
    plan = AttentionPlan("all", 1, tk) if rows == "one" else build_plan("groups/3", pos, tk, 1, torch.device("cpu"))
    out = biased_attention(q, k, v, bias, scale, plan, causal_float_masks(plan, q.dtype))
    assert maxdiff(out, _reference(q, k, v, pos, bias, scale)) < 1e-5
    zero = biased_attention(q, k, v, torch.zeros(hkv, tk), scale, plan, causal_float_masks(plan, q.dtype))
    unbiased = run_plan(plan, q, k, v, scale)
    assert maxdiff(zero, unbiased) < 1e-5 and maxdiff(out, unbiased) > 1e-2  # the bias is applied


def test_biased_attention_refuses_a_folded_plan():
    plan = build_plan("groups/fold3", torch.arange(5, 10), 10, 3, torch.device("cpu"))
    with pytest.raises(ValueError, match="unfolded groups"):
        biased_attention(torch.zeros(3, 5, 4), torch.zeros(1, 10, 4), torch.zeros(1, 10, 4), torch.zeros(1, 10),
                         1.0, plan, causal_float_masks(plan, torch.float32))


def test_stale_key_bias_recovers_a_constant_score_offset():
    torch.manual_seed(1)
    heads, hkv, d, s = 4, 2, 8, 12
    scale = d ** -0.5
    u = torch.randn(hkv, d)  # every query row of kv head h points along u[h]
    q = u.repeat_interleave(heads // hkv, 0)[:, None, :].expand(heads, 5, d).clone()  # (H, Q, D)
    fresh = torch.randn(hkv, s, d)
    offset = torch.tensor([0.7, -0.3])
    stale = fresh + (offset / (scale * (u * u).sum(-1)))[:, None, None] * u[:, None, :]  # q.k shifts by offset
    assert maxdiff(stale_key_bias(q, fresh, stale, scale), offset) < 1e-5
    assert maxdiff(stale_key_bias(q, fresh, fresh, scale), torch.zeros(hkv)) == 0.0
    assert stale_key_bias(q, fresh[:, :0], stale[:, :0], scale).tolist() == [0.0, 0.0]


def test_cache_bias_is_cleared_where_kv_is_written_and_survives_growth():
    cache = KVCache(2, 2, 4, 10, torch.float32, torch.device("cpu"))
    assert cache.layer_bias(0, 10) is None
    cache.set_bias(1, torch.tensor([2, 3, 7]), torch.tensor([-0.5, -1.0]))
    assert cache.layer_bias(0, 10).abs().sum() == 0
    assert cache.layer_bias(1, 10)[:, 3].tolist() == [-0.5, -1.0]
    cache.write(1, torch.tensor([3]), torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), 10)  # computed afresh
    assert cache.layer_bias(1, 10)[:, 3].tolist() == [0.0, 0.0] and cache.layer_bias(1, 10)[:, 2].tolist() == [-0.5, -1.0]
    cache.length = 10
    cache.ensure_capacity(30)
    assert cache.layer_bias(1, 30).shape == (2, 30) and cache.layer_bias(1, 30)[:, 7].tolist() == [-0.5, -1.0]
    assert cache.layer_bias(1, 30)[:, 10:].abs().sum() == 0
    cache.clear_bias(0, 8)
    assert cache.layer_bias(1, 30).abs().sum() == 0


def test_decoding_applies_the_cache_bias():
    """A key biased far down gets no weight: whatever its K/V hold, the next token's logits
    stay the same; unbiased, the same change moves them."""
    torch.manual_seed(2)
    runner = Runner(tiny_model())
    ids = torch.randint(0, 1000, (40,))

    def continuation(junk_seed: int, bias: float) -> torch.Tensor:
        cache = runner.new_cache(48)
        runner.prefill(ids, cache)
        gen = torch.Generator().manual_seed(junk_seed)
        rows = torch.arange(10, 20)
        for layer in range(runner.num_layers):
            cache.k[layer][:, rows] = torch.randn(cache.k[layer][:, rows].shape, generator=gen) * 3
            cache.v[layer][:, rows] = torch.randn(cache.v[layer][:, rows].shape, generator=gen) * 3
            cache.set_bias(layer, rows, torch.full((runner.kv_heads,), bias))
        return runner.prefill(torch.tensor([5, 6]), cache, start=40)[0]

    assert maxdiff(continuation(0, -80.0), continuation(1, -80.0)) < 1e-4
    assert maxdiff(continuation(0, 0.0), continuation(1, 0.0)) > 1e-2


@pytest.mark.parametrize("selection", SELECTIONS)
def test_blend_biases_exactly_the_stale_rows(selection):
    with make_engine(chunk_tokens=16, selection=selection) as engine, \
            make_engine(chunk_tokens=16, selection=selection, stale_bias=False) as plain:
        engine.ingest(DOCS)
        plain.ingest(DOCS)
        prompt = engine.build_prompt(QUESTION, DOCS)
        pre = engine.prefill(prompt, mode="blend", ratio=0.3)
        off = plain.prefill(prompt, mode="blend", ratio=0.3)
        reuse = engine.prefill(prompt, mode="blend", ratio=0.0)
        whole = engine.prefill(prompt, mode="blend", ratio=1.0)
    assert off.cache.bias is None and reuse.cache.bias is None and whole.cache.bias is None
    assert set(off.stats.selection.key_bias) <= {0.0}
    n = len(prompt)
    cand = torch.zeros(n, dtype=torch.bool)
    cand[prompt.documents[1].start:prompt.query.start] = True  # system layout: the first document is exact
    stale = cand.clone()
    stale[pre.stats.selection.selected_rows[-1]] = False
    biased_layers = 0
    for layer, mean in enumerate(pre.stats.selection.key_bias):
        bias = pre.cache.layer_bias(layer, n)  # (Hkv, N)
        assert bias[:, ~stale].abs().sum() == 0  # exact, recomputed and query rows: unbiased
        per_head = bias[:, stale]
        assert torch.equal(per_head, per_head[:, :1].expand_as(per_head))  # one value per head and layer
        assert math.isclose(float(-per_head[:, 0].mean()), mean, rel_tol=1e-5, abs_tol=1e-6)
        biased_layers += bool(per_head.abs().sum() > 0)
    if selection == "query":
        assert biased_layers >= engine.runner.num_layers - 1  # every layer (layer 0's keys can match exactly)
    else:  # from the layer after the check layer on
        assert biased_layers >= 1 and set(pre.stats.selection.key_bias[:2]) == {0.0}
    assert pre.stats.to_dict()["stale_key_bias"] == [round(b, 4) for b in pre.stats.selection.key_bias]


def _rotated(offset: torch.Tensor, rows: torch.Tensor, runner: Runner) -> torch.Tensor:
    """offset (Hkv, 1, D), as at position 0, moved to each position of rows (R,): (Hkv, R, D)."""
    return runner.rerotate(offset.expand(-1, rows.numel(), -1).contiguous(), rows)


@pytest.mark.parametrize("recomputed_rows", [MIN_SHIFT_ROWS + 4, MIN_SHIFT_ROWS - 1])
def test_stale_shift_adds_the_recomputed_rows_mean_offset_to_the_stale_rows(recomputed_rows):
    """Fresh K/V = loaded + one offset per head (keys: the offset rotated to each position):
    the stale rows get exactly that offset, nothing else changes, and the shifted keys leave
    no excess attention for the bias to take off. Too few recomputed rows: no shift."""
    torch.manual_seed(3)
    runner = Runner(tiny_model())
    n, hkv, d = 60, runner.kv_heads, runner.head_dim
    cache = runner.new_cache(n)
    cache.length = n
    cache.k[0][:, :n], cache.v[0][:, :n] = torch.randn(hkv, n, d), torch.randn(hkv, n, d)
    before_k, before_v = cache.k[0][:, :n].clone(), cache.v[0][:, :n].clone()
    recomputed = torch.arange(10, 10 + recomputed_rows)
    stale_rows = torch.arange(10 + recomputed_rows, 50)
    stale = StaleKeys(torch.arange(10, 50), n, torch.device("cpu"), enabled=True, shift=True)
    stale.update(torch.cat([recomputed, torch.arange(50, n)]))  # active: the recomputed and query rows
    assert torch.equal(stale.rows, stale_rows)
    off_k, off_v = torch.randn(hkv, 1, d), torch.randn(hkv, 1, d)
    fresh_k = before_k[:, recomputed] + _rotated(off_k, recomputed, runner)
    fresh_v = before_v[:, recomputed] + off_v
    stale.correct(runner, cache, 0, torch.randn(runner.num_heads, 10, d), fresh_k, fresh_v, recomputed)
    others = torch.ones(n, dtype=torch.bool)
    others[stale_rows] = False
    assert torch.equal(cache.k[0][:, others], before_k[:, others])
    assert torch.equal(cache.v[0][:, others], before_v[:, others])
    if recomputed_rows < MIN_SHIFT_ROWS:
        assert torch.equal(cache.k[0][:, :n], before_k) and torch.equal(cache.v[0][:, :n], before_v)
        assert abs(stale.per_layer()[0]) > 1e-3  # the bias alone still corrects
        return
    assert maxdiff(cache.v[0][:, stale_rows], before_v[:, stale_rows] + off_v) < 1e-5
    assert maxdiff(cache.k[0][:, stale_rows], before_k[:, stale_rows] + _rotated(off_k, stale_rows, runner)) < 1e-5
    assert abs(stale.per_layer()[0]) < 1e-5  # shifted loaded keys == fresh keys: nothing left to bias


@pytest.mark.parametrize("selection", ["query", "deviation"])
def test_blend_shifts_only_the_stale_rows_by_one_offset_per_layer_and_head(selection):
    with make_engine(chunk_tokens=16, selection=selection, stale_bias=False, stale_shift="on") as engine, \
            make_engine(chunk_tokens=16, selection=selection, stale_bias=False, stale_shift="off") as plain:
        engine.ingest(DOCS)
        plain.ingest(DOCS)
        prompt = engine.build_prompt(QUESTION, DOCS)
        pre = engine.prefill(prompt, mode="blend", ratio=0.3)
        off = plain.prefill(prompt, mode="blend", ratio=0.3)
        ends = [engine.prefill(prompt, mode="blend", ratio=r).cache for r in (0.0, 1.0)]
        plain_ends = [plain.prefill(prompt, mode="blend", ratio=r).cache for r in (0.0, 1.0)]
    n = len(prompt)
    for shifted, unshifted in zip(ends, plain_ends, strict=True):  # reuse and ratio 1: nothing to shift
        assert all(torch.equal(a[:, :n], b[:, :n]) for a, b in zip(shifted.k + shifted.v, unshifted.k + unshifted.v, strict=True))
    exact = prompt.documents[1].start  # system layout: the system part and the first document are exact
    stale = torch.zeros(n, dtype=torch.bool)
    stale[exact:prompt.query.start] = True
    stale[pre.stats.selection.selected_rows[-1]] = False
    rows = stale.nonzero().flatten()
    first = 0 if selection == "query" else engine.config.engine.blend.selection.check_layers[-1] + 1  # stale from this layer on
    shifted_layers = 0
    for layer in range(engine.runner.num_layers):
        k, v = pre.cache.layer(layer, n)
        k0, v0 = off.cache.layer(layer, n)
        assert torch.equal(k[:, :exact], k0[:, :exact]) and torch.equal(v[:, :exact], v0[:, :exact])
        dv = v[:, rows] - v0[:, rows]  # (Hkv, S, D)
        dk = engine.runner.rerotate(k[:, rows] - k0[:, rows], -rows)  # un-rotated
        assert maxdiff(dv, dv[:, :1].expand_as(dv)) < 1e-5 and maxdiff(dk, dk[:, :1].expand_as(dk)) < 1e-5
        if layer < first:
            assert float(dv.abs().max()) == 0.0
        shifted_layers += bool(dv.abs().max() > 1e-4)
    assert shifted_layers >= engine.runner.num_layers - first - 1  # layer 0's K/V can match exactly


def test_stale_shift_auto_leaves_out_the_deviation_rule_and_reads_yaml_switches():
    assert [shift_applies("auto", p) for p in SELECTIONS] == [p != "deviation" for p in SELECTIONS]
    assert all(shift_applies("on", p) for p in SELECTIONS) and not any(shift_applies("off", p) for p in SELECTIONS)
    cfg = EngineConfig()
    assert cfg.engine.blend.selection.stale_shift == "auto"
    assert cfg.with_overrides(stale_shift=True).engine.blend.selection.stale_shift == "on"
    assert cfg.with_overrides(stale_shift=False).engine.blend.selection.stale_shift == "off"
    with pytest.raises(ValueError, match="stale_shift"):
        cfg.with_overrides(stale_shift="sometimes")
    with make_engine(chunk_tokens=16, stale_bias=False) as auto, \
            make_engine(chunk_tokens=16, stale_bias=False, stale_shift="off") as off:
        for engine in (auto, off):
            engine.ingest(DOCS)
        prompt = auto.build_prompt(QUESTION, DOCS)
        for selection, moved in (("deviation", False), ("query", True)):
            a = auto.prefill(prompt, mode="blend", ratio=0.3, selection=selection).cache
            b = off.prefill(prompt, mode="blend", ratio=0.3, selection=selection).cache
            same = all(torch.equal(x[:, :len(prompt)], y[:, :len(prompt)]) for x, y in zip(a.v, b.v, strict=True))
            assert same != moved, selection


def test_follow_logprobs_equal_decoding_logprobs():
    """Teacher-forcing full prefill's own answer reproduces its decoding distributions."""
    with make_engine() as engine:
        engine.ingest(DOCS)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=6, logprobs=True)
        again = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=2, follow=full.token_ids)
        blend = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.3, max_new_tokens=2,
                                follow=full.token_ids)
        with pytest.raises(TypeError, match="follow must be"):
            engine.generate(QUESTION, DOCS, mode="full", follow="abc")
        with pytest.raises(TypeError, match="follow must be"):
            engine.generate(QUESTION, DOCS, mode="full", follow=[10 ** 9])
    assert full.token_logprobs.shape == (len(full.token_ids), full.first_token_logprobs.shape[0])
    assert maxdiff(full.token_logprobs[0], full.first_token_logprobs) == 0.0
    assert maxdiff(again.follow_logprobs, full.token_logprobs) < 1e-4
    assert blend.follow_logprobs.shape == full.token_logprobs.shape and full.follow_logprobs is None
