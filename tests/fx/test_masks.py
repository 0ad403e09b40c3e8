"""Per-key masks (boolean key padding, additive float biases) are served as a key bias, with SDPA's semantics.

Masked keys contribute nothing, any pattern (not only a padded tail); a row whose keys are all masked gives what
SDPA gives (0); a padded call equals the same call on the unpadded keys up to quantization. What masked keys hold
never matters: the lowering zeroes their K and V rows before smoothing (whose mean is over kept keys) and quantizing,
so no scale sees them (issue #43: huge finite values there used to move every scale). Masks that vary per query or head stay dense;
a per-key mask repeated over the heads (diffusers' ``prepare_attention_mask``) is read per key, and so is a
symmetric padding mask ``m_i & m_j`` (HunyuanVideo-1.5), whose masked queries' rows are then set to 0.
"""

import pytest
import torch
import torch.nn.functional as F

import support
import qattn_fx
from qattn_fx import kernels, tiny_models
from qattn_fx.kernels import reference
from qattn_fx.ops import quantized_attention
from qattn_fx.recipes import Recipe
from qattn_fx.spec import DEFAULT_RECIPE


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def compiled(backend, fn=sdpa, **kwargs):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, **kwargs)


def close(out, ref, *, rel=5e-2, cos=0.998):
    """Quantization tolerance of one attention layer read straight out (see test_backend.assert_close_to_dense;
    head_dim 32 and random projections here: measured relative L2 error 2-3.5 %, cosine >= 0.9994)."""
    r = (out - ref).norm() / ref.norm()
    c = F.cosine_similarity(out.flatten().double(), ref.flatten().double(), dim=0)
    assert r < rel and c > cos, (r.item(), c.item())


def qkv(b=2, h=2, sq=40, skv=56, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, sq, d, generator=g), torch.randn(b, h, skv, d, generator=g),
            torch.randn(b, h, skv, d, generator=g))


def padding_mask(b, skv, valid, *, shape="b11s"):
    """``True`` for the first ``valid[i]`` keys of batch element ``i``."""
    m = torch.arange(skv)[None, :] < torch.tensor(valid)[:, None]
    return {"b11s": m[:, None, None, :], "b1s": m[:, None, :], "bs": m}[shape]


@pytest.mark.parametrize("kind", ["bool", "zero-inf", "finite-bias"])
def test_a_padded_call_equals_the_unpadded_call_per_batch_element(kind):
    q, k, v = qkv()
    valid = [31, 56]
    mask = padding_mask(2, 56, valid)
    if kind == "zero-inf":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    elif kind == "finite-bias":  # LTX-Video's (1 - mask) * -10000: masked keys keep a weight of exp(-1e4) = 0
        mask = (1.0 - mask.float()) * -10000.0
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    out = compiled(backend)(q, k, v, mask)
    (site,) = backend.report.sites
    assert site.rewritten, site.reason
    # exactly the eager lowering with the mask
    torch.testing.assert_close(out, quantized_attention(q, k, v, DEFAULT_RECIPE, attn_mask=mask), rtol=0, atol=0)
    for i, n in enumerate(valid):
        unpadded = quantized_attention(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], DEFAULT_RECIPE)
        close(out[i:i + 1], unpadded)
        close(out[i:i + 1], sdpa(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], None))


def test_any_key_pattern_and_the_reference_definition():
    """Scattered masked keys: the reference equals SDPA over the kept keys (up to quantization)."""
    q, k, v = qkv(b=1, skv=64)
    keep = torch.rand(64, generator=torch.Generator().manual_seed(1)) > 0.4
    mask = keep[None, None, None, :]
    out = quantized_attention(q, k, v, DEFAULT_RECIPE, attn_mask=mask)
    close(out, sdpa(q, k[:, :, keep], v[:, :, keep], None))
    close(out, sdpa(q, k, v, mask))


