"""Runtime settings of qattn_fx's kernels and debug dumps, in the manner of ``torch._inductor.config``.

Settings are module attributes, read where they are used (so a change takes effect on the next call): set one
directly (``qattn_fx.config.autotune = False``) or for a block (``with qattn_fx.config.patch(gluon_tail_split=False):
...``; ``patch`` is also a decorator). Each default comes from an environment variable, read when qattn_fx is
imported:

===========================  ===============================  ================================================
setting                      environment variable             meaning
===========================  ===============================  ================================================
``debug_dir``                ``QATTN_FX_DEBUG``               directory for per-graph debug dumps (the
                                                              backend's ``debug_dir=`` wins)
``autotune``                 ``QATTN_AUTOTUNE`` (``0``/``1``)  time the launch configs on a problem's first call;
                                                              off: cached choices, else each kernel's default
``tuning_cache``             ``QATTN_TUNING_CACHE``           tuning choices file; ``""``: memory only; unset:
                                                              ``~/.cache/qattn_fx/tuning.json``
``triton_sage_config``       ``QATTN_TRITON_SAGE_CONFIG``     force one triton_sage config for every call
                                                              (``"BLOCK_M,BLOCK_N,warps,stages[,pipe]"``)
``gluon_sage_config``        ``QATTN_GLUON_SAGE_CONFIG``      force one gluon_sage config for every call
                                                              (``"BLOCK_N,STAGES[,flags]"``)
``gluon_tail_split``         ``QATTN_GLUON_TAIL_SPLIT``       split gluon_sage's partial last wave over the keys
                                                              (``0``: never)
``fused_kv_quantize``        ``QATTN_FUSED_KV_QUANTIZE``      quantize a Sage site's K and V on CUDA with
                                                              ``qattn::kv_stats`` and ``qattn::quantize_kv`` (one
                                                              Triton launch) when the recipe allows (read when a
                                                              graph is rewritten; default ``1``; ``0``: the
                                                              separate ops, bitwise the same data)
===========================  ===============================  ================================================
"""

import sys
from typing import Optional

from torch.utils._config_module import Config, install_config_module

debug_dir: Optional[str] = Config(default=None, env_name_default="QATTN_FX_DEBUG", value_type=Optional[str])
autotune: bool = Config(default=True, env_name_default="QATTN_AUTOTUNE")
tuning_cache: Optional[str] = Config(default=None, env_name_default="QATTN_TUNING_CACHE", value_type=Optional[str])
triton_sage_config: Optional[str] = Config(default=None, env_name_default="QATTN_TRITON_SAGE_CONFIG",
                                           value_type=Optional[str])
gluon_sage_config: Optional[str] = Config(default=None, env_name_default="QATTN_GLUON_SAGE_CONFIG",
                                          value_type=Optional[str])
gluon_tail_split: bool = Config(default=True, env_name_default="QATTN_GLUON_TAIL_SPLIT")
fused_kv_quantize: bool = Config(default=True, env_name_default="QATTN_FUSED_KV_QUANTIZE")

def flag(name: str) -> bool:
    """A boolean setting, validated where it is used (an environment variable may hold anything)."""
    value = getattr(sys.modules[__name__], name)
    if value not in (True, False):
        env = "QATTN_" + name.upper() if name != "debug_dir" else "QATTN_FX_DEBUG"
        raise ValueError(f"qattn_fx.config.{name} (${env}) = {value!r} is invalid; valid: 0, 1 (or False, True)")
    return bool(value)


install_config_module(sys.modules[__name__])
