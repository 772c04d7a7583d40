#!/usr/bin/env bash
# The GPU runs behind the GPU numbers in bench/results (*_<card>*.json, <card> the GPU's model from its
# name: h200, h100, ...), one step at a time:
#   bench/gpu_run.sh tests pull scale handover decode
# tests:    every gpu-marked test ($TESTS narrows the files); the CRIU ones need CRIU (tools/criu-fetch.sh).
# pull:     bench.weight_pull with 8 GB on one GPU, and from a second GPU when there is one; then
#           bench.checksum (the pull's verification alone) on 8 GiB.
# scale:    bench.scale, modes $MODES (default A,B,C; D and the restart come with C), on a 5.4 GiB
#           Mixtral-shaped model, rank r on GPU r % GPUs. A device call of 10 minutes holds C or
#           A,B but not all three.
# handover: bench.handover (recompute against replay) on that model in bf16.
# decode:   bench.decode on that model, batch 32 and 64 per rank: 1 rank, and with two GPUs 2 ranks
#           one per GPU, then 4 ranks two per GPU under MPS.
# step:     bench.step on that model (one rank's step by phase, its graph alone, the floor).
# deepseek: bench.step on bench.deepseek_like's DeepSeek-V3-shaped model (11.0 GB bf16, then its
#           5.5 GB FP8 form dequantised at load), batch 1, 32, 64, a 4096-token cache (MLA's decode
#           copies each row's cache rows out: a longer one costs that much more a step).
# attention: bench.attention (one layer's decode attention, gather + SDPA against the Triton kernel).
# join:     bench.join on that model: a cold joiner against one restored from a CUDA snapshot, by
#           phase and step (needs CRIU: ELASTIC_EP_CRIU), and what fills the image.
# restore:  bench.criu_restore: CRIU restore time by image size beside this machine's first-touch floor.
# traffic:  prompts mixed with decodes through the served graph on that model, one rank, 32
#           slots: bench.ttft (lone 128 and 1024-token prompts, 32 x 1024 at once), bench.serve (32
#           clients, 512 in, 64 out; aiperf from $BENCH_AIPERF, see bench/pack_aiperf.sh),
#           bench.consistency across 1 -> 2 -> 1 ($PHASE_S seconds a size, default 15). These start
#           the graph with `dynamo` from beside $PY (harness.server.env_tool), which is written there
#           when missing (a machine with the packages unpacked, not installed, has no console scripts).
# Results go to $OUT (default bench/results). Needs torch with CUDA, and nixl-cu13, msgspec and
# ai-dynamo-runtime importable.
set -uo pipefail
OUT=${OUT:-bench/results}
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
suffix=$([ "$gpus" -gt 1 ] && echo "_x$gpus" || echo "")
# "NVIDIA H100 80GB HBM3" -> h100: results name the card they were measured on
card=$($PY -c "import re, torch; m = re.search(r'\b([A-Z]\d{2,3})\b', torch.cuda.get_device_name(0)); print(m[1].lower() if m else 'gpu')")
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
rc=0
mxl() {  # the 5.4 GiB Mixtral-shaped model most steps run (/tmp/mxl), built by the first
    [ -d /tmp/mxl ] || $PY -m bench.mixtral_like /tmp/mxl --layers 2 || rc=1
}
dynamo_beside_py() {  # unresolved: a venv's python3 links to the base one, which lacks the venv's packages
    local py bin
    py=$(command -v "$PY") && bin=$(dirname "$py")
    [ -x "$bin/dynamo" ] && return
    printf '#!%s\nfrom components.graph.serve import main\nmain()\n' "$py" >"$bin/dynamo" && chmod +x "$bin/dynamo" || rc=1
}
for step in "$@"; do
    echo "=== $step ($gpus GPUs) $(date -u +%T)"
    case $step in
    tests)  # the files that hold a gpu-marked test ($TESTS narrows them): collecting all of tests/
        # needs client packages the GPU machine lacks; test_skip_policy's gpu test is pytester's
        files=${TESTS:-$(grep -l "pytest.mark.gpu" tests/test_*.py | grep -v test_skip_policy)}
        $PY -m pytest -m gpu -q -p no:cacheprovider $files || rc=1 ;;
    pull)
        $PY -m bench.weight_pull --mb 8192 --paths cuda-ipc,vmm-map --out "$OUT/weight_pull_${card}.json" || rc=1
        if [ "$gpus" -gt 1 ]; then
            $PY -m bench.weight_pull --mb 8192 --paths cuda-ipc,vmm-map --device cuda:0 --src-device cuda:1 \
                --out "$OUT/weight_pull_${card}_cross_gpu.json" || rc=1
        fi
        $PY -m bench.checksum --gb 8 --out "$OUT/checksum_${card}.json" || rc=1 ;;
    scale)
        mxl
        modes=${MODES:-A,B,C}
        restart=$([[ $modes == *C* ]] || echo --no-restart)
        $PY -m bench.scale --modes "$modes" $restart --out "$OUT/scale_${card}${suffix}_${modes//,/}.json" -- --Worker.model=/tmp/mxl \
            --Worker.device=cuda --Worker.dtype=bfloat16 --Worker.min_ranks=2 --Worker.max_seqs=8 \
            --Worker.vmm=true --Router.checkpoint_parked=true --Router.prepare_timeout_s=300 || rc=1 ;;
    handover)
        mxl
        $PY -m bench.handover --model /tmp/mxl --out "$OUT/handover_${card}.json" || rc=1 ;;
    decode)
        mxl
        ranks=$([ "$gpus" -gt 1 ] && echo 1,2 || echo 1)
        $PY -m bench.decode --device cuda --model /tmp/mxl --ranks $ranks --batch 32,64 --gen-len 256 \
            --out "$OUT/decode_${card}${suffix}.json" || rc=1
        if [ "$gpus" -gt 1 ]; then  # two ranks per GPU side by side under a private MPS daemon
            export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
            mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY && nvidia-cuda-mps-control -d
            $PY -m bench.decode --device cuda --model /tmp/mxl --ranks 4 --ranks-per-gpu 2 --batch 32,64 --gen-len 256 \
                --out "$OUT/decode_${card}${suffix}_4ranks_mps.json" || rc=1
            echo quit | nvidia-cuda-mps-control
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        fi ;;
    step)
        mxl
        $PY -m bench.step --model /tmp/mxl --out "$OUT/step_${card}.json" || rc=1 ;;
    deepseek)
        [ -d /tmp/dsv3 ] || $PY -m bench.deepseek_like /tmp/dsv3 || rc=1
        $PY -m bench.step --model /tmp/dsv3 --batch 1,32,64 --max-len 4096 --out "$OUT/step_${card}_deepseek.json" || rc=1
        [ -d /tmp/dsv3fp8 ] || $PY -m bench.deepseek_like /tmp/dsv3fp8 --fp8 || rc=1
        $PY -m bench.step --model /tmp/dsv3fp8 --dtype bfloat16 --batch 1,32,64 --max-len 4096 \
            --out "$OUT/step_${card}_deepseek_fp8.json" || rc=1 ;;
    attention)
        $PY -m bench.attention --out "$OUT/attention_${card}.json" || rc=1 ;;
    join)
        mxl
        $PY -m bench.join --device cuda --model /tmp/mxl --dtype bfloat16 --max-seqs 8 \
            --out "$OUT/join_cuda_${card}_mxl.json" || rc=1 ;;
    traffic)
        mxl
        dynamo_beside_py
        m="--Worker.model=/tmp/mxl --Worker.device=cuda --Worker.dtype=bfloat16 --Worker.max_seqs=32"
        $PY -m bench.ttft --lengths 128,1024 --burst 32 --burst-len 1024 --out "$OUT/ttft_${card}.json" \
            -- $m --Worker.max_ranks=1 --Worker.dp_size=1 || rc=1
        $PY -m bench.serve --max-seqs 32 --concurrency 32 --isl 512 --osl 64 --sigma 0 --requests 320 \
            --model /tmp/mxl --device cuda --dtype bfloat16 --out "$OUT/serve_${card}.json" || rc=1
        $PY -m bench.consistency --phase-s "${PHASE_S:-15}" --out "$OUT/consistency_${card}.json" \
            -- $m --Worker.max_ranks=2 || rc=1 ;;
    restore)
        $PY -m bench.criu_restore --out "$OUT/criu_restore_${card}.json" || rc=1 ;;
    *) echo "unknown step $step (tests, pull, scale, handover, decode, step, deepseek, attention, join, restore, traffic)"; exit 2 ;;
    esac
done
exit $rc
