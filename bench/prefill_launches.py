"""How many device launches one fixed-shape prefill forward makes (what a prefill CUDA graph captures), by
kind - the graph's launch gaps and, run eagerly, its host time. Runs on the CPU under TRITON_INTERPRET=1 with
the fused kernels on tests' tiny target (3 GDN layers, 1 attention layer; launch counts per layer do not
depend on the model's size): an eager torch op that launches a kernel counts one (a dtype cast to the same
dtype launches nothing and is not counted), a Triton launch one, and fla-core's chunked rule, which the CPU
replaces with the torch reference, one entry ("fla-core chunk rule": on CUDA its own ~7 launches).

    TRITON_INTERPRET=1 python bench/prefill_launches.py [--lanes 2] [--rows 64] [--first-chunk]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.checkpoints builds the tiny target
sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_launches import interpreted_launches  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=2, help="lanes of the batch (the last one a padding lane)")
    ap.add_argument("--rows", type=int, default=64, help="rows a lane (the graph shape T)")
    ap.add_argument("--first-chunk", action="store_true",
                    help="every lane starts its sequence (a first-chunk graph: attention over the chunk's own K/V)")
    args = ap.parse_args()
    count = interpreted_launches()

    import deltaflash.models.gdn as gdn_module
    from deltaflash.cache.slots import SlotPool
    from deltaflash.core.batch import ExtendBatch
    from deltaflash.models.loader import load_model
    from deltaflash.ops.kernels import triton_kernels
    from tests.checkpoints import build_hf_model, save_checkpoint

    chunk_rule = gdn_module.chunk_gated_delta_rule_padded

    def chunk_rule_counted(*args):
        """fla-core's launches as one entry, and the two torch.where that mask padding rows' gates (both
        routes launch them); the CPU route's own reference work inside is not counted."""
        count.tally("fla-core chunk rule")
        count.tally("where", 2)
        count.muted += 1
        try:
            return chunk_rule(*args)
        finally:
            count.muted -= 1

    gdn_module.chunk_gated_delta_rule_padded = chunk_rule_counted
    folder = save_checkpoint(build_hf_model("dense_gqa", seed=3), Path(tempfile.mkdtemp()) / "target")
    model = load_model(folder, device="cpu", dtype=torch.float16, progress=False)  # (the interpreter has no bf16 constants)
    L, T = args.lanes, args.rows
    pool = SlotPool(model.cfg, L + 2, 2 * T, torch.float16, "cpu")
    slots = list(range(L - 1)) + [-1]
    batch = ExtendBatch.padded(torch.zeros(L, T, dtype=torch.long), torch.tensor(slots), torch.zeros(L, dtype=torch.long),
                               torch.tensor([T // 2 + 1] * (L - 1) + [0]), torch.tensor(list(range(L - 1)) + [L]),
                               starts_sequences=args.first_chunk)
    with count, torch.inference_mode():
        count.phase = "prefill"
        model.extend(batch, pool, triton_kernels())
    tally = count.by_phase["prefill"]
    tally.pop("to", None)  # same-dtype casts reach the dispatcher and launch nothing
    gdn = sum(1 for t in model.cfg.layer_types if t == "linear_attention")
    print(f"{sum(tally.values())} launches per fixed-shape prefill forward ({L} lanes x {T} rows; "
          f"{gdn} GDN + {len(model.cfg.layer_types) - gdn} attention layers)")
    print("  " + ", ".join(f"{k} {v}" for k, v in tally.most_common()))


if __name__ == "__main__":
    main()
