"""Calibrate a Wan transformer: per-site errors of the candidate recipes on denoising-step inputs, and the plan.

    python examples/calibrate_wan.py --out calib_out                # CPU: tiny Wan, candidates emulated
    python examples/calibrate_wan.py --real-size --out calib_out    # GPU: Wan2.1-1.3B config, 2 blocks, 480p,
                                                                    # candidates on the real kernels
    qattn-fx calibrate --model examples.calibrate_wan:real_size --calls 2 --budget cos=0.999 --out spec.json
    python examples/calibrate_wan.py --real-size --emulate --calls 4 \
        --candidates int8-1-16-1,int8-1-16-1+cdf0.9,int8-1-16-1+target0.5 --out calib_out   # block sparsity

``--real-size`` builds the published Wan2.1-T2V-1.3B transformer config (``examples/pipeline.py``'s ``WAN_1_3B``)
with random weights and ``--blocks`` 2 blocks, in bf16 on the GPU, and calls it on 480p latents (81 frames:
21 x 60 x 104, 32760 tokens) with 512 random text tokens, at ``--calls`` noise levels from high to low. The
candidates run on the kernels the policy picks (gluon_sage on an H200). Written to ``--out``: ``spec.json`` (the
plan), ``calibration.json`` (everything; ``qattn_fx.calibration.load`` reads it back) and ``calibration.png`` (the
plot; skipped with a line saying so when matplotlib is missing: draw it later from the JSON).

``--emulate`` runs the candidates on the reference kernel even with ``--real-size`` (on the GPU): block-sparse
candidates (``+cdf0.9``, ``+top_k0.5``, ``+target0.5``) are served only where a kernel takes block lists, which in
emulation the reference kernel does.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline import WAN_1_3B  # noqa: E402  (examples/pipeline.py: the published config)

LATENTS_480P = (16, 21, 60, 104)
TEXT_LEN = 512


def real_size(blocks: int = 2):
    """``(model, calls)``: the Wan2.1-1.3B config with ``blocks`` blocks (random weights, bf16, CUDA) and
    ``calls(n)``: ``n`` calls at 480p, noise levels ``1, (n-1)/n, ...``."""
    from diffusers import WanTransformer3DModel

    if not torch.cuda.is_available():
        raise RuntimeError("real_size needs a CUDA GPU; on a CPU use examples.calibrate_wan:tiny")
    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**WAN_1_3B, "num_layers": blocks}).eval().to("cuda", torch.bfloat16)

    def calls(n: int):
        out = []
        for i in range(n):
            g = torch.Generator("cuda").manual_seed(i)
            kwargs = dict(hidden_states=torch.randn(1, *LATENTS_480P, generator=g, device="cuda",
                                                    dtype=torch.bfloat16),
                          timestep=torch.full((1,), 1000.0 * (1 - i / n), device="cuda"),
                          encoder_hidden_states=torch.randn(1, TEXT_LEN, WAN_1_3B["text_dim"], generator=g,
                                                            device="cuda", dtype=torch.bfloat16),
                          return_dict=False)
            out.append(((), kwargs))
        return out

    return model, calls


def tiny():
    """``(model, calls)``: qattn_fx's tiny random Wan (CPU) and ``calls(n)``."""
    from qattn_fx import tiny_models

    model, _ = tiny_models.wan()
    return model, lambda n: tiny_models.example_calls(model, n)[0]


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real-size", action="store_true", help="the Wan2.1-1.3B config on the GPU, real kernels")
    parser.add_argument("--blocks", type=int, default=2, help="--real-size: transformer blocks (default 2)")
    parser.add_argument("--calls", type=int, default=2, help="denoising-step calls (default 2)")
    parser.add_argument("--budget", default="cos=0.999", help="default cos=0.999")
    parser.add_argument("--candidates", help="comma-separated recipe ids (default: the calibration defaults); "
                        "block-sparse ones as int8-1-16-1+cdf0.9, +top_k0.5, +target0.5")
    parser.add_argument("--emulate", action="store_true", help="--real-size: the candidates on the reference kernel "
                        "(on the GPU), as block-sparse candidates need")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    args = parser.parse_args(argv)
    import qattn_fx

    start = time.perf_counter()
    model, calls = real_size(args.blocks) if args.real_size else tiny()
    call_list = calls(args.calls)
    labels = [f"t={1 - i / args.calls:.2f}" for i in range(args.calls)]
    print(f"qattn_fx {qattn_fx.__version__}: {type(model).__name__}, {'real size' if args.real_size else 'tiny'}, "
          f"{args.calls} calls; built in {time.perf_counter() - start:.1f} s", flush=True)
    result = qattn_fx.calibrate(model, call_list, budget=args.budget,
                                candidates=args.candidates.split(",") if args.candidates else None,
                                emulate=args.emulate or not args.real_size, labels=labels,
                                progress=lambda line: print(f"[{time.perf_counter() - start:6.1f} s] {line}",
                                                            flush=True))
    print()
    print(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec.json").write_text(result.spec.to_json(indent=1) + "\n")
    result.save(args.out / "calibration.json")
    try:
        result.plot(args.out / "calibration.png")
    except ImportError as e:
        print(f"plot skipped: {e}")
    print(f"wrote {args.out}/spec.json, calibration.json, calibration.png; {time.perf_counter() - start:.1f} s in all")
    return result


if __name__ == "__main__":
    main()
