#!/usr/bin/env bash
# GPU tests: builds loom with CUDA on a GPU machine and runs the whole test
# suite there (CPU tests, and the CUDA-vs-CPU tests that skip elsewhere), then
# prints a summary. Usage: bash tests/gpu/run.sh [test-name-filter...]
# The fixtures are the repository's tests/fixtures (they travel with the
# working tree; LOOM_FIXTURES overrides).
set -euo pipefail
cd "$(dirname "$0")/../.."
# NCCL and cuDNN of a PyTorch installation live in its nvidia/* packages.
py_lib() { python3 -c "import importlib.util as u; s=u.find_spec('nvidia.$1'); print(list(s.submodule_search_locations)[0]+'/lib' if s else '')" 2>/dev/null || true; }
export LD_LIBRARY_PATH="$(py_lib nccl):$(py_lib cudnn):${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
make -j"$(nproc)" CUDA=1 BUILD=build-cuda config build-cuda/loom build-cuda/loom_tests
build-cuda/loom version
# a failure here does not stop the GPU model and layout runs below; the
# script's status is the tests' then
rc=0
LOOM_BIN=build-cuda/loom build-cuda/loom_tests "$@" | tee build-cuda/gpu-tests.log || rc=1
echo "summary:"
grep -E '^(ok|FAIL|skip) ' build-cuda/gpu-tests.log | awk '{print $1}' | sort | uniq -c
# The NCCL backend on every GPU, when there are 2 or more: make test-nccl
# runs its CPU part, then one rank per GPU under mpirun -np N (when MPI is
# installed) and through the TCP rendezvous (--spawn N).
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$ngpu" -ge 2 ]; then
    echo "NCCL tests on $ngpu GPUs:"
    make CUDA=1 BUILD=build-cuda NCCL_NP="$ngpu" test-nccl 2>&1 | tee build-cuda/nccl-tests.log
fi
# The model on one GPU (fixtures in fp32, 0.6B-shaped bf16 vs fp32 for 50
# steps), then the parallel layouts against one GPU when there are 2+ GPUs.
bash tests/gpu/model.sh build-cuda 2>&1 | tee build-cuda/model.log | grep -E "^(ok|FAIL|skip) |curves|passed"
if [ "$ngpu" -ge 2 ]; then
    bash tests/gpu/layouts.sh build-cuda 2>&1 | tee build-cuda/layouts.log | tail -24
fi
exit $rc
