"""A diffusers Wan transformer under context parallelism (2 processes, gloo, CPU) quantized by the compiled pass.

``torchrun --standalone --nproc-per-node 2 -m benchmarks.context_parallel --model tiny --device cpu`` builds the
same tiny Wan on two ranks, splits its sequence with diffusers' ``enable_parallelism`` (Ulysses, then ring on the
``_native_flash`` backend), compiles it whole with ``qattn_fx.backend(emulate=True)`` and compares rank 0's output
with the single-process compiled one:

* Ulysses: every rank attends over all tokens of its heads, so the quantized blocks are the single process's and
  the output is the same;
* ring: each K/V chunk is quantized (smoothed, scaled) on its own and the partial results merge by their LSE, so the
  output differs from the single process's, by less than quantization moves either from dense, and it is about as
  close to dense as the single process's.

Graphs go to ``aot_eager`` after the pass (the pass is what is tested; Inductor on the same graphs is the
benchmark's default: docs/multi-gpu.md).
"""

import json
import subprocess
import sys

import pytest

from benchmarks import context_parallel
from support import ROOT, subprocess_env


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "cp.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "benchmarks.context_parallel", "--model", "tiny", "--device", "cpu", "--compiler", "aot_eager",
               "--variants", "dense-1,qattn-1,qattn-ulysses,qattn-ring", "--iters", "1", "--warmup", "0",
               "--min-cosine", "0.9999", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=subprocess_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {row["variant"]: row for row in json.loads(out.read_text())["rows"]}


def sites(row, role):
    return [s for s in row["site_table"] if s["role"] == role]


@pytest.mark.slow
def test_ulysses_quantized_output_is_the_single_process_one(run):
    assert run["qattn-ulysses"]["rel_l2_vs"]["qattn-1"] < 1e-6
    assert run["qattn-ulysses"]["graphs"] == run["qattn-ring"]["graphs"] == 1  # whole model, no graph break
    # the all-to-alls around the local attention (Q, K, V in; the output back) and the output's gather, untouched
    assert run["qattn-ulysses"]["collectives"] == {"all_to_all_single": 4, "all_gather_into_tensor": 1,
                                                   "wait_tensor": 5}
    (attn1,) = sites(run["qattn-ulysses"], "self")
    # the local attention: all 128 tokens, one of the two heads; the all-to-alls around it untouched
    assert attn1["module"] == "blocks.0.attn1" and attn1["q_shape"] == [1, 1, 128, 12]
    assert attn1["kernel"] == "reference" and attn1["notes"] == [
        "context parallel: Q, K/V through the Ulysses all-to-all; shapes are this rank's"]
    (attn2,) = sites(run["qattn-ulysses"], "cross")  # cross-attention: this rank's 64 queries, all 12 text tokens
    assert attn2["q_shape"] == [1, 2, 64, 12] and attn2["kv_shape"] == [1, 2, 12, 12]


@pytest.mark.slow
def test_ring_quantized_output_is_close_to_the_single_process_one(run):
    quantization = run["qattn-1"]["rel_l2_vs_ref"]  # how far quantizing moves the output from dense (dense-1)
    ring = run["qattn-ring"]
    assert ring["rel_l2_vs"]["qattn-1"] < quantization / 2, (ring["rel_l2_vs"], quantization)
    assert ring["rel_l2_vs_ref"] < 1.5 * quantization, (ring["rel_l2_vs_ref"], quantization)
    ring = sites(ring, "self")
    assert len(ring) == 2 and all(s["kernel"] == "reference" and s["q_shape"] == [1, 2, 64, 12] for s in ring)
    assert all(any("log-sum-exp" in n for n in s["notes"]) for s in ring)
    assert any("all-gather (ring attention)" in n for n in ring[1]["notes"])


def test_arguments():
    args = context_parallel.parse_args([])
    assert (args.model, args.blocks, args.frames, args.height, args.width) == ("wan14b", 4, 81, 720, 1280)
    assert args.ring_backend == "_native_cudnn" and not args.emulate
    assert context_parallel.describe(args) == ("Wan wan14b config (4 blocks, 40 heads, d128), 81 frames 720x1280 = "
                                               "75600 tokens, text 512, bfloat16")
    assert context_parallel.parse_args(["--device", "cpu"]).ring_backend == "_native_flash"
    for bad in (["--variants", "dense-2"], ["--height", "700"], ["--blocks", "0"]):
        with pytest.raises(SystemExit):
            context_parallel.parse_args(bad)
