"""`deltaflash generate` end to end, and the one-line errors of `generate` and `serve`, in a subprocess as a
user runs them."""

import json
import socket
import subprocess
import sys

import pytest
import torch

from deltaflash.engine.engine import Engine
from deltaflash.core.request import SamplingParams
from deltaflash.tokenizer import decode
from tests.checkpoints import build_hf_model, make_tokenizer, save_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = save_checkpoint(build_hf_model("dense_gqa", vocab_size=320), tmp_path_factory.mktemp("cli"))
    make_tokenizer(folder, vocab_size=300)
    return folder


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "deltaflash", *args], capture_output=True, text=True, timeout=300)
    return proc


def test_generate_json_with_prompt_ids(folder):
    proc = run_cli("generate", "--model", str(folder), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "9",
                   "--device", "cpu", "--json", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    engine = Engine.from_pretrained(folder, device="cpu", progress=False)
    (ref,), _ = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=9, ignore_eos=True))
    assert out["token_ids"] == ref.token_ids
    assert out["text"] == decode(engine.tokenizer, ref.token_ids)  # the server's rule: special tokens dropped
    assert out["stats"]["generated_tokens"] == 9 and out["stats"]["finish_reason"] == "length"


def test_generate_text_and_chat_prompts(folder):
    engine = Engine.from_pretrained(folder, device="cpu", progress=False)
    tok = engine.tokenizer
    raw = run_cli("generate", "--model", str(folder), "--prompt", "def hello", "--max-new-tokens", "5",
                  "--device", "cpu", "--json", "--ignore-eos")
    chat = run_cli("generate", "--model", str(folder), "--prompt", "def hello", "--chat", "--max-new-tokens", "5",
                   "--device", "cpu", "--json", "--ignore-eos")
    assert raw.returncode == 0 and chat.returncode == 0, raw.stderr + chat.stderr
    raw_ids = tok.encode("def hello", add_special_tokens=False)
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "def hello"}], add_generation_prompt=True)
    chat_ids = chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "input_ids") else chat_ids
    p = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert json.loads(raw.stdout)["token_ids"] == engine.generate([raw_ids], p)[0][0].token_ids
    assert json.loads(chat.stdout)["token_ids"] == engine.generate([list(chat_ids)], p)[0][0].token_ids
    assert json.loads(raw.stdout)["stats"]["prompt_tokens"] == len(raw_ids) != len(chat_ids)


def test_bad_input_is_a_clear_error(folder, tmp_path):
    proc = run_cli("generate", "--model", str(tmp_path), "--prompt-ids", "1", "--device", "cpu")
    assert proc.returncode == 2 and "config.json" in proc.stderr
    proc = run_cli("generate", "--model", str(folder), "--prompt-ids", "1", "--temperature", "-1", "--device", "cpu")
    assert proc.returncode == 2 and "temperature" in proc.stderr
    proc = run_cli("generate", "--model", str(folder), "--prompt-ids", "99999", "--device", "cpu")
    assert proc.returncode == 2 and "99999" in proc.stderr


