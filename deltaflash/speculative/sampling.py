"""Turning logits into tokens for a batch of lanes, each with its own request's settings, on the device.

Every lane samples from `lane_probs` (softmax(logits / T) over the top_k, then the top_p nucleus,
renormalised); greedy lanes take the argmax. Randomness is counter-based: the noise of one sampling
step of a request is a hash of (request seed, step number `draws`, stream, element index), so one
request's draws depend on nothing else in the batch, a seeded request is reproducible, and no
generator object or per-lane launch is needed. A sample from q is argmax(q / E) with E = -log(U),
U uniform in (0, 1) from the hash (an exponential race: exactly q-distributed). Nothing here syncs
with the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from deltaflash.core.batch import to_device
from deltaflash.core.request import SamplingParams

# noise streams of one sampling step: drafter sampling, acceptance uniforms, the resampled / bonus token
STREAM_DRAFT, STREAM_ACCEPT, STREAM_TOKEN = 0, 1, 2
_STREAMS = 3
_M32 = 0xFFFFFFFF
# multipliers below 2^31, so (value < 2^32) * multiplier never leaves int64
_MUL_A, _MUL_B = 0x7FEB352D, 0x5BD1E995
_ROW_CHUNK = 1 << 24  # elements of noise made at once (bounds the int64 temporaries)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def noise_keys(seed: int, draws: int) -> list[list[int]]:
    """[_STREAMS][2] 32-bit keys of one sampling step of one request (host ints)."""
    base = _splitmix64(_splitmix64(seed) ^ draws)
    keys = []
    for stream in range(_STREAMS):
        h = _splitmix64(base + stream)
        keys.append([h & _M32, h >> 32])
    return keys


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _M32
    return x ^ (x >> 16)


def uniform_noise(keys: Tensor, shape: tuple[int, ...]) -> Tensor:
    """U(0, 1) fp32 [L, *shape[1:]]: element i of lane l hashed from keys [L, 2] (one stream's keys)."""
    n = 1
    for d in shape[1:]:
        n *= d
    index = torch.arange(n, device=keys.device, dtype=torch.long)[None]
    h = _mix32(_mix32(index ^ keys[:, :1]) ^ keys[:, 1:2])
    return ((h >> 8).float() + 0.5).mul_(2.0 ** -24).view(shape)


def sample_from(probs: Tensor, keys: Tensor) -> Tensor:
    """One token per row of probs [L, ..., V] (fp32, rows sum to 1; zeros never drawn) with the noise
    of keys [L, 2]: argmax(q / E). Noise is made in chunks of rows to bound memory."""
    L = probs.shape[0]
    flat = probs.reshape(L, -1, probs.shape[-1])
    rows_per_chunk = max(1, _ROW_CHUNK // max(flat.shape[1] * flat.shape[2], 1))
    picks = []
    for lo in range(0, L, rows_per_chunk):
        part = flat[lo:lo + rows_per_chunk]
        exp_noise = uniform_noise(keys[lo:lo + rows_per_chunk], tuple(part.shape)).log_().neg_()
        picks.append((part / exp_noise).argmax(dim=-1))
    return torch.cat(picks).view(probs.shape[:-1])


@dataclass(frozen=True)
class LaneSampling:
    """Sampling settings of L lanes (one request each) on the device.

    temperature [L] fp32 (1 on greedy lanes, whose probabilities are never used); top_p [L] fp32;
    top_k [L] long (0 = off); greedy [L] bool; keys [L, 3, 2] long: this step's noise keys per stream;
    min_p [L] fp32 or None (no lane uses it).
    all_greedy / filtered (some lane uses top_p < 1, top_k > 0 or min_p) are host flags that skip work; when
    every lane is greedy the tensors are None (nothing reaches the device). Padding lanes are greedy.
    """

    temperature: Tensor | None
    top_p: Tensor | None
    top_k: Tensor | None
    greedy: Tensor | None
    keys: Tensor | None
    all_greedy: bool
    filtered: bool
    min_p: Tensor | None = None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], draws: Sequence[int], device,
              lanes: int | None = None) -> "LaneSampling":
        """One lane per request (params, seed, draw counter), padded with greedy lanes to `lanes`."""
        sampled = [p for p in params if not p.greedy]
        if not sampled:
            return ALL_GREEDY
        pad = (lanes or len(params)) - len(params)
        greedy = [p.greedy for p in params] + [True] * pad
        keys = [noise_keys(s, d) for s, d in zip(seeds, draws)] + [[[0, 0]] * _STREAMS] * pad
        temperature = [1.0 if p.greedy else p.temperature for p in params] + [1.0] * pad
        top_p = [p.top_p for p in params] + [1.0] * pad
        top_k = [p.top_k for p in params] + [0] * pad
        min_p = [p.min_p for p in params] + [0.0] * pad
        floats = to_device([temperature, top_p, min_p], device, torch.float32)  # two transfers, not six
        ints = to_device([[k, g, *(x for pair in lane for x in pair)] for k, g, lane in zip(top_k, greedy, keys)],
                         device)  # per lane [top_k, greedy, keys (3 x 2)]
        return cls(temperature=floats[0], top_p=floats[1], top_k=ints[:, 0], greedy=ints[:, 1].bool(),
                   keys=ints[:, 2:].view(-1, _STREAMS, 2), all_greedy=False,
                   filtered=any(p.top_p < 1 or p.top_k > 0 or p.min_p > 0 for p in sampled),
                   min_p=floats[2] if any(p.min_p > 0 for p in sampled) else None)

    @classmethod
    def greedy_lanes(cls, lanes: int, device) -> "LaneSampling":
        return cls.build([], [], [], device, lanes)

    def stream(self, which: int) -> Tensor:
        """keys [L, 2] of one stream."""
        return self.keys[:, which]


ALL_GREEDY = LaneSampling(None, None, None, None, None, all_greedy=True, filtered=False)  # build()'s all-greedy lanes


def lane_probs(logits: Tensor, sampling: LaneSampling) -> Tensor:
    """q [L, ..., V] fp32 from logits [L, ..., V]: per lane softmax(logits / T) over its top_k, then its
    top_p nucleus (tokens whose preceding mass in the top-k distribution is < top_p), then its min_p
    filter (tokens below min_p times the most likely one go), renormalised."""
    L, V = logits.shape[0], logits.shape[-1]
    per_lane = (L,) + (1,) * (logits.dim() - 1)
    scores = logits.float() / sampling.temperature.view(per_lane)
    if not sampling.filtered:
        return scores.softmax(dim=-1)
    ordered, order = scores.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)
    top_k = torch.where(sampling.top_k > 0, sampling.top_k, V).view(per_lane)
    ordered = ordered.masked_fill(rank >= top_k, float("-inf"))
    probs = ordered.softmax(dim=-1)
    nucleus = (probs.cumsum(dim=-1) - probs) < sampling.top_p.view(per_lane)
    probs = probs * nucleus
    if sampling.min_p is not None:  # sorted descending: the row's largest probability is column 0
        probs = probs * (probs >= sampling.min_p.view(per_lane) * probs[..., :1])
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def sampling_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """lane_probs with one setting for every row of logits [..., V] (the oracles' form)."""
    rows = logits.reshape(-1, logits.shape[-1])
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    sampling = LaneSampling.build([params] * rows.shape[0], [0] * rows.shape[0], [0] * rows.shape[0], logits.device)
    return lane_probs(rows, sampling).view(logits.shape)
