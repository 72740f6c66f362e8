#!/usr/bin/env bash
# One device call = one or more steps of the GPU plan, from the repo root on the H200. vLLM comes from a bundle
# (git-ignored: .devbundle34/1-N for vLLM 0.34, .devbundle33/1-N for 0.33; built by tests/gpu/devbundle/build.sh)
# cut into chunks that each fit one call's carry. First one stash call per chunk but the last, on the same warm
# machine: carry [".devbundle34/K"], command `bash .devbundle34/K/stash.sh` (copies the chunk to $HOME/v34-stage,
# which lasts while the machine stays warm). Then this call, with carry [".devbundle34/N"]; its activate.sh stashes
# the last chunk, assembles $HOME/v34-site once (~60 s) and puts it on PYTHONPATH:
#   source .devbundle34/N/activate.sh || exit 1; bash tests/gpu/run_on_device.sh STEP [STEP ...]
# (0.33 likewise with .devbundle33 and $HOME/v33-site; both can share one warm machine, one release per call.)
# Steps (minutes on a warm machine, measured or estimated):
#   model       tiny model vs the oracle (+ its bf16 floor), CUDA graphs: BF16 and INT4 checkpoints, FP8 on and
#               off, MoE backends, vLLM's in-tree model where it exists; every engine side by side, then
#               the oracles (fp32, bf16, FP8 reference in both)   (7.3 on 0.33 with 13 engines)
#   kda         vLLM's KDA kernels fed our gate vs the fp32 recurrence, + kda_core   (~2)
#   kda_core    our CUDA glue vs the CPU path on decode and verify batches, our gate and vLLM's
#               raw-gate kernels (VLLM_LING_KDA_GATE=kernel)                           (~0.6)
#   flashkda    FlashKDA's prefill vs our fp32 recurrence beside Triton chunk_kda (lengths 1..4096, varlen, slow
#               decay), kda_core's prefill glue on both (and FlashKDA's in-prefill checkpoint against our torch
#               path's), time and memory at 4K/16K/64K tokens x 32 heads  (~3)
#   mtp         MTP k=1 lossless + acceptance, for a draft built to agree (mtp_echo) and a random one
#               (stable_router), and the echo one with FP8 (mtp_echo_fp8): six engines side by side, then the
#               oracles                                        (4.6 on 0.33: 273 s measured)
#   tuning      ling-tune on the H200 + GB10-emulated, vLLM pickup, vs Marlin        (~7)
#   tuning_gpu  tuning's GPU tests alone (tests/gpu/test_tuning_gpu.py: runner, smem, vLLM lookup, guard)   (~2)
#   fullsize_eager | fullsize_graphs | fullsize_mtp   124B dummy weights, batch 1   (graphs 5, mtp 4 measured)
#   fs:NAME:ARGS  ling_bench.fullsize with ARGS (+ for spaces), e.g. fs:intree:--impl+vllm+--prefill=+--kernels
#               (full size, prefill 4K/16K/64K, --kernels: 5.0 min first on a fresh 0.33 machine, 3.7-4.9 after;
#               without prefill 2.8-3.0; 1-1.7 on a warm compile cache of the same settings; FS_TIMEOUT)
#               Speculative rounds at synthetic acceptance, several lengths on one engine (L <= k + 1), e.g.
#               fs:mtp3:--mode+mtp+--k+3+--prefill=+--acceptance-length+3.5,2.5 or
#               fs:dspark8:--mode+dspark+--k+8+--prefill=+--acceptance-length+6.5,5.3,3.5 (--adaptive: compute
#               capability 10.x and vLLM 0.34 only, refused before the engine elsewhere). With --fp8+w8a8 on a
#               fresh 0.34 H200: dspark8 457 s with the bundle's assembly, then plain 218 s, mtp1 282 s (the
#               short-prompt phases now take 7 requests each, a few seconds more)
#               On a warm H100 (util 0.95): dspark4 210 s, plain 173 s, dspark8 with --draft-fp8 209 s
#               Lanes under GB10's shared memory (emulated for Triton kernels), e.g.
#               fs:lanes:--fp8+w8a8+--prefill=+--lanes+1,2,4,8+--smem-limit+101376 (+--mode+mtp)
#               Long context, prefill and decode after 128K and 256K (the model's 262,144 less the decode):
#               fs:long:--fp8+w8a8+--prefill+131072,261952 (an H200's memory; FS_TIMEOUT)
#   engine_moe  INT4 MoE backends raced as decode steps, one engine each (ling_tuning.engine_compare), M = 1..1024,
#               ENGINE_BACKENDS (marlin,humming); engine logs tailed into engine_moe.log  (3.9 measured)
#   engine_race the same race as a test: served backend = asked, timed at M = 1, 8, 64 (2 layers)  (5.1 measured)
#   moe_align   our MoE token layout vs vLLM's op on the same ids, + µs per call                    (~1)
#   routing     our one-kernel MoE router vs the torch reference and vLLM's grouped_topk, + µs per call (1.3 measured)
#   router_gemm our fp32 router GEMM (M <= 16) vs an fp64 product, + µs per call beside cuBLAS's fp32 GEMM   (~1)
#   draft_vocab the MTP draft over a draft vocabulary (FP8 head rows, CUDA graphs, >= 0.32): acceptance with every
#               id as with the whole head, and lower without the frequent ids; three engines            (~4)
#   fp8_gemm    BF16 vs FP8 W8A16 vs W8A8 for every BF16 linear shape, M = 1..16, + KDA in_proj merged vs split (~1.5)
#   kv_memory   when the KV cache takes its memory: used MiB at ready, after requests; extensible cache default vs off (~2)
#   clamp       the routed experts' SwiGLU clamp as vLLM's fused MoE serves it (BF16 Triton, INT4 Marlin/Triton/Humming) vs the fp64 reference (~2)
#   config      a tiny Ling-2.5 served with vllm-ling installed; the full-size config through the in-tree model
#               under each config class (CONFIG_K selects cases)                                  (~8)
#   dspark      DSpark with tiny drafters (random, agreeing), K = 1..8 (DSPARK_KS=1,8 for a subset): lossless
#               against the oracle, acceptance (K = 1, 8 took 177 s warm, 4..7 207 s); DSPARK_FP8=1: the drafter's
#               own weights in FP8, DSPARK_TARGET=int4|fp8: the INT4 target or the FP8 one (its LM head shared),
#               DSPARK_ADAPTIVE=1: adaptive width (vLLM 0.34 refuses it below compute capability 10)
#   spec_concurrency  six requests of different lengths together vs each alone, MTP k=1 and DSpark K=4 (agreeing
#               and random drafter): a drafter's batch reorder must not corrupt recurrent state (three engines, ~4)
#   spec_smem   every Triton kernel held to GB10's 101,376 B at launch (emulated): MTP k=3, 8 lanes, DSpark K=8 (~5)
#   dspark_smoke  one eager DSpark engine (echo target, agreeing drafter, K = DSPARK_K or 3): does it plan,
#               draft and accept? DSPARK_SMOKE="--graphs --adaptive" for CUDA graphs / adaptive width (adaptive
#               needs graphs). 4.1 min on a fresh machine (Triton JIT), 1 warm (eager); writes dspark_smoke_kK_FLAGS.json
#   turn        an agent's turn inside the engine (ling_bench.cached_turn): NEW tokens after a HISTORY the prefix
#               cache holds vs the same length fresh, time to first token and decode after each, the kernels of a
#               cached and a fresh turn, without in-prefill KDA checkpoints (VLLM_LING_KDA_PREFILL_CHECKPOINT=0);
#               TURNS (16384+2048,32768+2048,61440+2048), TURN_ARGS (e.g. "--mode mtp")  (4.8 for two turns, H200)
#   turn_ckpt   the same with them (=1, the default): a cached turn in one prefill pass fewer, beside `turn` on the
#               same card                                                             (4.1 for two turns, H200)
#   prefix_cache  cached continuations equal uncached ones (bf16, CUDA graphs), hits with MTP and with DSpark on;
#               agent turns with hits inside a block (DSpark's on two targets, --prefix-match-unit's, and KDA
#               alone); in-prefill checkpoints (VLLM_LING_KDA_PREFILL_CHECKPOINT=1): seven engines side by side
#               (3.4 with seven engines on a warm H100)
#   prefix_cache_fp16  the agent turns with hits inside a block in fp16, where a wrong resume stands out from the
#               rounding (--prefix-match-unit 16, KDA alone, DSpark): three eager engines, then three fp32
#               oracles to check the fp16 engines (4.8 on a fresh H100 with 0.34's assembly, 3.9 with 0.33's;
#               with CUDA graphs it outran 400 s while its engines warmed up)
#   intree_check  vLLM's in-tree model on the tiny checkpoint: bare (no plugin) and with our config class,
#               greedy tokens against ours                                                    (~2)
#   agent_pc1 | agent_pc0  the agent workload (ling-bench --workload agent: 20-turn sessions that re-send their
#               history up to ~64K, one, then two at once) against the shipped recipe (serve-int4-mtp.sh under the
#               watchdog) on the full-size model with dummy weights, prefix caching on | off: one server each,
#               tests/gpu/agent_run.py (estimated ~6 on, ~7.5 off: start 3-5, sessions ~1.5 on, ~3 off). AGENT_TIMEOUT
#               (480) is the step's limit: agent_pc1 on the call that assembles the bundle (~60-90 s of it), then
#               AGENT_TIMEOUT=560 agent_pc0 on the same warm machine. `agent` runs both in one call (too long for
#               one). AGENT_RECIPE=serve/serve-int4.sh serves without MTP; AGENT_BENCH adds ling-bench flags (later
#               flags win). Writes agent_pcN.json (the run and ling-bench's report) and agent_pcN-server.log.
#               With MTP a card of >= 100 GiB (an H200: the device tool's needs_h200): it does not load on an H100;
#               there AGENT_RECIPE=serve/serve-int4.sh (no speculation, a 3 GiB KV cache; AGENT_KV_GIB sets it).
#               AGENT_IMPL=vllm serves vLLM's in-tree model instead of ours (files agent_pcN_vllm.*);
#               AGENT_SPEC=dspark serves serve-int4.sh with DSpark and a dummy drafter of the released shape, its KV
#               added to the pool (an H200; files agent_pcN_dspark.*)
# A machine idle for 30 s goes back (and the bundle must be stashed again: ~2.2 min): run the stash
# and every working step back to back, and fix code before them, not between steps.
# Ask for the machine with the first stash call alone: when none can be started, every later call of a batch is
# refused too, each at 15 s of device time (a batch of 24 costs 6 min with nothing run).
# Results land in $OUT. At most 8 files come back, so the per-test records (model_*.json, mtp_*.json, ...) are
# merged at the end into one $OUT/records.json ({name: record}); split it with `python3 -c` or read it whole.
set -uo pipefail
: "${OUT:?run on the device: OUT is the folder that comes back}"
: "${1:?step: model | kda | kda_core | flashkda | mtp | tuning_gpu | routing | router_gemm | draft_vocab | moe_align | tuning | engine_race | engine_moe | fullsize_* | fs:NAME:ARGS | turn | fp8_gemm | intree_check | agent_pc1 | agent_pc0}"
VLLM_RELEASE=$(python3 -c 'import vllm; v = vllm.__version__.split("."); print(v[0] + v[1])') || exit 2
case $VLLM_RELEASE in 033|034) SITE=$HOME/v${VLLM_RELEASE#0}-site ;;
    *) echo "activate a vLLM 0.33 or 0.34 bundle first (found release code $VLLM_RELEASE)" >&2; exit 2 ;; esac
