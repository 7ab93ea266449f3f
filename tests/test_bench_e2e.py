"""`deltaflash bench e2e` on CPU at tiny settings: the JSON it writes, both plots, lossless speculative
output (greedy spec == target-only), and the scripted workload at zero corruption."""

import argparse
import json
from pathlib import Path

import pytest

from deltaflash.bench import e2e, e2e_stats
from deltaflash.core.request import SamplingParams
from deltaflash.errors import DeltaflashError
from tests.checkpoints import build_hf_model, save_checkpoint


def parse(*argv):
    parser = argparse.ArgumentParser()
    e2e.register(parser.add_subparsers())
    return parser.parse_args(["e2e", *argv])


def test_demo_workload_writes_json_and_plots(tmp_path):
    args = parse("--concurrency", "1", "2", "--prompts", "2", "--max-new-tokens", "8", "--prompt-lines", "3",
                 "--device", "cpu", "--out", str(tmp_path), "--quiet", "--speculation", "fixed")  # the pair's block
    assert e2e.run(args) == 0
    result = json.loads((tmp_path / "e2e-demo.json").read_text())
    points = {(p["concurrency"], p["mode"]): p for p in result["points"]}
    assert sorted(points) == [(1, "spec"), (1, "target-only"), (2, "spec"), (2, "target-only")]
    for (c, mode), p in points.items():
        assert p["requests"] == 2 and p["output_tokens"] > 0 and p["tokens_per_s"] > 0
        assert p["mismatched_sequences"] == 0  # greedy speculative output == target-only output
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "seq_tokens_per_s_mean"):
            assert p[key] is not None and p[key] > 0, key
        assert sum(p["phase_shares"].values()) == pytest.approx(1.0)
        if mode == "spec":
            assert 1.5 < p["mean_accepted_length"] <= result["block_size"] and p["accepted_lengths"]  # ~3 for this pair
            assert p["phase_shares"]["verify"] > 0 and p["phase_shares"]["draft"] > 0
        else:
            assert p["mean_accepted_length"] is None
    assert set(result["figures"]) == {"spec_over_target_only_c1", "spec_over_target_only_c2",
                                      *(f"itl_p99_over_p50_c{c}_{m}" for c in (1, 2) for m in ("spec", "target-only"))}
    itl = points[2, "target-only"]
    assert result["figures"]["itl_p99_over_p50_c2_target-only"]["value"] == itl["itl_p99_ms"] / itl["itl_p50_ms"] >= 1
    for name in ("e2e-demo-tokens-per-s.png", "e2e-demo-accepted-length.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, name


def empty_skinny_table(folder: Path) -> Path:
    """A skinny GEMM table routing nothing (an engine given it keeps its path in its config)."""
    from deltaflash.ops.gemm.skinny import SkinnyGemms

    SkinnyGemms("test", {}).save(folder / "tiles.json")
    return folder / "tiles.json"


@pytest.mark.parametrize("workload", ["demo", "scripted"])
def test_workload_engines_take_the_options_given(tmp_path, workload):
    """--tree-budget, --tree-top-k, --speculation, --max-model-len, --max-num-batched-tokens, --max-prefill-stall
    and --skinny-gemm reach the engines the sweep measures (a lost keyword once made the demo sweep measure chains under a tree
    flag); target-only has no tree."""
    args = parse("--workload", workload, "--prompts", "1", "--max-new-tokens", "4", "--prompt-lines", "2",
                 "--device", "cpu", "--tree-budget", "6", "--tree-top-k", "2", "--speculation", "fixed",
                 "--max-model-len", "192", "--layers", "1", "--prompt-len", "8", "--max-num-batched-tokens", "96",
                 "--max-prefill-stall", "2.5", "--skinny-gemm", str(empty_skinny_table(tmp_path)),
                 *(["--model", str(save_checkpoint(build_hf_model("dense_gqa"), tmp_path / "t"))]
                   if workload == "scripted" else []))
    make = e2e._demo_workload if workload == "demo" else e2e._scripted_workload
    spec, plain = (make(args, max_slots=2).engine(mode) for mode in ("spec", "target-only"))
    assert (spec.config.tree_budget, spec.config.tree_top_k, spec.config.speculation) == (6, 2, "fixed")
    assert spec.config.max_model_len == plain.config.max_model_len == 192
    assert plain.config.tree_budget == 0 and plain.config.block_size == 1
    assert spec.config.max_num_batched_tokens == plain.config.max_num_batched_tokens == 96
    assert spec.config.max_prefill_stall == plain.config.max_prefill_stall == 2.5 and plain.scheduler.costs is not None
    assert spec.config.skinny_gemm == plain.config.skinny_gemm == str(tmp_path / "tiles.json")


def test_scripted_prompts_of_varied_length(tmp_path):
    """--prompt-len-max draws each scripted prompt's length in [--prompt-len, it] (the prefill graphs' padding
    at lengths that do not divide the budget); below --prompt-len it is an error."""
    model_dir = save_checkpoint(build_hf_model("dense_gqa", seed=4), tmp_path / "target")
    args = parse("--workload", "scripted", "--model", str(model_dir), "--prompts", "12", "--prompt-len", "5",
                 "--prompt-len-max", "30", "--max-new-tokens", "4", "--device", "cpu")
    workload = e2e._scripted_workload(args, max_slots=2)
    lengths = [len(p) for p in workload.prompts]
    assert all(5 <= n <= 30 for n in lengths) and len(set(lengths)) > 3
    assert (workload.meta["prompt_len"], workload.meta["prompt_len_max"]) == (5, 30)
    with pytest.raises(DeltaflashError, match="--prompt-len-max 4 is below --prompt-len 5"):
        e2e._scripted_workload(parse("--workload", "scripted", "--model", str(model_dir), "--prompt-len", "5",
                                     "--prompt-len-max", "4", "--device", "cpu"), max_slots=2)


def test_scripted_workload_without_corruption_accepts_and_is_lossless(tmp_path):
    model_dir = save_checkpoint(build_hf_model("dense_gqa", seed=4), tmp_path / "target")
    args = parse("--workload", "scripted", "--model", str(model_dir), "--corrupt", "0", "--block-size", "4",
                 "--concurrency", "1", "2", "--prompts", "2", "--prompt-len", "6", "--max-new-tokens", "12",
                 "--device", "cpu", "--no-profile", "--out", str(tmp_path / "out"), "--quiet",
                 "--speculation", "fixed")  # every round at the block: adaptive could decode plainly
    assert e2e.run(args) == 0
    result = json.loads((tmp_path / "out" / "e2e-scripted.json").read_text())
    assert "scripted" in result["label"]
    spec = [p for p in result["points"] if p["mode"] == "spec"]
    assert all(p["mean_accepted_length"] > 1 and p["mismatched_sequences"] == 0 for p in spec)
    assert spec[0]["mean_accepted_length"] > 3  # W 4, every draft the target's own greedy token
    for point in result["points"]:  # every prompt prefilled, within each step's budget
        pre = point["prefill_steps"]
        assert pre["steps"] >= 1 and pre["tokens_mean"] * pre["steps"] == pytest.approx(6 * point["requests"])
        assert 0 < pre["tokens_mean"] <= pre["budget_mean"] and pre["beside_a_round"] <= pre["steps"]
        assert pre["rows_per_token"] == 1.0  # (no prefill graph on the CPU: no padding row)
        assert (pre["graph_steps"], pre["graph_step_p50_ms"], pre["eager_steps"]) == (0, None, pre["steps"])
        assert pre["eager_step_p50_ms"] == pre["step_p50_ms"]
        slowest = pre["eager_slowest"]  # (every step eager here: the slowest of them, their prompt tokens)
        assert len(slowest) == min(8, pre["steps"]) and slowest[0]["ms"] >= pre["eager_step_p50_ms"]
        assert all(0 < s["prompt_tokens"] <= s["budget"] for s in slowest)
        # each of a prompt's 6 tokens prefilled in one chunk (budget 512): a step's chunks are its prompts
        assert all(s["chunks"] == s["prompt_tokens"] // 6 for s in slowest)
        assert point["eager_prefill_rows"] == 0  # (measured on CUDA alone)
    assert (result["meta"]["max_num_batched_tokens"], result["meta"]["max_prefill_stall"]) == (512, 0.0)
    limit = result["figures"]["spec_c1_over_tau_weight_read_limit"]
    assert limit["value"] > 0 and limit["weight_read_ms"] > 0


def test_corruption_for_a_target_accepted_length():
    for tau in (3.0, 6.0):
        corrupt = e2e.corrupt_for_tau(tau, 16)
        assert 0 < corrupt < 1 and e2e.expected_tau(corrupt, 16) == pytest.approx(tau, rel=1e-6)
    assert e2e.expected_tau(0.0, 16) == 16
    with pytest.raises(ValueError):
        e2e.corrupt_for_tau(16.0, 16)


def test_copying_random_model_decodes_stably_in_bf16():
    """The scripted workload's random model: greedy decoding repeats the current token, and the
    speculative route (16-row verify) reproduces target-only (1-row decode) output in bf16."""
    import dataclasses

    import torch

    from deltaflash.core.request import SamplingParams
    from deltaflash.engine.config import EngineConfig
    from deltaflash.engine.engine import Engine
    from deltaflash.models.random_init import qwen35_9b_config, random_model
    from deltaflash.speculative.sources import ScriptedSource

    cfg = dataclasses.replace(qwen35_9b_config(4), hidden_size=256, vocab_size=2048, num_heads=2, num_kv_heads=1,
                              head_dim=64, rotary_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=32, linear_value_head_dim=32, intermediate_size=512)
    model = random_model(cfg, torch.bfloat16, "cpu", copying=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 17)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    config = EngineConfig(max_slots=3, max_model_len=64, speculation="fixed")
    plain = Engine(model, None, None, config).generate(prompts, params)[0]
    assert [c.token_ids for c in plain] == [[p[-1]] * 24 for p in prompts]
    scripts = {tuple(c.prompt_ids): c.token_ids for c in plain}
    spec = Engine(model, None, None, config, draft_source=ScriptedSource(scripts, 16, cfg.vocab_size, 0.0, 0))
    done = spec.generate(prompts, params)[0]
    assert [c.token_ids for c in done] == [c.token_ids for c in plain]
    assert [c.accepted_lengths for c in done] == [[16, 7]] * 3  # every draft accepted; the last round verifies 7 rows


def test_server_mode_drives_live_servers(tmp_path):
    """`--server` / `--target-only-server` against two real `deltaflash serve` processes (bundled pair, CPU)."""
    from deltaflash.bundled import BUNDLED
    from tests.server_process import ServerProcess

    spec = ServerProcess(BUNDLED / "target", tmp_path / "spec.log", "--speculation", "fixed", draft=BUNDLED / "draft")
    try:
        plain = ServerProcess(BUNDLED / "target", tmp_path / "plain.log")
        try:
            args = parse("--server", spec.url, "--target-only-server", plain.url, "--concurrency", "1", "2",
                         "--prompts", "3", "--max-new-tokens", "16", "--prompt-lines", "4", "--out", str(tmp_path),
                         "--quiet")
            assert e2e.run(args) == 0
        finally:
            plain.stop()
    finally:
        spec.stop()
    result = json.loads((tmp_path / "e2e-demo-server.json").read_text())
    points = {(p["concurrency"], p["mode"]): p for p in result["points"]}
    assert sorted(points) == [(1, "spec"), (1, "target-only"), (2, "spec"), (2, "target-only")]
    for (c, mode), p in points.items():
        assert p["requests"] == 3 and 0 < p["output_tokens"] <= 3 * 16
        assert p["mismatched_sequences"] == 0
        assert p["seq_decode_tokens_per_s_mean"] > 0 and p["ttft_p50_ms"] > 0
    assert points[1, "spec"]["mean_accepted_length"] > 1.0 and points[1, "spec"]["rounds"] > 0  # drafts accepted
    assert points[1, "target-only"]["mean_accepted_length"] is None
    assert (tmp_path / "e2e-demo-server-tokens-per-s.png").is_file()


def test_latency_summary_counts_tokens_for_itl_and_events_for_stream_gaps():
    """Inter-token latency splits an event of n tokens into n gaps of 1/n of its interval; a stream gap
    is the interval itself, whatever its tokens (times in seconds from the sequence's submission)."""
    from deltaflash.bench.e2e_stats import latency_summary

    events = [(0.010, 1), (0.014, 4), (0.034, 1), (0.038, 4)]  # a round that emits one token after 20 ms
    out = latency_summary([(0.010, 0.038, events, 10)])
    assert out["ttft_p50_ms"] == pytest.approx(10.0)
    assert out["itl_p50_ms"] == pytest.approx(1.0) and out["itl_p99_ms"] == pytest.approx(20.0)
    assert out["gap_p50_ms"] == pytest.approx(4.0) and out["gap_p99_ms"] == pytest.approx(20.0)
    assert out["seq_decode_tokens_per_s_mean"] == pytest.approx(9 / 0.028)


def test_summary_reports_the_median_step_that_only_decoded():
    """decode_step_p50_ms is engine.step's wall time over the steps with decoding lanes and no prompt
    tokens: prefill steps and idle steps do not count."""
    from deltaflash.bench.e2e import Trace, summarize
    from deltaflash.core.request import StepReport

    def report(prefill_tokens, decode_lanes):
        return StepReport(admitted=0, prefill_tokens=prefill_tokens, prefill_s=0.0, decode_lanes=decode_lanes,
                          decode_s=0.0)
    steps = [(0.050, report(100, 0)), (0.002, report(0, 4)), (0.030, report(64, 4)), (0.003, report(0, 4)),
             (0.004, report(0, 4)), (0.001, report(0, 0))]
    trace = Trace(0.0, token_ids=[1, 2], event_times=[0.05, 0.06], event_tokens=[1, 1])
    out = summarize([trace], steps, wall=0.1)
    assert out["steps"] == 6 and out["decode_step_p50_ms"] == pytest.approx(3.0)


def test_summary_groups_decode_steps_by_round_width():
    """by_round_width: decode-only steps keyed by the widest lane of their round (a tree round by its
    nodes), with the median step, the mean lanes and the tokens each lane emitted (nearest-rank median);
    prefill steps do not count."""
    from deltaflash.bench.e2e import Trace, summarize
    from deltaflash.core.request import StepReport

    def report(widths, accepted=(), prefill_tokens=0, tree_budget=0):
        return StepReport(admitted=0, prefill_tokens=prefill_tokens, prefill_s=0.0, decode_lanes=len(widths),
                          decode_s=0.0, accepted_lengths=accepted, widths=widths, tree_budget=tree_budget)
    steps = [(0.002, report((1, 1))), (0.004, report((1, 1))), (0.010, report((8, 1), (3, 1))),
             (0.012, report((8, 8, 8), (5, 1, 2))), (0.050, report((8,), (2,), prefill_tokens=64)),
             (0.011, report((8, 8), (4, 6), tree_budget=16))]
    table = summarize([Trace(0.0, token_ids=[1], event_times=[0.01], event_tokens=[1])], steps, 0.1)["by_round_width"]
    assert list(table) == ["W 1", "W 8", "tree 16"]
    assert table["W 1"] == {"steps": 2, "step_p50_ms": pytest.approx(2.0), "lanes_mean": 2.0, "tokens_per_lane": 1.0}
    assert table["W 8"]["steps"] == 2 and table["W 8"]["step_p50_ms"] == pytest.approx(10.0)
    assert table["W 8"]["lanes_mean"] == 2.5 and table["W 8"]["tokens_per_lane"] == pytest.approx(12 / 5)
    assert table["tree 16"] == {"steps": 1, "step_p50_ms": pytest.approx(11.0), "lanes_mean": 2.0,
                                "tokens_per_lane": 5.0}


def test_repeats_alternate_the_modes_and_keep_the_median_run(monkeypatch):
    """--repeats 3: spec, target-only, spec, ... run one after another at each concurrency, and each point
    is the run of median tokens/s, all runs' tokens/s beside it (the machine drifts between runs)."""
    order, speeds = [], iter([9.0, 4.0, 5.0, 6.0, 7.0, 5.0])  # spec 9, 5, 7; target-only 4, 6, 5

    def measure(engine, workload, concurrency, requests):
        order.append(engine)
        tps = next(speeds)
        return {"tokens_per_s": tps, "mean_accepted_length": None}, [[int(tps)]]

    monkeypatch.setattr(e2e, "build_engines", lambda workload, profile: ({m: m for m in e2e.MODES}, {}))
    monkeypatch.setattr(e2e, "_measure", measure)
    monkeypatch.setattr(e2e, "explain", lambda *args: None)
    monkeypatch.setattr(e2e, "near_tie_margin", lambda engine: 0.0)
    workload = e2e.Workload("demo", "test", [[1]], SamplingParams(max_new_tokens=1), None, 4)
    result = e2e.sweep(workload, [1], profile=False, repeats=3)
    assert order == ["spec", "target-only"] * 3
    spec, plain = result["points"]
    assert (spec["tokens_per_s"], spec["tokens_per_s_runs"]) == (7.0, [9.0, 5.0, 7.0])
    assert (plain["tokens_per_s"], plain["tokens_per_s_runs"]) == (5.0, [4.0, 6.0, 5.0])
    assert result["figures"]["spec_over_target_only_c1"]["value"] == pytest.approx(7.0 / 5.0)


def test_compare_reports_where_each_sequence_first_differs():
    points = [{"mode": "spec"}, {"mode": "target-only"}]
    e2e_stats.compare(points, [[1, 2, 3], [4, 5, 9, 7], [1, 2]], [[1, 2, 3], [4, 5, 6, 7], [1, 2, 8]])
    assert all(p["mismatched_sequences"] == 2 for p in points)
    assert points[0]["first_differences"] == [
        {"sequence": 1, "position": 2, "spec": 9, "target_only": 6},
        {"sequence": 2, "position": 2, "spec": None, "target_only": 8}]


def test_explain_tells_near_ties_from_wrong_tokens(tmp_path):
    """At a first difference the target's top two tokens and their log-prob gap are reported; a near-tie
    only when both tokens are the top two and the gap is under the margin."""
    from tests.spec_pairs import engine_for, make_pair

    target, _ = make_pair(tmp_path)
    engine = engine_for(target, max_model_len=64)
    prompt = [3, 14, 15, 92]
    done, _ = engine.generate([prompt], SamplingParams(max_new_tokens=3, logprobs=5))
    out, top = done[0].token_ids, dict(done[0].logprobs[1].top)
    ranked = sorted(top, key=lambda t: -top[t])
    second, fifth = ranked[1], ranked[4]
    for spec_token, margin, near in ((second, 1e9, True), (second, 0.0, False), (fifth, 1e9, False)):
        points = [{"mode": "spec"}, {"mode": "target-only"}]
        e2e_stats.compare(points, [out[:1] + [spec_token]], [out[:2]])
        e2e_stats.explain(points, engine, [prompt], [out[:2]], margin)
        d = points[0]["first_differences"][0]
        assert d["position"] == 1 and d["top2"][0][0] == out[1]
        assert d["near_tie"] is near and points[1]["near_tie_sequences"] == int(near)
        if spec_token == second:
            assert abs(d["gap"] - (top[out[1]] - top[second])) < 1e-5
        else:
            assert d["gap"] is None
