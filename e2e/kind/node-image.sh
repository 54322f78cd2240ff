#!/usr/bin/env bash
# Builds the kind node image into the running Docker engine (engine.sh) and prints its name. No registry
# serves kindest/node here, so it is made the way the project's other images are: a Debian base from
# mmdebstrap (systemd, dbus, Debian's runc, CNI plugins, iptables and nftables) plus the project's own
# builds: containerd, ctr and the runc shim (build-node.sh), kubelet, kubeadm, kubectl and crictl
# (build-node.sh, build.sh, e2e/localcluster/build.sh), capsrunc (build.sh). It follows what kind
# expects of a node image: systemd as init behind an entrypoint (node/entrypoint), containerd on
# /run/containerd/containerd.sock, a kubelet unit kubeadm configures, /kind/version,
# /kind/manifests/default-cni.yaml and default-storage.yaml, and the images kubeadm runs already in
# containerd's k8s.io namespace (node/disagg-kind-preload imports them at boot). Those images are made
# here from the same binaries, one static binary each (kube-proxy with nft and its libraries):
# kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy and etcd at the pinned versions,
# CoreDNS at COREDNS_VERSION (the cluster config points kubeadm at that tag), pause (pause.c).
# The image's tag hashes its inputs; a present image is reused.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
lc="$here/../localcluster"
# shellcheck source=../localcluster/versions.env
source "$lc/versions.env"
# shellcheck source=../localcluster/cache.sh
source "$lc/cache.sh"
# shellcheck source=../images/versions.env
source "$here/../images/versions.env"
log() { echo "[kind-node-image] $*" >&2; }

k8s_bin="$(bash "$lc/build.sh")"
node_bin="$(bash "$lc/build-node.sh")"
kind_bin="$(bash "$here/build.sh")"
etcd_version="$("$k8s_bin/etcd" --version | sed -n 's/^etcd Version: //p')"
inputs="$( (cat "$here/node-image.sh" "$here"/node/*; echo "$k8s_bin $node_bin $kind_bin") | sha256sum | cut -c1-12)"
image="disagg.local/kind-node:${KUBERNETES_VERSION}-${inputs}"
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "$image"
  exit 0
fi

mkdir -p "$cache_root/tmp"
work="$(mktemp -d "$cache_root/tmp/kind-node.XXXXXX")"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"

# mkimage DIR NAME:TAG OUT ENTRYPOINT-JSON: a one-layer image of DIR, saved as a docker archive to OUT.
mkimage() {
  local dir="$1" ref="$2" out="$3" entrypoint="$4"
  mkdir -p "$dir/tmp" "$dir/etc" "$dir/var/run"
  chmod 1777 "$dir/tmp"
  tar -C "$dir" --owner=0 --group=0 -c . | docker import \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin' \
    --change "ENTRYPOINT $entrypoint" - "$ref" >/dev/null
  docker save "$ref" -o "$out"
  docker rmi "$ref" >/dev/null
}

