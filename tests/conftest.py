"""Test-session setup shared by every test module."""

import sys

import torch

if not torch.cuda.is_available():
    # fla-core is installed as a CUDA dependency. On a CPU machine under TRITON_INTERPRET=1 (which the
    # kernel tests need) transformers would pick fla's Triton kernels for its Qwen3.5 oracle and fail to
    # find a GPU driver; hiding fla keeps the oracle on transformers' torch reference path.
    sys.modules.setdefault("fla", None)
