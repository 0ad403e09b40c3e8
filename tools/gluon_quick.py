"""Quick correctness survey of kernels/gluon_sage.py on an sm_90 GPU: every case against the emulated tile loop
and the reference op; prints, never stops at the first failure.

    PYTHONPATH=$PWD python tools/gluon_quick.py ["128,2,ahead" ...]   # configs (default: gluon_sage.CONFIGS)
"""
import math
import sys
import traceback

import torch

sys.path.insert(0, "tests")
import support  # noqa: E402
from support import emulate, quantize  # noqa: E402

import qattn_fx.ops  # noqa: E402,F401
from qattn_fx.kernels import gluon_sage as gs, reference  # noqa: E402

CASES = [
    ("int8 one full tile", dict(b=1, hq=2, hkv=2, sq=64, skv=128), ("int8", 1, 16)),
    ("int8 two full tiles", dict(b=1, hq=2, hkv=2, sq=64, skv=256), ("int8", 1, 16)),
    ("int8 full + tail", dict(b=1, hq=2, hkv=2, sq=64, skv=200), ("int8", 1, 16)),
    ("bf16 two full tiles", dict(b=1, hq=2, hkv=2, sq=64, skv=256), ("bf16", 0, 0)),

    ("int8 1/16 one tile", dict(b=1, hq=2, hkv=2, sq=64, skv=100), ("int8", 1, 16)),
    ("bf16 one tile", dict(b=1, hq=2, hkv=2, sq=64, skv=100), ("bf16", 0, 0)),
    ("int8 1/16 multi", dict(b=2, hq=8, hkv=4, sq=1000, skv=1500), ("int8", 1, 16)),
    ("int8 0/0 multi", dict(b=2, hq=8, hkv=4, sq=1000, skv=1500), ("int8", 0, 0)),
    ("fp8 1/16 multi", dict(b=2, hq=8, hkv=4, sq=1000, skv=1500), ("fp8", 1, 16)),
    ("bf16 multi", dict(b=2, hq=8, hkv=4, sq=1000, skv=1500), ("bf16", 0, 0)),
    ("int8 d64", dict(b=2, hq=8, hkv=4, sq=1000, skv=1500, d=64), ("int8", 1, 16)),
]
for config in sys.argv[1:] or [str(c) for c in gs.CONFIGS]:
    for name, shape, recipe in CASES:
        try:
            kw = dict(d=128, device="cuda")
            kw.update(shape)
            args = quantize(*support.make_qkv(**kw), *recipe)
            sm = 1.0 / math.sqrt(kw["d"])
            cfg = gs.GluonConfig.parse(config)
            with gs.use_config(cfg):
                out = gs.scaled_attention(*args, sm, torch.float32)
            em = emulate(*args, sm, cfg.block_n)
            ref = reference.scaled_attention(*args, sm, torch.float32)
            e = (out.double() - em.double()).abs() / em.double().abs().max()
            mx, mean = support.errors(out, ref)
            print(f"{config:16s} {name:22s} vs emulation max {e.max().item():.2e} mean {e.mean().item():.2e} | "
                  f"vs reference max_rel {mx:.2e} mean_rel {mean:.2e} | nan {torch.isnan(out).sum().item()}",
                  flush=True)
        except Exception:
            print(f"{config} {name}: FAILED\n{traceback.format_exc()[-1500:]}", flush=True)
