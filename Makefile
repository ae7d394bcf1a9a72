# vescale: `make demo` runs the main job, `make test` runs every test. Both set up
# what they need first (Debian packages, .venv with the pinned torch, the C++ build),
# and skip what is already there.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := .make
JOBS ?= 2
# The CPU wheel of this exact version lies on the build machines; a range would let
# pip fetch a newer torch with several GB of CUDA packages.
TORCH_PIN := torch==2.13.0
PY_PINS := numpy==2.4.6 pytest==9.2.0 pytest-timeout==2.4.0 expecttest==0.3.0 hypothesis==6.170.15 tqdm==4.70.1 matplotlib==3.11.2 safetensors==0.8.0 transformers==5.23.0
APT_PKGS := cmake ninja-build g++ ccache libgtest-dev
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all setup build test test-cpp test-python test-package test-matrix demo bench clean

all: build

setup: $(STAMPS)/apt $(STAMPS)/venv

$(STAMPS)/apt:
	@mkdir -p $(STAMPS)
	@if ! dpkg -s $(APT_PKGS) >/dev/null 2>&1; then \
	  echo "installing Debian packages: $(APT_PKGS)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(APT_PKGS) >/dev/null; \
	fi
	@touch $@

$(STAMPS)/venv: $(STAMPS)/apt Makefile
	@mkdir -p $(STAMPS)
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_PIN) $(PY_PINS)
	@# Make the in-tree package importable from the venv (an editable install without the rebuild).
	@echo "$(CURDIR)" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/vescale-dev.pth"
	@touch $@

build: setup
	@[ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DPython_EXECUTABLE=$(CURDIR)/$(PY) >/dev/null
	cmake --build build -j $(JOBS)

test-cpp: build
	./build/vescale_cpp_tests --gtest_brief=1

test-python: build
	$(PY) -m pytest tests/python tests/opinfo/test_opinfo_subset.py -q

test: test-cpp test-python

# The package as a user installs it: a plain `pip install .` (isolated: pip's own build
# environment with scikit-build-core and the pinned torch, a temporary build dir, no
# GoogleTest) into a fresh venv, then the installed copy imported and run from outside
# the source tree. Needs only the Debian packages, not the development build.
test-package: $(STAMPS)/apt
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	python3 -m venv "$$tmp/venv" && \
	printf '%s\n' $(TORCH_PIN) $(PY_PINS) > "$$tmp/pins.txt" && \
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) "$$tmp/venv/bin/pip" install -q --disable-pip-version-check -c "$$tmp/pins.txt" . && \
	cd "$$tmp" && "$$tmp/venv/bin/python" "$(CURDIR)/tests/package_smoke.py" "$(CURDIR)"

# the Python tests under every CPU capability (native, avx2, default) and 1 and 2 threads
test-matrix: build
	PY=$(PY) tests/run_matrix.sh

demo: build
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 examples/demo.py

bench: build
	$(PY) bench/dispatch_overhead.py
	$(PY) bench/train_step.py
	$(PY) bench/checkpoint.py
	$(PY) bench/deferred_init.py
	$(PY) bench/pipeline.py
	$(PY) bench/autoplan_scale.py

clean:
	rm -rf build $(STAMPS) vescale/_C*.so
