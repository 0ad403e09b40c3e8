"""Dynamo trace rules that hide attention from the pass, and the one switch qattn_fx offers to change them.

Dynamo records ``torch.nn.functional.multi_head_attention_forward`` (what ``nn.MultiheadAttention`` runs) as one
call in its graph instead of tracing into it, so the ``scaled_dot_product_attention`` inside is no site: the report
names the call (:func:`qattn_fx.fx.match.other_attention`) with :data:`MHA_HINT`. :func:`trace_multihead_attention`
has Dynamo trace into it instead; the function then computes the same values with its own torch calls, and with
``need_weights=False`` its attention is an SDPA call the pass serves. With ``need_weights=True`` (the module's
default) it computes the weights with a matmul and a softmax, which no kernel serves.
"""

from __future__ import annotations

#: Dynamo's name for ``nn.MultiheadAttention``'s functional form.
MHA = "torch.nn.functional.multi_head_attention_forward"
#: Said with a report's note on calls of :data:`MHA`.
MHA_HINT = (f"{MHA} (nn.MultiheadAttention) is one call in Dynamo's graph; qattn_fx.trace_multihead_attention(), "
            "called before compiling, has Dynamo trace into it so that its attention becomes a site "
            "(with need_weights=False)")


def trace_multihead_attention() -> bool:
    """Have Dynamo trace into :data:`MHA` instead of recording it as one call, for every compile that follows in
    this process (Dynamo's rule for it is removed; code compiled before keeps its graphs). Returns whether the rule
    was there. Its values do not change: the function runs the same torch calls, traced."""
    from torch._dynamo import trace_rules

    removed = trace_rules.torch_non_c_binding_in_graph_functions.pop(MHA, None) is not None
    trace_rules.get_torch_obj_rule_map.cache_clear()
    return removed
