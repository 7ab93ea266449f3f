"""Depthwise causal conv + SiLU for prefill / decode rows that extend a sequence (state is written).

The verify route (read-only history, tree parents, windows for commit) lives in tree_step.py / naive.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_extend(rows: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, n_rows: torch.Tensor):
    """rows: [L, T, C] projected qkv (valid rows first, n_rows[l] of them); history: [L, C, K-1] the
    K-1 raw inputs before row 0; weight: [C, K] (tap K-1 multiplies the current row).
    Returns (silu(conv) [L, T, C] in rows' dtype, new history [L, C, K-1] = last K-1 raw inputs
    after the lane's n_rows rows)."""
    L, T, C = rows.shape
    K = weight.shape[1]
    full = torch.cat([history.to(rows.dtype), rows.transpose(1, 2)], dim=2)  # [L, C, K-1+T]
    out = F.conv1d(full.to(weight.dtype), weight[:, None, :], groups=C)  # [L, C, T]
    out = F.silu(out).to(rows.dtype).transpose(1, 2)
    idx = n_rows.view(L, 1, 1) + torch.arange(K - 1, device=rows.device).view(1, 1, K - 1)
    new_history = full.gather(2, idx.expand(L, C, K - 1))
    return out, new_history
