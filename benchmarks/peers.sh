#!/usr/bin/env bash
# paratron beside its peers on one GPU, in one command (benchmarks/README.md): torchtitan 0.2.2 (dense llama-1b
# in bf16 and float8, the moe-mini MoE) through its own run.sh, gpt-fast and HF transformers for decoding, then
# paratron's train_throughput.py and decode_bench.py on the same shapes and micro-batches.
#
#   bash benchmarks/peers.sh [PART ...]     PART: bf16 fp8 moe decode (default: all four); hf adds HF transformers
#                                            (+ torch.compile) to paratron's training and decode runs, same process
#
# Variables (paths relative to the repository root or absolute):
#   PEERS        a copy of ../shared/bench: torchtitan/, gptfast/, gptfast_generate.py, hf_generate.py, peers.py
#                (default .peers)
#   HOPPER_SITE  a site tarball of the Hopper extras (quack-kernels 0.3.11, nvidia-cutlass-dsl 4.4.2,
#                flash-attn-4 4.0.0b10; benchmarks/README.md says how to build it), unpacked to /tmp and put on
#                PYTHONPATH before paratron runs; unset or missing: paratron runs without them
#   OUT          where logs and records go (default benchmarks/results)
#   MB           dense micro-batch (default 16); GB paratron's global batch (default 64); MOE_MB (default 8)
#   PARATRON_COMMIT  the commit written into the records where the copy has no git history
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
peers="${PEERS:-.peers}"
out="${OUT:-benchmarks/results}"
mb="${MB:-16}" gb="${GB:-64}" moe_mb="${MOE_MB:-8}"
stamp="$(date -u +%Y%m%d_%H%M)"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(bf16 fp8 moe decode)
want() { [[ " ${parts[*]} " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 PEERS_DIR="$peers"
mkdir -p "$out"
[ -d "$peers" ] || { echo "no peers at '$peers' (set PEERS to a copy of ../shared/bench)" >&2; exit 2; }

# the peers first, each in its own process tree (torchtitan installs its wheels into /tmp/site)
tt=()
want bf16 && tt+=("bf16:$mb")
want fp8 && tt+=("float8:$mb")
if [ ${#tt[@]} -gt 0 ]; then
    (IFS=,; bash "$peers/torchtitan/run.sh" --variants "${tt[*]}") > "$out/torchtitan_dense_$stamp.log" 2>&1
    grep "BENCH_RESULT\|^|" "$out/torchtitan_dense_$stamp.log" | tail -6
fi
if want moe; then
    bash "$peers/torchtitan/run.sh" --moe --variants "moe-bf16:$moe_mb" > "$out/torchtitan_moe_$stamp.log" 2>&1
    grep "BENCH_RESULT\|^|" "$out/torchtitan_moe_$stamp.log" | tail -4
fi
if want decode; then
    (cd "$peers" && python3 gptfast_generate.py --batches 1,32) > "$out/gptfast_decode_$stamp.log" 2>&1
    tail -4 "$out/gptfast_decode_$stamp.log"
fi

# then paratron, with the Hopper extras when carried
if [ -n "${HOPPER_SITE:-}" ] && [ -f "$HOPPER_SITE" ]; then
    site=/tmp/paratron_hopper
    [ -d "$site/site" ] || { mkdir -p "$site" && tar -xJf "$HOPPER_SITE" -C "$site"; } || exit 1
    # cutlass-dsl's .pth file is not read from PYTHONPATH: its folder is named here
    export PYTHONPATH="$site/site:$site/site/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import quack, cutlass, flash_attn.cute; print('Hopper extras: quack', quack.__version__)" 2>/dev/null \
    || echo "Hopper extras: not importable (paratron runs its plain GPU path)"
dense="--torch-compile --micro-batch-size $mb --global-batch-size $gb"
fp8="--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
variants=()
want bf16 && variants+=(--variant "bf16:$dense")
want fp8 && variants+=(--variant "fp8:$dense $fp8")
want fp8 && variants+=(--variant "fp8-tensorwise:$dense --fp8-format e4m3 --fp8-recipe tensorwise")
want fp8 && variants+=(--variant "fp8-blockwise:$dense --fp8-format e4m3 --fp8-recipe blockwise")
hf=()
want hf && hf=(--hf)
if [ ${#variants[@]} -gt 0 ] || [ ${#hf[@]} -gt 0 ]; then
    python benchmarks/train_throughput.py --config llama-1b --record-dir "$out" "${variants[@]}" "${hf[@]}" 2>&1 \
        | grep -v "Warn\|warn" | tail -6
fi
if want moe; then
    moe="--torch-compile --moe-grouped-gemm --micro-batch-size $moe_mb --global-batch-size $moe_mb"
    experts="--moe-permute-fusion --bf16 --fp8-format e4m3"
    experts+=" --te-precision-config-file configs/precision/moe_experts_fp8.yaml"  # the routed experts alone
    python benchmarks/train_throughput.py --config moe-mini --record-dir "$out" --variant "moe:$moe" \
        --variant "moe-fused:$moe --moe-permute-fusion" \
        --variant "moe-fp8-experts-tensorwise:$moe $experts --fp8-recipe tensorwise" \
        --variant "moe-fp8-experts-delayed:$moe $experts --fp8-recipe delayed --fp8-amax-history-len 16" \
        --variant "moe-fp8-experts-blockwise:$moe $experts --fp8-recipe blockwise" 2>&1 \
        | grep -v "Warn\|warn" | tail -6
fi
if want decode || want hf; then
    nohf=(--no-hf)
    want hf && nohf=()
    python benchmarks/decode_bench.py --record-dir "$out" "${nohf[@]}" 2>&1 | grep -v "Warn\|warn\|Extern" | tail -6
fi
