"""Speculative sampling is lossless in distribution: a chi-square test over many seeded draws cannot
tell it from target-only sampling, while the same test does tell a broken acceptance rule apart."""

import pytest
import torch
from scipy.stats import chi2_contingency

import deltaflash.engine.runner as runner_module
from deltaflash.core.request import SamplingParams
from deltaflash.speculative.acceptance import Accepted, accept
from tests.spec_pairs import engine_for, peaked_pair

VOCAB, N, TOKENS = 12, 1200, 3
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return peaked_pair(tmp_path_factory.mktemp("sampling"), VOCAB, ("dflash", "dflash2"))


def accept_every_draft(logits, drafts, draft_q, n_draft, sampling, rules=None, top_logprobs=None):
    """A broken rule: every allowed draft is kept (no rejection step), the next token is the draft after."""
    if drafts.shape[1] == 0:
        return accept(logits, drafts, draft_q, n_draft, sampling, rules, top_logprobs)
    tokens = torch.cat([drafts, drafts[:, :1]], dim=1)
    return Accepted(counts=n_draft, tokens=tokens)


def draws(engine, params_for_seed):
    done, _ = engine.generate([PROMPT] * N, [params_for_seed(i) for i in range(N)])
    return torch.tensor([c.token_ids for c in done])  # [N, TOKENS]


def p_values(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Homogeneity of each position's token distribution, and of the (t1, t2) pair, between two samples."""
    out = []
    columns = [a[:, i] for i in range(TOKENS)] + [a[:, 0] * VOCAB + a[:, 1]]
    other = [b[:, i] for i in range(TOKENS)] + [b[:, 0] * VOCAB + b[:, 1]]
    for x, y in zip(columns, other):
        cells = sorted(set(x.tolist()) | set(y.tolist()))
        table = torch.tensor([[int((x == c).sum()), int((y == c).sum())] for c in cells])
        rare = table.sum(1) < 10  # merge sparse cells so the chi-square approximation holds
        table = torch.cat([table[~rare], table[rare].sum(0, keepdim=True)]) if rare.any() else table
        out.append(chi2_contingency(table.numpy())[1])
    return out


@pytest.mark.parametrize("variant,top_p,top_k", [("dflash", 1.0, 0), ("dflash", 0.9, 6), ("dflash2", 0.9, 0)])
def test_speculative_sampling_matches_target_distribution(pair, variant, top_p, top_k, monkeypatch):
    """DFlash drafts from q = its own sampling distribution; DFlash2 from the selector's q over its top-k."""
    target, drafts = pair
    draft = drafts[variant]
    params = lambda seed, base: SamplingParams(max_new_tokens=TOKENS, temperature=1.0, top_p=top_p, top_k=top_k,  # noqa: E731
                                              seed=base + seed, ignore_eos=True)
    plain = draws(engine_for(target, max_slots=64), lambda i: params(i, 0))
    spec = draws(engine_for(target, draft, max_slots=64), lambda i: params(i, 100_000))
    assert min(p_values(plain, spec)) > 1e-3

    # power: accepting every draft (no rejection step) must be caught by the same test
    monkeypatch.setattr(runner_module, "accept", accept_every_draft)
    broken = draws(engine_for(target, draft, max_slots=64), lambda i: params(i, 200_000))
    assert min(p_values(plain, broken)) < 1e-4
