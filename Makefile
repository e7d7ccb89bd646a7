# forkbox: the two commands of the README's Quick start, and what they need.
#   make demo   one GRPO step through the daemon: bake a warm template, fork
#               a group of sandboxes, solve, grade, kill (inside the emulated KVM
#               host where this machine has no hardware virtualization)
#   make test   format check, clippy, every test (VM tests included)
# Both install what they need first (Debian packages, the Rust build); the
# guest kernel and images are fetched and built by forkbox itself, cached
# under ~/.cache/forkbox (or $FORKBOX_CACHE).

CARGO ?= cargo
TRIPLE := x86_64-unknown-linux-gnu
AGENT := target/$(TRIPLE)/release/forkbox-agent
FORKBOX := target/release/forkbox

# Debian packages forkbox uses at build and run time.
APT_PACKAGES := busybox-static mmdebstrap kmod cpio e2fsprogs \
	ca-certificates python3 python3-pip

.PHONY: all deps qemu python-deps build agent demo test sdk-test lint fmt clean

all: build

deps:
	@missing=""; for p in $(APT_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "make: installing Debian packages:$$missing"; \
		SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
		$$SUDO apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$missing; \
	fi

# The emulated KVM host wants QEMU 10 (with 7.2 its kernel crashed under
# load): scripts/install-qemu.sh takes it from bookworm-backports on Debian 12,
# through the mirror the machine's apt already uses, and removes nothing.
qemu: deps
	@sh scripts/install-qemu.sh

# What the Python SDK and its tests need, from PyPI.
# PIP_BREAK_SYSTEM_PACKAGES: Debian's python3 refuses system-wide pip
# installs otherwise (PEP 668); older pips ignore it.
python-deps: deps
	PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --disable-pip-version-check httpx pytest pytest-timeout gymnasium

# The guest agent is PID 1 in an initramfs with no libc: link it statically.
agent: deps
	RUSTFLAGS="-C target-feature=+crt-static" $(CARGO) build --release -p forkbox-agent --target $(TRIPLE)

build: deps qemu agent
	$(CARGO) build --release --workspace

demo: build
	$(FORKBOX) demo

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --release -- -D warnings

test: build lint
	$(CARGO) test --workspace --release
	$(MAKE) sdk-test

# The Python SDK against a real forkboxd. Without hardware virtualization
# the whole pytest session runs inside the emulated KVM host (QEMU TCG; its
# root is this machine's, read-only), so the image is built out here first.
# A test that hangs fails after 10 minutes with where it waited (pytest-timeout)
# and the suite goes on, instead of the whole session hitting its limit.
sdk-test: build python-deps
	$(FORKBOX) image minimal >/dev/null
	$(FORKBOX) testbed run --if-needed --timeout 1800 --host-crash-retries 2 -- env PYTHONDONTWRITEBYTECODE=1 \
		python3 -m pytest -p no:cacheprovider -q --timeout 600 sdk/python/tests

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
