"""Prompt logprobs (what a completion's `echo` with logprobs scores): each prompt token's log probability
under the row before it, from a prefill that keeps every row's hidden state - cut into chunks, beside other
requests, with and without a drafter, resumed after a preemption - against transformers' forward of the
whole prompt."""

import pytest
import torch

from deltaflash.core.request import SamplingParams
from deltaflash.errors import RequestError
from tests.spec_pairs import DEVICE, engine_for, make_pair, prompts
from tests.test_pages import all_free, page_bytes

K = 3  # top logprobs asked for
# on a GPU fla-core's chunked kernels (the engine's prefill and the transformers oracle's) multiply in TF32
TOL = 1e-4 if DEVICE == "cpu" else 5e-3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("scored"), block_size=4)


@pytest.fixture(scope="module")
def oracle(pair):
    from transformers import Qwen3_5ForCausalLM

    # (on the test device: with fla-core installed, a GPU machine's transformers runs fla's kernels)
    model = Qwen3_5ForCausalLM.from_pretrained(pair[0], dtype=torch.float32).to(DEVICE).eval()

    def scores(prompt: list[int]) -> torch.Tensor:
        """log_softmax of every row of the whole prompt's forward [T, V]."""
        with torch.no_grad():
            return model(torch.tensor([prompt], device=DEVICE)).logits[0].float().log_softmax(-1).cpu()
    return scores


def assert_scored(entries, prompt, reference, k: int) -> None:
    """entries: one per prompt token from the second on - its logprob, its rank and the row's k most likely
    tokens - as the whole prompt's forward has them (within TOL: tokens closer than that may swap places)."""
    assert [e.token_id for e in entries] == prompt[1:]
    for t, entry in enumerate(entries):
        row = reference[t]
        chosen = row[prompt[t + 1]].item()
        assert entry.logprob == pytest.approx(chosen, abs=TOL)
        surely, maybe = (int((row > chosen + d).sum()) for d in (2 * TOL, -2 * TOL))  # likelier tokens (+ itself)
        assert 1 + surely <= entry.rank <= maybe
        top = row.topk(k)
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=TOL)
        assert all(row[i] >= top.values[-1] - 2 * TOL for i, _ in entry.top)  # each among the k likeliest