@pytest.mark.parametrize("mask_value", [False, float("-inf")])
def test_a_row_with_every_key_masked_gives_what_sdpa_gives(mask_value):
    q, k, v = qkv()
    mask = torch.ones(2, 1, 1, 56, dtype=torch.bool)
    mask[1] = False
    if mask_value is not False:
        mask = torch.zeros(mask.shape).masked_fill(~mask, mask_value)
    out = compiled(qattn_fx.backend(emulate=True, compiler="aot_eager"))(q, k, v, mask)
    dense = sdpa(q, k, v, mask)
    assert torch.equal(dense[1], torch.zeros_like(dense[1]))
    assert torch.equal(out[1], dense[1])
    close(out[0], dense[0])


@pytest.mark.parametrize("shape", ["1s", "b1s"])
def test_masks_of_other_ranks(shape):
    """SDPA broadcasts a mask from the right: (1, Skv) is per-key; a (2, 1, Skv) mask against batch-1
    operands with 2 heads varies over the heads."""
    q, k, v = qkv(b=1, h=2)
    keep = torch.arange(56) < 30
    mask = {"1s": keep[None], "b1s": torch.stack([keep, ~keep])[:, None]}[shape]
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    out = compiled(backend)(q, k, v, mask)
    (site,) = backend.report.sites
    if shape == "b1s":
        assert not site.rewritten and "varies per query or head" in site.reason
        torch.testing.assert_close(out, sdpa(q, k, v, mask), rtol=0, atol=0)
    else:
        assert site.rewritten, site.reason
        close(out, sdpa(q, k, v, mask))


def test_a_key_mask_broadcast_over_the_batch():
    q, k, v = qkv(b=3)
    mask = padding_mask(1, 56, [40])  # (1, 1, 1, Skv)
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    out = compiled(backend)(q, k, v, mask)
    assert backend.report.sites[0].rewritten
    close(out, sdpa(q, k, v, mask))


def test_a_mask_that_varies_per_query_stays_dense_and_untouched():
    q, k, v = qkv()
    mask = torch.rand(2, 1, 40, 56) > 0.5
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    out = compiled(backend)(q, k, v, mask)
    (site,) = backend.report.sites
    assert site.reason == ("dense: attn_mask is a boolean mask of shape (2, 1, 40, 56) that varies per query or "
                           "head; per-key masks are served")
    torch.testing.assert_close(out, sdpa(q, k, v, mask), rtol=0, atol=0)


