#!/usr/bin/env bash
# One command for a lent GPU node: is the expert path right there, how fast is it, and what does one training step
# reach. Run from the repository root (benchmarks/gpu/README.md says how, and what each stage measures):
#
#     benchmarks/gpu/run.sh [OUT_DIR]                    # default benchmarks/results/gpu/latest
#     STAGES="selftest step_profile" benchmarks/gpu/run.sh OUT_DIR      # some stages only
#
# Stages, in order (about 10 minutes in all on one H200):
#   selftest      `optimus selftest` on the step's recipe: every expert-path kernel against the reference, rates
#   expert_path   benchmarks/gpu/expert_path.py: Triton, torch's grouped GEMM and a per-expert loop, checked, then
#                 timed as fractions of a dense GEMM of the same FLOPs in the same run
#   device_path   benchmarks/gpu/device_path.py: one step of a 2-layer mula-7b-a1b on the device beside the dry
#                 run's trace of it on the stand-in device: operators (calls, FLOPs, bytes) and peak memory
#   step_triton   `optimus train` of a one-device MoE model (mula-7b-a1b's widths, 8 layers: 3.6B parameters,
#   step_torch    about 72 GiB planned) with kernels=triton, then kernels=torch: tokens/s, MFU, peak memory
#   calibrate     `optimus plan --calibrate` of this node on its cluster's recipe (nvidia, frontier or aurora),
#                 with the step_triton step's operators timed on the device (operators.json)
#   predict       `optimus plan --predict` of that step on that recipe with machine.calibration= its machine.yaml,
#                 its operators priced by their measured times
#   step_profile  one profiled step (kernels=triton): device time by kernel, device idle time, host syncs
#   kernel_tests  tests/kernels/test_kernels_triton.py on the device (awkward shapes in every dtype, compiled)
# Without a GPU the selftest, expert_path and step_torch stages run on tiny shapes (the Triton interpreter, the
# tiny model on the CPU), so that the script is known to work before a device is lent
# (tests/test_gpu_benchmarks.py runs that path).
#
# OPTIMUS_STEP_OVERRIDES adds overrides to the training steps' (the tests point it at a small local corpus).
# Each stage has its own time limit and its own log in OUT_DIR; a stage that fails is reported and the next one
# runs. OUT_DIR/summary.md is written last (benchmarks/gpu/summary.py), with the device, driver, torch and
# Triton versions.
set -u
out=${1:-benchmarks/results/gpu/latest}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OPTIMUS_CACHE=${OPTIMUS_CACHE:-$out/cache}
python=${PYTHON:-python3}
accelerator="import sys, torch; x = getattr(torch, 'xpu', None)
sys.exit(0 if torch.cuda.is_available() or (x is not None and x.is_available()) else 1)"
if $python -c "$accelerator"; then gpu=1; else gpu=0; fi
# Fragmentation headroom: the step plans about 72 GiB, close to an 80 GB card's usable memory
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# The node's cluster recipe and the device path its step is traced on: an Intel GPU's (Aurora), a ROCm build's
# (Frontier: torch calls the GCDs cuda devices), else NVIDIA's
node="import torch
print('xpu aurora' if not torch.cuda.is_available() else 'rocm frontier' if torch.version.hip else 'cuda nvidia')"
if [ "$gpu" = 1 ]; then
    read -r device_path node_machine < <($python -c "$node")
    stages=${STAGES:-selftest expert_path device_path step_triton step_torch calibrate predict step_profile kernel_tests}
    # STEP_LAYERS=6 for a 64 GB device (an Aurora tile): 8 layers plan about 72 GiB
    step_model=(model=mula-7b-a1b model.n_layers=${STEP_LAYERS:-8} train.seq_len=2048 train.micro_batch=4
        train.global_batch=32 train.dtype=bf16)
    steps=8 expert_path_args=() tiny_selftest=() device_path_args=()
