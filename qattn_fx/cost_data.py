"""Measured speed of qattn_fx's kernels against torch SDPA (cuDNN, bf16), the data of :mod:`qattn_fx.cost`.

Generated from ``benchmarks.attention_ops`` results by the command in :data:`COMMAND`; do not edit: re-run it.
``SOURCES``: one entry per result file (its path, device, architecture, date, timer). ``POINTS``: ``(kernel,
source, shape, batch_heads, q_len, kv_len, head_dim, speedup)`` per measured call, where ``batch_heads`` is B·H
of Q and ``speedup`` is the cuDNN bf16 SDPA time of the same run divided by the kernel's time with its quantize
passes (Inductor-compiled; ``ms_total`` in the result file). ``SPARSE_POINTS``: ``(kernel, source, shape,
batch_heads, q_len, kv_len, head_dim, visited, ratio)`` per measured block-sparse call (:mod:`qattn_fx.sparse_cost`):
the fraction of blocks visited and the predictor and kernel's time over the kernel's dense time.
"""

COMMAND = (
    "python -m benchmarks.cost_table"
    " benchmarks/results/2026-11-29_h200_attention_ops.json:cudnn_fp8,flashinfer_fa3_fp8"
    " benchmarks/results/2026-11-30_h200_attention_ops_triton_sage.json:triton_sage/int8-1-16-1"
    " benchmarks/results/2026-11-30_h200_attention_ops_wan1.3b-480p_d64.json"
    " benchmarks/results/2026-12-02_h200_attention_ops.json:gluon_sage/int8-1-16-1,cudnn_fp8"
    " benchmarks/results/2026-12-02_h200_attention_ops_d64_short.json:gluon_sage/int8-1-16-1"
    " benchmarks/results/2026-12-02_h200_attention_ops_d64_cogvideox.json:gluon_sage/int8-1-16-1"
    " benchmarks/results/2026-12-07_h100_attention_ops_cost.json:gluon_sage/int8-1-16-1,cudnn_fp8,flashinfer_fa3_fp8"
    " benchmarks/results/2026-12-06_h100_block_sparse.json:triton_sage"
    " benchmarks/results/2026-12-07_h100_block_sparse_flux_d64.json"
    " benchmarks/results/2026-12-07_h100_block_sparse_wan14b.json:WS_BN128_s3_ahead_permk_mmasum"
    " benchmarks/results/2026-12-07_h100_block_sparse_wan1.3b_flux_accumulators.json"
    " benchmarks/results/2026-12-08_h100_block_sparse_wan1.3b_flux_mid.json"
    " benchmarks/results/2026-12-08_h100_block_sparse_wan14b.json"
    " > qattn_fx/cost_data.py"
)

