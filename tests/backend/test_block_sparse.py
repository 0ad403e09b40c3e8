"""Block sparsity through the compile pass (CPU, reference kernel): the predictor's lists reach the attention op,
``top_k=1`` changes no bit, a step schedule compiles once and runs dense early, masks, GQA and Skip-Softmax compose,
and the report and the debug dumps say what each site skipped."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import qattn_fx
import qattn_fx.ops  # noqa: F401  (registers qattn::*)
from benchmarks.common import local_qkv
from qattn_fx import AttentionSpec, BlockSparse, Recipe, SkipSoftmax, Spec, block_sparse, skip_softmax
from qattn_fx.kernels.predict_blocks import reference as predictor

ops = torch.ops.qattn
SAGE = Recipe("int8", "fp8", 1, 16, 1)
D = 64


class Attention(torch.nn.Module):
    """SDPA of its inputs (a mask and GQA as given), scaled by a function of the timestep (so the timestep is a
    graph input, as a DiT's modulation reads it)."""

    def forward(self, q, k, v, timestep, mask=None, gqa=False):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return out * (1.0 + 0.0 * timestep.float().mean())


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every compile here is of ``Attention.forward``: each test starts below Dynamo's recompile limit for it."""
    torch._dynamo.reset()


def _inputs(sq=512, skv=640, h=2, hkv=None, seed=0):
    q, k, v = local_qkv(1, h, sq, skv, D, width=60.0, sink=4, seed=seed, device="cpu")
    if hkv is not None:
        k, v = k[:, :hkv], v[:, :hkv]
    return q.float(), k.float(), v.float()


def _compiled(bs: BlockSparse | None, skip: SkipSoftmax | None = None, **kwargs):
    backend = qattn_fx.backend(Spec(default=AttentionSpec(recipe=SAGE, block_sparse=bs, skip_softmax=skip)),
                               emulate=True, compiler="eager", **kwargs)
    return torch.compile(Attention(), backend=backend), backend


def _nodes(backend, name: str) -> list:
    return [n for gm in backend.graph_modules for n in gm.graph.nodes if name in str(n.target)]


def _direct(q, k, v, index, count, key_bias=None, skip=None):
    """The reference kernel called directly on the recipe's quantized operands with the given block lists."""
    sm_scale = 1.0 / math.sqrt(D)
    ks = ops.smooth_k(k) if key_bias is None else ops.smooth_k(k, key_bias)
    q_data, q_scale = ops.quantize_per_block(q, 1, torch.int8)
    k_data, k_scale = ops.quantize_per_block(ks, 16, torch.int8)
    v_in = v if key_bias is None else ops.mask_keys(v, key_bias)
    v_data, v_scale = ops.quantize_per_channel(v_in, torch.float8_e4m3fn, False)
    return ops.scaled_attention(q_data, q_scale, k_data, k_scale, v_data, v_scale, 1, 16, sm_scale, q.dtype,
                                "reference", key_bias, None, skip, "", index, count)


def test_top_k_one_changes_no_bit():
    q, k, v = _inputs()
    t = torch.tensor([500.0])
    plain, _ = _compiled(None)
    full, backend = _compiled(BlockSparse(top_k=1.0))
    with block_sparse.measure() as measured:
        out = full(q, k, v, t)
    assert torch.equal(out, plain(q, k, v, t))
    assert measured.sites["sdpa"].skipped == 0 and measured.sites["sdpa"].tiles == 2 * 4 * 5
    (predict,) = _nodes(backend, "predict_blocks")
    (attention,) = _nodes(backend, "scaled_attention")
    assert attention.args[-2:] == (predict.next, predict.next.next)  # block_index, block_count


def test_top_k_half_runs_the_predicted_lists():
    q, k, v = _inputs()
    bs = BlockSparse(top_k=0.5, similarity=0.0)
    model, backend = _compiled(bs)
    with block_sparse.measure() as measured:
        out = model(q, k, v, torch.tensor([500.0]))
    blocks = predictor.predict(q, k, None, 1.0 / math.sqrt(D), 0.5, "top_k", 1, True, 0.0)
    assert torch.equal(out, _direct(q, k, v, *blocks))
    assert measured.sites["sdpa"].skipped == blocks.total - blocks.visited > 0
    plain, _ = _compiled(None)
    dense = plain(q, k, v, torch.tensor([500.0]))
    assert not torch.equal(out, dense)
    assert F.cosine_similarity(out.flatten(), dense.flatten(), dim=0) > 0.99  # local attention: little is lost
    # the predictor reads the canonical, unquantized q and k (graph inputs here), before any quantize node
    (predict,) = _nodes(backend, "predict_blocks")
    assert [a.op for a in predict.args[:2]] == ["placeholder", "placeholder"]
    assert predict.args[5:] == (predict.args[5], "top_k", 1, True, 0.0, "sdpa")
    assert "block_keep" in str(predict.args[5].target)


@pytest.mark.slow
def test_step_schedule_compiles_once_and_is_dense_early():
    q, k, v = _inputs()
    until = 0.6
    gated, backend = _compiled(BlockSparse(cdf=0.5, similarity=0.0, disabled_until_timestep=until))
    dense, _ = _compiled(BlockSparse(top_k=1.0, similarity=0.0))
    always, _ = _compiled(BlockSparse(cdf=0.5, similarity=0.0))
    timesteps = torch.linspace(999, 0, 50).round()
    skipped = []
    with block_sparse.measure() as measured:
        for i, t in enumerate(timesteps):
            step = t.reshape(1)
            before = measured.sites["sdpa"].skipped if "sdpa" in measured.sites else 0
            with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
                out = gated(q, k, v, step)
            skipped.append(measured.sites["sdpa"].skipped - before)
            if t / 1000 > until:
                assert torch.equal(out, dense(q, k, v, step)), int(t)
            else:
                assert torch.equal(out, always(q, k, v, step)), int(t)
    assert len(backend.graph_modules) == 1
    early = [s for s, t in zip(skipped, timesteps) if t / 1000 > until]
    late = [s for s, t in zip(skipped, timesteps) if t / 1000 <= until]
    assert early and set(early) == {0} and late and min(late) > 0


def test_a_gated_site_without_a_timestep_input_names_the_key():
    class NoTimestep(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    spec = Spec(default=AttentionSpec(recipe=SAGE, block_sparse=BlockSparse(cdf=0.9, disabled_until_timestep=0.5)))
    q, k, v = _inputs(256, 256)
    with pytest.raises(Exception, match=r"block_sparse.disabled_until_timestep=0.5 at .* needs the denoising "
                                        r"timestep in the compiled graph"):
        torch.compile(NoTimestep(), backend=qattn_fx.backend(spec, emulate=True, compiler="eager"))(q, k, v)


def test_key_padding_mask_and_skip_softmax_compose():
    q, k, v = _inputs()
    mask = torch.ones(1, 1, 1, 640, dtype=torch.bool)
    mask[..., 380:] = False  # key tiles 3 and 4 hold no kept key (tile 2 holds some)
    bs, skip = BlockSparse(top_k=0.75, similarity=0.0), SkipSoftmax(threshold=0.01)
    model, backend = _compiled(bs, skip)
    t = torch.tensor([100.0])
    with block_sparse.measure() as blocks_measured, skip_softmax.measure() as tiles_measured:
        out = model(q, k, v, t, mask)
    key_bias = ops.key_bias(mask, k)
    blocks = predictor.predict(q, k, key_bias, 1.0 / math.sqrt(D), 0.75, "top_k", 1, True, 0.0)
    assert not block_sparse.to_mask(blocks)[..., 3:].any()  # empty key tiles are never visited
    lam = ops.skip_threshold(k, 0.01, 0.0, None, 0.0, 1000.0)
    assert torch.equal(out, _direct(q, k, v, *blocks, key_bias=key_bias, skip=lam))
    assert blocks_measured.sites["sdpa"].skipped == blocks.total - blocks.visited
    assert "sdpa" in tiles_measured.sites
    (predict,) = _nodes(backend, "predict_blocks")
    assert "key_bias" in predict.args[2].name
    (site,) = backend.report.sites
    assert site.skip_short == "skip 0.01" and site.block_short == "bs top_k 0.75"


def test_gqa_predictor_takes_the_key_heads():
    q, k, v = _inputs(h=4, hkv=2)
    model, backend = _compiled(BlockSparse(top_k=0.5, similarity=0.0))
    out = model(q, k, v, torch.tensor([1.0]), None, True)
    (predict,) = _nodes(backend, "predict_blocks")
    assert predict.args[1].meta["example_value"].shape[1] == 2  # K's own heads, not repeated
    blocks = predictor.predict(q, k, None, 1.0 / math.sqrt(D), 0.5, "top_k", 1, True, 0.0)
    assert blocks.index.shape[1] == 4
    assert torch.equal(out, _direct(q, k, v, *blocks))


def test_report_and_dumps_show_the_setting_and_the_measured_block_sparsity(tmp_path):
    q, k, v = _inputs()
    model, backend = _compiled(BlockSparse(top_k=0.5, similarity=0.0), debug_dir=tmp_path)
    with block_sparse.measure() as measured:
        model(q, k, v, torch.tensor([1.0]))
    report = backend.record_block_sparsity(measured)
    (site,) = report.to_dict()["sites"]
    assert site["block_sparse"] == "block-sparse top_k 0.5, sinks 1, diag, no sim guard"
    assert site["block_sparsity"] == measured.sites["sdpa"].sparsity > 0
    assert site["skip_softmax"] is None and site["sparsity"] is None
    text = str(report)
    assert "int8 1/16, fp8/ch, bs top_k 0.5" in text
    assert f"skipped {100 * measured.sites['sdpa'].sparsity:.1f}% of blocks" in text
    dump = json.loads((tmp_path / "block_sparsity.json").read_text())
    assert dump["sdpa"]["block_sparse"] == site["block_sparse"]
    assert dump["sdpa"]["skipped"] == measured.sites["sdpa"].skipped and dump["sdpa"]["calls"] == 1


def test_explain_says_what_each_site_skips():
    class TwoSites(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn1, self.attn2 = Attention(), Attention()

        def forward(self, q, k, v, timestep):
            return self.attn2(self.attn1(q, k, v, timestep), k, v, timestep)

    spec = {"default": {"recipe": SAGE.to_dict()},
            "rules": [{"match": {"module": "attn1"}, "use": {"recipe": SAGE.to_dict(),
                                                             "block_sparse": {"cdf": 0.9}}}]}
    q, k, v = _inputs(256, 256)
    report = qattn_fx.explain(TwoSites(), q, k, v, torch.tensor([1.0]), spec=spec, emulate=True)
    by_module = {s.module: s for s in report.sites}
    assert by_module["attn1"].block_sparse == "block-sparse cdf 0.9, sinks 1, diag, sim 0.6"
    assert by_module["attn2"].block_sparse is None  # auto never adds it where not asked
    assert "bs cdf 0.9" in str(report)


def test_eager_lowering_checks_what_it_is_given():
    q, k, v = _inputs(256, 256)
    bs = BlockSparse(cdf=0.9)
    with pytest.raises(ValueError, match=r"block_sparse needs a recipe of the scaled family"):
        qattn_fx.quantized_attention(q, k, v, Recipe("mxfp8", "mxfp8"), block_sparse=bs)
    with pytest.raises(ValueError, match=r"return_lse=True with block_sparse is not served"):
        qattn_fx.quantized_attention(q, k, v, SAGE, block_sparse=bs, return_lse=True)
    with pytest.raises(ValueError, match=r"needs a calibration that turns it into a cdf or top_k"):
        qattn_fx.quantized_attention(q, k, v, SAGE, block_sparse=BlockSparse(target_sparsity=0.5))
    with pytest.raises(ValueError, match=r"block_sparse.disabled_until_timestep=0.5 needs the denoising timestep"):
        qattn_fx.quantized_attention(q, k, v, SAGE, block_sparse=BlockSparse(cdf=0.9, disabled_until_timestep=0.5))
    no_lists = [n for n, i in qattn_fx.kernels.KERNELS.items() if not i.block_sparse and i.scaled]
    if no_lists:
        with pytest.raises(ValueError, match=rf"kernel '{no_lists[0]}' takes no block lists"):
            qattn_fx.quantized_attention(q, k, v, SAGE, kernel=no_lists[0], block_sparse=bs)
    eager = qattn_fx.quantized_attention(q, k, v, SAGE, block_sparse=BlockSparse(top_k=1.0))
    assert torch.equal(eager, qattn_fx.quantized_attention(q, k, v, SAGE))


def test_block_keep_is_the_keep_or_one_while_the_timestep_is_above_the_gate():
    k = torch.zeros(1, 2, 10, 8)
    assert ops.block_keep(k, 0.7, None, 0.0, 1000.0).tolist() == pytest.approx([0.7])
    got = [ops.block_keep(k, 0.7, torch.tensor([t]), 0.9, 1000.0).item() for t in (999, 901, 900, 10)]
    assert got == pytest.approx([1.0, 1.0, 0.7, 0.7])


@pytest.mark.slow
def test_inductor_compiles_the_gated_site_once():
    q, k, v = _inputs(256, 384)
    spec = Spec(default=AttentionSpec(recipe=SAGE, block_sparse=BlockSparse(top_k=0.5, similarity=0.0,
                                                                            disabled_until_timestep=0.5)))
    backend = qattn_fx.backend(spec, emulate=True)
    model = torch.compile(Attention(), backend=backend, fullgraph=True)
    with torch.no_grad(), block_sparse.measure() as measured:
        model(q, k, v, torch.tensor([999.0]))
        with torch.compiler.set_stance("fail_on_recompile"):
            for t in (700.0, 400.0, 100.0):
                model(q, k, v, torch.tensor([t]))
    assert len(backend.graph_modules) == 1 and measured.sites["sdpa"].calls == 4
    assert 0 < measured.sites["sdpa"].skipped


def test_masked_queries_of_a_symmetric_mask_reach_no_block_list():
    """A symmetric padding mask (``m_i & m_j``, built in the graph as HunyuanVideo-1.5 does): what masked queries
    hold moves neither the predictor's pooled query tiles nor any kept query's output (the pass zeroes their Q before
    the predictor and their rows after)."""
    q, k, v = _inputs(sq=512, skv=512)
    m = torch.ones(1, 512, dtype=torch.bool)
    m[0, 200:300] = False  # a gap across query tiles 1 and 2
    junk = q.clone()
    junk[:, :, 200:300] = 1e4 * torch.randn_like(junk[:, :, 200:300])

    def symmetric(q, k, v, m):
        row = m.view(1, 1, 1, 512).repeat(1, 1, 512, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=row & row.transpose(2, 3))

    backend = qattn_fx.backend(Spec(default=AttentionSpec(recipe=SAGE, block_sparse=BlockSparse(
        top_k=0.5, sink_tiles=0, diagonal=False, similarity=0.0))), emulate=True, compiler="eager")
    fn = torch.compile(symmetric, backend=backend)
    with torch.no_grad():
        clean, dirty = fn(q, k, v, m), fn(junk, k, v, m)
    assert [s.rewritten for s in backend.report.sites] == [True]
    assert _nodes(backend, "predict_blocks") and clean[:, :, 200:300].eq(0).all()
    assert torch.equal(clean, dirty)
