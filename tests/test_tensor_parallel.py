"""Tensor parallelism of the target (deltaflash/parallel/tensor.py), two ranks over gloo on the CPU: the
sharded forwards give the single-process model's logits, and each rank's slot state is its heads' share
of the single model's."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time

import httpx
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltaflash.cache.slots import SlotPool
from deltaflash.config import ModelConfig
from deltaflash.core.batch import ExtendBatch, VerifyBatch
from deltaflash.core.request import SamplingParams
from deltaflash.engine.engine import Engine
from deltaflash.errors import DeltaflashError, UnsupportedModelError
from deltaflash.models.loader import load_model
from deltaflash.models.vocab import Vocab
from deltaflash.ops.kernels import reference_kernels
from deltaflash.parallel.launch import COLLECTIVE_TIMEOUT, ranks
from deltaflash.parallel.tensor import Shard, shard_config, shard_model, shard_state
from tests.checkpoints import build_hf_model, save_checkpoint
from tests.server_process import ServerProcess, tiny_pair
from tests.spec_pairs import pairs_by_kind

PROMPTS = ([5, 17, 3, 44, 9, 21, 60], [8, 2, 71])
DRAFTS = ([30, 12, 7, 55], [1, 90, 4, 33])  # a verify round after the prompts: anchor + 3 drafts per lane


def forwards(model) -> dict[str, torch.Tensor]:
    """A ragged prefill of two prompts, then a chain verify of four rows per lane, on a pool of the model's
    own (sharded) shapes."""
    kernels = reference_kernels()
    pool = SlotPool(model.cfg, 2, 64, torch.float32, "cpu")
    prefill, _ = model.extend(ExtendBatch.build([(i, 0, p) for i, p in enumerate(PROMPTS)], "cpu"), pool, kernels)
    batch = VerifyBatch.chain(torch.tensor(DRAFTS), (0, 1), tuple(len(p) for p in PROMPTS))
    verify = model.verify(batch, pool, kernels)
    return {"prefill": prefill, "verify": verify.logits, "state": pool.recurrent_state.clone(),
            "conv": pool.conv_history.clone(), "keys": pool.key_cache.clone(), "log": verify.replay_log.clone()}


def _rank(rank: int, size: int, target: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    try:
        model = shard_model(load_model(target, device="cpu", dtype=torch.float32, progress=False), rank, size)
        torch.save(forwards(model), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_checkpoint(build_hf_model("dense_gqa", seed=3), tmp_path_factory.mktemp("tp") / "target")


SHAPES = {"dense": ("dense_gqa", {}), "moe": ("moe", {}),
          "one kv head": ("dense_gqa", {"num_key_value_heads": 1})}  # fewer key/value heads than ranks


@pytest.mark.parametrize("shape", list(SHAPES))
def test_two_ranks_give_the_single_models_logits_and_shares_of_its_state(shape, tmp_path):
    size = 2
    kind, overrides = SHAPES[shape]
    target = save_checkpoint(build_hf_model(kind, seed=3, **overrides), tmp_path / "target")
    mp.spawn(_rank, args=(size, str(target), str(tmp_path / "init"), str(tmp_path)), nprocs=size, join=True)
    single = forwards(load_model(target, device="cpu", dtype=torch.float32, progress=False))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    cfg = load_model(target, device="cpu", dtype=torch.float32, progress=False).cfg
    for got in ranks:  # every rank holds the whole residual stream: the same logits
        torch.testing.assert_close(got["prefill"], single["prefill"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["verify"], single["verify"], rtol=1e-5, atol=1e-5)
    nv = cfg.linear_num_value_heads // size
    kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    for r, got in enumerate(ranks):  # and its heads' share of the slot state and the K/V pages
        torch.testing.assert_close(got["state"], single["state"][:, :, r * nv:(r + 1) * nv], rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(got["log"], single["log"][:, :, :, r * nv:(r + 1) * nv], rtol=1e-4, atol=2e-5)
        share = cfg.num_kv_heads // size  # the rank's key/value heads; one repeated when there are fewer than ranks
        kv = slice(r * share, (r + 1) * share) if share else slice(r * cfg.num_kv_heads // size, r * cfg.num_kv_heads // size + 1)
        torch.testing.assert_close(got["keys"], single["keys"][..., kv, :], rtol=1e-4, atol=2e-5)
        q, k, v = (slice(r * kd // size, (r + 1) * kd // size), slice(kd + r * kd // size, kd + (r + 1) * kd // size),
                   slice(2 * kd + r * vd // size, 2 * kd + (r + 1) * vd // size))
        channels = torch.cat([single["conv"][:, :, s] for s in (q, k, v)], dim=2)
        torch.testing.assert_close(got["conv"], channels, rtol=1e-4, atol=2e-5)


def test_shares_must_divide_the_heads_and_the_widths(target, tmp_path):
    cfg = load_model(target, device="cpu", dtype=torch.float32, progress=False).cfg
    assert shard_config(cfg, 2).linear_num_value_heads == cfg.linear_num_value_heads // 2
    with pytest.raises(UnsupportedModelError, match="does not divide num_heads 4, .*num_kv_heads 2"):
        shard_config(cfg, 3)
    assert shard_config(dataclasses.replace(cfg, num_kv_heads=1), 2).num_kv_heads == 1  # repeated, not split
    assert shard_config(cfg, 2).vocab_rows == cfg.vocab_size // 2
    with pytest.raises(UnsupportedModelError, match=f"vocab_size {cfg.vocab_size + 1}"):
        shard_config(dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1), 2)
    moe = ModelConfig.from_folder(save_checkpoint(build_hf_model("moe"), tmp_path / "moe"))
    assert shard_config(moe, 2).moe_intermediate_size == moe.moe_intermediate_size // 2


def _serve_prompts(tp, target: str, draft: str | None, out: str) -> list[list[int]]:
    """A rank's engine generating ragged prompts together, greedy, seeded and unseeded sampled; each rank
    writes what it generated (the ranks must agree without being told)."""
    engine = Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32, progress=False,
                                    tensor_parallel=tp, max_slots=4, max_model_len=96, max_num_batched_tokens=32, idle_prefill_tokens=32)
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True),
              SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=0.8, seed=7),
              SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=1.0),  # unseeded
              SamplingParams(max_new_tokens=9, ignore_eos=True)]
    done, _ = engine.generate([list(p) for p in PROMPTS] + [[4, 4, 9], list(range(3, 40))], params)
    tokens = [c.token_ids for c in done]
    torch.save((tokens, [c.accepted_lengths for c in done], engine.config.speculation), f"{out}/engine{tp.rank}.pt")
    return tokens


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return pairs_by_kind(tmp_path_factory.mktemp("tp-pair"))


@pytest.fixture(scope="module")
def pair(pairs):
    return pairs["dense_gqa"]


@pytest.mark.parametrize("kind,speculative", [("dense_gqa", True), ("moe", True), ("moe", False)])
def test_tensor_parallel_engine_serves_what_one_device_serves(pairs, kind, speculative, tmp_path):
    """Two ranks of an engine (gloo, CPU) serve ragged prompts in chunks, four at a time, greedy and
    sampled: both ranks emit the same tokens (unseeded requests too: their seeds are common), and the
    seeded ones equal a single-device engine's (drafts accepted alike). Dense and MoE targets."""
    target, draft = str(pairs[kind][0]), str(pairs[kind][1]) if speculative else None
    with ranks(2, "cpu", _serve_prompts, target, draft, str(tmp_path)) as tp:
        tokens = _serve_prompts(tp, target, draft, str(tmp_path))
    (a, acc_a, spec_a), (b, acc_b, _) = (torch.load(tmp_path / f"engine{r}.pt") for r in range(2))
    assert a == b == tokens and acc_a == acc_b and spec_a == "fixed"
    single = Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32, progress=False, max_slots=4,
                                    max_model_len=96, max_num_batched_tokens=32, idle_prefill_tokens=32, speculation="fixed")
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True),
              SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=0.8, seed=7)]
    want, _ = single.generate([list(p) for p in PROMPTS], params)
    assert [c.token_ids for c in want] == a[:2] and [c.accepted_lengths for c in want] == acc_a[:2]
    if speculative:
        assert max(n for lens in acc_a for n in lens) > 1  # drafts were accepted