SOURCES = {
    "2026-11-29_h200_attention_ops": {
        "file": "benchmarks/results/2026-11-29_h200_attention_ops.json",
        "device": "NVIDIA H200",
        "arch": "sm_90",
        "date": "2026-11-29",
        "timer": "events",
    },
    "2026-11-30_h200_attention_ops_triton_sage": {
        "file": "benchmarks/results/2026-11-30_h200_attention_ops_triton_sage.json",
        "device": "NVIDIA H200",
        "arch": "sm_90",
        "date": "2026-11-30",
        "timer": "events",
    },
    "2026-12-02_h200_attention_ops": {
        "file": "benchmarks/results/2026-12-02_h200_attention_ops.json",
        "device": "NVIDIA H200",
        "arch": "sm_90",
        "date": "2026-12-02",
        "timer": "graph",
    },
    "2026-12-02_h200_attention_ops_d64_short": {
        "file": "benchmarks/results/2026-12-02_h200_attention_ops_d64_short.json",
        "device": "NVIDIA H200",
        "arch": "sm_90",
        "date": "2026-12-02",
        "timer": "graph",
    },
    "2026-12-02_h200_attention_ops_d64_cogvideox": {
        "file": "benchmarks/results/2026-12-02_h200_attention_ops_d64_cogvideox.json",
        "device": "NVIDIA H200",
        "arch": "sm_90",
        "date": "2026-12-02",
        "timer": "graph",
    },
    "2026-12-07_h100_attention_ops_cost": {
        "file": "benchmarks/results/2026-12-07_h100_attention_ops_cost.json",
        "device": "NVIDIA H100 80GB HBM3",
        "arch": "sm_90",
        "date": "2026-12-07",
        "timer": "graph",
    },
    "2026-12-06_h100_block_sparse": {
        "file": "benchmarks/results/2026-12-06_h100_block_sparse.json",
        "device": "NVIDIA H100 80GB HBM3",
        "arch": "sm_90",
        "date": "2026-12-06",
        "timer": "graph",
    },
    "2026-12-07_h100_block_sparse_flux_d64": {
        "file": "benchmarks/results/2026-12-07_h100_block_sparse_flux_d64.json",
        "device": "NVIDIA H100 80GB HBM3",
        "arch": "sm_90",
        "date": "2026-12-07",
        "timer": "graph",
    },
    "2026-12-08_h100_block_sparse_wan1.3b_flux_mid": {
        "file": "benchmarks/results/2026-12-08_h100_block_sparse_wan1.3b_flux_mid.json",
        "device": "NVIDIA H100 80GB HBM3",
        "arch": "sm_90",
        "date": "2026-12-08",
        "timer": "graph",
    },
    "2026-12-08_h100_block_sparse_wan14b": {
        "file": "benchmarks/results/2026-12-08_h100_block_sparse_wan14b.json",
        "device": "NVIDIA H100 80GB HBM3",
        "arch": "sm_90",
        "date": "2026-12-08",
        "timer": "graph",
    },
}

