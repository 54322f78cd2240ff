#!/usr/bin/env bash
# The kind provider's Docker engine: Debian's dockerd and containerd, started for one run and stopped
# after it, kept apart from everything else on the machine (the real node's containerd among them).
#
#   bash e2e/kind/engine.sh start   # prints DOCKER_HOST=unix://...
#   bash e2e/kind/engine.sh stop    # stops both, removes their bridges and mounts
#   bash e2e/kind/engine.sh status
#
# Under ${DISAGG_CACHE:-$XDG_CACHE_HOME/disagg}/docker/: data/ (images, containers; kept between runs so
# images load fast; `clean` removes it), run/ (sockets, runtime state; removed on stop). Its own
# containerd (its own socket, root and state; never /run/containerd/containerd.sock), no iptables rules,
# no ip_forward change, no default bridge ("bridge": "none": builds use the host's network), and one
# network, kind's, that e2e.sh creates as bridge disagg-kind0 on 198.51.100.0/24 (TEST-NET-2): off the
# private ranges, the real node's 198.18.0.0/15 and this machine's own (192.0.2.0/24 on eth0, and
# 203.0.113.0/24 where its package and module proxies answer: a route for it would cut them off).
# Containers run through capsrunc (build.sh), which drops the capabilities this machine's bounding set
# lacks, so `--privileged` (kind's nodes) works.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../localcluster/cache.sh
source "$here/../localcluster/cache.sh"
root="$cache_root/docker"
run="$root/run"
sock="$root/docker.sock"
log() { echo "[kind-engine] $*" >&2; }

start() {
  local bin
  if [[ -S "$sock" ]] && DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1; then
    echo "DOCKER_HOST=unix://$sock"
    return
  fi
  for tool in dockerd containerd containerd-shim-runc-v2 docker-proxy runc; do
    command -v "$tool" >/dev/null || { log "missing $tool: apt-get install docker.io (make kind-packages)"; exit 2; }
  done
  bin="$(bash "$here/build.sh")"
  mkdir -p "$root/data" "$run/containerd"
  # kind mounts /lib/modules into every node; a machine without modules has no such directory: an
  # empty one stands in while the engine runs (removed on stop).
  if [[ ! -e /lib/modules ]]; then
    mkdir /lib/modules
    touch "$root/made-lib-modules"
  fi
  cat >"$root/containerd.toml" <<TOML
version = 2
root = "$root/data/containerd"
state = "$run/containerd/state"
imports = []
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt"]
[grpc]
  address = "$run/containerd/containerd.sock"
[ttrpc]
  address = "$run/containerd/containerd.sock.ttrpc"
TOML
  cat >"$root/daemon.json" <<JSON
{
  "data-root": "$root/data/docker",
  "exec-root": "$run/docker",
  "pidfile": "$run/dockerd.pid",
  "hosts": ["unix://$sock"],
  "containerd": "$run/containerd/containerd.sock",
  "iptables": false,
  "ip6tables": false,
  "ip-forward": false,
  "ip-masq": false,
  "ipv6": false,
  "bridge": "none",
  "default-address-pools": [{"base": "198.51.100.0/24", "size": 24}],
  "storage-driver": "overlay2",
  "exec-opts": ["native.cgroupdriver=cgroupfs"],
  "cgroup-parent": "disagg-docker",
  "oom-score-adjust": 0,
  "log-driver": "json-file",
  "features": {"buildkit": true},
  "runtimes": {"capsrunc": {"path": "$bin/capsrunc"}},
  "default-runtime": "capsrunc"
}
JSON
  # Every node's kubelet, kube-proxy and systemd take inotify instances from one per-user limit
  # (root's, machine-wide): six nodes overrun the common default of 128 ("fsnotify watcher init: too
  # many open files"). Raised while the engine runs; the old value is put back on stop.
  local instances
  instances="$(cat /proc/sys/fs/inotify/max_user_instances)"
  if ((instances < 1024)); then
    echo "$instances" >"$root/inotify-instances.orig"
    echo 1024 >/proc/sys/fs/inotify/max_user_instances
  fi
  containerd --config "$root/containerd.toml" >"$root/containerd.log" 2>&1 &
  echo $! >"$root/containerd.pid"
  for _ in $(seq 100); do [[ -S "$run/containerd/containerd.sock" ]] && break; sleep 0.1; done
  dockerd --config-file "$root/daemon.json" >"$root/dockerd.log" 2>&1 &
  echo $! >"$root/dockerd.pid"
  for _ in $(seq 300); do
    DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1 && { echo "DOCKER_HOST=unix://$sock"; return; }
    kill -0 "$(cat "$root/dockerd.pid")" 2>/dev/null || break
    sleep 0.2
  done
  log "dockerd did not start; its log:"
  tail -20 "$root/dockerd.log" >&2
  stop
  exit 1
}

stop_pid() {  # stop_pid FILE: TERM the process whose id FILE holds, KILL it after 30 s
  local f="$1" pid
  [[ -f "$f" ]] || return 0
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$f"
}

stop() {
  local m link
  stop_pid "$root/dockerd.pid"
  stop_pid "$root/containerd.pid"
  # shims left behind by a killed containerd: only those serving this engine's socket
  for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $run/containerd/containerd.sock" || true); do
    kill -9 "$pid" 2>/dev/null || true
  done
  # mounts under the engine's directories, deepest first
  while read -r m; do umount -l "$m" 2>/dev/null || true; done < <(
    awk -v r="$root" '$5 == r || index($5, r "/") == 1 {print $5}' /proc/self/mountinfo | sort -r)
  # the kind network's bridge, when dockerd left it behind
  for link in $(ip -o link show type bridge | awk -F': ' '{print $2}' | cut -d@ -f1); do
    case "$link" in disagg-kind*) ip link del "$link" ;; esac
  done
  rm -rf "$run" "$sock"
  if [[ -f "$root/inotify-instances.orig" ]]; then
    [[ "$(cat /proc/sys/fs/inotify/max_user_instances)" == 1024 ]] &&
      cat "$root/inotify-instances.orig" >/proc/sys/fs/inotify/max_user_instances
    rm -f "$root/inotify-instances.orig"
  fi
  if [[ -f "$root/made-lib-modules" ]]; then
    rmdir /lib/modules 2>/dev/null || true
    rm -f "$root/made-lib-modules"
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) [[ -S "$sock" ]] && DOCKER_HOST="unix://$sock" docker info --format '{{.ServerVersion}} {{.Driver}} {{.CgroupVersion}}' ;;
  clean) stop; rm -rf "$root" ;;
  *) log "usage: $0 start|stop|status|clean"; exit 2 ;;
esac