def _run(cmd: list[str]) -> str:
    """A command's stdout; a failure names its exit code and stderr (what the ranks reported)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd[2:])}\n{proc.stderr}"
    return proc.stdout


def test_cli_generate_on_two_ranks_equals_one(pair):
    target, draft = map(str, pair)
    base = [sys.executable, "-m", "deltaflash", "generate", "--model", target, "--draft", draft, "--prompt-ids",
            "5,17,3,44,9", "--max-new-tokens", "12", "--ignore-eos", "--device", "cpu", "--dtype", "float32", "--json",
            "--speculation", "fixed"]
    one, two = (json.loads(_run(base + extra)) for extra in ([], ["--tensor-parallel-size", "2"]))
    assert two["token_ids"] == one["token_ids"] and two["stats"]["tensor_parallel_size"] == 2
    assert two["stats"]["accepted_lengths"] == one["stats"]["accepted_lengths"]
    bad = subprocess.run(base + ["--tensor-parallel-size", "3"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "rank" in bad.stderr and "does not divide" in bad.stderr


def test_bench_round_over_two_ranks_times_each_ranks_share(tmp_path):
    """`bench round --tensor-parallel-size 2` (the toy shape on the CPU; the 9B / 27B shapes on GPUs): every
    rank runs the rounds in step, rank 0 reports them against the weight-read limit of its share - about
    half the weights (norms and routers are whole on each)."""
    reports = {}
    for size in (1, 2):
        out = tmp_path / f"tp{size}.json"
        _run([sys.executable, "-m", "deltaflash", "bench", "round", "--device", "cpu", "--shape", "toy",
              "--tensor-parallel-size", str(size), "--lanes", "1", "2", "--width", "4", "--rounds", "2",
              "--prompt-len", "16", "--max-model-len", "64", "--routes", "unfused", "--json", str(out)])
        reports[size] = json.loads(out.read_text())
    one, two = reports[1], reports[2]
    assert two["tensor_parallel_size"] == 2 and [r["lanes"] for r in two["rows"]] == [1, 2]
    assert 0.45 < two["weight_read_bytes"] / one["weight_read_bytes"] < 0.55
    assert all(r["unfused_round_ms"] > 0 and r["unfused_verify_ms"] > 0 for r in two["rows"])


def test_server_on_two_ranks_answers_what_one_device_answers(tmp_path):
    """`deltaflash serve --tensor-parallel-size 2` (gloo, CPU): concurrent completions,
    greedy and seeded, with a drafter, equal those of a one-device server; SIGTERM stops every rank, exit 0."""
    target, draft = tiny_pair(tmp_path)
    flags = ("--max-concurrency", "4", "--max-model-len", "256", "--speculation", "fixed")
    bodies = [{"model": "tiny", "prompt": [11, 42, 7, 99, 23][:n], "max_tokens": 10, "ignore_eos": True,
               "temperature": t, "seed": 5} for n, t in ((5, 0), (3, 0.9), (2, 0))]

    async def answers(url):
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            replies = await asyncio.gather(*(http.post("/v1/completions", json=b | {"return_token_ids": True})
                                             for b in bodies))
            return [r.json()["choices"][0]["token_ids"] for r in replies]

    got = {}
    for size in (1, 2):
        server = ServerProcess(target, tmp_path / f"tp{size}.log", *flags, "--tensor-parallel-size", str(size),
                               draft=draft)
        try:
            got[size] = asyncio.run(answers(server.url))
        finally:
            assert server.stop() == 0, server.log.read_text()
    assert got[2] == got[1] and all(len(ids) == 10 for ids in got[1])


def _fails_mid_run(tp, target: str) -> None:
    """Rank 1 raises after a few steps of a generation; rank 0 carries on into its next all-reduce."""
    engine = Engine.from_pretrained(target, None, device="cpu", dtype=torch.float32, progress=False,
                                    tensor_parallel=tp, max_slots=2, max_model_len=64)
    for prompt in PROMPTS:
        engine.add_request(list(prompt), SamplingParams(max_new_tokens=30, ignore_eos=True))
    for step in range(30):
        if tp.rank == 1 and step == 3:
            raise RuntimeError("injected failure")
        engine.step()


def test_a_rank_failing_mid_run_ends_every_rank_with_its_error(pair):
    started = time.monotonic()
    with pytest.raises(DeltaflashError, match="rank 1 failed: RuntimeError: injected failure"):
        with ranks(2, "cpu", _fails_mid_run, str(pair[0])) as tp:
            _fails_mid_run(tp, str(pair[0]))
    assert time.monotonic() - started < COLLECTIVE_TIMEOUT.total_seconds()  # no wait for the timeout


def test_vocab_shares_look_up_and_project_what_the_whole_tables_do():
    """Each rank's share of the vocabulary (models/vocab.py): lookups of ids outside it are zeros, so the
    ranks' lookups add up to the whole table's rows exactly (what the all-reduce does); the shares'
    logits, concatenated in rank order (the all-gather), are the whole lm_head's."""
    gen = torch.Generator().manual_seed(0)
    V, H, size = 12, 5, 3
    embed, head = torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen)
    ids, hidden = torch.tensor([[0, 3, 11], [4, 8, 7]]), torch.randn(2, 3, H, generator=gen)
    whole = Vocab.whole(embed, head)
    rows = V // size
    shares = [Vocab(embed[r * rows:(r + 1) * rows], head[r * rows:(r + 1) * rows], V, r * rows) for r in range(size)]
    lookups = [s.embed(ids) for s in shares]
    assert all(s.sharded for s in shares) and not whole.sharded
    assert torch.equal(sum(lookups), whole.embed(ids))
    assert all(torch.count_nonzero(x.abs().sum(-1)) == torch.count_nonzero((ids // rows) == r)
               for r, x in enumerate(lookups))  # each id looked up by one rank only
    gathered = torch.cat([s.head_weight @ hidden[..., None] for s in shares], dim=-2).squeeze(-1)
    torch.testing.assert_close(gathered, whole.project(hidden))
    joined = Vocab(shares[1].embed_weight, shares[1].head_weight, V, rows,  # rank 1's own logits in the middle
                   gather=lambda t: torch.cat([t if r == 1 else hidden @ s.head_weight.T for r, s in enumerate(shares)],
                                              dim=-1))
    torch.testing.assert_close(joined.project(hidden), whole.project(hidden))


def test_the_argmax_of_vocab_shares_is_the_whole_rows_argmax_ties_included():
    """Vocab.argmax gathers one (max, id) pair per rank and row: the same ids as the argmax of the
    gathered rows, a tie between ranks (or inside one) going to the first index as torch.argmax's does."""
    V, size = 12, 3
    rows = V // size
    logits = torch.randn(4, 5, V, generator=torch.Generator().manual_seed(1))
    logits[0, 0, [5, 9]] = 9.0  # a tie across ranks 1 and 2
    logits[1, 2, [4, 6]] = 9.0  # a tie inside rank 1
    logits[2, 4, [3, 4]] = 9.0  # a tie across ranks 0 and 1, at their border
    head = torch.zeros(V, 2)
    shares = [Vocab(head[r * rows:(r + 1) * rows], head[r * rows:(r + 1) * rows], V, r * rows) for r in range(size)]
    pieces = [logits[..., r * rows:(r + 1) * rows] for r in range(size)]
    sent = []  # what each rank contributes to the all-gather
    for share, piece in zip(shares, pieces):
        dataclasses.replace(share, gather=lambda t: sent.append(t) or t).argmax(piece)
    assert all(t.shape == (4, 5, 2) for t in sent)  # two values a row, not V / size
    for share, piece in zip(shares, pieces):
        got = dataclasses.replace(share, gather=lambda t: torch.cat(sent, dim=-1)).argmax(piece)
        assert torch.equal(got, logits.argmax(dim=-1))
    assert got[0, 0] == 5 and got[1, 2] == 4 and got[2, 4] == 3
    assert torch.equal(Vocab.whole(head).argmax(logits), logits.argmax(dim=-1))


def _count_gathers(tp, target: str, draft: str | None, out: str) -> None:
    """A rank's engine: the widths its target's (and drafter's) all-gathers carry in the rounds, greedy
    lanes and then sampled ones."""
    engine = Engine.from_pretrained(target, draft, device="cpu", dtype=torch.float32, progress=False,
                                    tensor_parallel=tp, max_slots=2, max_model_len=96, speculation="fixed")
    target_widths, draft_widths, real = [], [], engine.model.gather
    engine.model.gather = lambda t: target_widths.append(t.shape[-1]) or real(t)
    source = engine.runner.source
    if source is not None:  # the drafter reads the target's tables through its own Vocab
        source.vocab = dataclasses.replace(source.vocab, gather=lambda t: draft_widths.append(t.shape[-1]) or real(t))
    counted = {}
    for name, params in (("greedy", SamplingParams(max_new_tokens=8, ignore_eos=True)),
                         ("sampled", SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.9, seed=3))):
        for p in PROMPTS:
            engine.add_request(list(p), params)
        while engine.scheduler.waiting or any(s.num_prefilled < len(s.prompt_ids)
                                              for s in engine.scheduler.running.values()):
            engine.step()
        target_widths.clear()
        draft_widths.clear()
        rounds = 0
        while engine.has_work():
            engine.step()
            rounds += 1
        counted[name] = (list(target_widths), list(draft_widths), rounds)
    torch.save((counted, engine.cfg.vocab_rows), f"{out}/gathers{tp.rank}.pt")


@pytest.mark.parametrize("speculative", [False, True])
def test_greedy_rounds_gather_argmax_pairs_not_vocabulary_rows(pair, speculative, tmp_path):
    """Under tensor parallelism an all-greedy round (no logit rules, no logprobs) gathers each row's
    (max, id) per rank - 2 values - instead of the rows' vocabulary shares, for the target's verify rows
    and the DFlash drafter's block alike; sampled rounds gather the rows."""
    target, draft = str(pair[0]), str(pair[1]) if speculative else None
    with ranks(2, "cpu", _count_gathers, target, draft, str(tmp_path)) as tp:
        _count_gathers(tp, target, draft, str(tmp_path))
    for r in range(2):
        counted, share = torch.load(tmp_path / f"gathers{r}.pt")
        greedy, greedy_drafts, greedy_rounds = counted["greedy"]
        sampled, sampled_drafts, sampled_rounds = counted["sampled"]
        assert greedy_rounds >= 2 and sampled_rounds >= 2
        assert greedy == [2] * greedy_rounds  # one pair gather per round, no row of the vocabulary
        assert sampled == [share] * sampled_rounds
        if speculative:
            assert greedy_drafts and set(greedy_drafts) == {2} and len(greedy_drafts) <= greedy_rounds
            assert sampled_drafts and set(sampled_drafts) == {share}
        else:
            assert greedy_drafts == sampled_drafts == []


@pytest.mark.parametrize("kind", ["dense_gqa", "moe"])
def test_sharded_loading_reads_only_each_ranks_rows(kind, tmp_path, monkeypatch):
    """load_model with a Shard builds the rank's share straight from the files - equal to slicing the whole
    model - and reads every sharded tensor by its rows only, never whole."""
    from deltaflash.models import checkpoint

    target = save_checkpoint(build_hf_model(kind, seed=4), tmp_path / "target")
    whole = load_model(target, device="cpu", dtype=torch.float32, progress=False)
    read_whole = []
    real = checkpoint._read_tensor
    monkeypatch.setattr(checkpoint, "_read_tensor", lambda h, f, name, *a: read_whole.append(name) or real(h, f, name, *a))
    for rank in range(2):
        read_whole.clear()
        share = load_model(target, device="cpu", dtype=torch.float32, progress=False,
                           shard=lambda cfg: Shard(cfg, rank, 2))
        want = shard_state(whole.cfg, whole.state_dict(), rank, 2)
        got = share.state_dict()
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
        sharded = [n for n in read_whole if Shard(whole.cfg, rank, 2).rows(n.removeprefix("model.")) is not None]
        assert read_whole and not sharded  # norms and routers whole, every sharded tensor by rows
        assert got["embed_tokens.weight"].shape[0] == whole.cfg.vocab_size // 2  # vocab-parallel
