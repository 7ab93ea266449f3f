"""fla-core launch tables (deltaflash/ops/gdn/fla_launch.py): a table's round trip, clear errors for bad
tables, pinning and unpinning the kernels' configs, the environment's choice, each shipped table; on CUDA,
the chunked rule under a pinned table runs that config and agrees with fla-core's own pick."""

import json

import pytest
import torch
import triton
import triton.language as tl

from deltaflash.ops.gdn import fla_launch
from deltaflash.ops.tables import device_table


@triton.heuristics({"EVEN": lambda args: args["n"] % 16 == 0})  # wrapped as fla-core's kernels are
@triton.autotune(configs=[triton.Config({"BV": 32}, num_warps=2), triton.Config({"BV": 64}, num_warps=4)], key=["n"])
@triton.jit
def _state_kernel(x, n, BV: tl.constexpr, EVEN: tl.constexpr):
    pass


@triton.autotune(configs=[triton.Config({}, num_warps=4, num_stages=2)], key=["n"])
@triton.jit
def _wu_kernel(x, n):
    pass


@pytest.fixture
def kernels(monkeypatch):
    """fla-core's kernels as the pinning sees them, stood in by two autotuned kernels of this module (the
    CPU tests hide fla: conftest.py), under the names of the real ones."""
    monkeypatch.setattr(fla_launch, "KERNELS", {"h": (__name__, "_state_kernel"), "wu": (__name__, "_wu_kernel")})


def same(a: triton.Config, b: triton.Config) -> bool:
    return (a.kwargs, a.num_warps, a.num_stages) == (b.kwargs, b.num_warps, b.num_stages)


@pytest.fixture
def configs():
    return {"h": triton.Config({"BV": 16}, num_warps=4, num_stages=2),
            "wu": triton.Config({}, num_warps=2, num_stages=3)}


def test_table_round_trip_pin_and_unpin(tmp_path, configs, kernels):
    path = tmp_path / "t.json"
    fla_launch.save(path, "Some GPU", configs)
    loaded = fla_launch.load(path)
    assert loaded.keys() == configs.keys() and all(same(loaded[n], configs[n]) for n in configs)
    own = {name: fla_launch.autotuner(name).configs for name in fla_launch.KERNELS}
    before = fla_launch.pin(loaded)
    try:
        for name in fla_launch.KERNELS:
            now = fla_launch.autotuner(name).configs
            assert (len(now) == 1 and same(now[0], loaded[name])) if name in loaded else now is own[name]
    finally:
        fla_launch.unpin(before)
    assert all(fla_launch.autotuner(name).configs is own[name] for name in fla_launch.KERNELS)


def test_bad_tables_name_the_file(tmp_path, kernels):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not an fla-core launch table"):
        fla_launch.load(bad)
    bad.write_text(json.dumps({"device": "x", "configs": {"nope": {"kwargs": {}, "num_warps": 4, "num_stages": 2}}}))
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        fla_launch.load(bad)
    bad.write_text(json.dumps({"device": "x", "configs": {"h": {"kwargs": {"BV": 16}}}}))
    with pytest.raises(ValueError, match="not an fla-core launch table"):
        fla_launch.load(bad)


def test_the_environment_chooses_the_table(tmp_path, monkeypatch, configs, kernels):
    """off: fla-core's autotuner; a path: that table, pinned once per process; no table for the device:
    nothing pinned."""
    path = tmp_path / "t.json"
    fla_launch.save(path, "Some GPU", configs)
    own = {name: fla_launch.autotuner(name).configs for name in fla_launch.KERNELS}
    try:
        monkeypatch.setenv("DELTAFLASH_FLA_TILES", "off")
        fla_launch.pin_for.cache_clear()
        assert "autotuner" in fla_launch.pin_for("Some GPU") and fla_launch.autotuner("h").configs is own["h"]
        monkeypatch.delenv("DELTAFLASH_FLA_TILES")
        fla_launch.pin_for.cache_clear()
        assert "no table" in fla_launch.pin_for("No Such GPU 9000") and fla_launch.autotuner("h").configs is own["h"]
        monkeypatch.setenv("DELTAFLASH_FLA_TILES", str(path))
        fla_launch.pin_for.cache_clear()
        assert fla_launch.pin_for("Some GPU") == str(path)
        assert same(fla_launch.autotuner("h").configs[0], configs["h"])
        fla_launch.autotuner("h").configs = own["h"]
        assert fla_launch.pin_for("Some GPU") == str(path) and fla_launch.autotuner("h").configs is own["h"]  # once
    finally:
        fla_launch.unpin(own)
        fla_launch.pin_for.cache_clear()


def test_every_shipped_table_loads_and_is_found_by_its_devices_name():
    for path in sorted(fla_launch.TABLES.glob("*.json")):
        device = json.loads(path.read_text())["device"]
        assert device_table(fla_launch.TABLES, device) == path
        assert set(fla_launch.load(path)) <= set(fla_launch.KERNELS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's kernels need CUDA")
def test_a_pinned_config_runs_and_agrees_with_fla_cores_pick():
    """The chunked rule at a small GVA shape, fla-core's own pick, then a table pinning configs outside
    its lists (BV 16 for the state kernel, 8 warps for the output one): the pinned configs are the ones
    that ran, and the outputs agree within bf16 rounding."""
    from deltaflash.ops.gdn.chunk import _fla

    g = torch.Generator(device="cuda").manual_seed(0)
    L, T, nk, nv, d = 2, 200, 2, 4, 64

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g)

    q, k = (torch.nn.functional.normalize(randn(L, T, nk, d), dim=-1).bfloat16() for _ in range(2))
    args = (q, k, randn(L, T, nv, d).bfloat16(), randn(L, T, nv).bfloat16(), randn(L, T, nv).bfloat16(),
            torch.rand(nv, device="cuda").log(), randn(nv), randn(L, nv, d, d) * 0.1)
    own = {name: fla_launch.autotuner(name).configs for name in fla_launch.KERNELS}
    try:
        fla_launch.unpin(own)
        ref = _fla(*args)
        table = {"h": triton.Config({"BV": 16}, num_warps=2, num_stages=2),
                 "o": triton.Config({"BK": 64, "BV": 32}, num_warps=8, num_stages=2)}
        fla_launch.pin(table)
        out = _fla(*args)
        for name, config in table.items():
            assert same(fla_launch.autotuner(name).best_config, config)
        torch.testing.assert_close(out[0].float(), ref[0].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out[1], ref[1], atol=1e-3, rtol=1e-3)
    finally:
        fla_launch.unpin(own)