def one_line_error(proc, *words):
    """Exit 2 with one `deltaflash: error:` line naming `words`, no traceback, no weights loaded."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("deltaflash: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert all(w in errors[0] for w in words), errors[0]
    assert "Traceback" not in proc.stderr and "loading" not in proc.stderr, proc.stderr


def test_bad_prompts_fail_before_loading(folder):
    procs = [subprocess.Popen([sys.executable, "-m", "deltaflash", "generate", "--model", str(folder), "--device",
                               "cpu", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             # undecodable bytes in argv (latin-1 "café", a lone 0xff) reach Python as lone surrogates
             for args in (["--prompt-ids", "1,a,3"], ["--prompt", "caf\udce9"], ["--prompt", "x\udcff", "--chat"])]
    results = [(p.communicate(timeout=120), p.returncode) for p in procs]
    for ((out, err), rc), words in zip(results, (("--prompt-ids", "'a'"), ("--prompt", "not valid Unicode"),
                                                 ("--prompt", "not valid Unicode"))):
        one_line_error(subprocess.CompletedProcess([], rc, out, err), *words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_one_line_error(folder):
    one_line_error(run_cli("generate", "--model", str(folder), "--prompt-ids", "1", "--device", "cuda"),
                   "--device cuda", "CUDA is not available")


def test_serve_rejects_bad_flags_fast_before_loading(folder, tmp_path):
    """Each bad flag is a one-line error naming it, found before any weight is read: the target's weights
    here are garbage, so an error that came after loading would name the damaged file instead."""
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for path in folder.iterdir():
        data = path.read_bytes()
        (damaged / path.name).write_bytes(b"\0" * len(data) if path.suffix == ".safetensors" else data)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = [(["--max-model-len", "1"], ("--max-model-len", ">= 2")),
             (["--port", str(busy.getsockname()[1])], ("--port", "cannot listen")),
             (["--draft", str(tmp_path / "missing")], ("--draft", "config.json")),
             (["--block-size", "4"], ("--block-size", "--draft")),
             (["--tree-budget", "8"], ("--tree-budget", "--draft")),
             (["--gpu-memory-utilization", "1.5"], ("--gpu-memory-utilization", "(0, 1]")),
             (["--page-size", "0"], ("--page-size", ">= 1")),
             (["--max-prefill-stall", "-1"], ("--max-prefill-stall", ">= 0")),
             (["--skinny-gemm", str(tmp_path / "tiles.json")], ("--skinny-gemm", "not a skinny GEMM table"))]
    procs = [subprocess.Popen([sys.executable, "-m", "deltaflash", "serve", "--model", str(damaged), "--device", "cpu",
                               "--host", "127.0.0.1", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, _ in cases]
    results = [(p.communicate(timeout=120), p.returncode) for p in procs]
    busy.close()
    for ((out, err), rc), (_, words) in zip(results, cases):
        one_line_error(subprocess.CompletedProcess([], rc, out, err), *words)
    damaged_run = run_cli("serve", "--model", str(damaged), "--device", "cpu", "--host", "127.0.0.1", "--port", "0")
    one_line_error(damaged_run, ".safetensors")  # (good flags: loading then fails on the garbage, as it should)


def test_serve_flags_reach_the_engine(folder):
    """The prefill flags of `deltaflash serve` reach the engine it builds."""
    import argparse

    from deltaflash.server import cli as serve_cli
    from deltaflash.server.launcher import build_engine

    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", str(folder), "--device", "cpu", "--max-concurrency", "2",
                              "--max-num-batched-tokens", "96", "--idle-prefill-tokens", "160",
                              "--max-prefill-stall", "2.5", "--max-model-len", "128"])
    config = build_engine(args).config
    assert (config.max_slots, config.max_num_batched_tokens, config.idle_prefill_tokens, config.max_prefill_stall) \
        == (2, 96, 160, 2.5)


def _parser():
    import argparse

    from deltaflash import cli
    from deltaflash.bench import cli as bench_cli
    from deltaflash.server import cli as serve_cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve_cli.register(sub)
    bench_cli.register(sub)
    return parser, cli


def test_scheduler_flag_defaults_are_the_engine_config_defaults():
    """`add_scheduler_args` spells EngineConfig's defaults (engine/args.py imports no torch): held equal here."""
    import argparse

    from deltaflash.engine.args import add_scheduler_args, scheduler_config
    from deltaflash.engine.config import EngineConfig

    p = argparse.ArgumentParser()
    add_scheduler_args(p)
    defaults = scheduler_config(p.parse_args([]))
    assert defaults == {name: getattr(EngineConfig(), name) for name in defaults}


