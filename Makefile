# forkbox: the two commands of the README's Quick start, and what they need.
#   make demo   one GRPO step through the daemon: bake a warm template, fork
#               a group of sandboxes, solve, grade, kill (inside the emulated KVM
#               host where this machine has no hardware virtualization)
#   make test   format check, clippy, every test (VM tests included), the
#               fuzz corpus replayed and a short fuzzing pass (nightly only)
#   make fuzz   every fuzz target for FUZZ_SECS seconds (default 30) each
# Both install what they need first (Debian packages, the Rust build); the
# guest kernel and images are fetched and built by forkbox itself, cached
# under ~/.cache/forkbox (or $FORKBOX_CACHE).

CARGO ?= cargo
TRIPLE := x86_64-unknown-linux-gnu
AGENT := target/$(TRIPLE)/release/forkbox-agent
FORKBOX := target/release/forkbox

# Debian packages forkbox uses at build and run time.
APT_PACKAGES := busybox-static mmdebstrap kmod cpio e2fsprogs erofs-utils docker-registry \
	ca-certificates python3 python3-pip

.PHONY: all deps qemu runsc python-deps build agent demo test sdk-test sdk-test-gvisor lint fmt clean \
	fuzz fuzz-test fuzz-replay fuzz-nightly cargo-fuzz

all: build

deps:
	@missing=""; for p in $(APT_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "make: installing Debian packages:$$missing"; \
		SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
		$$SUDO apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$missing && \
		case " $$missing " in *" docker-registry "*) \
			echo "make: docker-registry is for the tests, which start their own on loopback: its system service (port 5000, all interfaces) is stopped and disabled"; \
			$$SUDO systemctl disable --now docker-registry >/dev/null 2>&1 || true;; \
		esac; \
	fi

# The emulated KVM host wants QEMU 10 (with 7.2 its kernel crashed under
# load), the gVisor backend a runsc of 2024 or later: scripts/install-backport.sh
# takes each from bookworm-backports on Debian 12, through the mirror the
# machine's apt already uses, and removes nothing.
qemu: deps
	@sh scripts/install-backport.sh qemu-system-x86 1:10 \
		"hosts without hardware virtualization run microVMs in QEMU's emulated host, whose kernel crashed under load with older QEMUs"

runsc: deps
	@sh scripts/install-backport.sh runsc 0.0~20240729 \
		"the gVisor backend is tested with runsc 20240729; older ones may not checkpoint or restore a sandbox"

# What the Python SDK and its tests need, from PyPI.
# PIP_BREAK_SYSTEM_PACKAGES: Debian's python3 refuses system-wide pip
# installs otherwise (PEP 668); older pips ignore it.
python-deps: deps
	PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --disable-pip-version-check httpx pytest pytest-timeout gymnasium

# The guest agent is PID 1 in an initramfs with no libc: link it statically.
agent: deps
	RUSTFLAGS="-C target-feature=+crt-static" $(CARGO) build --release -p forkbox-agent --target $(TRIPLE)

build: deps qemu runsc agent
	$(CARGO) build --release --workspace

demo: build
	$(FORKBOX) demo

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --release -- -D warnings

test: build lint
	$(CARGO) test --workspace --release
	$(MAKE) fuzz-test
	$(MAKE) sdk-test
	$(MAKE) sdk-test-gvisor

# The Python SDK against a real forkboxd. Without hardware virtualization
# the pytest session runs inside the emulated KVM host (QEMU TCG; its root
# is this machine's, read-only), so the image is built out here first: in
# one-CPU hosts side by side (one per CPU, at most 2), each running its
# share of the modules, and a host that crashes or wedges is replaced by
# one that runs only what had not ended (sdk/python/tests/testbed_shard.py).
# A test that hangs fails after 10 minutes with where it waited (pytest-timeout)
# and the suite goes on, instead of the whole session hitting its limit.
sdk-test: build python-deps
	$(FORKBOX) image build minimal >/dev/null
	$(FORKBOX) image build debian >/dev/null
	$(FORKBOX) image build docker >/dev/null
	$(FORKBOX) testbed run --if-needed --shards 2 --label sdk --timeout 1800 --host-crash-retries 4 -- \
		env PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -p no:cacheprovider -q --timeout 600 \
		--durations 10 sdk/python/tests

