"""What torch's SDPA backends give for a query row whose keys are all masked, on the GPU (bf16).

    python -m tools.masked_rows

A symmetric padding mask ``m_i & m_j`` (HunyuanVideo-1.5) masks every key of each masked query. qattn_fx sets those
rows to 0 (:class:`qattn_fx.fx.masks.MaskRead`); this prints, per SDPA backend, the largest magnitude in those rows,
whether any is NaN, and whether the kept rows are finite.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    q, k, v = (torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    m = torch.ones(1, 256, dtype=torch.bool, device="cuda")
    m[:, 200:] = False
    r = m.view(1, 1, 1, 256).repeat(1, 1, 256, 1)
    mask = r & r.transpose(2, 3)
    backends = [("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]
    for name, backend in backends:
        try:
            with sdpa_kernel(backend) if backend is not None else torch.no_grad():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        except RuntimeError as e:
            print(f"{name}: error {str(e)[:200]}")
            continue
        rows = out[:, :, 200:]
        print(f"{name} masked rows: max|x| {rows.abs().max().item()} nan {rows.isnan().any().item()} kept rows "
              f"finite {out[:, :, :200].isfinite().all().item()}")


if __name__ == "__main__":
    main()
