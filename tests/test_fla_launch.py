"""fla-core launch tables (deltaflash/ops/gdn/fla_launch.py): a table's round trip, clear errors for bad
tables, pinning and unpinning the kernels' configs, the active table's bucket per call, the engine option's
resolution (EngineConfig.fla_tiles, DELTAFLASH_FLA_TILES), each shipped table; on CUDA, the chunked rule
under a table runs its bucket's configs and agrees with fla-core's own pick."""

import json

import pytest
import torch
import triton
import triton.language as tl

from deltaflash.engine.config import EngineConfig
from deltaflash.errors import DeltaflashError
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
def table():
    return fla_launch.LaunchTable("Some GPU", {
        "h": [(0, triton.Config({"BV": 64}, num_warps=4, num_stages=2)),
              (2048, triton.Config({"BV": 16}, num_warps=4, num_stages=3))],
        "wu": [(0, triton.Config({}, num_warps=2, num_stages=3))]})


def test_rows_pick_the_bucket(table):
    """A call's longest lane picks the last bucket starting at or below its rows."""
    for rows, bv, bound in ((1, 64, 0), (2047, 64, 0), (2048, 16, 2048), (100_000, 16, 2048)):
        configs = table.configs(rows)
        assert configs["h"].kwargs == {"BV": bv} and configs["wu"].num_warps == 2 and table.bound(rows) == bound
    empty = fla_launch.LaunchTable("Some GPU", {})  # (what tune_fla writes where nothing beat fla-core's picks)
    assert empty.configs(4096) == {} and empty.bound(4096) == 0


def test_table_round_trip_pin_and_unpin(tmp_path, table, kernels):
    path = tmp_path / "t.json"
    table.save(path)
    loaded = fla_launch.LaunchTable.load(path)
    assert loaded.device == "Some GPU" and loaded.buckets.keys() == table.buckets.keys()
    for name, entries in table.buckets.items():
        assert [r for r, _ in loaded.buckets[name]] == [r for r, _ in entries]
        assert all(same(a, b) for (_, a), (_, b) in zip(loaded.buckets[name], entries))
    own = {name: fla_launch.autotuner(name).configs for name in fla_launch.KERNELS}
    before = fla_launch.pin(loaded.configs(4096))
    try:
        now = fla_launch.autotuner("h").configs
        assert len(now) == 1 and now[0].kwargs == {"BV": 16}
    finally:
        fla_launch.unpin(before)
    assert all(fla_launch.autotuner(name).configs is own[name] for name in fla_launch.KERNELS)


