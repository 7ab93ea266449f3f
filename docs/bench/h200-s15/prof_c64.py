"""Profile a target-only closed wave of C requests on the bundled target (either tree): host cost per step.
usage: PYTHONPATH=<tree> python prof_c64.py C max_new [device]"""
import cProfile, pstats, sys, time
import torch
try:
    from deltaflash.bundled import BUNDLED
except ImportError:
    from deltaflash.demo import BUNDLED
try:
    from deltaflash.engine.config import EngineConfig
    from deltaflash.core.request import SamplingParams
except ImportError:
    from deltaflash.engine.engine import EngineConfig
    from deltaflash.engine.request import SamplingParams
from deltaflash.engine.engine import Engine
from deltaflash.models.loader import load_model, default_dtype
from deltaflash.tokenizer import load_tokenizer, encode_prompt
from deltaflash.train.corpus import heldout_prompts, load_split

C, new = int(sys.argv[1]), int(sys.argv[2])
dev = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu")
torch.set_grad_enabled(False)
model = load_model(BUNDLED / "target", dtype=default_dtype(dev), device=dev, progress=False)
tok = load_tokenizer(BUNDLED / "target")
prompts = [encode_prompt(tok, t) for t in heldout_prompts(load_split(), 16, num_lines=12)]
prompts = [prompts[i % 16] for i in range(C)]
eng = Engine(model, tok, None, EngineConfig(max_slots=C, max_model_len=320))
params = SamplingParams(max_new_tokens=new)
eng.generate(prompts[:C], SamplingParams(max_new_tokens=4, ignore_eos=True))
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
for rep in range(2):
    for p in prompts:
        eng.add_request(p, params)
    steps, times = 0, []
    sync(); t0 = time.perf_counter()
    prof = cProfile.Profile() if rep == 1 else None
    if prof: prof.enable()
    tokens = 0
    while eng.has_work():
        ts = time.perf_counter()
        rep_ = []
        ev = eng.step(rep_.append)
        times.append((time.perf_counter() - ts, rep_[0].prefill_tokens if rep_ else -1, rep_[0].decode_lanes if rep_ else 0))
        tokens += sum(len(e.token_ids) for e in ev)
        steps += 1
    sync()
    if prof: prof.disable()
    wall = time.perf_counter() - t0
    dec = sorted(t for t, p, d in times if p == 0 and d)
    pre = [t for t, p, d in times if p > 0]
    big = sorted((t for t, p, d in times if p == 0 and d == C))
    print(f"rep {rep}: steps {steps} tokens {tokens} wall {wall*1e3:.1f} ms tok/s {tokens/wall:.0f}; decode-only steps {len(dec)} p50 {dec[len(dec)//2]*1e3:.3f} ms"
          f" sum {sum(dec)*1e3:.1f} ms; full-width ({C}) steps {len(big)} p50 {big[len(big)//2]*1e3 if big else 0:.3f}; prefill steps {len(pre)} sum {sum(pre)*1e3:.1f} ms")
st = pstats.Stats(prof); st.sort_stats("tottime").print_stats(35)
