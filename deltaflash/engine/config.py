"""Every engine option, resolved once - flags, defaults and environment variables - into a frozen
`EngineConfig` the engine holds. No other engine code reads the environment (the server's
DELTAFLASH_API_KEY is the default of `deltaflash serve --api-key`, read with its flags).

Environment variables (README, "Environment"):
- DELTAFLASH_NO_FUSED_KERNELS=1: run the unfused reference route (ops/kernels.reference_kernels) on CUDA too.
- DELTAFLASH_NO_CUDA_GRAPHS=1: run every forward eagerly on CUDA (no graph capture at start).
- DELTAFLASH_NO_PREFILL_GRAPHS=1: run prefill steps eagerly on CUDA (rounds still replay their graphs).
- DELTAFLASH_NO_ROUND_GRAPHS=1: greedy rounds replay their three graphs with eager launches between them
  instead of one graph for the whole round.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deltaflash.errors import DeltaflashError

ENV_NO_FUSED_KERNELS = "DELTAFLASH_NO_FUSED_KERNELS"
ENV_NO_CUDA_GRAPHS = "DELTAFLASH_NO_CUDA_GRAPHS"
ENV_NO_PREFILL_GRAPHS = "DELTAFLASH_NO_PREFILL_GRAPHS"
ENV_NO_ROUND_GRAPHS = "DELTAFLASH_NO_ROUND_GRAPHS"
ENV_FLA_TILES = "DELTAFLASH_FLA_TILES"


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "0").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine. `resolve` turns the automatic ones into decisions:

    max_slots: sequences served together (one slot of GDN state each).
    max_model_len: prompt + generated tokens of one sequence; None = the model's max_position_embeddings
        (lowered to what the page pool holds, with a warning; a value given that the pool cannot hold
        for one sequence is an error).
    max_num_batched_tokens: prompt tokens one step prefills (oldest prompt first, in chunks), beside the
        round, which every decoding lane gets each step whatever its width: a prompt arriving stalls the
        running streams by at most this much prefill, and a full round never starves waiting prompts.
    idle_prefill_tokens: prompt tokens a step prefills when no sequence is decoding (no stream to stall:
        a prompt arriving at an idle engine goes in chunks of this size, fewer weight reads and better
        shaped GEMMs than the budget's; never less than max_num_batched_tokens).
    scale_prefill_budget: beside a speculative round, the step's prefill budget is max_num_batched_tokens
        times the round's measured cost over a plain round's at its lane bucket (speculative/policy.py:
        RoundCosts; at most idle_prefill_tokens). A waiting prompt then takes the same share of each
        step as beside plain decoding: the running streams' stall relative to their round is what it is
        without speculation, and prompts go in at the same wall-clock rate (H200, 9B shape and demo pair:
        speculative TTFT p50 51 against 70 ms at 16 clients, 73 against 89 ms at 64; docs/benchmarks.md).
        A prompt the scaled budget would cut at most an eighth of it short of its end goes in whole
        (Scheduler.prefill_slack: its rest would take a padded graph lane of its own in the next step).
        None: on for speculative engines of one rank (ranks must plan alike; their timings differ).
    max_prefill_stall: beside a round, a step prefills at most the prompt tokens whose measured cost is this
        many plain rounds (Scheduler.stall_budget; what prompt tokens add to a step is measured on the steps
        that prefill beside a round: speculative/policy.py PrefillCost), within max_num_batched_tokens and at
        least 64: a prompt arriving then stretches a running stream's inter-token time to about 1 + this many
        rounds, at any load and on any model, where a fixed token budget stalls low loads most (one round is
        short there). Where a step's fixed prefill cost alone exceeds it, max_num_batched_tokens (fewer,
        larger chunks stall less in all). 0: off.
    share_prompts: a request whose prompt a sequence is prefilling (the n samples of one prompt; clients sending
        the same prompt) waits for that prefill and forks from it - the state copied, the prompt's whole pages
        shared - instead of prefilling the prompt again (engine/shares.py).
    prefix_cache: prompts (of at least 64 tokens), and the branch points where prompts sharing a beginning part,
        whose state the prefix cache keeps for later prompts that begin with them (engine/prefix_cache.py: a row of
        saved GDN state each, a slot's size, and their pages, given back least recently used first when pages run
        short); None = max_slots; 0 = off.
    page_size: token positions per page of K/V (target attention and drafter context).
    kv_cache_memory: bytes of the page pool; None = 2 GiB on CPU, and on CUDA `gpu_memory_utilization`
        of the device less what weights, slot state, CUDA graphs and activations take.
    gpu_memory_utilization: fraction of the device's memory the engine may use in all (CUDA).
    tree_budget: 0 = speculate with the drafter's top-1 chain; N >= 2 = with trees of N nodes (the anchor
        included) built from the block's per-depth candidates (speculative/tree.py), N rows per lane.
    tree_top_k: candidates per depth a tree may branch into.
    tree_max_lanes: with trees, which rounds verify trees and which the top-1 chains (the block). None: each
        round takes the mode with more tokens per second at its lane bucket, from what each mode's rounds
        have measured (speculative/policy.py: TreeChoice; a tree's extra rows cost little beside a
        launch-bound round and a lot beside a compute-bound one, so no fixed lane count serves every
        model). N >= 1: trees in rounds of at most N decoding lanes, chains above; 0: trees at every load.
        A round holding a seeded sampled request verifies trees whatever the rule (its output must not
        depend on the load). Under tensor parallelism None resolves to 1 (choices from each rank's own
        timings would part the ranks).
    speculation: "adaptive" = each round verifies the width (1, powers of two, the block) that maximises
        expected tokens per second from the lanes' acceptance so far and the measured cost of a round
        (speculative/policy.py); "fixed" = always the block; "auto" = adaptive on CPU, fixed on CUDA
        (the H200 demo sweep of 2026-12-02 measured adaptive behind fixed at C = 4-64: docs/benchmarks.md).
        Trees always use their budget.
    block_size: W, rows a speculating lane verifies; 0 = the drafter's own; resolved to 1 without a drafter.
    kernels: "triton" (fused kernels) or "reference" (the unfused route); "auto" = triton on CUDA unless
        DELTAFLASH_NO_FUSED_KERNELS=1, reference on CPU.
    cuda_graphs: replay rounds from CUDA graphs captured at start; None = on CUDA unless
        DELTAFLASH_NO_CUDA_GRAPHS=1.
    prefill_graphs: also replay prefill steps from graphs of fixed chunk shapes (lanes x a multiple of
        64 rows, engine/runner.py: prefill_shapes); steps that fit none, or would pad more than about
        twice their rows, run eagerly. None = with cuda_graphs unless DELTAFLASH_NO_PREFILL_GRAPHS=1.
    round_graphs: a greedy round (every lane greedy, no logit rules, no logprobs, fused kernels, a
        DFlash drafter, one rank) replays one CUDA graph per chain width, or per tree budget - the
        drafter's block (and trees), the verify forward, acceptance, the state commit (and a tree's K/V
        moves) and the drafter's context append - instead of three graphs and ~25 eager launches (a
        tree round: ~70); the host reads the counts and tokens as before (engine/runner.py: _greedy_round,
        _greedy_tree_round). None = with cuda_graphs and the fused kernels unless DELTAFLASH_NO_ROUND_GRAPHS=1.
    sync_phase_timing: sync the device between round phases (profiling: exact phase times, slower).
    batch_invariant: run the target's products through ops/gemm's batch-invariant kernel instead of
        cuBLAS (a row's logits then never depend on its batch; opt-in until its speed is measured; the
        model's layers are switched in place).
    skinny_gemm: the products of rounds of at most 64 rows (target and drafter) through ops/gemm's skinny
        split-K kernel where a table tuned on the device (bench/tune_skinny.py) measured it faster than
        cuBLAS (graph replays: device time): "auto" = the table shipped for this CUDA device
        (ops/gemm/tiles/) when rounds replay CUDA graphs, none if there is none; "off" = cuBLAS everywhere;
        else the path of a table. Off for a batch-invariant engine.
    fla_tiles: launch configs of fla-core's chunked prefill kernels by rows (ops/gdn/fla_launch.py; fla-core
        autotunes once per process at whatever shape comes first): "auto" = DELTAFLASH_FLA_TILES (a path or
        "off") if set, else the table shipped for this CUDA device (ops/gdn/tiles/), none if there is none;
        "off" = fla-core's autotuner; else the path of a table. Off on the CPU (the torch reference).
    tensor_parallel_size: ranks the target is sharded over (set by the engine from its TensorParallel,
        parallel/launch.py); above 1 speculation is fixed ("auto" resolves to it, "adaptive" is refused:
        widths chosen from each rank's own timings would part the ranks).
    """

    max_slots: int = 8
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512
    idle_prefill_tokens: int = 2048
    scale_prefill_budget: bool | None = None
    max_prefill_stall: float = 0.0
    share_prompts: bool = True
    prefix_cache: int | None = None
    page_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    tree_budget: int = 0
    tree_top_k: int = 4
    tree_max_lanes: int | None = None
    speculation: str = "auto"
    block_size: int = 0
    kernels: str = "auto"
    cuda_graphs: bool | None = None
    prefill_graphs: bool | None = None
    batch_invariant: bool = False
    skinny_gemm: str = "auto"
    fla_tiles: str = "auto"
    round_graphs: bool | None = None
    sync_phase_timing: bool = False
    tensor_parallel_size: int = 1

    def resolve(self, device: torch.device, drafter_block: int | None,
                env: Mapping[str, str] | None = None, model_max_len: int = 4096) -> "EngineConfig":
        """The decided config for an engine on `device` whose draft source drafts blocks of
        `drafter_block` (None: no draft source), for a model of `model_max_len` positions. Raises
        DeltaflashError for impossible options. (max_model_len may still be lowered to the page pool's
        capacity by the runner, `fit_to_pages`.)"""
        env = os.environ if env is None else env
        for name, low in (("max_slots", 1), ("max_model_len", 2), ("max_num_batched_tokens", 1),
                          ("idle_prefill_tokens", 1), ("block_size", 0), ("prefix_cache", 0),
                          ("page_size", 1), ("kv_cache_memory", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise DeltaflashError(f"{name} must be >= {low}, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise DeltaflashError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        cuda = torch.device(device).type == "cuda"
        kernels = self.kernels
        if kernels == "auto":
            kernels = "triton" if cuda and not _env_flag(env, ENV_NO_FUSED_KERNELS) else "reference"
        if kernels not in ("triton", "reference"):
            raise DeltaflashError(f"kernels must be 'triton', 'reference' or 'auto', got {kernels!r}")
        graphs = cuda and not _env_flag(env, ENV_NO_CUDA_GRAPHS) if self.cuda_graphs is None else self.cuda_graphs
        if graphs and not cuda:
            raise DeltaflashError("cuda_graphs needs a CUDA device")
        prefill_graphs = graphs and not _env_flag(env, ENV_NO_PREFILL_GRAPHS) if self.prefill_graphs is None \
            else self.prefill_graphs
        if prefill_graphs and not graphs:
            raise DeltaflashError("prefill_graphs needs cuda_graphs")
        round_graphs = graphs and kernels == "triton" and not _env_flag(env, ENV_NO_ROUND_GRAPHS) \
            if self.round_graphs is None else self.round_graphs
        if round_graphs and not (graphs and kernels == "triton"):
            raise DeltaflashError("round_graphs needs cuda_graphs and the fused kernels")
        if drafter_block is None:
            if self.block_size > 1:
                raise DeltaflashError(f"block size {self.block_size} needs a drafter (--draft)")
            block = 1
        else:
            block = self.block_size or drafter_block
            if block < 2:
                raise DeltaflashError(f"block size must be >= 2 to speculate, got {block}")
        if self.speculation not in ("adaptive", "fixed", "auto"):
            raise DeltaflashError(f"speculation must be 'adaptive', 'fixed' or 'auto', got {self.speculation!r}")
        if self.tensor_parallel_size < 1:
            raise DeltaflashError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.speculation == "adaptive":
            raise DeltaflashError("speculation 'adaptive' does not run under tensor parallelism yet (its widths come "
                                  "from each rank's own timings); use 'fixed' or 'auto'")
        speculation = self.speculation if self.speculation != "auto" else \
            "fixed" if cuda or self.tensor_parallel_size > 1 else "adaptive"
        if self.tree_budget:
            from deltaflash.speculative.tree import max_nodes

            if block < 2:
                raise DeltaflashError(f"tree_budget {self.tree_budget} needs a drafter (--draft)")
            if self.tree_max_lanes is not None and self.tree_max_lanes < 0:
                raise DeltaflashError(f"tree_max_lanes must be >= 0, got {self.tree_max_lanes}")
            if not 2 <= self.tree_budget <= 64 or self.tree_top_k < 1:
                raise DeltaflashError(f"tree_budget must be 0 or in [2, 64] and tree_top_k >= 1, got "
                                      f"{self.tree_budget} and {self.tree_top_k}")
            if self.tree_budget > max_nodes(block - 1, self.tree_top_k, self.tree_budget):
                raise DeltaflashError(f"a tree of {self.tree_budget} nodes does not fit {block - 1} depths of "
                                      f"{self.tree_top_k} candidates")
        skinny_gemm = self._skinny_gemm(device, env, graphs)
        fla_tiles = self._fla_tiles(device, env)
        tree_max_lanes = 1 if self.tree_max_lanes is None and self.tensor_parallel_size > 1 else self.tree_max_lanes
        if self.max_prefill_stall < 0:
            raise DeltaflashError(f"max_prefill_stall must be >= 0 (0: off), got {self.max_prefill_stall}")
        for name in ("max_prefill_stall", "scale_prefill_budget"):  # budgets from timings: ranks must plan alike
            if getattr(self, name) and self.tensor_parallel_size > 1:
                raise DeltaflashError(f"{name} does not run under tensor parallelism (the budget would come from "
                                      "each rank's own timings)")
        scale = block > 1 and self.tensor_parallel_size == 1 if self.scale_prefill_budget is None \
            else self.scale_prefill_budget and block > 1
        return dataclasses.replace(self, kernels=kernels, cuda_graphs=graphs, prefill_graphs=prefill_graphs,
                                   scale_prefill_budget=scale, skinny_gemm=skinny_gemm, fla_tiles=fla_tiles,
                                   round_graphs=round_graphs, tree_max_lanes=tree_max_lanes,
                                   block_size=block, speculation=speculation,
                                   max_model_len=self.max_model_len or model_max_len,
                                   prefix_cache=self.max_slots if self.prefix_cache is None else self.prefix_cache,
                                   idle_prefill_tokens=max(self.idle_prefill_tokens, self.max_num_batched_tokens))

    def _skinny_gemm(self, device: torch.device, env: Mapping[str, str], graphs: bool) -> str:
        """skinny_gemm resolved to "off" or the path of a table that loads."""
        from deltaflash.ops.gemm.skinny import SkinnyGemms, bundled_table

        device = torch.device(device)
        if self.skinny_gemm == "auto":  # (eager, two Triton launches cost more host time than cuBLAS's one)
            if device.type != "cuda" or self.batch_invariant or not graphs or not torch.cuda.is_available():
                return "off"  # (the last: a config resolved for CUDA on a machine without one, in tests)
            table = bundled_table(torch.cuda.get_device_name(device))
            return "off" if table is None else str(table)
        if self.skinny_gemm == "off":
            return "off"
        if self.batch_invariant:
            raise DeltaflashError("skinny_gemm and batch_invariant exclude each other (the batch-invariant GEMM "
                                  "has one tile for every call)")
        if device.type != "cuda" and not _env_flag(env, "TRITON_INTERPRET"):
            raise DeltaflashError(f"skinny_gemm {self.skinny_gemm}: its Triton kernels need a CUDA device")
        try:
            SkinnyGemms.load(self.skinny_gemm)
        except ValueError as e:
            raise DeltaflashError(f"skinny_gemm: {e}") from None
        return self.skinny_gemm

    def _fla_tiles(self, device: torch.device, env: Mapping[str, str]) -> str:
        """fla_tiles resolved to "off" or the path of a table that loads (a path given is checked anywhere)."""
        from deltaflash.ops.gdn.fla_launch import LaunchTable, bundled_table

        choice = (env.get(ENV_FLA_TILES) or "auto") if self.fla_tiles == "auto" else self.fla_tiles
        if choice not in ("auto", "off"):
            try:
                LaunchTable.load(choice)
            except ValueError as e:
                raise DeltaflashError(f"fla_tiles: {e}") from None
        if choice == "off" or torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return "off"  # (the last: a config resolved for CUDA on a machine without one, in tests)
        if choice == "auto":
            table = bundled_table(torch.cuda.get_device_name(device))
            return "off" if table is None else str(table)
        return choice

    @property
    def round_prefill_tokens(self) -> int:
        """The most prompt tokens a step prefills beside a round (the prefill graphs cover them)."""
        return self.idle_prefill_tokens if self.scale_prefill_budget else self.max_num_batched_tokens

    @property
    def adaptive(self) -> bool:
        """Rounds choose their width (a speculative engine of chains with speculation 'adaptive')."""
        return self.speculative and not self.tree_budget and self.speculation == "adaptive"

    @property
    def widths(self) -> tuple[int, ...]:
        """The chain widths rounds may verify (each has a CUDA graph; a tree engine's trees have their own)."""
        from deltaflash.speculative.policy import allowed_widths

        if self.tree_budget:  # chains unless trees at every load (trees: their own graphs)
            return (1, self.block_size) if self.tree_max_lanes != 0 else (1,)
        return allowed_widths(self.block_size) if self.adaptive else tuple(sorted({1, self.block_size}))

    @property
    def costed_trees(self) -> bool:
        """A tree engine whose rounds choose trees or chains by their measured tokens per second."""
        return bool(self.tree_budget) and self.tree_max_lanes is None

    def trees_for(self, lanes: int) -> bool:
        """Whether a speculative round of `lanes` decoding lanes verifies trees, by the fixed rule
        (tree_max_lanes N; with costed_trees the scheduler's TreeChoice decides)."""
        return bool(self.tree_budget) and (not self.tree_max_lanes or lanes <= self.tree_max_lanes)

    @property
    def reach(self) -> int:
        """Positions past its committed length one round may write for a sequence: the drafter's block
        and the verify rows (a tree's nodes)."""
        return max(self.block_size, self.tree_budget)

    def fit_to_pages(self, pool_tokens: int, given: bool) -> "EngineConfig":
        """This config with max_model_len at most what one sequence can hold in a pool of `pool_tokens`
        positions (a sequence's verify rows reach block_size - 1 past it). given: the user chose
        max_model_len, so a pool too small for it is an error rather than a lower default."""
        room = pool_tokens - self.reach
        if self.max_model_len <= room:
            return self
        if given or room < 2:
            raise DeltaflashError(
                f"max_model_len {self.max_model_len} does not fit the K/V page pool, which holds {pool_tokens} "
                f"token positions ({room} for one sequence with its verify rows): raise --kv-cache-memory / "
                "--gpu-memory-utilization or lower --max-model-len")
        return dataclasses.replace(self, max_model_len=room)

    @property
    def speculative(self) -> bool:
        return self.block_size > 1
