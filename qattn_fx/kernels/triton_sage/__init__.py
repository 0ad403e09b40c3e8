"""qattn_fx's own Triton SageAttention kernel for Ada (sm_89) and Hopper (sm_90).

Implements ``qattn::scaled_attention`` with exactly the numerics of
:func:`qattn_fx.kernels.reference.scaled_attention` (non-causal; masks as a per-key logit bias):

* ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Skv, D)``: int8 or float8_e4m3fn with fp32 scales ``(B|1, H|1, NB)``, one
  scale per ``q_block`` / ``k_block`` tokens (``NB = ceil(S / block)``), or ``block == 0``: one scale per head
  ``(1, H, 1)`` or per tensor ``(1, 1, 1)``. Or bf16/fp16 Q/K with ``q_scale = k_scale = None`` (QK16PV8).
  Any strides with unit stride on D (BSHD views and BHSD both; nothing is copied). Scales must be >= 0
  (they are ``amax · fp32(1/qmax)``); size-1 scale dims broadcast.
* ``v (B, Hkv, Skv, Dv)``: float8_e4m3fn, sequence-major (``stride(-2) == 1``, physically ``(B, H, Dv, S)``, what
  the quantize node writes for this kernel and what Hopper's FP8 wgmma wants for its B operand) or D-major
  (``stride(-1) == 1``, accepted; P·V then runs as an exact fp16 MMA, slower). ``v_scale (B|1, Hkv|1, Dv|1)``.
* ``key_bias`` (optional): fp32 ``(B|1, Skv)``, unit stride on keys, added to the logits in natural-log units
  (``-inf`` masks a key; how key-padding masks run). A row whose keys are all masked gives 0.
* ``block_index`` / ``block_count`` (optional, :mod:`qattn_fx.block_sparse`): int32 ``(B, Hq, ceil(Sq/128),
  ceil(Skv/128))`` / ``(B, Hq, ceil(Sq/128))``, contiguous, on Q's device: per (batch, query head) and 128-row
  query tile, the ascending key tiles of 128 keys it visits (the first ``count`` entries; those past it are never
  read). A block not visited is exactly a block whose logits are ``-inf``; a query tile that visits nothing gives 0
  and LSE ``-inf``.
* ``V`` may hold more rows than K (``Sv >= Skv``: the quantize node pads sequence-major V to 16 tokens); only the
  first ``Skv`` are read. Calls of more than 65,535 (batch, head) pairs run in batch chunks (the grid limit; the
  block lists are chunked with them).
* GQA (``Hq = g · Hkv``), ``Sq != Skv``, lengths that are not multiples of any tile, head_dim 64 or 128.
* Returns ``(B, Hq, Sq, Dv)`` in ``out_dtype`` stored BSHD (``torch.empty(B, Sq, Hq, Dv).transpose(1, 2)``);
  :func:`attention` can also return the natural-log LSE ``(B, Hq, Sq)`` fp32.

Algorithm (one program = ``BLOCK_M`` query rows of one (batch, head)):

1. Q's tile is loaded once. Its per-row scale ``q_scale · sm_scale · log2(e)`` (times K's scale when K has one
   scale per head/tensor) is a ``BLOCK_M`` vector ``rs``.
2. For each ``BLOCK_N`` tile of K/V: ``S = dot(q, kᵀ)`` (int32 for int8, fp32 for fp8/bf16). INT8 accumulators
   are converted exactly with the ``2^23 · 1.5`` magic number (an integer add that Triton folds into the MMA's
   initial accumulator, then one fp op, instead of a slow I2F; exact because ``|S| <= 128³ < 2^22``). K scales
   with ``k_block < BLOCK_N`` multiply the columns, fused with that conversion into one correctly rounded fma
   (K scales used with 22 significant bits there, a relative change < 2e-7); when ``k_block`` divides the tile
   only ``BLOCK_N / k_block`` scales are loaded and applied through a (BLOCK_M, groups, k_block) view of S (a
   register relabeling, no data movement); coarser K scales are uniform over the tile and fold into ``rs``.
   Logits in log2 units are ``z = t · rs`` with ``t`` the K-scaled accumulator; because scales are >= 0 the row
   max is ``max(t) · rs``. With ``pipe`` configs the next tile's ``S`` is issued (async wgmma) before this
   tile's softmax, so the exp2s run while the tensor cores compute it.
3. Online softmax in fp32 with exp2: ``P448 = exp2(z - m + log2(448))`` = ``448 · exp2(z - m)`` where ``m`` is
   the running row max, so the e4m3 operand is just ``P448`` rounded (RNE, saturating: the reference's
   ``e4m3(P · 448)``) and ``l = Σ P448`` (unrounded) carries the same factor 448, which cancels in ``acc / l``.
4. Two-level accumulation: every tile's ``P·V`` goes into a fresh fp32 MMA accumulator (FP8 MMAs on Ada and Hopper
   keep ~22 bits in the accumulator) which is then added in full fp32 to the running output:
   ``acc = acc · alpha + dot(P8, V8)``. (Triton folds ``acc + dot(a, b)`` into ``dot(a, b, acc)`` only when the
   dot's ``max_num_imprecise_acc`` is 0: on sm_90 FP8 dots default to 2^30, on sm_89 we pass ``BLOCK_N``.)
5. Epilogue: ``O = acc · v_scale / l``, stored in ``out_dtype``; ``lse = ln2 · (m + log2(l) - log2(448))``.

Block-sparse calls (lists given; the ``SPARSE`` constexpr, so the dense kernel's code is unchanged): ``BLOCK_M``
and ``BLOCK_N`` divide 128 (configs that do not are refused, or pruned from autotuning), so a program's rows lie in
one query tile and a key tile is ``128 / BLOCK_N`` whole sub-tiles. The program reads its tile's count and walks
the listed key tiles' sub-tiles in list order, steps 2-4 on each (no loads, Q·Kᵀ or P·V for the others); sub-tiles
past ``Skv`` are left out and the last key tile's partial one is masked as the dense tail is. K/V bases are computed
per sub-tile (64-bit) instead of advanced. With ``pipe`` the next sub-tile of the walk has its Q·Kᵀ issued early
(its list entry read one step ahead). With a key bias every visited sub-tile adds it (the dense kernel skips it
outside the bias's nonzero span). Lists of every block reproduce the dense kernel's bits; under the interpreter a
walk's loop runs to the most sub-tiles a list can name, iterations past the walk doing nothing. An empty walk under
``pipe`` still issues one masked Q·Kᵀ and runs the final step on a fully masked sub-tile (no K/V loads), whose
result it discards (branch-free: a branch there costs registers in the loop); the output is 0.

Differences from the reference are fp32 rounding and the P rounding point: the reference rounds
``exp(s - global_max) · 448`` while a flash kernel rounds against the running max of the tiles seen so far
(identical when the row max sits in the first tile). P of tiles before a row's max tile therefore land on a
different e4m3 grid; outputs differ from the reference by ~1-3 % relative (growing with the number of such tiles
towards the rms of one e4m3 rounding), which is the size of the reference's own FP8-P error against fp32
attention, not an accuracy loss. The tests pin the algorithm itself to fp32 level (emulation, first-tile max).

Offsets: batch/head bases and the Q/O tile base are int64; inside a head, K/V pointers advance by
``BLOCK_N · stride`` per tile (pointer arithmetic, 64-bit), so tensors past 2^31 elements index correctly as long
as one tile's span (``BLOCK_N · stride_s``, ``Dv · stride_d``) fits in int32.

Configs: :data:`CONFIGS` are autotuned (``triton.autotune``) per (head_dim, dtypes, block sizes, V layout,
sequence-length buckets) among those with the device's key tile (:data:`BLOCK_N_BY_CAPABILITY`,
:func:`tuned_candidates`): they give identical outputs, so the choice changes only the time. :func:`set_config` /
:func:`use_config` or ``qattn_fx.config.triton_sage_config``
(``$QATTN_TRITON_SAGE_CONFIG="BLOCK_M,BLOCK_N,num_warps,num_stages[,pipe]"``) force one (benchmarks sweep with them).
Autotuning benchmarks on the first call per key: warm up before CUDA-graph capture, or force a config. Variants tried
and removed (an fp16 P·V, K/V through TMA descriptors, a depth-2 pipeline): docs/kernel-design.md.

The kernel source is loaded on first use in the Triton mode then in effect (:func:`.launch.kernel_module`), so
``TRITON_INTERPRET=1`` set at any time before the first call runs it under the Triton interpreter (CPU tensors
allowed there). The interpreter's fp32→fp8 cast and its bf16 ``dot`` are not exact, so under the interpreter the
kernel rounds P onto the e4m3 grid itself (RNE, exact) and upcasts bf16/fp16 Q/K to fp32 (exact products);
compiled kernels use the hardware paths.

Layout: :mod:`.config` (launch configs, forcing); the Triton source in three files, :mod:`.tiles` (one tile's
loads, softmax and P·V, the schedules' steps), :mod:`.walk` (the block-sparse walk) and :mod:`.kernel`
(``_sage_fwd``), each loaded per Triton mode by :mod:`.source`; :mod:`.launch` (the host side). The constants,
input checks and helpers shared with gluon_sage are in :mod:`.._sage_common`.
"""

from .._offline import ptxas_report
from .config import (BLOCK_N_BY_CAPABILITY, CONFIGS, INTERPRET_CONFIG, FORCED, KernelConfig, forced_config, set_config,
                     use_config)
from .launch import (CAPABILITIES, HEAD_DIMS, attention, best_config, check_device, compile_for, interpreter_active,
                     kernel_module, prune_configs, scaled_attention, sparse_config_error, tuned_candidates)

__all__ = ["BLOCK_N_BY_CAPABILITY", "CAPABILITIES", "CONFIGS", "FORCED", "HEAD_DIMS", "INTERPRET_CONFIG",
           "KernelConfig", "attention", "best_config", "check_device", "compile_for", "forced_config",
           "interpreter_active", "kernel_module", "prune_configs", "ptxas_report", "scaled_attention", "set_config",
           "sparse_config_error", "tuned_candidates", "use_config"]
