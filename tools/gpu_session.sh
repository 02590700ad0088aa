#!/usr/bin/env bash
# Issue 8's GPU checks on a machine whose python3 already has a CUDA build of torch and no network
# (a lent GPU machine): the GPU suite (tests/gpu) and the GPU benchmarks, each bounded, each
# logged to OUTDIR/<step>.log, a summary line per step on stdout. On a machine with network and
# the project's own setup, `make gpu` runs the same suite and benchmarks from the venv.
#
#   bash tools/gpu_session.sh OUTDIR [WHEELDIR]
#
# WHEELDIR: wheels of packages the machine's python3 lacks (pyzmq, ...), installed with --no-deps
# into /tmp/site first. DALI's wheel (about 400 MiB) is usually not among them; then the DALI
# GPU test skips and the VLM test reads precomputed pixels instead of decoding images.
# STEPS="env gpu_tests ..." (step names below) runs only those; GPU_TESTS_S=300 (a step's name in
# capitals, then _S) changes its limit. Exits 1 if any step failed (each step's status is printed).
# The limits add up to 570 s, under the 600 s a lent machine gives one command (on 2026-11-30 the
# whole suite took 302 s on an H200, cuda_ipc 22 s, teacher_throughput 15 s; on 2026-11-27
# section_memory 82 s).
set -u
out=${1:?usage: bash tools/gpu_session.sh OUTDIR [WHEELDIR]}
whl=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -n "$whl" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$whl"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
failed=0

chosen() { case " ${STEPS:-$1} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

step() {  # step NAME LIMIT_S COMMAND...: run bounded (NAME_S overrides LIMIT_S), log to OUTDIR/NAME.log
    local name=$1 limit=$2 start rc var
    shift 2
    chosen "$name" || return 0
    var="$(echo "$name" | tr '[:lower:]' '[:upper:]')_S"
    limit=${!var:-$limit}
    echo "== $name (limit ${limit}s): $*"
    start=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - start ))s"
    tail -n "${TAIL_LINES:-25}" "$out/$name.log"
    [ "$rc" -eq 0 ] || failed=1
}

# section_memory runs pipelines/distill.py on the text demo (what `maestro data demo` writes first)
if chosen section_memory && [ ! -f data/demo/text.arrow ]; then
    python3 -c "from loaders.demo import build_text_demo; build_text_demo('data/demo')" || exit 1
fi

step env 25 bash -c 'date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc;
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(0), torch.cuda.nccl.version())";
  python3 -c "import zmq, msgpack, pyarrow, click, safetensors, transformers
import maestro_flow.runtime.worker, maestro_flow.parallel.fsdp, maestro_flow.parallel.tp
import maestro_flow.transport.cuda_ipc
print(\"imports ok: pyzmq\", zmq.__version__, \"transformers\", transformers.__version__)"'
step gpu_tests 380 python3 -m pytest tests/gpu -v -p no:cacheprovider --timeout 150
step cuda_ipc 35 python3 -m tools.bench.cuda_ipc --timeout-s 30
step teacher_throughput 35 python3 -m tools.bench.teacher_throughput
step section_memory 95 python3 -m tools.bench.section_memory \
    --set sections.student.device=cuda --set sections.teacher.device=cuda
exit "$failed"
