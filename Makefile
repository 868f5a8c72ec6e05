# The two set-up commands of the README: `make demo` and `make test`.
# Both install what they need (Debian packages, a virtualenv) and are idempotent.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install demo test test-sanitized test-loaders bench clean

install: $(VENV)/.installed

# libfuse3-dev, libzstd-dev, zlib1g-dev, pkg-config, gcc and python3-dev build the native engine (setup.py, docs/native.md).
SYSTEM_PACKAGES := fuse3 libfuse3-3 libfuse3-dev libzstd-dev zlib1g-dev pkg-config gcc python3-dev
NATIVE_SOURCES := pyproject.toml setup.py $(wildcard atlasfs/fuse/native/*.[ch] atlasfs/formats/atlas/native/*.[ch])

$(VENV)/.installed: $(NATIVE_SOURCES)
	./scripts/install-system-packages.sh $(SYSTEM_PACKAGES)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

# The demo installs atlasfs and webdataset (the demo reads its tars back with it: the extra
# `demo`), not the test stack; it leaves its dataset in ./atlasfs-demo (reused by the next
# run) and ends with the README's quick start: mount it, ls, umount.
$(VENV)/.installed-demo: $(NATIVE_SOURCES)
	./scripts/install-system-packages.sh $(SYSTEM_PACKAGES)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[demo]'
	touch $@

demo: $(VENV)/.installed-demo
	./scripts/demo.sh $(BIN) atlasfs-demo

# systemd provides systemd-analyze, which the unit tests use (systemd itself is not started).
# pytest exits 5 when it collected no tests: that is a failure here, not a pass.
# Then the native engine's FUSE tests again, its C code built with ASan and UBSan (test-sanitized).
test: install
	./scripts/install-system-packages.sh systemd
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi
	./scripts/test-sanitized.sh $(VENV)

test-sanitized: install
	./scripts/test-sanitized.sh $(VENV)

# The real training loaders against the tar view (tests/loaders/test_loaders_real.py, marker `loaders`):
# megatron-energon 7.4.1 (with torch from PyPI, CUDA wheels included) and DALI 2.4.0 (its CPU
# pipeline needs no GPU) in their own virtualenv, never atlasfs's: about 6.5 GB, 80 s to install.
LOADERS_VENV ?= .venv-loaders
$(LOADERS_VENV)/.installed:
	$(PYTHON) -m venv $(LOADERS_VENV)
	$(LOADERS_VENV)/bin/pip install --quiet --disable-pip-version-check megatron-energon==7.4.1 nvidia-dali-cuda120==2.4.0
	touch $@

test-loaders: install $(LOADERS_VENV)/.installed
	ATLASFS_LOADERS_VENV=$(abspath $(LOADERS_VENV)) $(BIN)/python -m pytest -q -m loaders $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-loaders: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The benchmark suite (docs/performance.md), then the FUSE floor, the tar view and the shuffled
# epoch over real media in the same run: installs ratarmount, the peer of the suite, into
# bench/.venv-ratarmount and Pillow into bench/.venv-media (never into $(VENV)), and the Debian
# packages squashfuse and squashfs-tools (the shuffle's peer, squashfuse_ll). Each writes its report
# into bench/results (latest.*, floor.*, tarview.*, shuffle.*). BENCH_ARGS go to all four (the
# harness's flags, bench/harness.py: --smoke, --repeat N, --out DIR, --workdir DIR), RUN_ARGS to
# bench/run.py alone, SHUFFLE_ARGS to bench/shuffle.py alone; e.g. make bench BENCH_ARGS="--smoke"
# or BENCH_ARGS="--repeat 5" RUN_ARGS="--datasets image" SHUFFLE_ARGS="--samples 2000".
bench: install
	$(BIN)/python bench/run.py $(BENCH_ARGS) $(RUN_ARGS)
	$(BIN)/python bench/floor.py $(BENCH_ARGS)
	$(BIN)/python bench/tarview.py $(BENCH_ARGS)
	$(BIN)/python bench/shuffle.py $(BENCH_ARGS) $(SHUFFLE_ARGS)
	$(BIN)/python bench/first_read.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
