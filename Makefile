# Thin wrapper over CMake. `make run` and `make test` do all set-up on a fresh Debian 12 machine.
SHELL := /bin/bash
BUILD ?= build
JOBS ?= $(shell nproc)
MODEL ?= models/tiny-k3
PROMPT ?= The quick brown fox
DEB_PKGS := build-essential cmake pkg-config libjansson-dev libpcre2-dev libxxhash-dev \
            libcmocka-dev libmicrohttpd-dev libopenmpi-dev openmpi-bin libhiredis-dev redis-server \
            libcurl4-openssl-dev
PIP_PKGS := pytest openai numpy
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps build run test clean format bench

all: build

# Installs only what is missing: apt-get when a Debian package is absent, pip when a module is.
deps:
	@missing=""; for p in $(DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi
	@python3 -c "import pytest, openai, numpy" 2>/dev/null || python3 -m pip install -q $(PIP_PKGS)

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

$(MODEL)/config.json: | build
	./$(BUILD)/deltaserve init-model --preset $(notdir $(MODEL)) --out $(MODEL)

model: build $(MODEL)/config.json

run: build $(MODEL)/config.json
	./$(BUILD)/deltaserve generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens 32

test: build $(MODEL)/config.json
	cd $(BUILD) && ctest --output-on-failure -j 2
	DS_BIN=$(CURDIR)/$(BUILD)/deltaserve DS_MODEL=$(CURDIR)/$(MODEL) python3 -m pytest -q tests/e2e

bench: build
	@[ -f models/bench-large/config.json ] || ./$(BUILD)/deltaserve init-model --preset bench-large --out models/bench-large
	./$(BUILD)/deltaserve bench --model models/bench-large

format:
	clang-format -i $$(git ls-files 'src/*.c' 'src/*.h' 'tests/*.c' 'tests/*.h')

clean:
	rm -rf $(BUILD)