def _prepared(q, k, v, bias):
    """diffusers' prepare_attention_mask: a (B, 1, Skv) bias repeated over the heads, then viewed per head."""
    b, h = q.shape[:2]
    mask = bias.repeat_interleave(h, dim=0).view(b, h, -1, bias.shape[-1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("source", [(2, 56), (2, 1, 56), (2, 1, 1, 56)], ids=["2d", "3d", "4d"])
def test_a_mask_repeated_over_the_heads_is_read_per_key(source):
    """prepare_attention_mask's (B, H, 1, Skv) mask: read as its source (a note says so; a 2-D or 3-D source gains
    unit axes, a 4-D one is read as it is), quantized, and equal to the call with the per-key mask itself."""
    q, k, v = qkv(b=2, h=3)
    bias = torch.zeros(source)
    bias[0, ..., 40:] = -10000.0  # LTX-Video's padding bias: (1 - mask) * -10000
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    out = compiled(backend, _prepared)(q, k, v, bias)
    (site,) = backend.report.sites
    assert site.rewritten and site.notes == (
        f"attn_mask (2, 3, 1, 56) repeats a {source} mask over the heads (repeat_interleave + view): read per key "
        "as (2, 1, 1, 56)",)
    assert sum("mask_per_key" in n.name for n in backend.graph_modules[0].graph.nodes) == 4 - len(source)
    per_key = quantized_attention(q, k, v, DEFAULT_RECIPE, attn_mask=bias.view(2, 1, 1, 56))
    torch.testing.assert_close(out, per_key, rtol=0, atol=0)
    close(out, _prepared(q, k, v, bias))


@pytest.mark.parametrize("tile", [
    lambda m, h, sq: m.expand(-1, h, sq, -1),  # Lumina-Next's processor
    lambda m, h, sq: m.expand(-1, 1, sq, -1),
    lambda m, h, sq: m.repeat(1, h, sq, 1),
], ids=["expand-heads-queries", "expand-queries", "repeat"])
def test_a_key_mask_broadcast_over_heads_and_queries_is_read_per_key(tile):
    q, k, v = qkv(b=2, h=3)
    m = torch.ones(2, 56, dtype=torch.int32)
    m[0, 40:] = 0
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(  # noqa: E731
        q, k, v, attn_mask=tile(m.bool().view(2, 1, 1, -1), q.shape[1], q.shape[2]))
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    out = compiled(backend, fn)(q, k, v, m)
    (site,) = backend.report.sites
    assert site.rewritten and len(site.notes) == 1 and site.notes[0].endswith(
        "broadcasts a (2, 1, 1, 56) mask over the heads and queries (expand or repeat): read per key")
    per_key = quantized_attention(q, k, v, DEFAULT_RECIPE, attn_mask=m.bool().view(2, 1, 1, -1))
    torch.testing.assert_close(out, per_key, rtol=0, atol=0)
    close(out, fn(q, k, v, m))


@pytest.mark.parametrize("form", ["repeat_interleave", "expand"])
@pytest.mark.parametrize("cast", [lambda x: x.to(torch.bfloat16), lambda x: x.bfloat16()], ids=["to", "bfloat16"])
def test_a_mask_cast_after_it_is_repeated_is_read_per_key_and_cast_alike(form, cast):
    """``mask.to(query.dtype)`` after the repeat over the heads (or the broadcast over heads and queries): the read
    is the source cast the same way (an fp32 bias rounded to bf16 as SDPA sees it), equal to the per-key call on
    the cast bias."""
    q, k, v = (t.bfloat16() for t in qkv(b=2, h=3))
    bias = torch.randn(2, 56) * 3
    bias[0, 40:] = -10000.0

    def fn(q, k, v, bias):
        mask = (bias.repeat_interleave(3, dim=0).view(2, 3, 1, -1) if form == "repeat_interleave"
                else bias.view(2, 1, 1, -1).expand(-1, 3, 40, -1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=cast(mask))

    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    out = compiled(backend, fn)(q, k, v, bias)
    (site,) = backend.report.sites
    assert site.rewritten and len(site.notes) == 1 and ", then cast to torch.bfloat16: read per key" in site.notes[0]
    assert any(n.name.endswith("mask_per_key_cast") for n in backend.graph_modules[0].graph.nodes)
    per_key = quantized_attention(q, k, v, DEFAULT_RECIPE, attn_mask=bias.bfloat16().view(2, 1, 1, 56))
    torch.testing.assert_close(out, per_key, rtol=0, atol=0)
    close(out.float(), fn(q, k, v, bias).float())


def _tiled_then_written(m):
    key_mask = m.bool().view(2, 1, 1, -1).clone()
    mask = key_mask.repeat(1, 3, 40, 1)
    key_mask[..., 0] = False  # the repeated copy keeps the old values
    return mask


@pytest.mark.parametrize("make", [
    lambda m: (m.bool()[:, None, :40, None] & m.bool()[:, None, None, :]).expand(-1, 3, -1, -1),
    lambda m: m.bool().view(2, 1, 1, -1).expand(-1, 3, 40, -1).masked_fill(torch.eye(40, 56, dtype=torch.bool), 0),
    _tiled_then_written,
], ids=["per-query-source", "changed-after", "source-written"])
def test_other_broadcast_masks_stay_dense(make):
    q, k, v = qkv(b=2, h=3)
    m = torch.ones(2, 56, dtype=torch.int32)
    m[0, 40:] = 0
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=make(m))  # noqa: E731
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    out = compiled(backend, fn)(q, k, v, m)
    (site,) = backend.report.sites
    assert not site.rewritten and "varies per query or head" in site.reason and not site.notes
    torch.testing.assert_close(out, fn(q, k, v, m), rtol=0, atol=0)


@pytest.mark.parametrize("make", [
    lambda bias, b, h: bias.repeat_interleave(h, dim=1).view(b, h, 1, -1),  # repeated along another dim
    lambda bias, b, h: bias.repeat(h, 1, 1).view(b, h, 1, -1),  # tiled, not interleaved
], ids=["dim-1", "tiled"])
def test_other_repeats_of_a_mask_stay_dense(make):
    q, k, v = qkv(b=2, h=3)
    bias = torch.randn(2, 1, 56)
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    fn = lambda q, k, v, bias: F.scaled_dot_product_attention(q, k, v, attn_mask=make(bias, 2, 3))  # noqa: E731
    out = compiled(backend, fn)(q, k, v, bias)
    (site,) = backend.report.sites
    assert not site.rewritten and "varies per query or head" in site.reason and not site.notes
    torch.testing.assert_close(out, fn(q, k, v, bias), rtol=0, atol=0)


def test_a_mask_repeated_over_one_head_is_left_as_it_is():
    q, k, v = qkv(b=2, h=1)
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    compiled(backend, _prepared)(q, k, v, torch.zeros(2, 1, 56))
    (site,) = backend.report.sites
    assert site.rewritten and not site.notes  # (2, 1, 1, 56) is per key already
    assert not any("mask_per_key" in n.name for n in backend.graph_modules[0].graph.nodes)


def test_a_per_query_mask_repeated_over_the_heads_stays_dense():
    q, k, v = qkv(b=2, h=3)
    bias = torch.randn(2, 40, 56)  # varies per query: read per head it still does
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    compiled(backend, _prepared)(q, k, v, bias)
    (site,) = backend.report.sites
    assert site.reason == ("dense: attn_mask is a float bias of shape (2, 3, 40, 56) that varies per query or head; "
                           "per-key biases are served")


def test_masked_lengths_are_symbolic_too():
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    fn = compiled(backend)
    for skv in (56, 77, 130):
        q, k, v = qkv(skv=skv)
        mask = padding_mask(2, skv, [skv - 9, skv])
        torch.testing.assert_close(fn(q, k, v, mask), quantized_attention(q, k, v, DEFAULT_RECIPE, attn_mask=mask),
                                   rtol=0, atol=0)
    assert len(backend.graph_modules) == 2 and all(s.rewritten for s in backend.report.sites)


def _symmetric(m, tile="repeat", op="and", swap=False):
    """HunyuanVideo-1.5's self-attention mask of a (B, S) padding mask: ``m_i & m_j``, as its processor builds it."""
    b, s = m.shape
    row = m.bool().view(b, 1, 1, s)
    tiled = row.repeat(1, 1, s, 1) if tile == "repeat" else row.expand(b, 1, s, s)
    a, t = (tiled.transpose(2, 3), tiled) if swap else (tiled, tiled.transpose(2, 3))
    return (a & t if op == "and" else torch.logical_and(a, t)).bool()


def _symmetric_sdpa(q, k, v, m, tile="repeat", op="and", swap=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_symmetric(m, tile, op, swap))


@pytest.mark.parametrize("form", [dict(), dict(tile="expand"), dict(op="logical_and"), dict(swap=True)],
                         ids=["repeat", "expand", "logical_and", "swapped"])
def test_a_symmetric_padding_mask_is_read_per_key_with_masked_queries_zeroed(form):
    """``m_i & m_j`` of a (B, S) padding mask: read as the key mask ``m`` (a note says so), quantized, equal to the
    call with that key mask whose masked queries' rows are set to 0, which is what SDPA's math kernel gives them."""
    q, k, v = qkv(b=2, h=3, sq=40, skv=40)
    m = torch.ones(2, 40, dtype=torch.int64)
    m[0, 30:] = 0  # a padded tail
    m[1, 5:9] = 0  # a gap
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    fn = lambda q, k, v, m: _symmetric_sdpa(q, k, v, m, **form)  # noqa: E731
    out = compiled(backend, fn)(q, k, v, m)
    (site,) = backend.report.sites
    assert site.rewritten and site.notes == (
        "attn_mask (2, 1, 40, 40) is m_i & m_j of a (2, 1, 1, 40) key mask m (repeat + transpose): read per key, the "
        "rows of masked queries set to 0 (SDPA math's output for them)",)
    key_mask = m.bool()[:, None, None, :]
    per_key = quantized_attention(q, k, v, DEFAULT_RECIPE, attn_mask=key_mask)
    torch.testing.assert_close(out, torch.where(key_mask.transpose(-2, -1), per_key, 0.0), rtol=0, atol=0)
    dense = fn(q, k, v, m)
    assert out[0, :, 30:].eq(0).all() and dense[0, :, 30:].eq(0).all() and out[1, :, 5:9].eq(0).all()
    close(out, dense)


def test_a_symmetric_mask_repeated_over_the_heads_is_read_per_key():
    """HunyuanVideo-1.5's token refiner: ``m_i & m_j`` as a (B, 1, S, S) mask through ``prepare_attention_mask``
    (repeated over the heads, then viewed per head) is read as the key mask ``m``, like the symmetric mask itself."""
    q, k, v = qkv(b=2, h=3, sq=40, skv=40)
    m = torch.ones(2, 40, dtype=torch.int64)
    m[0, 30:] = 0
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    fn = lambda q, k, v, m: _prepared(q, k, v, _symmetric(m))  # noqa: E731
    out = compiled(backend, fn)(q, k, v, m)
    (site,) = backend.report.sites
    assert site.rewritten and site.notes == (
        "attn_mask (2, 3, 40, 40) repeats a (2, 1, 40, 40) mask over the heads (repeat_interleave + view), which is "
        "m_i & m_j of a (2, 1, 1, 40) key mask m (repeat + transpose): read per key, the rows of masked queries set "
        "to 0 (SDPA math's output for them)",)
    key_mask = m.bool()[:, None, None, :]
    per_key = quantized_attention(q, k, v, DEFAULT_RECIPE, attn_mask=key_mask)
    torch.testing.assert_close(out, torch.where(key_mask.transpose(-2, -1), per_key, 0.0), rtol=0, atol=0)
    close(out, fn(q, k, v, m))


def _column_set_mask(m):
    """HunyuanVideo's token refiner: ``m_i & m_j`` with its first column set in place (a masked query sees key 0)."""
    mask = _symmetric(m)
    mask[:, :, :, 0] = True
    return mask


def _column_set(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_column_set_mask(m))


def _bias_written_after_its_repeat(q, k, v, bias):
    mask = bias.repeat_interleave(q.shape[1], dim=0).view(q.shape[0], q.shape[1], -1, bias.shape[-1])
    bias.masked_fill_(bias < 0, 0.0)  # the repeated copy keeps the old values
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("case", ["column-set", "symmetric-repeated-column-set", "source-written"])
def test_a_mask_written_in_place_is_not_read_per_key(case):
    """A read of the source would miss (or see) a write into the mask's chain after it was built: such masks stay
    dense, exactly as SDPA computes them."""
    q, k, v = qkv(b=2, h=3, sq=40, skv=40)
    m = torch.ones(2, 40, dtype=torch.int64)
    m[0, 30:] = 0
    bias = torch.zeros(2, 1, 40)
    bias[0, :, 30:] = -10000.0
    fn, arg = {
        "column-set": (_column_set, m),
        "symmetric-repeated-column-set": (lambda q, k, v, m: _prepared(q, k, v, _column_set_mask(m)), m),
        "source-written": (_bias_written_after_its_repeat, bias),
    }[case]
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    out = compiled(backend, fn)(q, k, v, arg.clone())
    (site,) = backend.report.sites
    assert not site.rewritten and "varies per query or head" in site.reason and not site.notes
    torch.testing.assert_close(out, fn(q, k, v, arg.clone()), rtol=0, atol=0)


def test_symmetric_masks_at_symbolic_lengths():
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    fn = compiled(backend, _symmetric_sdpa)
    for s in (40, 57, 90):
        q, k, v = qkv(sq=s, skv=s)
        m = (torch.arange(s) < s - 7).expand(2, s).to(torch.int64)
        per_key = quantized_attention(q, k, v, DEFAULT_RECIPE, attn_mask=m.bool()[:, None, None, :])
        expected = torch.where(m.bool()[:, None, :, None], per_key, 0.0)
        torch.testing.assert_close(fn(q, k, v, m), expected, rtol=0, atol=0)
    assert len(backend.graph_modules) == 2 and all(s.rewritten for s in backend.report.sites)


@pytest.mark.slow
def test_hunyuan_video_dual_and_single_stream_sites_are_quantized_with_text_padding():
    """HunyuanVideo's joint attention pads the text to a fixed length and masks the padding with a (B, 1, 1, N)
    boolean mask: every dual- and single-stream site is quantized (the token refiner's query×key mask over the
    text stays dense), the compiled model matches the dense one, and no graph breaks."""
    model, inputs = tiny_models.hunyuan_video()
    inputs = dict(inputs)
    inputs["encoder_attention_mask"] = torch.tensor([[1.0] * 7 + [0.0] * 5])  # 7 text tokens, 5 padding
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")  # the rewrite; HunyuanVideo-1.5 runs Inductor
    torch._dynamo.reset()
    with torch.no_grad():
        dense = model(**inputs)[0]
        out = torch.compile(model, backend=backend, fullgraph=True)(**inputs)[0]
    blocks = [s for s in backend.report.sites if "transformer_blocks" in s.module]
    assert len(blocks) == 2 and all(s.rewritten for s in blocks), backend.report
    assert len(backend.graph_modules) == 1
    rel = (out - dense).abs().max() / dense.abs().max()
    assert rel < 1e-2, rel


@pytest.mark.slow
def test_hunyuan_video15_blocks_are_quantized_with_their_symmetric_text_padding_mask():
    """HunyuanVideo-1.5 masks every block's joint attention with ``m_i & m_j`` of its padding mask: each block site
    is quantized, read per key (the note says so), and so is the token refiner's (the same form repeated over the
    heads by ``prepare_attention_mask``); the compiled model matches the dense one."""
    model, inputs = tiny_models.hunyuan_video15()
    backend = qattn_fx.backend(emulate=True)
    torch._dynamo.reset()
    with torch.no_grad():
        dense = model(**inputs)[0]
        out = torch.compile(model, backend=backend)(**inputs)[0]
    blocks = [s for s in backend.report.sites if "token_refiner" not in s.module]
    refiner = [s for s in backend.report.sites if "token_refiner" in s.module]
    assert blocks and all(s.rewritten and "is m_i & m_j of a (1, 1, 1, 151) key mask" in s.notes[0]
               for s in blocks)
    assert refiner and all(s.rewritten and "which is m_i & m_j" in s.notes[0] for s in refiner)
    rel = (out - dense).abs().max() / dense.abs().max()
    cos = F.cosine_similarity(out.flatten(), dense.flatten(), dim=0)
    assert rel < 1e-2 and cos > 0.9999, (rel, cos)


# ------------------------------------------------------------------------------------------------------------------
# what masked keys hold (issue #43, item 2)
# ------------------------------------------------------------------------------------------------------------------

JUNK_RECIPES = {
    "int8-smooth": DEFAULT_RECIPE,
    "int8-raw": Recipe("int8", "fp8", 1, 16, 1, smooth_k=False),
    "int8-64-128-head": Recipe("int8", "fp8", 64, 128, 0, scale_scope="head"),
    "fp8-tensor": Recipe("fp8", "fp8", 0, 0, 0),
    "bf16-pv8": Recipe("bf16", "fp8", 0, 0, 1),
    "mxfp8": Recipe("mxfp8", "mxfp8"),
    "nvfp4": Recipe("nvfp4", "nvfp4"),
}


@pytest.mark.parametrize("mask_form", ["bool", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("recipe", list(JUNK_RECIPES))
def test_what_masked_keys_hold_does_not_change_the_output(recipe, dtype, mask_form):
    """Huge finite K and V in masked keys (6e4 in fp16) used to reach the smooth-K mean and every K/V scale: cos 0.35
    against the same call with zeros there at 6e4 (int8), 0.64 for per-tensor FP8. Now bit-identical."""
    q, k, v, k_junk, v_junk, mask = support.masked_junk(b=2, hq=2, hkv=1, sq=24, skv=50, d=32, dtype=dtype)
    if mask_form == "-inf":
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    recipe = JUNK_RECIPES[recipe]
    clean = quantized_attention(q, k, v, recipe, attn_mask=mask)
    assert torch.equal(quantized_attention(q, k_junk, v_junk, recipe, attn_mask=mask), clean)
    for junk in (1e2, 1e3, 1e4):
        *_, k_junk, v_junk, _ = support.masked_junk(b=2, hq=2, hkv=1, sq=24, skv=50, d=32, dtype=dtype, junk=junk)
        assert torch.equal(quantized_attention(q, k_junk, v_junk, recipe, attn_mask=mask), clean)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_compiled_masked_junk_gives_the_clean_output_close_to_sdpa(dtype):
    q, k, v, k_junk, v_junk, mask = support.masked_junk(b=2, hq=4, hkv=2, sq=40, skv=56, d=32, dtype=dtype)
    backend = qattn_fx.backend(emulate=True, compiler="aot_eager")
    fn = compiled(backend, lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True))
    out = fn(q, k_junk, v_junk, mask)
    assert all(s.rewritten for s in backend.report.sites)
    assert torch.equal(out, fn(q, k, v, mask))
    dense = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    close(out.float(), dense, rel=6e-2)


def test_lse_does_not_depend_on_masked_keys_and_a_finite_bias_masks_nothing():
    """The LSE's smoothing shift (lse_shift) takes the smoothing mean of the kept keys too. A finite bias (-1e4,
    LTX-Video's padding bias) is no mask: its keys are kept, in the mean and in every scale."""
    q, k, v, k_junk, v_junk, mask = support.masked_junk(b=2, hq=2, hkv=2, sq=24, skv=50, d=32, dtype=torch.float32)
    sage = Recipe("int8", "fp8", 1, 16, 1)
    out, lse = quantized_attention(q, k, v, sage, attn_mask=mask, return_lse=True)
    out_junk, lse_junk = quantized_attention(q, k_junk, v_junk, sage, attn_mask=mask, return_lse=True)
    assert torch.equal(out_junk, out) and torch.equal(lse_junk, lse)
    bias = torch.where(mask, 0.0, float("-inf"))
    exact = torch.logsumexp((q @ k.transpose(-1, -2)) * 32 ** -0.5 + bias, dim=-1)
    torch.testing.assert_close(lse, exact, atol=0.05, rtol=0)
    finite = torch.where(mask, 0.0, -1e4)
    k_big = k + 3.0 * (~mask[:, :, 0, :, None])  # the -1e4 keys hold other values: the K mean sees them
    assert not torch.equal(quantized_attention(q, k_big, v, sage, attn_mask=finite),
                           quantized_attention(q, k, v, sage, attn_mask=finite))


def _attention_args(q, k, v, recipe, mask, kernel="reference"):
    """The attention op's arguments the lowering builds for ``kernel`` (the op itself not run)."""
    calls = []

    def emit(target, args, name):
        if name == "attention":
            calls.append(args)
            return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]).transpose(1, 2)
        return target(*args)

    quantized_attention(q, k, v, recipe, kernel=kernel, attn_mask=mask, emit=emit)
    return calls[0]


@pytest.mark.parametrize("kernel", [n for n, i in kernels.KERNELS.items() if i.key_bias])
def test_kernels_that_serve_masks_get_the_same_inputs_whatever_masked_keys_hold(kernel):
    """The CPU side of tests/gpu/test_shapes_and_masks.py's masked-junk test: every kernel that takes a key bias gets
    bit-identical quantized inputs whether masked keys hold junk or zeros; the reference kernel and the kernels'
    tile loop (emulation) on them agree with fp32 SDPA over the kept keys."""
    q, k, v, k_junk, v_junk, mask = support.masked_junk(b=2, hq=4, hkv=2, sq=40, skv=150, d=64, dtype=torch.float16)
    recipe = Recipe("int8", "fp8", 1, 16, 1)
    clean = _attention_args(q, k, v, recipe, mask, kernel)
    for a, b in zip(_attention_args(q, k_junk, v_junk, recipe, mask, kernel), clean):
        assert (a == b) if not isinstance(a, torch.Tensor) else (
            a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            if a.element_size() == 1 else torch.equal(a, b))
    qd, qs, kd, ks, vd, vs, qb, kb, sm_scale, out_dtype, _, key_bias, _ = clean
    if qs is None:  # the kernel quantizes Q itself: the reference gets the graph's Q pass
        qd, qs = torch.ops.qattn.quantize_per_block(qd, qb, torch.int8)
    dense = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    ref = reference.scaled_attention(qd, qs, kd, ks, vd, vs, qb, kb, sm_scale, torch.float32, key_bias=key_bias)
    close(ref, dense)
    emulated = support.emulate(qd, qs, kd, ks, vd, vs, qb, kb, sm_scale, 128, key_bias=key_bias)
    close(emulated.float(), dense)


@pytest.mark.parametrize("q_block", [1, 16])
def test_a_symmetric_mask_ignores_what_masked_tokens_hold(q_block):
    """``m_i & m_j``: masked tokens are keys and queries. Junk in their Q, K and V changes nothing: masked keys are
    zeroed before K/V quantization, masked queries' Q before a Q scale spanning several tokens reads it (q_block 16;
    per-token Q scales need nothing), and their output rows are set to 0."""
    q, k, v = qkv(b=2, h=2, sq=40, skv=40)
    m = torch.ones(2, 40, dtype=torch.int64)
    m[0, 30:] = 0
    m[1, 5:9] = 0
    gone = ~m.bool()[:, None, :, None]
    spec = qattn_fx.Spec.from_dict({"default": {"backend": "REFERENCE", "recipe": {
        "qk_dtype": "int8", "v_dtype": "fp8", "q_block_size": q_block, "k_block_size": 16, "v_block_size": 1}}})
    backend = qattn_fx.backend(spec, emulate=True, compiler="aot_eager")
    fn = compiled(backend, lambda q, k, v, m: _symmetric_sdpa(q, k, v, m))
    clean = fn(q, k, v, m)
    assert backend.report.sites[0].rewritten, backend.report.sites[0].reason
    junk = fn(q.masked_fill(gone, 1e30), k.masked_fill(gone, 1e30), v.masked_fill(gone, -1e30), m)
    assert torch.equal(junk, clean)
    close(clean, _symmetric_sdpa(q, k, v, m))
