"""qattn_fx quickstart: compile a diffusers Wan transformer with quantized attention and check it against dense.

    python examples/quickstart.py                    # CPU: recipes emulated by the reference kernel
    python examples/quickstart.py --spec my.json     # any spec format (canonical, TensorRT-LLM, vLLM-Omni)

On a CUDA machine the same script runs the real kernels chosen by the policy on a bf16 Wan whose attention calls
have Wan2.1-1.3B's shapes at 480p (``tiny_models.wan_480p``: 12 heads of 128, 32,760 video and 512 text tokens, 2
blocks): on an H200 the self-attention runs on the Sage INT8 kernel and the cross-attention to 512 text tokens
stays dense, predicted slower there. It prints the site table (what happened at every attention call and why), the
accuracy against the dense model, and where the debug dump went.
"""

from __future__ import annotations

import argparse
import time

import torch

import qattn_fx
from qattn_fx import tiny_models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", help="spec file (.json/.yaml); default: the auto spec (Sage INT8 1/16/1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--debug-dir", default="qattn_debug", help="where the per-graph debug dump goes")
    args = parser.parse_args()

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    # A real diffusers WanTransformer3DModel with random weights: 2 blocks of self- and cross-attention (on a GPU at
    # Wan2.1-1.3B's attention shapes: on short sequences `auto` keeps every site dense, predicted slower)
    model, inputs = tiny_models.wan_480p() if on_gpu else tiny_models.wan()
    if on_gpu:  # bf16 on the GPU, as diffusion pipelines run; kernels take bf16/fp16
        model = model.to(device=device, dtype=torch.bfloat16)
        inputs = {k: v.to(device, torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else
                  (v.to(device) if torch.is_tensor(v) else v) for k, v in inputs.items()}

    backend = qattn_fx.backend(args.spec, emulate=not on_gpu, debug_dir=args.debug_dir)
    with torch.no_grad():
        dense = model(**inputs)[0]
        start = time.perf_counter()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        out = compiled(**inputs)[0]
        seconds = time.perf_counter() - start

    print(f"qattn_fx {qattn_fx.__version__} on {qattn_fx.detect(device).describe()}"
          f"{' (emulated: reference kernel)' if not on_gpu else ''}; compiled in {seconds:.1f} s\n")
    print(backend.report)
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), dense.float().flatten(), dim=0).item()
    rel = ((out.float() - dense.float()).norm() / dense.float().norm()).item()
    print(f"\naccuracy vs dense: cosine {cos:.6f}, relative L2 error {rel:.2e}")
    print(f"debug dump: {args.debug_dir}/ (graph before/after the rewrite, site table, resolved spec)")


if __name__ == "__main__":
    main()