def test_bench_serve_passes_every_engine_and_scheduler_flag_to_its_server(folder):
    """`bench serve` starts `deltaflash serve` with each engine and scheduler flag it was given (it used to drop
    --round-graphs and --tree-max-lanes): the server's parse of that command holds the same values."""
    from deltaflash.bench.serve import server_command
    from deltaflash.engine.args import kernel_config, scheduler_config, speculation_config

    parser, _ = _parser()
    given = ["--model", str(folder), "--draft", str(folder), "--device", "cpu", "--dtype", "float32",
             "--block-size", "4", "--speculation", "fixed", "--no-round-graphs", "--tree-budget", "8",
             "--tree-top-k", "2", "--tree-max-lanes", "0", "--batch-invariant", "--skinny-gemm", "off",
             "--max-model-len", "256", "--page-size", "32", "--kv-cache-memory", "64MiB",
             "--gpu-memory-utilization", "0.5", "--max-num-batched-tokens", "96", "--no-scale-prefill-budget",
             "--max-prefill-stall", "1.5", "--idle-prefill-tokens", "160", "--no-share-prompts", "--max-concurrency", "3",
             "--clients", "5",
             "--api-key", "k", "--no-host-overlap"]
    bench = parser.parse_args(["bench", "serve", *given])
    command = server_command(bench)
    assert command[1:4] == ["-m", "deltaflash", "serve"]
    served = parser.parse_args(command[3:])
    for fields in (speculation_config, kernel_config, scheduler_config):
        assert fields(served) == fields(bench)
    for name in ("model", "draft", "device", "dtype", "max_model_len", "page_size", "kv_cache_memory",
                 "gpu_memory_utilization", "max_concurrency", "api_key", "no_host_overlap"):
        assert getattr(served, name) == getattr(bench, name), name
    assert served.max_queue == 5
    plain = server_command(parser.parse_args(["bench", "serve"]))  # defaults: nothing but the bench's own
    assert plain[4:] == ["--host", "127.0.0.1", "--port", "0", "--max-concurrency", "8", "--max-queue", "64"]


def test_bench_e2e_takes_the_engine_flags_of_serve():
    """`bench e2e` builds its engines from the same speculation, kernel and scheduler flags as `serve` (one set of
    definitions, engine/args.py), checked as `serve` checks them."""
    from deltaflash.bench.e2e import _engine_config
    from deltaflash.engine.args import speculation_config
    from deltaflash.errors import DeltaflashError

    parser, _ = _parser()
    args = parser.parse_args(["bench", "e2e", "--max-prefill-stall", "2", "--idle-prefill-tokens", "100",
                              "--no-round-graphs", "--tree-max-lanes", "3", "--skinny-gemm", "off"])
    config = _engine_config(args, 4)
    assert (config.max_slots, config.max_prefill_stall, config.idle_prefill_tokens, config.skinny_gemm) == \
        (4, 2.0, 100, "off")
    assert speculation_config(args)["round_graphs"] is False and speculation_config(args)["tree_max_lanes"] == 3
    # its points reuse prompts, which would fork from each other's prefill or start from the prefix cache: off
    # unless asked for
    assert not config.share_prompts and _engine_config(parser.parse_args(["bench", "e2e", "--share-prompts"]), 4).share_prompts
    assert config.prefix_cache == 0 and _engine_config(parser.parse_args(["bench", "e2e", "--prefix-cache", "3"]),
                                                       4).prefix_cache == 3
    bad = parser.parse_args(["bench", "e2e", "--max-prefill-stall", "-1"])
    with pytest.raises(DeltaflashError, match="--max-prefill-stall must be >= 0"):
        bad.func(bad)


def test_a_benchmark_returning_its_result_exits_zero(monkeypatch):
    """Benchmarks return their result dict (for callers and JSON); the command's exit status is still 0."""
    from deltaflash import cli
    from deltaflash.bench import kernels

    monkeypatch.setattr(kernels, "run", lambda args: {"lanes": args.lanes})
    assert cli.main(["bench", "kernels", "--lanes", "2"]) == 0
