# loom build.
#
#   make                 libloom.a, libloom.so and the loom command (CPU backend)
#   make CUDA=1          also the CUDA backend (cuBLASLt, cuDNN, NCCL)
#   make test            builds with address/undefined-behaviour sanitizers and runs the tests
#   make test-mpi        the collectives and the mesh under mpirun -np 1..4 (sanitizer build)
#   make test-gloo       the same collectives on Gloo, ranks started with RANK/WORLD_SIZE (no MPI)
#   make CUDA=1 test-nccl  the NCCL backend on every GPU: mpirun (with MPI) and TCP rendezvous
#   make fuzz            libFuzzer targets (clang) for FUZZ_SECONDS each (default 60)
#   make check           test + test-mpi + test-gloo + fuzz: what CI runs
#
# Knobs: CC, BUILD (output dir), SAN=1 (sanitizers), WERROR=1, DEBUG=1,
#        BLAS=auto|openblas|blas|none, OPENMP=1|0, MPI=auto|0 (OpenMPI's mpicc),
#        GLOO=auto|0 (Debian's libgloo-dev: CPU collectives without MPI; CXX compiles its shim),
#        CUDA=1 with CUDA_HOME, NCCL_HOME, CUDNN_HOME, CUDA_ARCH (default 90).

CC      ?= cc
BUILD   ?= build
SAN     ?= 0
WERROR  ?= 0
DEBUG   ?= 0
BLAS    ?= auto
OPENMP  ?= 1
CUDA    ?= 0
MPI     ?= auto
GLOO    ?= auto
PYTHON  ?= python3
FUZZ_SECONDS ?= 60

CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wshadow -Wno-unused-parameter \
               -Iinclude -fPIC -MMD -MP
ifeq ($(DEBUG),1)
  OPT := -O0 -g3
else
  OPT := -O2 -g
endif
ifeq ($(SAN),1)
  OPT := -O1 -g -fno-omit-frame-pointer
  SANFLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined
endif
ifeq ($(WERROR),1)
  CFLAGS_BASE += -Werror
endif
ifeq ($(OPENMP),1)
  CFLAGS_BASE += -fopenmp
  LDLIBS += -fopenmp
else
  CFLAGS_BASE += -Wno-unknown-pragmas
endif

# ---- BLAS: probe for a CBLAS that links (OpenBLAS first, then the reference) ----
HASH := \#
blas_probe = $(shell printf '$(HASH)include <cblas.h>\nint main(void){float a=1,b=1,c=0;cblas_sgemm(CblasRowMajor,CblasNoTrans,CblasNoTrans,1,1,1,1.f,&a,1,&b,1,0.f,&c,1);return c!=1;}\n' \
               | $(CC) -x c - $(1) -o /dev/null >/dev/null 2>&1 && echo ok)
ifeq ($(BLAS),auto)
  ifeq ($(call blas_probe,-lopenblas),ok)
    BLAS_LIB := -lopenblas
  else ifeq ($(call blas_probe,-lcblas),ok)
    BLAS_LIB := -lcblas
  else ifeq ($(call blas_probe,-lblas),ok)
    BLAS_LIB := -lblas
  endif
else ifeq ($(BLAS),openblas)
  BLAS_LIB := -lopenblas
else ifeq ($(BLAS),blas)
  BLAS_LIB := -lblas
endif
ifneq ($(BLAS_LIB),)
  CFLAGS_BASE += -DLOOM_HAVE_BLAS
  LDLIBS += $(BLAS_LIB)
endif
LDLIBS += -lm -lpthread

# ---- MPI (CPU ranks): OpenMPI's wrapper says how to compile and link ----
ifneq ($(MPI),0)
  MPI_COMPILE := $(shell mpicc --showme:compile 2>/dev/null)
  MPI_LINK    := $(shell mpicc --showme:link 2>/dev/null)
  ifneq ($(MPI_LINK),)
    HAVE_MPI := 1
    # -isystem: warnings inside mpi.h are not ours
    CFLAGS_BASE += -DLOOM_HAVE_MPI $(patsubst -I%,-isystem %,$(MPI_COMPILE))
    LDLIBS += $(MPI_LINK)
  endif