else
    stages=${STAGES:-selftest expert_path device_path step_torch}
    step_model=(model=tiny train.seq_len=64 train.micro_batch=2 train.global_batch=4)
    steps=3 expert_path_args=(--tiny) tiny_selftest=(kernels=torch) device_path_args=(--tiny)
fi
step_args=(optim.update=adamw optim.lr=4e-4 optim.warmup_steps=2 train.log_interval=1 train.eval_interval=100000
    train.eval_sequences=4 ${OPTIMUS_STEP_OVERRIDES:-})

stage() {  # stage NAME LIMIT_S COMMAND...: run, log to OUT_DIR/NAME.log, record the exit status
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >>"$out/stages.txt"
    echo "   exit $rc after $((SECONDS - t0)) s; last lines:"
    tail -n 4 "$out/$name.log" | sed 's/^/   /'
}

rm -f "$out/stages.txt"
$python benchmarks/gpu/summary.py --environment >"$out/environment.json"
for name in $stages; do
    case $name in
    selftest)
        rm -rf "$out/selftest"
        stage selftest 300 $python -m optimus selftest --out "$out/selftest" "${step_model[@]}" "${tiny_selftest[@]}"
        ;;
    expert_path)
        stage expert_path 170 $python benchmarks/gpu/expert_path.py "${expert_path_args[@]}" --out "$out/expert_path.json"
        ;;
    device_path)
        stage device_path 150 $python benchmarks/gpu/device_path.py "${device_path_args[@]}" --out "$out/device_path.json"
        ;;
    step_triton | step_torch)
        rm -rf "${out:?}/$name"
        stage "$name" 130 $python -m optimus train "${step_model[@]}" "${step_args[@]}" train.steps=$steps \
            kernels=${name#step_} run.dir="$out/$name"
        ;;
    step_profile)  # the fourth step traced: compiled, autotuned and warm by then
        rm -rf "${out:?}/step_profile"
        stage step_profile 130 $python -m optimus train "${step_model[@]}" "${step_args[@]}" train.steps=4 \
            kernels=triton profile.torch=true profile.torch_steps=4-4 run.dir="$out/step_profile"
        trace="$out/step_profile/trace_rank0.json"
        if [ -f "$trace" ]; then  # hundreds of MB: profile.md keeps what it showed
            $python benchmarks/gpu/profile_summary.py "$trace" >"$out/profile.md" 2>&1 && rm -f "$trace"
        fi
        ;;
    calibrate)  # this node's rates laid over its cluster's recipe, and the step's operators timed on its devices
        # (Triton compiles and tunes its kernels at the first call of each), as a user calibrates a cluster's node
        stage calibrate 300 $python -m optimus plan --calibrate --overwrite --out "$out/calibration" --world 1 \
            "${step_model[@]}" "${step_args[@]}" kernels=triton machine="$node_machine"
        ;;
    predict)  # the step_* stages' step predicted from the calibrate stage's machine.yaml
        if [ ! -f "$out/calibration/machine.yaml" ]; then
            echo "== predict: skipped, no calibration/machine.yaml (the calibrate stage writes it)"
            continue
        fi
        stage predict 150 $python -m optimus plan --predict --world 1 --device "$device_path" "${step_model[@]}" \
            "${step_args[@]}" kernels=triton machine="$node_machine" \
            machine.calibration="$out/calibration/machine.yaml" machine.ranks_per_node=1
        ;;
    kernel_tests)
        stage kernel_tests 300 $python -m pytest -q -rf --tb=short -p no:cacheprovider tests/kernels/test_kernels_triton.py \
            tests/kernels/test_kernels_host_syncs.py tests/kernels/test_kernel_check.py
        ;;
    *) echo "unknown stage $name: choose from selftest expert_path device_path step_triton step_torch calibrate" \
        "predict step_profile kernel_tests" ;;
    esac
done

$python benchmarks/gpu/summary.py --out "$out" | tee "$out/summary.md"
