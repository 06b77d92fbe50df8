"""What this CPU lets torch run, for the few tests whose outcome depends on it.

``runs_bf16_lstm()``: under CPU bf16 autocast an ``nn.LSTM`` fed a float32 input takes oneDNN's RNN
(``aten::mkldnn_rnn_layer``, which autocast casts to bfloat16), and oneDNN has a bf16 RNN primitive only
from its ``avx512_core`` ISA on. On an x86 CPU without AVX-512 (or with ``ONEDNN_MAX_CPU_ISA=AVX2``) torch
itself raises "could not create a primitive descriptor for the LSTM forward propagation primitive", which
the plugin turns into its one-sentence ``RecipeUnsupportedError`` (``tests/checks/test_runner.py`` checks
that sentence on such a CPU). Measured on torch 2.14.1: a bf16 ``nn.GRU`` runs there (it stays in float32
under autocast). ``torch.ops.mkldnn._is_mkldnn_bf16_supported`` reads oneDNN's effective ISA, so it
follows that cap.
"""
from __future__ import annotations

import torch

#: The reason a test that runs an LSTM under the bf16 recipe is skipped on such a CPU.
NO_BF16_LSTM = ("torch's CPU bf16 autocast cannot run nn.LSTM on this CPU (oneDNN's bf16 RNN needs AVX-512): "
                "the plugin's one-sentence error there is checked by tests/checks/test_runner.py")


def runs_bf16_lstm() -> bool:
    """Whether torch can run an ``nn.LSTM`` under CPU bf16 autocast on this machine (module doc)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN: the native LSTM runs
        return True