#: (kernel, source, shape, batch_heads, q_len, kv_len, head_dim, speedup)
POINTS = (
    ("cudnn_fp8", "2026-12-07_h100_attention_ops_cost", "ltx-512", 32, 3872, 3872, 64, 0.7527),
    ("cudnn_fp8", "2026-12-07_h100_attention_ops_cost", "sd3-1024", 24, 4429, 4429, 64, 0.7199),
    ("cudnn_fp8", "2026-12-07_h100_attention_ops_cost", "ltx-704", 32, 9196, 9196, 64, 0.9455),
    ("cudnn_fp8", "2026-12-02_h200_attention_ops", "d64", 32, 16384, 16384, 64, 1.1197),
    ("cudnn_fp8", "2026-12-07_h100_attention_ops_cost", "d64", 32, 16384, 16384, 64, 1.0931),
    ("cudnn_fp8", "2026-12-07_h100_attention_ops_cost", "cogvideox", 48, 17776, 17776, 64, 1.112),
    ("cudnn_fp8", "2026-12-02_h200_attention_ops", "cross-512", 40, 32760, 512, 128, 0.3011),
    ("cudnn_fp8", "2026-12-07_h100_attention_ops_cost", "cross-512", 40, 32760, 512, 128, 0.2921),
    ("cudnn_fp8", "2026-12-02_h200_attention_ops", "flux-1024", 24, 4608, 4608, 128, 0.8177),
    ("cudnn_fp8", "2026-12-07_h100_attention_ops_cost", "flux-1024", 24, 4608, 4608, 128, 0.7967),
    ("cudnn_fp8", "2026-12-02_h200_attention_ops", "wan1.3b-480p", 12, 32760, 32760, 128, 1.3525),
    ("cudnn_fp8", "2026-12-07_h100_attention_ops_cost", "wan1.3b-480p", 12, 32760, 32760, 128, 1.3524),
    ("cudnn_fp8", "2026-12-02_h200_attention_ops", "wan14b-720p", 40, 75600, 75600, 128, 1.4058),
    ("cudnn_fp8", "2026-12-07_h100_attention_ops_cost", "wan14b-720p", 40, 75600, 75600, 128, 1.4161),
    ("flashinfer_fa3_fp8", "2026-12-07_h100_attention_ops_cost", "ltx-512", 32, 3872, 3872, 64, 0.8884),
    ("flashinfer_fa3_fp8", "2026-12-07_h100_attention_ops_cost", "sd3-1024", 24, 4429, 4429, 64, 0.8914),
    ("flashinfer_fa3_fp8", "2026-12-07_h100_attention_ops_cost", "ltx-704", 32, 9196, 9196, 64, 1.1374),
    ("flashinfer_fa3_fp8", "2026-11-29_h200_attention_ops", "d64", 32, 16384, 16384, 64, 1.1918),
    ("flashinfer_fa3_fp8", "2026-12-07_h100_attention_ops_cost", "d64", 32, 16384, 16384, 64, 1.2051),
    ("flashinfer_fa3_fp8", "2026-12-07_h100_attention_ops_cost", "cogvideox", 48, 17776, 17776, 64, 1.3097),
    ("flashinfer_fa3_fp8", "2026-11-29_h200_attention_ops", "cross-512", 40, 32760, 512, 128, 0.5853),
    ("flashinfer_fa3_fp8", "2026-12-07_h100_attention_ops_cost", "cross-512", 40, 32760, 512, 128, 0.5683),
    ("flashinfer_fa3_fp8", "2026-11-29_h200_attention_ops", "flux-1024", 24, 4608, 4608, 128, 0.5769),
    ("flashinfer_fa3_fp8", "2026-12-07_h100_attention_ops_cost", "flux-1024", 24, 4608, 4608, 128, 0.9484),
    ("flashinfer_fa3_fp8", "2026-11-29_h200_attention_ops", "wan1.3b-480p", 12, 32760, 32760, 128, 1.4528),
    ("flashinfer_fa3_fp8", "2026-12-07_h100_attention_ops_cost", "wan1.3b-480p", 12, 32760, 32760, 128, 1.4065),
    ("flashinfer_fa3_fp8", "2026-11-29_h200_attention_ops", "wan14b-720p", 40, 75600, 75600, 128, 1.5078),
    ("flashinfer_fa3_fp8", "2026-12-07_h100_attention_ops_cost", "wan14b-720p", 40, 75600, 75600, 128, 1.4909),
    ("gluon_sage", "2026-12-02_h200_attention_ops_d64_short", "ltx-512", 32, 3872, 3872, 64, 0.9352),
    ("gluon_sage", "2026-12-07_h100_attention_ops_cost", "ltx-512", 32, 3872, 3872, 64, 0.9419),
    ("gluon_sage", "2026-12-02_h200_attention_ops_d64_short", "sd3-1024", 24, 4429, 4429, 64, 0.879),
    ("gluon_sage", "2026-12-07_h100_attention_ops_cost", "sd3-1024", 24, 4429, 4429, 64, 0.9083),
    ("gluon_sage", "2026-12-02_h200_attention_ops_d64_short", "ltx-704", 32, 9196, 9196, 64, 1.0677),
    ("gluon_sage", "2026-12-07_h100_attention_ops_cost", "ltx-704", 32, 9196, 9196, 64, 1.0882),
    ("gluon_sage", "2026-12-02_h200_attention_ops", "d64", 32, 16384, 16384, 64, 1.1367),
    ("gluon_sage", "2026-12-07_h100_attention_ops_cost", "d64", 32, 16384, 16384, 64, 1.156),
    ("gluon_sage", "2026-12-02_h200_attention_ops_d64_cogvideox", "cogvideox", 48, 17776, 17776, 64, 1.2942),
    ("gluon_sage", "2026-12-07_h100_attention_ops_cost", "cogvideox", 48, 17776, 17776, 64, 1.2703),
    ("gluon_sage", "2026-12-02_h200_attention_ops", "cross-512", 40, 32760, 512, 128, 0.658),
    ("gluon_sage", "2026-12-07_h100_attention_ops_cost", "cross-512", 40, 32760, 512, 128, 0.6583),
    ("gluon_sage", "2026-12-02_h200_attention_ops", "flux-1024", 24, 4608, 4608, 128, 0.9021),
    ("gluon_sage", "2026-12-07_h100_attention_ops_cost", "flux-1024", 24, 4608, 4608, 128, 0.9295),
    ("gluon_sage", "2026-12-02_h200_attention_ops", "wan1.3b-480p", 12, 32760, 32760, 128, 1.5001),
    ("gluon_sage", "2026-12-07_h100_attention_ops_cost", "wan1.3b-480p", 12, 32760, 32760, 128, 1.5262),
    ("gluon_sage", "2026-12-02_h200_attention_ops", "wan14b-720p", 40, 75600, 75600, 128, 1.5306),
    ("gluon_sage", "2026-12-07_h100_attention_ops_cost", "wan14b-720p", 40, 75600, 75600, 128, 1.5076),
    ("triton_sage", "2026-11-30_h200_attention_ops_triton_sage", "d64", 32, 16384, 16384, 64, 0.9205),
    ("triton_sage", "2026-11-30_h200_attention_ops_triton_sage", "flux-1024", 24, 4608, 4608, 128, 0.4546),
    ("triton_sage", "2026-11-30_h200_attention_ops_triton_sage", "wan1.3b-480p", 12, 32760, 32760, 128, 1.1798),
    ("triton_sage", "2026-11-30_h200_attention_ops_triton_sage", "wan14b-720p", 40, 75600, 75600, 128, 1.1577),
)