# The Debian part is cached (a tarball keyed on the package list and mirrors): it changes far less often
# than the files below.
packages=systemd,systemd-sysv,dbus,runc,containernetworking-plugins,iptables,nftables,iproute2,ethtool,socat,conntrack,kmod,ca-certificates,procps,util-linux,mount,bash
debian_key="$(echo "$packages $DEBIAN_SUITE $DEBIAN_MIRROR $DEBIAN_SECURITY_MIRROR" | sha256sum | cut -c1-12)"
debian_tar="$cache_root/images/kind-node-debian/$debian_key.tar"
if [[ ! -f "$debian_tar" ]]; then
  log "making the node's Debian ${DEBIAN_SUITE} with mmdebstrap"
  mkdir -p "$(dirname "$debian_tar")"
  nice -n 19 mmdebstrap --mode=auto --variant=minbase --format=tar --quiet --include="$packages" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    "$DEBIAN_SUITE" "$work/debian.tar" "deb $DEBIAN_MIRROR $DEBIAN_SUITE main" \
    "deb $DEBIAN_SECURITY_MIRROR $DEBIAN_SUITE-security main" >&2
  rm -f "$(dirname "$debian_tar")"/*.tar  # an older package list's
  mv "$work/debian.tar" "$debian_tar"
fi
mkdir -p "$rootfs"
tar -C "$rootfs" --numeric-owner -xf "$debian_tar"

log "adding the project's binaries and kind's node files"
install -m 755 "$node_bin"/{containerd,containerd-shim-runc-v2,ctr,kubelet} "$k8s_bin/kubectl" \
  "$kind_bin"/{kubeadm,crictl} "$here/node/entrypoint" "$here/node/disagg-kind-preload" \
  "$here/node/disagg-kind-net" "$here/node/disagg-kind-kubelet-cgroups" "$rootfs/usr/local/bin/"
install -m 755 "$kind_bin/capsrunc" "$rootfs/usr/local/sbin/"
install -D -m 644 "$here/node/containerd.toml" "$rootfs/etc/containerd/config.toml"
for unit in containerd.service kubelet.service disagg-kind-preload.service disagg-kind-net.service; do
  install -m 644 "$here/node/$unit" "$rootfs/etc/systemd/system/$unit"
  ln -sf "/etc/systemd/system/$unit" "$rootfs/etc/systemd/system/multi-user.target.wants/$unit"
done
# units that have nothing to do in a container, and the console login prompt
for unit in getty.target systemd-udevd.service systemd-modules-load.service sys-kernel-debug.mount \
  sys-kernel-tracing.mount sys-kernel-config.mount systemd-firstboot.service; do
  ln -sf /dev/null "$rootfs/etc/systemd/system/$unit"
done
ln -sf /lib/systemd/system/multi-user.target "$rootfs/etc/systemd/system/default.target"
printf 'runtime-endpoint: unix:///run/containerd/containerd.sock\nimage-endpoint: unix:///run/containerd/containerd.sock\n' \
  >"$rootfs/etc/crictl.yaml"
: >"$rootfs/etc/machine-id"
mkdir -p "$rootfs/kind/manifests" "$rootfs/kind/images/node" "$rootfs/kind/images/control-plane" "$rootfs/etc/cni/net.d"
echo "$KUBERNETES_VERSION" >"$rootfs/kind/version"
cp "$here/node/default-cni.yaml" "$here/node/default-storage.yaml" "$rootfs/kind/manifests/"

log "making the images kubeadm runs"
for c in kube-apiserver kube-controller-manager kube-scheduler etcd; do
  d="$work/img-$c"; mkdir -p "$d/usr/local/bin"
  if [[ $c == etcd ]]; then cp "$k8s_bin/etcd" "$d/usr/local/bin/"; tag="${etcd_version}-0"; else cp "$k8s_bin/$c" "$d/usr/local/bin/"; tag="$KUBERNETES_VERSION"; fi
  mkimage "$d" "registry.k8s.io/$c:$tag" "$rootfs/kind/images/control-plane/$c.tar" "[\"/usr/local/bin/$c\"]"
  rm -rf "$d"
done
d="$work/img-kube-proxy"; mkdir -p "$d/usr/local/bin" "$d/usr/sbin"
cp "$node_bin/kube-proxy" "$d/usr/local/bin/"
cp "$rootfs/usr/sbin/nft" "$d/usr/sbin/"
# nft's shared libraries, from the node's own Debian
for lib in $(chroot "$rootfs" ldd /usr/sbin/nft | awk '/=>/ {print $3} /ld-linux/ {print $1}'); do
  mkdir -p "$d$(dirname "$lib")"; cp -L "$rootfs$lib" "$d$lib"
done
[[ -e "$d/lib64" ]] || ln -s usr/lib64 "$d/lib64" 2>/dev/null || true
mkimage "$d" "registry.k8s.io/kube-proxy:$KUBERNETES_VERSION" "$rootfs/kind/images/node/kube-proxy.tar" '["/usr/local/bin/kube-proxy"]'
d="$work/img-coredns"; mkdir -p "$d"; cp "$node_bin/coredns" "$d/coredns"
mkimage "$d" "registry.k8s.io/coredns/coredns:$COREDNS_VERSION" "$rootfs/kind/images/node/coredns.tar" '["/coredns"]'
d="$work/img-pause"; mkdir -p "$d"; cp "$node_bin/pause" "$d/pause"
mkimage "$d" "registry.k8s.io/pause:3.10.2" "$rootfs/kind/images/node/pause.tar" '["/pause"]'

log "importing $image"
tar -C "$rootfs" --numeric-owner -c . | docker import \
  --change 'ENV container=docker' \
  --change 'ENTRYPOINT ["/usr/local/bin/entrypoint"]' - "$image" >/dev/null
echo "$image"