rm -rf /tmp/vllm-ling-src && mkdir /tmp/vllm-ling-src && tar --exclude='./.devbundle*' --exclude=./.git -cf - . | tar -xf - -C /tmp/vllm-ling-src
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$SITE" /tmp/vllm-ling-src \
    2>&1 | grep -v "already exists" || true
export LING_GPU_RESULTS=$OUT
# Triton keeps compiled kernels on disk but re-times every autotuned kernel in each new process unless told to keep
# the timings: we saw ~80 s of each engine's start-up in its first CUDA-graph capture, warm machine or not.
export TRITON_CACHE_AUTOTUNING=1
# A step killed by its timeout must still leave something to read: output unbuffered, and each pytest step's engine
# logs under /tmp/pt-STEP, whose tails come back in $OUT/STEP-engines.log when the step fails.
export PYTHONUNBUFFERED=1
[ -f /tmp/flash/config.json ] || python3 -m ling_tools.tiny /tmp/flash --full-config --force >/dev/null
for STEP in "$@"; do
run() {  # the step's exit status is its command's, not the pipeline's
    # an engine script's own limit stays 40 s inside the step's, so a slow engine fails with every engine's log tail
    LING_ENGINE_TIMEOUT=$(( $1 > 100 ? $1 - 40 : $1 )) timeout -k 10 "$1" "${@:2}" 2>&1 \
        | tee -a "$OUT/${STEP%%:*}.log" | grep -v " INFO \| WARNING " | tail -40
    return "${PIPESTATUS[0]}"
}
echo "=== $STEP ($(date +%T))"
export PYTEST_ADDOPTS="--basetemp=/tmp/pt-${STEP%%:*}"
rm -rf "/tmp/pt-${STEP%%:*}"
case $STEP in
    model) run "${MODEL_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model_gpu.py ;;
    kda) run 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kda_kernels_gpu.py tests/gpu/test_kda_core_gpu.py ;;
    kda_core) run 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kda_core_gpu.py ;;
    flashkda) run 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flashkda_gpu.py ;;
    mtp) run 580 python3 -m pytest -q -p no:cacheprovider --durations=6 tests/gpu/test_mtp_gpu.py ;;
    tuning) bash tests/gpu/tuning_run.sh ;;
    tuning_gpu) run 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_tuning_gpu.py ;;
    fullsize_*) run 560 python3 -m ling_bench.fullsize /tmp/flash --mode "${STEP#fullsize_}" --out "$OUT/$STEP.json" ;;
    fs:*) name=${STEP#fs:}; name=${name%%:*}; args=${STEP#fs:*:}
        run "${FS_TIMEOUT:-560}" python3 -m ling_bench.fullsize /tmp/flash ${args//+/ } --out "$OUT/fs_$name.json" ;;
    turn|turn_ckpt) ckpt=0; [[ $STEP == turn_ckpt ]] && ckpt=1
        VLLM_LING_KDA_PREFILL_CHECKPOINT=$ckpt run "${FS_TIMEOUT:-560}" python3 -m ling_bench.fullsize /tmp/flash --fp8 w8a8 --prefill= --kernels \
        --turn "${TURNS:-16384+2048,32768+2048,61440+2048}" ${TURN_ARGS:-} --out "$OUT/fs_$STEP.json" ;;
    engine_race) run 500 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_compare_gpu.py ;;
    engine_moe) run "${ENGINE_TIMEOUT:-560}" python3 -m ling_tuning.engine_compare --model /tmp/flash \
            --backends "${ENGINE_BACKENDS:-marlin,humming}" --timeout 270 --workdir /tmp/engine_moe --out "$OUT/engine_moe.json"
        for f in /tmp/engine_moe/engine-*.log; do echo "--- $f"; grep -v "^\s*$" "$f" | tail -25; done >> "$OUT/engine_moe.log" ;;
    moe_align) run 200 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_moe_align_gpu.py ;;
    routing) run 200 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_routing_gpu.py ;;
    router_gemm) run 200 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_router_gemm_gpu.py ;;
    draft_vocab) run 400 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_draft_vocab_gpu.py ;;
    fp8_gemm) run 300 python3 tests/gpu/fp8_gemm_bench.py /tmp/flash "$OUT/fp8_gemm.json" ;;
    kv_memory) [ -f /tmp/tiny/config.json ] || python3 -m ling_tools.tiny /tmp/tiny --force >/dev/null
        run 500 python3 tests/gpu/kv_memory_probe.py /tmp/tiny "$OUT/kv_memory.json" ;;
    intree_check) run 400 python3 tests/gpu/intree_check.py "$OUT/intree_check.json" ;;
    clamp) run 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_clamp_gpu.py ;;
    prefix_cache) run 560 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prefix_cache_gpu.py ;;
    prefix_cache_fp16) run 560 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prefix_cache_fp16_gpu.py ;;
    spec_concurrency) run 500 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_spec_concurrency_gpu.py ;;
    spec_smem) run 500 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_spec_smem_gpu.py ;;
    dspark_smoke) flags=${DSPARK_SMOKE:-}; tag=${flags//--/_}; tag=${tag// /}
        run "${SMOKE_TIMEOUT:-300}" python3 tests/gpu/dspark_smoke.py "$OUT/dspark_smoke_k${DSPARK_K:-3}$tag.json" \
            --k "${DSPARK_K:-3}" $flags --dir /tmp/pt-dspark_smoke ;;
    dspark) run "${DSPARK_TIMEOUT:-580}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_dspark_gpu.py ;;
    config) run "${CONFIG_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_config_gpu.py ${CONFIG_K:+-k "$CONFIG_K"} ;;
    agent|agent_pc[01]) pcs="1 0"; [[ $STEP == agent_pc? ]] && pcs=${STEP#agent_pc}
        # the full-size config with the tiny tokenizer: a dummy-weight server that takes text
        [ -f /tmp/flash-agent/tokenizer.json ] || python3 -m ling_tools.tiny /tmp/flash-agent --full-config --tokenizer \
            --force >/dev/null
        run "${AGENT_TIMEOUT:-480}" python3 tests/gpu/agent_run.py "$OUT" --model /tmp/flash-agent --prefix-cache $pcs \
            ${AGENT_RECIPE:+--recipe "$AGENT_RECIPE"} ${AGENT_KV_GIB:+--kv-gib "$AGENT_KV_GIB"} \
            ${AGENT_IMPL:+--impl "$AGENT_IMPL"} ${AGENT_SPEC:+--spec "$AGENT_SPEC"} \
            ${AGENT_BENCH:+--bench-args "$AGENT_BENCH"} ;;
    *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
rc=$?
if (( rc != 0 )) && [ -d "/tmp/pt-${STEP%%:*}" ]; then
    echo "=== $STEP failed ($rc): engine log tails in ${STEP%%:*}-engines.log"
    find "/tmp/pt-${STEP%%:*}" -name '*.log' | sort | while read -r f; do echo "--- $f"; tail -30 "$f"; done \
        > "$OUT/${STEP%%:*}-engines.log"
fi
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
parts = sorted(p for p in out.glob("*.json") if p.name != "records.json")
if len(parts) > 4:  # keep a few whole files as they are; many come back only merged
    merged = {p.stem: json.loads(p.read_text()) for p in parts}
    (out / "records.json").write_text(json.dumps(merged, indent=1))
    for p in parts:
        p.unlink()
PY