#: (kernel, source, shape, batch_heads, q_len, kv_len, head_dim, visited, ratio)
SPARSE_POINTS = (
    ("gluon_sage", "2026-12-07_h100_block_sparse_flux_d64", "d64", 32, 16384, 16384, 64, 0.25, 0.3942),
    ("gluon_sage", "2026-12-07_h100_block_sparse_flux_d64", "d64", 32, 16384, 16384, 64, 0.5, 0.6676),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan1.3b_flux_mid", "flux-1024", 24, 4608, 4608, 128, 0.25, 0.6585),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan1.3b_flux_mid", "flux-1024", 24, 4608, 4608, 128, 0.5, 0.8767),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan1.3b_flux_mid", "flux-1024", 24, 4608, 4608, 128, 0.75, 1.0822),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan1.3b_flux_mid", "mid-12k", 24, 12288, 12288, 128, 0.25, 0.3983),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan1.3b_flux_mid", "mid-12k", 24, 12288, 12288, 128, 0.5, 0.6552),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan1.3b_flux_mid", "mid-12k", 24, 12288, 12288, 128, 0.75, 0.897),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan1.3b_flux_mid", "wan1.3b-480p", 12, 32760, 32760, 128, 0.25, 0.3202),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan1.3b_flux_mid", "wan1.3b-480p", 12, 32760, 32760, 128, 0.5, 0.5703),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan1.3b_flux_mid", "wan1.3b-480p", 12, 32760, 32760, 128, 0.75, 0.8563),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan14b", "wan14b-720p", 40, 75600, 75600, 128, 0.2504, 0.2918),
    ("gluon_sage", "2026-12-08_h100_block_sparse_wan14b", "wan14b-720p", 40, 75600, 75600, 128, 0.5008, 0.56),
    ("triton_sage", "2026-12-06_h100_block_sparse", "wan1.3b-480p", 12, 32760, 32760, 128, 0.25, 0.3583),
    ("triton_sage", "2026-12-06_h100_block_sparse", "wan1.3b-480p", 12, 32760, 32760, 128, 0.5, 0.633),
    ("triton_sage", "2026-12-06_h100_block_sparse", "wan14b-720p", 40, 75600, 75600, 128, 0.2504, 0.3464),
    ("triton_sage", "2026-12-06_h100_block_sparse", "wan14b-720p", 40, 75600, 75600, 128, 0.5008, 0.674),
)