# The same suite against a forkboxd on gVisor (--backend gvisor), natively:
# gVisor needs no virtualization. What that backend does not do yet is
# listed in sdk/python/tests/conftest.py (GVISOR_NOT_YET) and reported as
# skipped, with the reason, in the summary.
sdk-test-gvisor: build python-deps
	FORKBOX_TEST_BACKEND=gvisor PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -p no:cacheprovider \
		-q --timeout 300 -rs --durations 5 sdk/python/tests

fmt:
	$(CARGO) fmt --all
	cd fuzz && $(CARGO) fmt --all

# Fuzzing (docs/SECURITY.md, Fuzzing). fuzz/ is its own workspace in
# cargo-fuzz's layout; the targets' bodies are a stable library
# (fuzz/targets) whose test replays the committed corpus, fuzz/corpus/.
# The replay shares target/ with the main workspace, so it reuses its
# dependencies' builds. Fuzzing itself needs nightly and cargo-fuzz.
# Every target in fuzz/fuzz_targets/ (a list written out here once missed one).
FUZZ_TARGETS := $(basename $(notdir $(wildcard fuzz/fuzz_targets/*.rs)))
# Seconds per target: `make fuzz`, and the pass `make test` runs.
FUZZ_SECS ?= 30
FUZZ_TEST_SECS ?= 10
NIGHTLY := $(shell $(CARGO) +nightly --version >/dev/null 2>&1 && echo yes)

fuzz-replay:
	cd fuzz && $(CARGO) fmt --all -- --check
	cd fuzz && $(CARGO) clippy --release -p forkbox-fuzz-targets --all-targets \
		--target-dir $(CURDIR)/target -- -D warnings
	cd fuzz && $(CARGO) test --release -p forkbox-fuzz-targets --target-dir $(CURDIR)/target

cargo-fuzz:
	@$(CARGO) +nightly fuzz --version >/dev/null 2>&1 || { \
		echo "make: installing cargo-fuzz from crates.io"; \
		$(CARGO) install cargo-fuzz --locked; }

fuzz-nightly:
	@[ "$(NIGHTLY)" = yes ] || { echo "make fuzz: needs a nightly toolchain:" \
		"rustup toolchain install nightly" >&2; exit 1; }

# Each target in turn (never in parallel), at low priority. New inputs go
# to fuzz/corpus/<target>/ (shrink with `cargo +nightly fuzz cmin <target>`
# before committing); a crash stops here, its input in fuzz/artifacts/.
fuzz: fuzz-nightly cargo-fuzz
	cd fuzz && for t in $(FUZZ_TARGETS); do \
		echo "== fuzzing $$t for $(FUZZ_SECS) s"; \
		nice -n 19 $(CARGO) +nightly fuzz run $$t corpus/$$t -- \
			-max_total_time=$(FUZZ_SECS) -print_final_stats=1 || exit 1; \
	done

# What `make test` runs: the corpus replay always; with nightly, also
# FUZZ_TEST_SECS of fuzzing per target, whose new inputs go to a scratch
# directory (the committed corpus is read, never written).
fuzz-test: fuzz-replay
	@if [ "$(NIGHTLY)" != yes ]; then \
		echo "***********************************************************************"; \
		echo "* make test: NO FUZZING: no nightly toolchain (cargo +nightly).       *"; \
		echo "* Only the committed corpus was replayed (fuzz/corpus). To fuzz:      *"; \
		echo "*   rustup toolchain install nightly && make fuzz                     *"; \
		echo "***********************************************************************"; \
	else \
		{ $(CARGO) +nightly fuzz --version >/dev/null 2>&1 || \
			$(CARGO) install cargo-fuzz --locked; } && \
		scratch=$$(mktemp -d) && trap 'rm -rf "$$scratch"' EXIT && \
		cd fuzz && nice -n 19 $(CARGO) +nightly fuzz build && \
		for t in $(FUZZ_TARGETS); do \
			echo "== fuzzing $$t for $(FUZZ_TEST_SECS) s"; \
			mkdir -p "$$scratch/$$t" && \
			nice -n 19 $(CARGO) +nightly fuzz run $$t "$$scratch/$$t" corpus/$$t -- \
				-max_total_time=$(FUZZ_TEST_SECS) || { \
				echo "make test: fuzz target $$t failed; its input is in fuzz/artifacts/$$t/" >&2; \
				exit 1; }; \
		done; \
	fi

clean:
	$(CARGO) clean
