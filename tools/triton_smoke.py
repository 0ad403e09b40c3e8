"""Quick GPU check of the Triton Sage kernel against the reference on identical quantized inputs (a few shapes)."""
import time

import torch

from qattn_fx.ops import lowering, quantized_attention
from qattn_fx.recipes import Recipe

torch.manual_seed(0)
for (b, h, sq, skv, d) in [(1, 4, 1000, 1000, 128), (2, 3, 777, 333, 64), (1, 12, 32760, 32760, 128)]:
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for s in (sq, skv, skv))
    for recipe in (Recipe("int8", "fp8", 1, 16, 1), Recipe("fp8", "fp8", 1, 16, 1), Recipe("bf16", "fp8", 0, 0, 1)):
        try:
            torch.cuda.synchronize(); t = time.time()
            out = quantized_attention(q, k, v, recipe, kernel="triton_sage")
            torch.cuda.synchronize(); first = time.time() - t
            ref = quantized_attention(q, k, v, recipe, kernel="reference") if sq * skv < 4e8 else None
            ms = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                quantized_attention(q, k, v, recipe, kernel="triton_sage")
            end.record(); torch.cuda.synchronize(); ms = start.elapsed_time(end) / 5
            line = f"{(b, h, sq, skv, d)} {recipe.name}: first {first:.1f}s, {ms:.2f} ms (with quantize, eager), " \
                   f"{4 * b * h * sq * skv * d / ms / 1e9:.0f} TFLOP/s"
            if ref is not None:
                rel = ((out.float() - ref.float()).abs().sum() / ref.float().abs().sum()).item()
                line += f", rel L1 vs reference {rel:.2e}"
            print(line, flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{(b, h, sq, skv, d)} {recipe.name}: {type(e).__name__}: {str(e)[:400]}", flush=True)
