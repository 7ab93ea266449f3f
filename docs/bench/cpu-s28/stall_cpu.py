"""The bundled target on this CPU box, target-only, 4 slots, step budget 256: three streams decode and a
1,200-token prompt arrives; per prefill step (tokens, budget, step ms), without and with --max-prefill-stall 2.
usage: python docs/bench/cpu-s28/stall_cpu.py"""
import torch, time
from deltaflash.bundled import BUNDLED
from deltaflash.engine.engine import Engine
from deltaflash.core.request import SamplingParams
torch.set_grad_enabled(False)
for stall in (0.0, 2.0):
    eng = Engine.from_pretrained(BUNDLED / "target", device="cpu", progress=False, max_slots=4, max_model_len=2048,
                                 max_num_batched_tokens=256, max_prefill_stall=stall)
    for i in range(3):
        eng.add_request([1 + i, 2, 3], SamplingParams(max_new_tokens=300, ignore_eos=True))
    for _ in range(5): eng.step()
    eng.add_request(list(range(5, 1205)), SamplingParams(max_new_tokens=4, ignore_eos=True))
    reps = []
    t = time.perf_counter()
    while eng.has_work() and len(reps) < 60:
        eng.step(on_report=reps.append)
    c = eng.scheduler.costs
    print("stall", stall, [(r.prefill_tokens, r.prefill_budget, round((r.prefill_s + r.decode_s) * 1e3, 1)) for r in reps if r.prefill_tokens][:12])
    dec = sorted(r.decode_s for r in reps if not r.prefill_tokens)
    print("  decode-only step p50 ms", round(dec[len(dec)//2]*1e3, 2), "prefill line (a s, b s/token, fitted)", c and c.prefill.line(), "plain round cost s", c and c.cost(4, 1))