endif

# ---- Gloo (CPU ranks without MPI): a C++ shim over libgloo (no pkg-config file) ----
ifneq ($(GLOO),0)
  GLOO_PROBE := $(shell printf '$(HASH)include <gloo/transport/tcp/device.h>\nint main(){gloo::transport::tcp::attr a("localhost");return a.hostname.empty();}\n' \
                 | $(CXX) -std=c++17 -x c++ - -lgloo -o /dev/null >/dev/null 2>&1 && echo ok)
  ifeq ($(GLOO_PROBE),ok)
    HAVE_GLOO := 1
    CFLAGS_BASE += -DLOOM_HAVE_GLOO
    LDLIBS += -lgloo -lstdc++
  endif
endif

# ---- CUDA: toolkit, cuDNN and NCCL under CUDA_HOME or a Python env's nvidia/* ----
ifeq ($(CUDA),1)
  NVCC_PATH := $(shell command -v nvcc 2>/dev/null)
  CUDA_HOME ?= $(if $(wildcard /usr/local/cuda/bin/nvcc),/usr/local/cuda,$(patsubst %/bin/nvcc,%,$(NVCC_PATH)))
  NVCC := $(CUDA_HOME)/bin/nvcc
  ifeq ($(wildcard $(NVCC)),)
    $(error CUDA=1: no nvcc at $(NVCC); set CUDA_HOME to the CUDA toolkit (the directory with bin/nvcc))
  endif
  py_pkg = $(shell $(PYTHON) -c 'import importlib.util,os;s=importlib.util.find_spec("nvidia.$(1)");print(list(s.submodule_search_locations)[0] if s else "")' 2>/dev/null)
  find_home = $(firstword $(foreach d,$(2),$(if $(wildcard $(d)/include/$(1)),$(d))))
  NCCL_HOME  ?= $(call find_home,nccl.h,$(CUDA_HOME) /usr $(call py_pkg,nccl))
  CUDNN_HOME ?= $(call find_home,cudnn.h,$(CUDA_HOME) /usr $(call py_pkg,cudnn))
  ifeq ($(NCCL_HOME),)
    $(error CUDA=1: nccl.h not found under $(CUDA_HOME), /usr or a Python nvidia-nccl package; set NCCL_HOME)
  endif
  ifeq ($(CUDNN_HOME),)
    $(error CUDA=1: cudnn.h not found under $(CUDA_HOME), /usr or a Python nvidia-cudnn package; set CUDNN_HOME)
  endif
  libdir = $(firstword $(foreach d,$(1)/lib64 $(1)/lib $(1)/lib/x86_64-linux-gnu,$(if $(wildcard $(d)/$(2)*),$(d))))
  NCCL_LIBDIR  := $(call libdir,$(NCCL_HOME),libnccl.so)
  CUDNN_LIBDIR := $(call libdir,$(CUDNN_HOME),libcudnn.so)
  CUDA_LIBDIR  := $(call libdir,$(CUDA_HOME),libcublasLt.so)
  # Python wheels ship only libX.so.N (no unversioned link): link by that name.
  libname = $(if $(wildcard $(1)/lib$(2).so),-l$(2),-l:$(notdir $(firstword $(wildcard $(1)/lib$(2).so.*))))
  CUDA_ARCH ?= 90
  NVCCFLAGS := -O2 -g -std=c++17 -Iinclude -I$(NCCL_HOME)/include -I$(CUDNN_HOME)/include \
               -Xcompiler -fPIC,-Wall,-Wextra,-Wno-unused-parameter -MMD -MP
  CU_ARCH_FLAGS = $(foreach a,$(CUDA_ARCH),-gencode arch=compute_$(a),code=sm_$(a))
  ifeq ($(WERROR),1)
    NVCCFLAGS += -Werror all-warnings -Xcompiler -Werror
  endif
  CFLAGS_BASE += -DLOOM_HAVE_CUDA -I$(CUDA_HOME)/include \
                 $(if $(filter /usr $(CUDA_HOME),$(NCCL_HOME)),,-isystem $(NCCL_HOME)/include)
  LDLIBS += -L$(CUDA_LIBDIR) -L$(NCCL_LIBDIR) -L$(CUDNN_LIBDIR) \
            -Wl,-rpath,$(CUDA_LIBDIR) -Wl,-rpath,$(NCCL_LIBDIR) -Wl,-rpath,$(CUDNN_LIBDIR) \
            -lcublasLt -lcublas $(call libname,$(CUDNN_LIBDIR),cudnn) \
            $(call libname,$(NCCL_LIBDIR),nccl) -lcudart -lstdc++
  CU_SRC := $(wildcard src/backend/cuda/*.cu)
endif

CFLAGS := $(CFLAGS_BASE) $(OPT) $(SANFLAGS) $(EXTRA_CFLAGS)
# C++ (the Gloo shim): the C flags' defines and warnings, C++17
CXXFLAGS := -std=c++17 -D_GNU_SOURCE -Wall -Wextra -Wshadow -Wno-unused-parameter -Iinclude -fPIC \
            -MMD -MP $(filter -D% -Werror,$(CFLAGS_BASE)) $(OPT) $(SANFLAGS)
LDFLAGS += $(SANFLAGS)

LIB_SRC  := $(wildcard src/*/*.c src/*/*/*.c)
CLI_SRC  := $(wildcard cli/*.c)
# tests/common: the runner parts the three test programs share
TEST_SRC := $(wildcard tests/*.c) tests/common/runner.c tests/common/spawn.c tests/common/golden.c \
            tests/common/backend_pair.c \
            tests/common/qwen35_models.c
MPI_TEST_SRC := $(wildcard tests/mpi/*.c) tests/common/runner.c tests/common/ranks.c
CC_SRC   := $(if $(HAVE_GLOO),src/comm/comm_gloo.cc)
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/obj/%.o) $(CU_SRC:%.cu=$(BUILD)/obj/%.o) $(CC_SRC:%.cc=$(BUILD)/obj/%.o)
CLI_OBJ  := $(CLI_SRC:%.c=$(BUILD)/obj/%.o)
TEST_OBJ := $(TEST_SRC:%.c=$(BUILD)/obj/%.o)
MPI_TEST_OBJ := $(MPI_TEST_SRC:%.c=$(BUILD)/obj/%.o)
# tests/gloo: its runner and tests, and the comm and mesh tests of tests/mpi
GLOO_TEST_SRC := $(wildcard tests/gloo/*.c) tests/mpi/test_comm.c tests/mpi/test_mesh.c \
                 tests/common/runner.c tests/common/ranks.c tests/common/spawn.c
GLOO_TEST_OBJ := $(GLOO_TEST_SRC:%.c=$(BUILD)/obj/%.o)

.PHONY: all lib test test-fast test-mpi test-gloo test-nccl test-python test-emu fuzz check clean config bench-tokenizer
all: $(BUILD)/libloom.a $(BUILD)/libloom.so $(BUILD)/loom

config:
	@echo "CC=$(CC) BLAS=$(if $(BLAS_LIB),$(BLAS_LIB),none (C fallback)) OPENMP=$(OPENMP) MPI=$(if $(HAVE_MPI),$(MPI_LINK),none) GLOO=$(if $(HAVE_GLOO),-lgloo,none) CUDA=$(CUDA) SAN=$(SAN)"
ifeq ($(CUDA),1)
	@echo "CUDA_HOME=$(CUDA_HOME) NCCL_HOME=$(NCCL_HOME) CUDNN_HOME=$(CUDNN_HOME) CUDA_ARCH=$(CUDA_ARCH)"
endif

# The library's objects hide every symbol include/loom.h does not declare
# (its visibility pragma): libloom.so exports the API alone; the CLI and
# the tests link libloom.a, where hidden symbols still resolve.
$(BUILD)/obj/src/%.o: VISIBILITY := -fvisibility=hidden

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(VISIBILITY) -c $< -o $@

$(BUILD)/obj/%.o: %.cc
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) $(VISIBILITY) -c $< -o $@

$(BUILD)/obj/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) $(CU_ARCH_FLAGS) $(if $(VISIBILITY),-Xcompiler $(VISIBILITY)) -c $< -o $@

# wgmma and setmaxnreg exist on sm_90a only: the Hopper GEMM is built for it
# alone (loom_cuda_gemm_lora_ok refuses other devices).
$(BUILD)/obj/src/backend/cuda/gemm_sm90.o: CU_ARCH_FLAGS := -gencode arch=compute_90a,code=sm_90a

$(BUILD)/libloom.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libloom.so: $(LIB_OBJ) src/libloom.map
	$(CC) -shared $(LDFLAGS) -Wl,--version-script=src/libloom.map -o $@ $(LIB_OBJ) $(LDLIBS)

$(BUILD)/loom: $(CLI_OBJ) $(BUILD)/libloom.a
	$(CC) $(LDFLAGS) -o $@ $(CLI_OBJ) $(BUILD)/libloom.a $(LDLIBS)

$(BUILD)/loom_tests: $(TEST_OBJ) $(BUILD)/libloom.a
	$(CC) $(LDFLAGS) -o $@ $(TEST_OBJ) -Wl,--whole-archive $(BUILD)/libloom.a -Wl,--no-whole-archive $(LDLIBS)

$(BUILD)/loom_mpi_tests: $(MPI_TEST_OBJ) $(BUILD)/libloom.a
	$(CC) $(LDFLAGS) -o $@ $(MPI_TEST_OBJ) -Wl,--whole-archive $(BUILD)/libloom.a -Wl,--no-whole-archive $(LDLIBS)

$(BUILD)/loom_gloo_tests: $(GLOO_TEST_OBJ) $(BUILD)/libloom.a
	$(CC) $(LDFLAGS) -o $@ $(GLOO_TEST_OBJ) -Wl,--whole-archive $(BUILD)/libloom.a -Wl,--no-whole-archive $(LDLIBS)

# Tests run against the sanitizer build; a sanitizer report aborts (a signal),
# which the tests of the command line count as a crash.
SAN_ENV := ASAN_OPTIONS=abort_on_error=1:detect_leaks=1:allocator_may_return_null=1 \
           UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:abort_on_error=1
test:
	$(MAKE) --no-print-directory BUILD=build-san SAN=1 WERROR=1 build-san/loom build-san/loom_tests
	$(SAN_ENV) LOOM_BIN=build-san/loom build-san/loom_tests $(T)

# Same tests, optimised build, no sanitizers.
test-fast: $(BUILD)/loom $(BUILD)/loom_tests
	LOOM_BIN=$(BUILD)/loom $(BUILD)/loom_tests $(T)

# The CUDA Gated DeltaNet kernels on the CPU (tools/cuda_emu: threads as
# fibers, three orders) against the CPU reference, where no GPU is
# (tests/emu/gdn_emu.cpp). EMU_ARGS=big adds the larger cases.
EMU_DIR := $(BUILD)/emu
EMU_DEPS := src/backend/cuda/ops_common.cuh src/backend/cuda/cuda_ops.h src/backend/gdn_ws.h \
            src/backend/cpu/cpu_gdn.h tests/emu/emu_util.h $(wildcard tools/cuda_emu/fake/*.h) \
            tools/cuda_emu/fake/mma.cuh
EMU_CXXFLAGS := -std=c++17 -O1 -g -I. -Iinclude -Itools/cuda_emu/fake -w
$(EMU_DIR)/%.cpp: src/backend/cuda/%.cu tools/cuda_emu/pre.py
	@mkdir -p $(EMU_DIR)
	$(PYTHON) tools/cuda_emu/pre.py $< $@
$(EMU_DIR)/gdn_emu: $(EMU_DIR)/ops_gdn.cpp $(EMU_DIR)/ops_gdn_norm.cpp $(EMU_DIR)/ops_gdn_rule.cpp \
                    $(EMU_DIR)/ops_gdn_l2.cpp \
                    $(EMU_DIR)/ops_gdn_tc.cpp $(EMU_DIR)/ops_gdn_tc_bwd.cpp $(EMU_DIR)/ops_gdn_state.cpp \
                    tools/cuda_emu/emu.cpp tests/emu/gdn_emu.cpp \
                    $(EMU_DEPS) src/backend/cuda/ops_gdn_rule.cuh src/backend/cuda/ops_gdn_tc.cuh \
                    src/backend/cuda/ops_gdn_small.cuh \
                    src/backend/cuda/mma_addr.cuh $(BUILD)/libloom.a
	$(CXX) $(EMU_CXXFLAGS) -o $@ $(filter %.cpp,$^) $(BUILD)/libloom.a $(LDLIBS)
$(EMU_DIR)/attn_emu: $(EMU_DIR)/ops_attention.cpp $(EMU_DIR)/ops_attention_mma.cpp \
                     tools/cuda_emu/emu.cpp tests/emu/attn_emu.cpp $(EMU_DEPS) \
                     src/backend/cuda/ops_attention.cuh src/backend/cuda/mma_addr.cuh \
                     $(BUILD)/libloom.a
	$(CXX) $(EMU_CXXFLAGS) -o $@ $(filter %.cpp,$^) $(BUILD)/libloom.a $(LDLIBS)
test-emu: $(EMU_DIR)/gdn_emu $(EMU_DIR)/attn_emu
	$(EMU_DIR)/gdn_emu $(EMU_ARGS)
	$(EMU_DIR)/attn_emu $(EMU_ARGS)

# The Python package (python/loom) with pytest, on the optimised library of
# $(BUILD): the API in one process, the usage example under mpirun and under
# launcher variables without MPI (Gloo), over Ray, and `pip install .` in a
# fresh virtual environment. T=expr picks tests (pytest -k).
test-python: $(BUILD)/libloom.so $(BUILD)/loom
	LOOM_BUILD=$(abspath $(BUILD)) $(PYTHON) -m pytest -q -rs tests/python $(if $(T),-k "$(T)")

# The MPI tests: one program run by every rank under mpirun -np N for each
# N in MPI_NP (sanitizer build; leak detection off, OpenMPI itself leaks).
# LOOM_COMM_TIMEOUT turns a hang into a failure; mpirun --timeout is the backstop.
MPI_NP ?= 1 2 3 4
MPIRUN ?= mpirun
MPIRUN_FLAGS ?= --oversubscribe --allow-run-as-root --timeout 120
# (no CMA single-copy: containers often forbid process_vm_readv)
MPI_ENV := ASAN_OPTIONS=abort_on_error=1:detect_leaks=0:allocator_may_return_null=1 \
           UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:abort_on_error=1 \
           LOOM_COMM_TIMEOUT=30 OMPI_MCA_btl_vader_single_copy_mechanism=none
test-mpi:
ifeq ($(HAVE_MPI),1)
	$(MAKE) --no-print-directory BUILD=build-san SAN=1 WERROR=1 build-san/loom_mpi_tests
	@set -e; for n in $(MPI_NP); do \
	    echo "test-mpi: $$n process(es)"; \
	    $(MPI_ENV) $(MPIRUN) $(MPIRUN_FLAGS) -np $$n build-san/loom_mpi_tests $(T); \
	done
else
	@echo "test-mpi: skipped: no MPI (mpicc --showme failed, or MPI=0); install openmpi-bin and libopenmpi-dev"
endif

# The Gloo tests: tests/gloo/'s program starts N ranks of itself with
# RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (--spawn N, torchrun's variables,
# no mpirun) for each N in GLOO_NP; they run tests/mpi's collectives and
# mesh tests and tests/gloo's own (timeouts, a rank that ends). Sanitizer
# build (Gloo itself is not instrumented; leak detection off, as for MPI).
GLOO_NP ?= 1 2 3 4
GLOO_ENV := ASAN_OPTIONS=abort_on_error=1:detect_leaks=0:allocator_may_return_null=1 \
            UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:abort_on_error=1 LOOM_COMM_TIMEOUT=30
test-gloo:
ifeq ($(HAVE_GLOO),1)
	$(MAKE) --no-print-directory BUILD=build-san SAN=1 WERROR=1 build-san/loom_gloo_tests
	@set -e; for n in $(GLOO_NP); do \
	    echo "test-gloo: $$n process(es)"; \
	    $(GLOO_ENV) build-san/loom_gloo_tests --spawn $$n $(T); \
	done
else
	@echo "test-gloo: skipped: no Gloo (GLOO=0, or no libgloo: apt-get install libgloo-dev)"
endif

# The NCCL tests (CUDA=1): tests/nccl/ is its own program, linked with the
# core and comm objects only (no kernels to build). First its CPU part
# (launcher variables, the TCP rendezvous; no GPU needed), then, with one
# process per GPU: under mpirun when MPI is there and there are 2+ GPUs,
# and started by the program itself (--spawn N: RANK/WORLD_SIZE/MASTER_ADDR,
# the TCP rendezvous). Not a sanitizer build (ASan and CUDA do not mix).
NCCL_TEST_SRC := $(wildcard tests/nccl/*.c) tests/common/runner.c tests/common/ranks.c \
                 tests/common/spawn.c
NCCL_TEST_OBJ := $(NCCL_TEST_SRC:%.c=$(BUILD)/obj/%.o)
NCCL_LIB_OBJ  := $(filter $(BUILD)/obj/src/core/% $(BUILD)/obj/src/comm/%,$(LIB_OBJ))
NCCL_NP  ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
NCCL_ENV := LOOM_COMM_TIMEOUT=60 OMPI_MCA_btl_vader_single_copy_mechanism=none
$(BUILD)/loom_nccl_tests: $(NCCL_TEST_OBJ) $(NCCL_LIB_OBJ)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)
test-nccl:
ifeq ($(CUDA),1)
	$(MAKE) --no-print-directory $(BUILD)/loom_nccl_tests
	$(BUILD)/loom_nccl_tests --cpu $(T)
	@set -e; n="$(NCCL_NP)"; n=$${n:-0}; \
	if [ "$$n" -lt 1 ]; then echo "test-nccl: no GPU visible: only the CPU part ran"; exit 0; fi; \
	if [ "$$n" -ge 2 ] && [ "$(HAVE_MPI)" = 1 ]; then \
	    echo "test-nccl: mpirun -np $$n"; \
	    $(NCCL_ENV) $(MPIRUN) $(MPIRUN_FLAGS) -np $$n $(BUILD)/loom_nccl_tests $(T); \
	elif [ "$$n" -ge 2 ]; then echo "test-nccl: no MPI: the mpirun run is skipped"; fi; \
	echo "test-nccl: $$n process(es), TCP rendezvous"; \
	$(NCCL_ENV) $(BUILD)/loom_nccl_tests --spawn $$n $(T)
else
	@echo "test-nccl: needs make CUDA=1 (the NCCL backend is part of the CUDA build)"
endif

# A per-kernel GPU time profiler (CUPTI activity records), for LD_PRELOAD
# under any CUDA program: bench/kprof.c says how. CUDA=1 only.
ifeq ($(CUDA),1)
CUPTI_LIBDIR := $(firstword $(foreach d,$(CUDA_HOME)/extras/CUPTI/lib64 $(CUDA_HOME)/lib64 $(CUDA_HOME)/lib,$(if $(wildcard $(d)/libcupti.so*),$(d))))
$(BUILD)/libloom_kprof.so: bench/kprof.c
	@mkdir -p $(dir $@)
	$(CC) -O2 -std=c11 -Wall -Wextra -shared -fPIC -I$(CUDA_HOME)/include \
	    -I$(CUDA_HOME)/extras/CUPTI/include -o $@ $< -L$(CUPTI_LIBDIR) -Wl,-rpath,$(CUPTI_LIBDIR) -lcupti

# A Hopper GEMM probe (TMA + wgmma, sm_90a only) checked and timed against
# cuBLASLt: bench/gemm_sm90.cu says what it measures. CUDA=1 only.
$(BUILD)/gemm_sm90: bench/gemm_sm90.cu src/backend/cuda/gemm_sm90.cuh
	@mkdir -p $(dir $@)
	$(NVCC) -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a \
	    $(if $(filter 1,$(WERROR)),-Werror all-warnings) -o $@ $< -L$(CUDA_LIBDIR) -lcublasLt

# Power probes under the board's limit: bench/power_probe.cu says what they do.
$(BUILD)/power_probe: bench/power_probe.cu
	@mkdir -p $(dir $@)
	$(NVCC) -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a \
	    $(if $(filter 1,$(WERROR)),-Werror all-warnings) -o $@ $< -L$(CUDA_LIBDIR) -lcublas
endif

# ---- fuzzing (clang + libFuzzer) ----
FUZZ_CC ?= clang
FUZZ_LIB_SRC := src/core/core.c src/core/dtype.c src/core/json.c src/core/json_write.c src/core/sha256.c \
                src/io/safetensors.c src/io/safetensors_writer.c src/io/hf_experts.c src/io/hf_config.c src/io/outdir.c src/io/ckpt_dir.c src/io/state_format.c \
                src/data/tokens.c src/data/dataset.c src/data/loader.c \
                $(wildcard src/data/chat*.c src/data/tokenizer*.c src/data/unicode*.c src/data/jinja*.c)
FUZZ_TARGETS := json safetensors tokens dataset tokenizer state config jinja
build-fuzz/fuzz_%: fuzz/fuzz_%.c $(FUZZ_LIB_SRC) $(wildcard include/*.h src/*/*.h)
	@mkdir -p build-fuzz
	$(FUZZ_CC) -std=c11 -D_GNU_SOURCE -Iinclude -g -O1 -fsanitize=fuzzer,address,undefined \
	    -fno-sanitize-recover=undefined -o $@ $(filter %.c,$^) -lm