@pytest.mark.parametrize("speculative", [False, True], ids=["target-only", "spec"])
def test_prompt_logprobs_equal_the_whole_prompts_forward(pair, oracle, speculative):
    """Prompts of 41, 9 and 1 tokens scored beside an unscored request, in steps of 16 prompt tokens, a chunk's
    rows scored 8 at a time: every entry as transformers has it; a request of max_new_tokens 0 ends after its
    prefill with nothing generated; scoring changes no generated token."""
    engine = engine_for(pair[0], pair[1] if speculative else None, max_num_batched_tokens=16, idle_prefill_tokens=16)
    engine.runner.scoring_rows = 8
    vocab = engine.cfg.vocab_size
    batch = prompts(vocab, [41, 9, 1, 23], seed=5)
    asked = [SamplingParams(max_new_tokens=0, prompt_logprobs=K),
             SamplingParams(max_new_tokens=6, prompt_logprobs=K, ignore_eos=True),
             SamplingParams(max_new_tokens=0, prompt_logprobs=0),
             SamplingParams(max_new_tokens=6, ignore_eos=True)]
    done, _ = engine.generate(batch, asked)
    long, short, one, plain = done
    assert long.token_ids == [] and long.finish_reason == "length" and one.token_ids == []
    assert_scored(long.prompt_logprobs, batch[0], oracle(batch[0]), K)
    assert_scored(short.prompt_logprobs, batch[1], oracle(batch[1]), K)
    assert one.prompt_logprobs == [] and plain.prompt_logprobs == []
    unscored, _ = engine.generate([batch[1]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert short.token_ids == unscored[0].token_ids and len(short.token_ids) == 6
    assert all_free(engine)


def test_a_scored_prompt_is_prefilled_whole_and_its_logits_computed_scoring_rows_at_a_time(pair, monkeypatch):
    """The scheduler cuts a scored prompt as any other (here: one step); the runner projects its rows to logits
    `scoring_rows` at a time (the 40 rows that predict prompt tokens 1..40 in blocks of 16, 16 and 8), then
    the last row for the first token - so a step's logits stay small however long its scored chunks."""
    engine = engine_for(pair[0])
    engine.runner.scoring_rows = 16
    model, projected = engine.runner.model, []
    logits = model.logits

    def counting(hidden, kernels):
        projected.append(hidden.shape[0])
        return logits(hidden, kernels)
    monkeypatch.setattr(model, "logits", counting)
    engine.add_request(prompts(engine.cfg.vocab_size, [41])[0], SamplingParams(max_new_tokens=0, prompt_logprobs=0))
    steps = []
    while engine.has_work():
        engine.step(on_report=lambda r: steps.append(r.prefill_tokens))
    assert steps == [41] and projected == [16, 16, 8, 1]


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "target-only"])
def test_preempted_scored_sequences_resume_without_scoring_again(pair, speculative):
    """A pool too small for four scored sequences: the newest are preempted and recomputed; each prompt's
    entries come once (no row scored twice) and equal an engine's with room for all."""
    draft = pair[1] if speculative else None
    batch = prompts(96, [10, 7, 12, 9], seed=4)
    config = dict(max_slots=4, max_model_len=64, page_size=4)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, prompt_logprobs=1)
    roomy, _ = engine_for(pair[0], draft, **config).generate(batch, params)
    tight = engine_for(pair[0], draft, kv_cache_memory=26 * page_bytes(pair[0], draft, page_size=4), **config)
    done, _ = tight.generate(batch, params)
    assert tight.stats["preemptions"] > 0 and all_free(tight)
    for got, want, prompt in zip(done, roomy, batch):
        assert [e.token_id for e in got.prompt_logprobs] == prompt[1:]
        assert [e.logprob for e in got.prompt_logprobs] == pytest.approx([e.logprob for e in want.prompt_logprobs],
                                                                          abs=1e-5)
        if DEVICE == "cpu":
            assert got.token_ids == want.token_ids


def test_prompt_logprobs_are_checked():
    SamplingParams(max_new_tokens=0, prompt_logprobs=0).validate()
    with pytest.raises(RequestError, match="0 only with prompt_logprobs"):
        SamplingParams(max_new_tokens=0).validate()
    with pytest.raises(RequestError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=21).validate()
    with pytest.raises(RequestError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=-1).validate()


def test_the_warm_requests_score_a_prompt(pair, monkeypatch):
    """Start-up's warm requests (run on CUDA before the first client) take prompts through the scored prefill,
    so a client's first `echo` meets no kernel for the first time."""
    engine = engine_for(pair[0], pair[1])
    scored, prefill = [], engine.runner._prefill_scored

    def recording(chunks, which, alone):
        scored.extend(len(chunks[i].tokens) for i in which)
        return prefill(chunks, which, alone)

    monkeypatch.setattr(engine.runner, "_prefill_scored", recording)
    engine._warm_requests()
    assert sorted(scored) == [16, 29] and not engine.has_work()


def test_top_logprobs_of_a_vocabulary_smaller_than_k_list_every_token():
    """k = 20 over a 12-token vocabulary: each row's every token, most likely first (the engine's start-up
    memory probe scores a block at MAX_LOGPROBS whatever the vocabulary)."""
    from deltaflash.speculative.acceptance import token_logprobs

    rows = torch.randn(3, 12)
    chosen, ids, values, ranks = token_logprobs(rows, torch.tensor([0, 5, 11]), 20, ranks=True)
    assert ids.shape == (3, 12) and torch.equal(ids[:, 0], rows.argmax(-1)) and bool((values[:, :-1] >= values[:, 1:]).all())
    assert torch.equal(ranks, (rows > rows.gather(1, torch.tensor([[0], [5], [11]]))).sum(1) + 1)
