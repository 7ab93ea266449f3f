"""Which op breaks a CUDA-graph capture: report Triton module loads and host syncs made while a stream captures."""
import sys, traceback
import torch
import triton.compiler.compiler as tc

def capturing():
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

orig_init = tc.CompiledKernel._init_handles
def init_handles(self):
    if capturing() and getattr(self, "module", None) is None:
        print(f"[capture] Triton module load inside capture: {self.name}", flush=True)
        traceback.print_stack(limit=14)
    return orig_init(self)
tc.CompiledKernel._init_handles = init_handles
for name in ("item", "tolist", "cpu", "__bool__"):
    orig = getattr(torch.Tensor, name)
    def wrap(self, *a, _orig=orig, _name=name, **k):
        if self.is_cuda and capturing():
            print(f"[capture] host read {_name} inside capture", flush=True)
            traceback.print_stack(limit=14)
        return _orig(self, *a, **k)
    setattr(torch.Tensor, name, wrap)
import pytest
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-s", *sys.argv[1:]]))