fuzz: $(FUZZ_TARGETS:%=build-fuzz/fuzz_%)
	@set -e; for t in $(FUZZ_TARGETS); do \
	    mkdir -p build-fuzz/corpus-$$t; \
	    echo "fuzz_$$t: $(FUZZ_SECONDS) s"; \
	    build-fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=0 \
	        -artifact_prefix=build-fuzz/crash-$$t- build-fuzz/corpus-$$t fuzz/corpus/$$t \
	        2>build-fuzz/fuzz_$$t.log || { tail -n 60 build-fuzz/fuzz_$$t.log; exit 1; }; \
	    grep -E '^#[0-9]+[[:space:]]+DONE' build-fuzz/fuzz_$$t.log | tail -n 1; \
	done

# Tokenizer throughput (one thread); bench/README.md runs it against Hugging Face.
bench-tokenizer: $(BUILD)/tokenizer_bench
$(BUILD)/tokenizer_bench: $(BUILD)/obj/bench/tokenizer_bench.o $(BUILD)/libloom.a
	$(CC) $(LDFLAGS) -o $@ $< $(BUILD)/libloom.a $(LDLIBS)

check:
	$(MAKE) --no-print-directory test
	$(MAKE) --no-print-directory test-mpi
	$(MAKE) --no-print-directory test-gloo
	$(MAKE) --no-print-directory test-python
	$(MAKE) --no-print-directory test-emu
	$(MAKE) --no-print-directory fuzz

clean:
	rm -rf build build-san build-fuzz build-cuda

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