def test_bad_tables_name_the_file(tmp_path, kernels):
    bad = tmp_path / "bad.json"
    entry = {"min_rows": 0, "kwargs": {}, "num_warps": 4, "num_stages": 2}
    for text, match in (("{not json", "bad.json: not an fla-core launch table"),
                        (json.dumps({"device": "x", "configs": {"nope": [entry]}}), "unknown kernel 'nope'"),
                        (json.dumps({"device": "x", "configs": {"h": [{**entry, "min_rows": 64}]}}), "start at 0"),
                        (json.dumps({"device": "x", "configs": {"h": [entry, entry]}}), "increase"),
                        (json.dumps({"device": "x", "configs": {"h": [{"min_rows": 0, "kwargs": {}}]}}),
                         "not an fla-core launch table")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            fla_launch.LaunchTable.load(bad)


def test_the_active_table_pins_each_calls_bucket(table, kernels):
    """use(table): each call pins its rows' bucket (once per change of bucket); use(None): fla-core's lists
    again."""
    own = {name: fla_launch.autotuner(name).configs for name in fla_launch.KERNELS}
    try:
        fla_launch.use(table)
        for rows, bv in ((64, 64), (4096, 16), (512, 64)):
            fla_launch.select(rows)
            assert fla_launch.autotuner("h").configs[0].kwargs == {"BV": bv}
        fla_launch.autotuner("h").configs = own["h"]
        fla_launch.select(1000)  # the same bucket as the last call's: nothing pinned again
        assert fla_launch.autotuner("h").configs is own["h"]
        fla_launch.select(4096)
        assert fla_launch.autotuner("h").configs[0].kwargs == {"BV": 16}
        fla_launch.use(fla_launch.LaunchTable("Some GPU", {}))  # a table naming no kernel: fla-core's lists
        fla_launch.select(4096)
        assert all(fla_launch.autotuner(name).configs is own[name] for name in fla_launch.KERNELS)
        fla_launch.use(table)
        fla_launch.select(4096)
        fla_launch.use(None)
        assert all(fla_launch.autotuner(name).configs is own[name] for name in fla_launch.KERNELS)
        fla_launch.select(4096)
        assert fla_launch.autotuner("h").configs is own["h"]
    finally:
        fla_launch.use(None)
        fla_launch.unpin(own)


def test_the_engine_option_resolves_the_table(tmp_path, monkeypatch, table):
    """auto: DELTAFLASH_FLA_TILES if set, else the table shipped for the CUDA device, none elsewhere; a path
    is checked wherever it is given; off: none."""
    path = tmp_path / "t.json"
    table.save(path)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig().resolve(cpu, None, env={}).fla_tiles == "off"
    assert EngineConfig(fla_tiles=str(path)).resolve(cpu, None, env={}).fla_tiles == "off"  # (the torch reference)
    for given, env in ((str(tmp_path / "missing.json"), {}), ("auto", {"DELTAFLASH_FLA_TILES": str(tmp_path)})):
        with pytest.raises(DeltaflashError, match="not an fla-core launch table"):
            EngineConfig(fla_tiles=given).resolve(cpu, None, env=env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolving for a CUDA device (nothing runs)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    shipped = str(device_table(fla_launch.TABLES, "NVIDIA H100 80GB HBM3"))
    for given, env, want in (("auto", {}, shipped), ("auto", {"DELTAFLASH_FLA_TILES": "off"}, "off"),
                             ("auto", {"DELTAFLASH_FLA_TILES": str(path)}, str(path)), (str(path), {}, str(path)),
                             ("off", {"DELTAFLASH_FLA_TILES": str(path)}, "off")):
        config = EngineConfig(fla_tiles=given, cuda_graphs=False)
        assert config.resolve(cuda, None, env=env).fla_tiles == want, (given, env)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "No Such GPU 9000")
    assert EngineConfig(cuda_graphs=False).resolve(cuda, None, env={}).fla_tiles == "off"


def test_every_shipped_table_loads_and_is_found_by_its_devices_name():
    for path in sorted(fla_launch.TABLES.glob("*.json")):
        table = fla_launch.LaunchTable.load(path)
        assert device_table(fla_launch.TABLES, table.device) == path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla-core's kernels need CUDA")
def test_a_table_runs_its_bucket_and_agrees_with_fla_cores_pick():
    """The chunked rule at a small GVA shape under fla-core's autotuner, then under a table whose buckets
    pin configs outside its lists (BV 16 for the state kernel; 8 warps for the output one from 128 rows):
    each call runs its bucket's configs, and the outputs agree within bf16 rounding."""
    from deltaflash.ops.gdn.chunk import _fla

    g = torch.Generator(device="cuda").manual_seed(0)
    L, nk, nv, d = 2, 2, 4, 64

    def args(T):
        def randn(*shape):
            return torch.randn(*shape, device="cuda", generator=g)
        q, k = (torch.nn.functional.normalize(randn(L, T, nk, d), dim=-1).bfloat16() for _ in range(2))
        return (q, k, randn(L, T, nv, d).bfloat16(), randn(L, T, nv).bfloat16(), randn(L, T, nv).bfloat16(),
                torch.rand(nv, device="cuda").log(), randn(nv), randn(L, nv, d, d) * 0.1, T)

    C = triton.Config
    table = fla_launch.LaunchTable(torch.cuda.get_device_name(), {
        "h": [(0, C({"BV": 16}, num_warps=2, num_stages=2))],
        "o": [(0, C({"BK": 64, "BV": 64}, num_warps=4, num_stages=2)), (128, C({"BK": 64, "BV": 32}, num_warps=8,
                                                                                 num_stages=2))]})
    try:
        for T in (100, 200):
            x = args(T)
            fla_launch.use(None)
            ref = _fla(*x)
            fla_launch.use(table)
            out = _fla(*x)
            for name, config in table.configs(T).items():
                assert same(fla_launch.autotuner(name).best_config, config), (T, name)
            torch.testing.assert_close(out[0].float(), ref[0].float(), atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(out[1], ref[1], atol=1e-3, rtol=1e-3)
    finally:
        fla_launch.use(None)
