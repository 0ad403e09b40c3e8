"""Golden graphs: the full rewritten graph of a small attention block, one per recipe family.

The graphs are printed with :func:`qattn_fx.fx.printer.format_graph`, which renames Dynamo's nodes canonically
(``in0``, ``v0``) and keeps the names of the nodes qattn_fx inserts (after the site's module:
``blocks_0_q_quant``), so the goldens are stable across runs and torch releases. Update them with
``EXPECTTEST_ACCEPT=1 python -m pytest tests/fx/test_golden_graphs.py``.
"""

from typing import Callable

import expecttest
import pytest
import torch
import torch.nn.functional as F

import qattn_fx
from qattn_fx import AttentionSpec, BlockSparse, Recipe, Spec
from qattn_fx.fx.printer import format_graph


class AttentionBlock(torch.nn.Module):
    """qkv projection → (B, H, S, D) views → SDPA → output projection, as DiT attention blocks do."""

    def __init__(self, dim: int = 64, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, d))


class Model(torch.nn.Module):
    """One block in a ``blocks`` list, as DiTs hold them: the site's module path is ``blocks.0``."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([AttentionBlock()])

    def forward(self, x):
        return self.blocks[0](x)


def rewritten_graph(spec: Spec) -> str:
    torch.manual_seed(0)
    block = Model().eval()
    backend = qattn_fx.backend(spec, emulate=True, compiler="eager")
    with torch.no_grad():
        torch.compile(block, backend=backend, fullgraph=True)(torch.randn(1, 8, 64))
    assert len(backend.graph_modules) == 1
    return format_graph(backend.graph_modules[0])


def hopper_graph(spec: Spec, block: Callable[[], torch.nn.Module] = lambda: AttentionBlock(dim=256),
                 inputs: Callable[[], tuple] = lambda: (torch.randn(1, 8, 256, dtype=torch.bfloat16),)) -> str:
    """The graph the backend hands on for an H200 (sm_90, triton 3.6), rewritten on this CPU machine: a bf16
    ``block()`` (default: head_dim 128) called on ``inputs()``, whose run then fails here (gluon_sage needs the GPU)
    after the graph is recorded."""
    torch.manual_seed(0)
    module = block().eval().to(torch.bfloat16)
    hardware = qattn_fx.Hardware.for_arch("sm_90", {"triton": "3.6.0"})
    backend = qattn_fx.backend(spec, hardware=hardware, compiler="eager")
    torch._dynamo.reset()  # (static shapes whatever ran before: no automatic-dynamic sizes from other tests)
    with torch.no_grad(), pytest.raises(RuntimeError, match="gluon_sage: needs an sm_90"):
        torch.compile(module, backend=backend, fullgraph=True, dynamic=False)(*inputs())
    assert len(backend.graph_modules) == 1
    return format_graph(backend.graph_modules[0])


class MaskedCrossAttention(torch.nn.Module):
    """Cross-attention to text under a padding bias that diffusers' ``prepare_attention_mask`` repeats over the heads
    (LTX-Video's): ``repeat_interleave(heads, dim=0)`` then ``view(B, heads, -1, Skv)``."""

    def __init__(self, dim: int = 256, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.q, self.kv = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, 2 * dim)

    def forward(self, x, text, text_mask):
        b, s, d = x.shape
        bias = ((1 - text_mask.to(x.dtype)) * -10000.0).unsqueeze(1)  # (B, 1, T)
        bias = bias.repeat_interleave(self.heads, dim=0).view(b, self.heads, -1, bias.shape[-1])
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = self.kv(text).view(b, text.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def spec_for(recipe: Recipe, backend: str) -> Spec:
    return Spec(default=AttentionSpec(backend=backend, recipe=recipe))


def emulated_graph(spec: Spec, block: Callable[[], torch.nn.Module], inputs: Callable[[], tuple]) -> str:
    """The rewritten graph of ``block()`` called on ``inputs()`` (fp32, emulated on the reference kernel)."""
    torch.manual_seed(0)
    backend = qattn_fx.backend(spec, emulate=True, compiler="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(block().eval(), backend=backend, fullgraph=True, dynamic=False)(*inputs())
    assert len(backend.graph_modules) == 1
    return format_graph(backend.graph_modules[0])


class TestGoldenGraphs(expecttest.TestCase):
    def test_sage_int8_on_gluon_sage_quantizes_q_in_the_kernel(self):
        """gluon_sage takes the bf16 Q and quantizes it per token itself (KernelInfo.quantizes_q): no Q node."""
        self.assertExpectedInline(hopper_graph(spec_for(Recipe("int8", "fp8", 1, 16, 1), "TRITON")), """\
in0: bf16[1,8,256]
in1: bf16[768,256]
in2: bf16[768]
in3: bf16[256,256]
in4: bf16[256]
v0 = linear(in0, in1, in2)  # bf16[1,8,768]
v1 = .view(v0, 1, 8, 3, 2, 128)  # bf16[1,8,3,2,128]
v2 = .permute(v1, 2, 0, 3, 1, 4)  # bf16[3,1,2,8,128]
v3 = getitem(v2, 0)  # bf16[1,2,8,128]
v4 = getitem(v2, 1)  # bf16[1,2,8,128]
v5 = getitem(v2, 2)  # bf16[1,2,8,128]
sdpa_k_smooth = qattn.smooth_k(v4)  # f32[1,2,8,128]
sdpa_k_quant = qattn.quantize_per_block(sdpa_k_smooth, 16, torch.int8)  # (i8[1,2,8,128], f32[1,2,4])
sdpa_k_data = getitem(sdpa_k_quant, 0)  # i8[1,2,8,128]
sdpa_k_scale = getitem(sdpa_k_quant, 1)  # f32[1,2,4]
sdpa_v_quant = qattn.quantize_per_channel(v5, torch.float8_e4m3fn, True)  # (f8e4m3[1,2,16,128], f32[1,2,128])
sdpa_v_data = getitem(sdpa_v_quant, 0)  # f8e4m3[1,2,16,128]
sdpa_v_scale = getitem(sdpa_v_quant, 1)  # f32[1,2,128]
sdpa_attention = qattn.scaled_attention(v3, None, sdpa_k_data, sdpa_k_scale, sdpa_v_data, sdpa_v_scale, 1, 16, 0.0883883, torch.bfloat16, 'gluon_sage')  # bf16[1,2,8,128]
v6 = .transpose(sdpa_attention, 1, 2)  # bf16[1,8,2,128]
v7 = .reshape(v6, 1, 8, 256)  # bf16[1,8,256]
v8 = linear(v7, in3, in4)  # bf16[1,8,256]
return (v8,)""")

    def test_a_mask_repeated_over_the_heads_reaches_gluon_sage_as_a_key_bias(self):
        """The repeated mask's source, unsqueezed on the head axis, becomes the key bias; the repeat is left to
        Inductor to drop."""
        inputs = lambda: (torch.randn(1, 8, 256, dtype=torch.bfloat16),  # noqa: E731
                          torch.randn(1, 32, 256, dtype=torch.bfloat16), torch.ones(1, 32))
        graph = hopper_graph(spec_for(Recipe("int8", "fp8", 1, 16, 1), "TRITON"), MaskedCrossAttention, inputs)
        self.assertExpectedInline(graph, """\
in0: bf16[1,8,256]
in1: f32[1,32]
in2: bf16[256,256]
in3: bf16[256]
in4: bf16[512,256]
in5: bf16[512]
in6: bf16[1,32,256]
v0 = .to(in1, torch.bfloat16)  # bf16[1,32]
v1 = sub(1, v0)  # bf16[1,32]
v2 = mul(v1, -10000)  # bf16[1,32]
v3 = .unsqueeze(v2, 1)  # bf16[1,1,32]
v4 = .repeat_interleave(v3, 2, dim=0)  # bf16[2,1,32]
v5 = .view(v4, 1, 2, -1, 32)  # bf16[1,2,1,32]
v6 = linear(in0, in2, in3)  # bf16[1,8,256]
v7 = .view(v6, 1, 8, 2, -1)  # bf16[1,8,2,128]
v8 = .transpose(v7, 1, 2)  # bf16[1,2,8,128]
v9 = linear(in6, in4, in5)  # bf16[1,32,512]
v10 = .view(v9, 1, 32, 2, 2, -1)  # bf16[1,32,2,2,128]
v11 = .permute(v10, 2, 0, 3, 1, 4)  # bf16[2,1,2,32,128]
v12 = getitem(v11, 0)  # bf16[1,2,32,128]
v13 = getitem(v11, 1)  # bf16[1,2,32,128]
sdpa_mask_per_key = unsqueeze(v3, 1)  # bf16[1,1,1,32]
sdpa_key_bias = qattn.key_bias(sdpa_mask_per_key, v12)  # f32[1,32]
sdpa_k_smooth = qattn.smooth_k(v12, sdpa_key_bias)  # f32[1,2,32,128]
sdpa_k_quant = qattn.quantize_per_block(sdpa_k_smooth, 16, torch.int8)  # (i8[1,2,32,128], f32[1,2,4])
sdpa_k_data = getitem(sdpa_k_quant, 0)  # i8[1,2,32,128]
sdpa_k_scale = getitem(sdpa_k_quant, 1)  # f32[1,2,4]
sdpa_v_masked = qattn.mask_keys(v13, sdpa_key_bias)  # bf16[1,2,32,128]
sdpa_v_quant = qattn.quantize_per_channel(sdpa_v_masked, torch.float8_e4m3fn, True)  # (f8e4m3[1,2,32,128], f32[1,2,128])
sdpa_v_data = getitem(sdpa_v_quant, 0)  # f8e4m3[1,2,32,128]
sdpa_v_scale = getitem(sdpa_v_quant, 1)  # f32[1,2,128]
sdpa_attention = qattn.scaled_attention(v8, None, sdpa_k_data, sdpa_k_scale, sdpa_v_data, sdpa_v_scale, 1, 16, 0.0883883, torch.bfloat16, 'gluon_sage', sdpa_key_bias, None)  # bf16[1,2,8,128]
return (sdpa_attention,)""")

    def test_sage_int8_per_block(self):
        self.assertExpectedInline(rewritten_graph(spec_for(Recipe("int8", "fp8", 1, 16, 1), "TRTLLM")), """\
in0: f32[1,8,64]
in1: f32[192,64]
in2: f32[192]
in3: f32[64,64]
in4: f32[64]
v0 = linear(in0, in1, in2)  # f32[1,8,192]
v1 = .view(v0, 1, 8, 3, 2, 32)  # f32[1,8,3,2,32]
v2 = .permute(v1, 2, 0, 3, 1, 4)  # f32[3,1,2,8,32]
v3 = getitem(v2, 0)  # f32[1,2,8,32]
v4 = getitem(v2, 1)  # f32[1,2,8,32]
v5 = getitem(v2, 2)  # f32[1,2,8,32]
blocks_0_k_smooth = qattn.smooth_k(v4)  # f32[1,2,8,32]
blocks_0_q_quant = qattn.quantize_per_block(v3, 1, torch.int8)  # (i8[1,2,8,32], f32[1,2,8])
blocks_0_q_data = getitem(blocks_0_q_quant, 0)  # i8[1,2,8,32]
blocks_0_q_scale = getitem(blocks_0_q_quant, 1)  # f32[1,2,8]
blocks_0_k_quant = qattn.quantize_per_block(blocks_0_k_smooth, 16, torch.int8)  # (i8[1,2,8,32], f32[1,2,4])
blocks_0_k_data = getitem(blocks_0_k_quant, 0)  # i8[1,2,8,32]
blocks_0_k_scale = getitem(blocks_0_k_quant, 1)  # f32[1,2,4]
blocks_0_v_quant = qattn.quantize_per_channel(v5, torch.float8_e4m3fn, False)  # (f8e4m3[1,2,8,32], f32[1,2,32])
blocks_0_v_data = getitem(blocks_0_v_quant, 0)  # f8e4m3[1,2,8,32]
blocks_0_v_scale = getitem(blocks_0_v_quant, 1)  # f32[1,2,32]
blocks_0_attention = qattn.scaled_attention(blocks_0_q_data, blocks_0_q_scale, blocks_0_k_data, blocks_0_k_scale, blocks_0_v_data, blocks_0_v_scale, 1, 16, 0.176777, torch.float32, 'reference')  # f32[1,2,8,32]
v6 = .transpose(blocks_0_attention, 1, 2)  # f32[1,8,2,32]
v7 = .reshape(v6, 1, 8, 64)  # f32[1,8,64]
v8 = linear(v7, in3, in4)  # f32[1,8,64]
return (v8,)""")

    def test_fp8_per_tensor(self):
        self.assertExpectedInline(rewritten_graph(spec_for(Recipe("fp8", "fp8"), "CUDNN")), """\
in0: f32[1,8,64]
in1: f32[192,64]
in2: f32[192]
in3: f32[64,64]
in4: f32[64]
v0 = linear(in0, in1, in2)  # f32[1,8,192]
v1 = .view(v0, 1, 8, 3, 2, 32)  # f32[1,8,3,2,32]
v2 = .permute(v1, 2, 0, 3, 1, 4)  # f32[3,1,2,8,32]
v3 = getitem(v2, 0)  # f32[1,2,8,32]
v4 = getitem(v2, 1)  # f32[1,2,8,32]
v5 = getitem(v2, 2)  # f32[1,2,8,32]
blocks_0_k_smooth = qattn.smooth_k(v4)  # f32[1,2,8,32]
blocks_0_q_quant = qattn.quantize_per_tensor(v3, torch.float8_e4m3fn)  # (f8e4m3[1,2,8,32], f32[1,1,1])
blocks_0_q_data = getitem(blocks_0_q_quant, 0)  # f8e4m3[1,2,8,32]
blocks_0_q_scale = getitem(blocks_0_q_quant, 1)  # f32[1,1,1]
blocks_0_k_quant = qattn.quantize_per_tensor(blocks_0_k_smooth, torch.float8_e4m3fn)  # (f8e4m3[1,2,8,32], f32[1,1,1])
blocks_0_k_data = getitem(blocks_0_k_quant, 0)  # f8e4m3[1,2,8,32]
blocks_0_k_scale = getitem(blocks_0_k_quant, 1)  # f32[1,1,1]
blocks_0_v_quant = qattn.quantize_per_tensor(v5, torch.float8_e4m3fn, False)  # (f8e4m3[1,2,8,32], f32[1,1,1])
blocks_0_v_data = getitem(blocks_0_v_quant, 0)  # f8e4m3[1,2,8,32]
blocks_0_v_scale = getitem(blocks_0_v_quant, 1)  # f32[1,1,1]
blocks_0_attention = qattn.scaled_attention(blocks_0_q_data, blocks_0_q_scale, blocks_0_k_data, blocks_0_k_scale, blocks_0_v_data, blocks_0_v_scale, 0, 0, 0.176777, torch.float32, 'reference')  # f32[1,2,8,32]
v6 = .transpose(blocks_0_attention, 1, 2)  # f32[1,8,2,32]
v7 = .reshape(v6, 1, 8, 64)  # f32[1,8,64]
v8 = linear(v7, in3, in4)  # f32[1,8,64]
return (v8,)""")

    def test_mxfp8(self):
        self.assertExpectedInline(rewritten_graph(spec_for(Recipe("mxfp8", "mxfp8"), "CUDNN")), """\
in0: f32[1,8,64]
in1: f32[192,64]
in2: f32[192]
in3: f32[64,64]
in4: f32[64]
v0 = linear(in0, in1, in2)  # f32[1,8,192]
v1 = .view(v0, 1, 8, 3, 2, 32)  # f32[1,8,3,2,32]
v2 = .permute(v1, 2, 0, 3, 1, 4)  # f32[3,1,2,8,32]
v3 = getitem(v2, 0)  # f32[1,2,8,32]
v4 = getitem(v2, 1)  # f32[1,2,8,32]
v5 = getitem(v2, 2)  # f32[1,2,8,32]
blocks_0_k_smooth = qattn.smooth_k(v4)  # f32[1,2,8,32]
blocks_0_q_quant = qattn.quantize_mxfp8(v3, -1)  # (f8e4m3[1,2,8,32], u8[1,2,8,1])
blocks_0_q_data = getitem(blocks_0_q_quant, 0)  # f8e4m3[1,2,8,32]
blocks_0_q_scale = getitem(blocks_0_q_quant, 1)  # u8[1,2,8,1]
blocks_0_k_quant = qattn.quantize_mxfp8(blocks_0_k_smooth, -1)  # (f8e4m3[1,2,8,32], u8[1,2,8,1])
blocks_0_k_data = getitem(blocks_0_k_quant, 0)  # f8e4m3[1,2,8,32]
blocks_0_k_scale = getitem(blocks_0_k_quant, 1)  # u8[1,2,8,1]
blocks_0_v_quant = qattn.quantize_mxfp8(v5, -2)  # (f8e4m3[1,2,8,32], u8[1,2,4,32])
blocks_0_v_data = getitem(blocks_0_v_quant, 0)  # f8e4m3[1,2,8,32]
blocks_0_v_scale = getitem(blocks_0_v_quant, 1)  # u8[1,2,4,32]
blocks_0_attention = qattn.block_scaled_attention(blocks_0_q_data, blocks_0_q_scale, None, blocks_0_k_data, blocks_0_k_scale, None, blocks_0_v_data, blocks_0_v_scale, None, 'mxfp8', 'mxfp8', 0.176777, torch.float32, 'reference')  # f32[1,2,8,32]
v6 = .transpose(blocks_0_attention, 1, 2)  # f32[1,8,2,32]
v7 = .reshape(v6, 1, 8, 64)  # f32[1,8,64]
v8 = linear(v7, in3, in4)  # f32[1,8,64]
return (v8,)""")

    def test_qk16pv8(self):
        self.assertExpectedInline(rewritten_graph(spec_for(Recipe("bf16", "fp8"), "CUTEDSL")), """\
in0: f32[1,8,64]
in1: f32[192,64]
in2: f32[192]
in3: f32[64,64]
in4: f32[64]
v0 = linear(in0, in1, in2)  # f32[1,8,192]
v1 = .view(v0, 1, 8, 3, 2, 32)  # f32[1,8,3,2,32]
v2 = .permute(v1, 2, 0, 3, 1, 4)  # f32[3,1,2,8,32]
v3 = getitem(v2, 0)  # f32[1,2,8,32]
v4 = getitem(v2, 1)  # f32[1,2,8,32]
v5 = getitem(v2, 2)  # f32[1,2,8,32]
blocks_0_v_quant = qattn.quantize_per_tensor(v5, torch.float8_e4m3fn, False)  # (f8e4m3[1,2,8,32], f32[1,1,1])
blocks_0_v_data = getitem(blocks_0_v_quant, 0)  # f8e4m3[1,2,8,32]
blocks_0_v_scale = getitem(blocks_0_v_quant, 1)  # f32[1,1,1]
blocks_0_attention = qattn.scaled_attention(v3, None, v4, None, blocks_0_v_data, blocks_0_v_scale, 0, 0, 0.176777, torch.float32, 'reference')  # f32[1,2,8,32]
v6 = .transpose(blocks_0_attention, 1, 2)  # f32[1,8,2,32]
v7 = .reshape(v6, 1, 8, 64)  # f32[1,8,64]
v8 = linear(v7, in3, in4)  # f32[1,8,64]
return (v8,)""")

    def test_dense(self):
        self.assertExpectedInline(rewritten_graph(Spec(default="dense")), """\
in0: f32[1,8,64]
in1: f32[192,64]
in2: f32[192]
in3: f32[64,64]
in4: f32[64]
v0 = linear(in0, in1, in2)  # f32[1,8,192]
v1 = .view(v0, 1, 8, 3, 2, 32)  # f32[1,8,3,2,32]
v2 = .permute(v1, 2, 0, 3, 1, 4)  # f32[3,1,2,8,32]
v3 = getitem(v2, 0)  # f32[1,2,8,32]
v4 = getitem(v2, 1)  # f32[1,2,8,32]
v5 = getitem(v2, 2)  # f32[1,2,8,32]
v6 = scaled_dot_product_attention(v3, v4, v5)  # f32[1,2,8,32]
v7 = .transpose(v6, 1, 2)  # f32[1,8,2,32]
v8 = .reshape(v7, 1, 8, 64)  # f32[1,8,64]
v9 = linear(v8, in3, in4)  # f32[1,8,64]
return (v9,)""")

    def test_block_sparse_predicts_from_the_unquantized_q_and_k(self):
        """block_keep (the keep as data) and predict_blocks (from the canonical q and k, before any quantize node)
        feed the attention op's block lists."""
        spec = Spec(default=AttentionSpec(recipe=Recipe("int8", "fp8", 1, 16, 1), block_sparse=BlockSparse(cdf=0.9)))
        self.assertExpectedInline(rewritten_graph(spec), """\
in0: f32[1,8,64]
in1: f32[192,64]
in2: f32[192]
in3: f32[64,64]
in4: f32[64]
v0 = linear(in0, in1, in2)  # f32[1,8,192]
v1 = .view(v0, 1, 8, 3, 2, 32)  # f32[1,8,3,2,32]
v2 = .permute(v1, 2, 0, 3, 1, 4)  # f32[3,1,2,8,32]
v3 = getitem(v2, 0)  # f32[1,2,8,32]
v4 = getitem(v2, 1)  # f32[1,2,8,32]
v5 = getitem(v2, 2)  # f32[1,2,8,32]
blocks_0_block_keep = qattn.block_keep(v4, 0.9, None, 0, 1000)  # f32[1]
blocks_0_predict_blocks = qattn.predict_blocks(v3, v4, None, 0.176777, None, blocks_0_block_keep, 'cdf', 1, True, 0.6, 'blocks_0')  # (int32[1,2,1,1], int32[1,2,1])
blocks_0_block_index = getitem(blocks_0_predict_blocks, 0)  # int32[1,2,1,1]
blocks_0_block_count = getitem(blocks_0_predict_blocks, 1)  # int32[1,2,1]
blocks_0_k_smooth = qattn.smooth_k(v4)  # f32[1,2,8,32]
blocks_0_q_quant = qattn.quantize_per_block(v3, 1, torch.int8)  # (i8[1,2,8,32], f32[1,2,8])
blocks_0_q_data = getitem(blocks_0_q_quant, 0)  # i8[1,2,8,32]
blocks_0_q_scale = getitem(blocks_0_q_quant, 1)  # f32[1,2,8]
blocks_0_k_quant = qattn.quantize_per_block(blocks_0_k_smooth, 16, torch.int8)  # (i8[1,2,8,32], f32[1,2,4])
blocks_0_k_data = getitem(blocks_0_k_quant, 0)  # i8[1,2,8,32]
blocks_0_k_scale = getitem(blocks_0_k_quant, 1)  # f32[1,2,4]
blocks_0_v_quant = qattn.quantize_per_channel(v5, torch.float8_e4m3fn, False)  # (f8e4m3[1,2,8,32], f32[1,2,32])
blocks_0_v_data = getitem(blocks_0_v_quant, 0)  # f8e4m3[1,2,8,32]
blocks_0_v_scale = getitem(blocks_0_v_quant, 1)  # f32[1,2,32]
blocks_0_attention = qattn.scaled_attention(blocks_0_q_data, blocks_0_q_scale, blocks_0_k_data, blocks_0_k_scale, blocks_0_v_data, blocks_0_v_scale, 1, 16, 0.176777, torch.float32, 'reference', None, None, None, 'blocks_0', blocks_0_block_index, blocks_0_block_count)  # f32[1,2,8,32]
v6 = .transpose(blocks_0_attention, 1, 2)  # f32[1,8,2,32]
v7 = .reshape(v6, 1, 8, 64)  # f32[1,8,64]
v8 = linear(v7, in3, in4)  # f32[1,8,64]
return (v8,)""")

    def test_block_sparse_on_a_masked_site_gives_the_predictor_the_key_bias(self):
        inputs = lambda: (torch.randn(1, 8, 256), torch.randn(1, 32, 256), torch.ones(1, 32))  # noqa: E731
        spec = Spec(default=AttentionSpec(recipe=Recipe("bf16", "fp8", 0, 0, 1),
                                          block_sparse=BlockSparse(top_k=0.5, sink_tiles=0, similarity=0.0)))
        self.assertExpectedInline(emulated_graph(spec, MaskedCrossAttention, inputs), """\
in0: f32[1,8,256]
in1: f32[1,32]
in2: f32[256,256]
in3: f32[256]
in4: f32[512,256]
in5: f32[512]
in6: f32[1,32,256]
v0 = .to(in1, torch.float32)  # f32[1,32]
v1 = sub(1, v0)  # f32[1,32]
v2 = mul(v1, -10000)  # f32[1,32]
v3 = .unsqueeze(v2, 1)  # f32[1,1,32]
v4 = .repeat_interleave(v3, 2, dim=0)  # f32[2,1,32]
v5 = .view(v4, 1, 2, -1, 32)  # f32[1,2,1,32]
v6 = linear(in0, in2, in3)  # f32[1,8,256]
v7 = .view(v6, 1, 8, 2, -1)  # f32[1,8,2,128]
v8 = .transpose(v7, 1, 2)  # f32[1,2,8,128]
v9 = linear(in6, in4, in5)  # f32[1,32,512]
v10 = .view(v9, 1, 32, 2, 2, -1)  # f32[1,32,2,2,128]
v11 = .permute(v10, 2, 0, 3, 1, 4)  # f32[2,1,2,32,128]
v12 = getitem(v11, 0)  # f32[1,2,32,128]
v13 = getitem(v11, 1)  # f32[1,2,32,128]
sdpa_mask_per_key = unsqueeze(v3, 1)  # f32[1,1,1,32]
sdpa_key_bias = qattn.key_bias(sdpa_mask_per_key, v12)  # f32[1,32]
sdpa_block_keep = qattn.block_keep(v12, 0.5, None, 0, 1000)  # f32[1]
sdpa_predict_blocks = qattn.predict_blocks(v8, v12, sdpa_key_bias, 0.0883883, None, sdpa_block_keep, 'top_k', 0, True, 0, 'sdpa')  # (int32[1,2,1,1], int32[1,2,1])
sdpa_block_index = getitem(sdpa_predict_blocks, 0)  # int32[1,2,1,1]
sdpa_block_count = getitem(sdpa_predict_blocks, 1)  # int32[1,2,1]
sdpa_v_masked = qattn.mask_keys(v13, sdpa_key_bias)  # f32[1,2,32,128]
sdpa_v_quant = qattn.quantize_per_channel(sdpa_v_masked, torch.float8_e4m3fn, False)  # (f8e4m3[1,2,32,128], f32[1,2,128])
sdpa_v_data = getitem(sdpa_v_quant, 0)  # f8e4m3[1,2,32,128]
sdpa_v_scale = getitem(sdpa_v_quant, 1)  # f32[1,2,128]
sdpa_attention = qattn.scaled_attention(v8, None, v12, None, sdpa_v_data, sdpa_v_scale, 0, 0, 0.0883883, torch.float32, 'reference', sdpa_key_bias, None, None, 'sdpa', sdpa_block_index, sdpa_block_count)  # f32[1,2,8,128]
return (sdpa_attention,)""")


if __name__ == "__main__":
    import unittest

    unittest.main()
