#!/usr/bin/env bash
# The GPU checks and measurements docs/benchmarks.md records, as named steps, each under a time limit,
# output appended to OUT/log.txt (JSON / PNG files land in OUT). On the lent H200 (fresh machine,
# wheels carried in .whl/): run a few steps per device call, e.g.
#   bash bench/gpu_checks.sh "$OUT" tests tune kernels        # call 1
#   bash bench/gpu_checks.sh "$OUT" target                    # call 2
#   bash bench/gpu_checks.sh "$OUT" round profile e2etau      # call 3
# Steps: tests spec target tune tunebuild tuneconv skinny skinnyround kernels round profile demo first e2etau e2edemo e2epair attention paged longctx
# treeround treedemo invariance stepprofile prefillattn chunkprofile serveoverlap itl2k ttft model capacity tp savecache
# longctxfast graphlaunch roundgraphs treestep treegraphs treepair randomdraft verifytrees prefillscale specdefault
# treeprofile treedefault treeops firstpair rgdemo rgprofile rg64 treechoice prefillstacks graphlaunch9b gemmgraphs swiglu
# tunefla ttfttable demodefault forks turns system burst streamoverlap (bench/h200_owed.sh runs the figures the issues still owe, in two calls)
# (tp: the 27B shape's round at TP 1 and
# TP_SIZES, default "2 4", on a multi-GPU kind). PYTEST_ARGS="-n 8" spreads the test steps over workers. LIMIT_<STEP>=seconds
# overrides a limit; TESTS="file::test ..." runs those tests instead of the kernel and graph test files.
# TUNE_ARGS replaces tune_verify.py's lanes / configs, BUILD_SETS the tunebuild option sets (comma-joined flags,
# e.g. "--fp-fusion,--widen-at-load"); skinny: SKINNY_ARGS (tune_skinny.py's, e.g. "--quick" or "--shapes 9b");
# skinnyround: SKINNY_TABLE (default OUT/skinny-tiles.json, the skinny step's); itl2k: ITL_BUDGETS ("512"), ITL_STALLS
# ("0": --max-prefill-stall values), ITL_CONCURRENCY ("8 32");
# e2etau: TAUS ("6 3"), SPECULATION (auto), PROMPT_LEN_MAX (prompts of 128 to that many tokens, not 256 each);
# prefillscale (the scripted e2e
# with the prefill budget scaled by the round's cost, then not): PS_WORKLOAD (scripted; demo), TAU (6),
# PS_CONCURRENCY ("16 64"), SPECULATION. prefillstacks: STACKS (a kernel-name regex; the small kernels of the 2048-token profile). specdefault: demo pair and scripted TAUS, --speculation fixed then adaptive.
# treepair: PAIR_RUNS (2), PAIR_BUDGETS ("0 16"), PAIR_CONCURRENCY ("1 4"). treedemo: TREEDEMO_FLAGS ("--round-graphs";
# "--no-round-graphs" for eager rounds).
# `spec` runs the speculative and engine suites on CUDA (DELTAFLASH_TEST_DEVICE=cuda, fp32, fused kernels);
# `e2epair` runs the demo e2e on this tree (serve defaults, and at --max-model-len 320) and on OLD_TREE
# (`git archive COMMIT | tar x -C DIR`, carried).
# `first` starts `deltaflash serve` (bundled pair) and times its start-up and first ten requests.
# A fresh machine compiles every kernel and captures every CUDA graph on first use: the kernel and graph
# tests take about 170 s there, the target tests (transformers on fla-core's autotuned kernels) over 200 s.
# The device brings back only a few files per call (about eight): e2e steps write three each.
set -u
OUT=${1:?usage: bench/gpu_checks.sh OUT STEP...}
shift
mkdir -p "$OUT"
LOG=$OUT/log.txt
if ls .whl/*.whl >/dev/null 2>&1; then  # fla-core (and dflash for the references) are not installed there
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >/dev/null 2>&1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
# Triton's compile cache travels between calls (a fresh machine otherwise recompiles every kernel): the
# `savecache` step writes it as OUT/triton-cache.tgz.part-* (15 MB pieces: the device returns files of
# 16 MiB at most); copy those to .tcache/ (git-ignored) and carry .tcache.
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
if ls .tcache/triton-cache.tgz.part-* >/dev/null 2>&1; then
    cat .tcache/triton-cache.tgz.part-* | tar xzf - -C "$TRITON_CACHE_DIR"
fi
T0=$(date +%s)

run() {  # run STEP LIMIT CMD...: log the command, its exit code and the seconds it took
    local step=$1 limit=$2
    shift 2
    local var="LIMIT_${step^^}"
    limit=${!var:-$limit}
    echo "=== [$(( $(date +%s) - T0 )) s] $step: $* (limit $limit s)" | tee -a "$LOG"
    # SIGINT at the limit (KILL 20 s later): pytest then still reports the failures it saw, with tracebacks
    timeout -s INT -k 20 "$limit" "$@" >> "$LOG" 2>&1
    echo "=== $step: exit $?" | tee -a "$LOG"
}

for step in "$@"; do
    case $step in
        tests) run tests 300 python3 -m pytest -q ${PYTEST_ARGS:-} ${TESTS:-tests/test_ops_gpu.py tests/test_ops_norm.py \
                   tests/test_ops_moe.py tests/test_ops_attention.py tests/test_ops_rope.py tests/test_ops_skinny.py tests/test_gpu_graphs.py} ;;
        spec) DELTAFLASH_TEST_DEVICE=cuda run spec 400 python3 -m pytest -q ${PYTEST_ARGS:-} tests/test_spec.py \
                  tests/test_spec_sampling.py tests/test_engine.py tests/test_prefill_graphs.py tests/test_pages.py \
                  tests/test_tree.py tests/test_policy.py ;;
        savecache) # a cached kernel loads from its binary and metadata: the IR files are a compile's by-products
                   find "$TRITON_CACHE_DIR" -type f \( -name '*.ptx' -o -name '*.llir' -o -name '*.ttir' \
                       -o -name '*.ttgir' -o -name '*.source' \) -delete
                   tar czf - -C "$TRITON_CACHE_DIR" . | split -b 15M - "$OUT/triton-cache.tgz.part-" &&
                   ls -la "$OUT"/triton-cache.tgz.part-* | tee -a "$LOG" ;;
        invariance) run invariance 150 python3 bench/batch_invariance.py ;;
        forks) run forks 300 python3 bench/prompt_forks.py ${FORKS_ARGS:-} ;;  # n samples of one prompt, shared or not
        burst) run burst 300 python3 bench/prompt_forks.py --questions 128 ${FORKS_ARGS:-} ;;  # n questions after one
               # system prompt at once: the prefix cache (the first prefill stops at the branch point) or not
        others) run others 300 python3 bench/prompt_forks.py --questions 128 --others 1 ${FORKS_ARGS:-} ;;  # the same
                # and a request of a prompt of its own after them: its TTFT (an older tree: run it from its export)
        turns) run turns 300 python3 bench/prefix_turns.py ${TURNS_ARGS:-} ;;  # an agent's turns, prefix cache or not
        answers) run answers 300 python3 bench/prefix_turns.py --answers ${TURNS_ARGS:-} ;;  # chat turns sending the
                 # answer back: a finished request's state kept, or not
        system) run system 300 python3 bench/prefix_turns.py --system ${TURNS_ARGS:-} ;;  # questions after one
                # system prompt: the prefix cache's branch point, or not
        target) run target 400 python3 -m pytest -q -x tests/test_gpu_target.py ;;
        tune) run tune 200 python3 bench/tune_verify.py ${TUNE_ARGS:-} ;;
        tunebuild) for flags in ${BUILD_SETS:---fp-fusion --widen-at-load --fp-fusion,--widen-at-load}; do  # verify.BuildOptions
                       run tunebuild 120 python3 bench/tune_verify.py ${flags//,/ } ${TUNE_ARGS:---lanes 1 16 64 \
                           --configs 4x1 8x1 16x1 16x2 32x2 16x4 32x4}
                   done ;;  # (gamma vs torch: GATES)
        tuneconv) run tuneconv 90 python3 bench/tune_conv.py ;;  # issue 15: the prefill conv's tiles
        tunefla) run tunefla 240 python3 bench/tune_fla.py --quick --shapes 1x2048 16x64 --out "$OUT/fla-tiles.json" ;;  # issue 15:
                 # fla-core's chunked kernels under other launch configs (ship the table as deltaflash/ops/gdn/tiles/<slug>.json)
        skinny) run skinny 420 python3 bench/tune_skinny.py --out "$OUT/skinny-tiles.json" --report "$OUT/skinny.json" \
                    ${SKINNY_ARGS:-} ;;  # issue 16 item 3: skinny split-K tiles vs cuBLAS (copy the table to
                    # deltaflash/ops/gemm/tiles/), then one round with cuBLAS and with that table side by side
        skinnyround) table=${SKINNY_TABLE:-$OUT/skinny-tiles.json}  # cuBLAS and the table side by side, then where the ms go
                     run skinnyround 240 python3 -m deltaflash bench round --lanes 1 4 16 --routes fused --rounds 6 \
                         --skinny-gemm off "$table" --json "$OUT/skinny-round.json"
                     run skinnyprofile 150 python3 bench/profile_round.py 1 4 --skinny-gemm "$table" ;;
        kernels) run kernels 90 python3 -m deltaflash bench kernels --json "$OUT/kernels.json" ;;
        round) run round 150 python3 -m deltaflash bench round --lanes 1 4 16 32 --rounds 6 --json "$OUT/round.json" ;;
        profile) run profile 120 python3 bench/profile_round.py 1 16 ;;
        demo) run demo 180 python3 -m deltaflash demo --device cuda ;;
        first) run first 240 python3 bench/first_requests.py --out "$OUT/first.json" ;;
        firstpair) for flag in --no-round-graphs --round-graphs; do  # start-up and first requests without round graphs and with
                       run firstpair 240 python3 bench/first_requests.py --out "$OUT/first$flag.json" -- $flag
                   done ;;
        e2etau) for tau in ${TAUS:-6 3}; do  # issue 16: scripted tau 6 / 3 at the serve defaults, every load
                    run e2etau 300 python3 -m deltaflash bench e2e --workload scripted --tau $tau --prompts 16 \
                        --concurrency 1 4 16 64 --no-profile --speculation ${SPECULATION:-auto} --out "$OUT/tau$tau" --quiet \
                        ${PROMPT_LEN_MAX:+--prompt-len 128 --prompt-len-max $PROMPT_LEN_MAX}
                done ;;
        prefillscale) work=${PS_WORKLOAD:-scripted}  # the prefill budget beside a round scaled by its cost, or not
                      for scale in scale no-scale; do
                          run prefillscale 300 python3 -m deltaflash bench e2e --workload $work \
                              $([ $work = scripted ] && echo --tau ${TAU:-6}) --prompts 16 \
                              --concurrency ${PS_CONCURRENCY:-16 64} --no-profile --speculation ${SPECULATION:-auto} \
                              --$scale-prefill-budget --out "$OUT/$work-$scale" --quiet
                      done ;;
        specdefault) for s in fixed adaptive; do  # the CUDA default's choice: fixed chains or adaptive widths, side by side
                         run specdefault 150 python3 -m deltaflash bench e2e --workload demo --prompts 16 \
                             --concurrency 1 4 16 64 --no-profile --speculation $s --out "$OUT/demo-$s" --quiet
                         for tau in ${TAUS:-6 3}; do
                             run specdefault 200 python3 -m deltaflash bench e2e --workload scripted --tau $tau --prompts 16 \
                                 --concurrency 1 4 16 64 --no-profile --speculation $s --out "$OUT/tau$tau-$s" --quiet
                         done
                         rm -f "$OUT"/demo-$s/*.png "$OUT"/tau*-$s/*.png  # the device returns ~8 files: JSON only
                     done ;;
        e2epair) for tree in . "${OLD_TREE:?e2epair: set OLD_TREE to an exported older tree}"; do  # same command, two trees
                     for len in "" 320; do  # HEAD also at the old tree's max_model_len (its prompts + 129)
                         [ "$tree" != . ] && [ -n "$len" ] && continue
                         name=e2e-$(basename "$(cd "$tree" && pwd)")${len:+-len$len}
                         (cd "$tree" && PYTHONPATH=$PWD:${PYTHONPATH:-} run e2epair 300 python3 -m deltaflash bench e2e \
                             --workload demo --prompts 16 --concurrency 1 4 16 64 --no-profile --quiet \
                             ${len:+--max-model-len $len} --out "/tmp/$name") && cp "/tmp/$name/e2e-demo.json" "$OUT/$name.json"
                     done
                 done ;;
        e2edemo) run e2edemo 300 python3 -m deltaflash bench e2e --workload demo --prompts 16 --reference --out "$OUT/demo" \
                     --quiet ;;
        attention) run attention 200 python3 -m deltaflash bench attention --json "$OUT/attention.json" ;;
        paged) run paged 400 python3 -m deltaflash bench round --lanes 1 16 --routes fused --rounds 8 \
                   --max-model-len 1024 32768 262144 --json "$OUT/round-paged.json" ;;  # one model, three capacities
        longctx) for ctx in 4096 32768 131072; do  # real long contexts at 16 lanes
                     run longctx 300 python3 -m deltaflash bench round --lanes 16 --routes fused --rounds 4 \
                         --prompt-len $ctx --max-model-len $(( ctx + 256 )) --json "$OUT/long-$ctx.json"
                 done ;;
        longctxfast) for ctx in 4096 32768 131072; do  # the same rounds on unwritten contexts (no prefill: seconds)
                         run longctxfast 90 python3 -m deltaflash bench round --lanes 16 --routes fused --rounds 6 \
                             --prompt-len $ctx --max-model-len $(( ctx + 256 )) --unwritten-context \
                             --json "$OUT/long-$ctx-unwritten.json"
                     done ;;
        graphlaunch) run graphlaunch 150 python3 bench/graph_launch.py --lanes 8 ;;  # host cost of graph launches
        graphlaunch9b) run graphlaunch9b 250 python3 bench/graph_launch.py --shape 9b --lanes 1 --skip-synthetic ;;
        gemmgraphs) run gemmgraphs 90 python3 bench/graph_launch.py --gemms 512 2048 ;;  # cuBLAS's memset nodes
        swiglu) run swiglu 200 python3 bench/swiglu_gemm.py ;;  # the fused SwiGLU GEMM against cuBLAS + silu_mul
        roundgraphs) for flag in --no-round-graphs --round-graphs; do  # a speculative step with greedy round graphs and without
                         run roundgraphs 90 python3 bench/step_profile.py --lanes 8 --steps 60 $flag
                     done ;;
        capacity) run capacity 420 python3 bench/capacity.py --json "$OUT/capacity.json" ;;  # issue 14: 32k sequences of 9B
        treeround) for budget in 0 16; do  # a tree round against a chain round of the same 16 rows
                       run treeround 150 python3 -m deltaflash bench round --lanes 1 16 --routes fused --rounds 6 \
                           --tree-budget $budget --json "$OUT/round-tree$budget.json"
                   done ;;
        treeprofile) DELTAFLASH_NO_CUDA_GRAPHS=1 run treeprofile 200 python3 bench/profile_round.py 1 16 --tree-budget 0 16 ;;  # 9B: the tree round's extra cost by kernel group
        treedefault) run treedefault 120 python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 1 4 16 \
                         --tree-budget 16 --round-graphs --no-profile --out "$OUT/treedefault" --quiet ;;  # the default --tree-max-lanes: trees or chains by cost
        treeops) run treeops 120 python3 bench/tree_ops.py ;;  # issue 17: the vocabulary top-k and ancestor mask, torch vs kernels
        verifytrees) run verifytrees 120 python3 bench/verify_trees.py ;;  # issue 17: the GDN kernel's tree path vs chains
        randomdraft) run randomdraft 300 python3 -m deltaflash bench e2e --workload scripted --corrupt 1.0 --prompts 16 \
                         --concurrency 1 16 --no-profile --speculation adaptive --out "$OUT/randomdraft" --quiet ;;  # issue 16: <= 5% behind target-only
        treestep) for budget in 0 16; do  # a demo-pair step at one lane, chain vs tree: where the tree round's time goes
                      for flag in --no-round-graphs --round-graphs; do
                          run treestep 150 python3 bench/step_profile.py --lanes 1 --steps 60 --split --tree-budget $budget $flag
                      done
                  done ;;
        treegraphs) for budget in 0 16; do  # issue 17 side by side: chain vs tree, greedy round graphs on and off
                        for flag in --no-round-graphs --round-graphs; do
                            run treegraphs 200 python3 -m deltaflash bench e2e --workload demo --prompts 16 \
                                --concurrency 1 4 16 --tree-budget $budget --tree-max-lanes 0 $flag --no-profile \
                                --out "$OUT/treegraphs$budget$flag" --quiet
                        done
                    done ;;
        treepair) for run in $(seq "${PAIR_RUNS:-2}"); do  # issue 17 at low load: chain and trees with round graphs,
                      for budget in ${PAIR_BUDGETS:-0 16}; do  # alternating (the machine's speed drifts between runs)
                          run treepair 120 python3 -m deltaflash bench e2e --workload demo --prompts 16 \
                              --concurrency ${PAIR_CONCURRENCY:-1 4} --tree-budget $budget --round-graphs --no-profile \
                              --out "$OUT/treepair$budget-$run" --quiet
                      done
                  done ;;
        rgprofile) for lanes in ${RG_LANES:-16 40 64}; do  # a step with round graphs off / on, by lanes (the C = 64 question)
                       for flag in --no-round-graphs --round-graphs; do
                           run rgprofile 90 python3 bench/step_profile.py --lanes $lanes --max-slots 64 --steps 40 --rows 12 $flag
                       done
                   done ;;
        rg64) for run in 1 2; do  # C = 64 with round graphs off / on, alternating (the machine drifts between runs)
                  for flag in --no-round-graphs --round-graphs; do
                      run rg64 120 python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 64 $flag \
                          --no-profile --out "$OUT/rg64$flag-$run" --quiet
                  done
              done ;;
        rgdemo) for flag in --no-round-graphs --round-graphs; do  # demo pair at the serve defaults, round graphs off / on
                    run rgdemo 200 python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 1 4 16 64 \
                        $flag --no-profile --out "$OUT/rgdemo$flag" --quiet
                done ;;
        treechoice) for lanes in "" "--tree-max-lanes 1"; do  # trees or chains by measured tokens/s (the default), and the fixed rule
                        run treechoice 200 python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 1 4 16 \
                            --tree-budget 16 $lanes --no-profile --out "$OUT/treechoice${lanes:+-fixed}" --quiet
                    done ;;
        treedemo) for budget in 0 8 16 32; do  # demo pair: the chain (block 8) and trees at every load (issue 17's sweep)
                      run treedemo 200 python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 1 4 16 \
                          --tree-budget $budget --tree-max-lanes 0 ${TREEDEMO_FLAGS:---round-graphs} --no-profile \
                          --out "$OUT/tree$budget" --quiet
                  done ;;
        model) run model 420 python3 -m deltaflash bench model --decode-batches 1 8 --json "$OUT/model.json" ;;
        ttfttable) run ttfttable 300 python3 -m deltaflash bench model --decode-batches 1 \
                       --ttft-tokens 64 256 1024 2048 8192 32768 --json "$OUT/model.json" ;;  # issue 15's TTFT table
        demodefault) run demodefault 150 python3 -m deltaflash bench e2e --workload demo --prompts 16 \
                         --concurrency 1 4 16 64 --no-profile --out "$OUT/demo" --quiet ;;  # demo pair, serve defaults
        ttft) for off in 0 1; do  # one 173-token prompt's TTFT with prefill graphs and without (demo pair)
                  DELTAFLASH_NO_PREFILL_GRAPHS=$off run ttft 90 python3 bench/step_profile.py --ttft 173 --steps 20
              done ;;
        tp) for size in 1 ${TP_SIZES:-2 4}; do  # issue 19: the 27B shape's round per GPU count (multi-GPU kinds)
                if [ "$size" -le "$(nvidia-smi -L | wc -l)" ]; then
                    run tp 300 python3 -m deltaflash bench round --shape 27b --tensor-parallel-size $size --lanes 1 16 \
                        --routes fused --rounds 6 --json "$OUT/round-27b-tp$size.json"
                fi
            done ;;
        itl2k) for budget in ${ITL_BUDGETS:-512}; do  # issue 15: ITL p99 <= 3x p50 (each --max-num-batched-tokens
                   for stall in ${ITL_STALLS:-0}; do       # and --max-prefill-stall)
                       run itl2k 300 python3 -m deltaflash bench e2e --workload scripted --tau 6 --prompt-len 2048 \
                           --prompts 32 --concurrency ${ITL_CONCURRENCY:-8 32} --no-profile --max-num-batched-tokens $budget \
                           --max-prefill-stall $stall --out "$OUT/itl2k-$budget-stall$stall" --quiet
                   done
               done ;;
        streamoverlap) run streamoverlap 240 python3 bench/stream_overlap.py ;;  # a step's chunk and round on two streams
        prefillattn) run prefillattn 60 python3 bench/prefill_attention.py ;;  # paged kernel vs the dense route
        chunkprofile) run chunkprofile 150 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 10 ;;  # issue 15
        prefillstacks) DELTAFLASH_NO_PREFILL_GRAPHS=1 run prefillstacks 150 python3 bench/step_profile.py --shape 9b \
                           --ttft 2048 --steps 3 --stacks "${STACKS:-direct_copy|FillFunctor|where_kernel|index}" ;;  # who launches the small ones
        serveoverlap) for flag in "" --no-host-overlap; do  # issue 15: the device's wait for the host, overlap on / off
                          run serveoverlap 240 python3 -m deltaflash bench serve --draft deltaflash/assets/demo/draft \
                              --max-concurrency 64 --clients 64 --requests 512 --max-tokens 128 --disconnect-fraction 0 \
                              $flag --json "$OUT/serve${flag:-overlap}.json"
                      done ;;
        stepprofile) for lanes in 1 16 64; do  # one step's wall / device time / host ops (bench/step_profile.py)
                         for mode in "" --target-only; do
                             run stepprofile 120 python3 bench/step_profile.py --lanes $lanes --max-slots 64 --split $mode
                         done
                     done ;;
        *) echo "unknown step $step" | tee -a "$LOG" ;;
    esac
done
echo "=== done in $(( $(date +%s) - T0 )) s" | tee -a "$LOG"
