"""qattn_fx's benchmarks, run from the repository root as modules (``python -m benchmarks.attention_ops --help``).

* :mod:`benchmarks.attention_ops`: the attention op alone (kernel, and quantize + kernel compiled) against torch SDPA.
* :mod:`benchmarks.dit_step`: one denoising forward of a diffusers video transformer under ``torch.compile``.
* :mod:`benchmarks.context_parallel`: a Wan transformer split over GPUs (diffusers' Ulysses / ring context
  parallelism, ``torchrun``), dense vs qattn_fx; :mod:`benchmarks.parallel` sets the parallelism up for a compile.
* :mod:`benchmarks.tune`: sweep the launch configs of ``triton_sage`` or ``gluon_sage``.
* :mod:`benchmarks.shapes`: the one table of benchmark shapes; :mod:`benchmarks.common`: timing, accuracy, inputs
  and reporting helpers shared by the benchmarks and by ``tools/``.

Results of the runs behind BENCHMARKS.md and docs/kernel-profile.md are in ``benchmarks/results/``.
"""
