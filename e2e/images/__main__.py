"""``python -m disagg.e2e.images --containerd-socket PATH``: build (or reuse) the images, print their
references as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from .build import TARGETS, ensure_images


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.e2e.images", description=__doc__)
    p.add_argument("--containerd-socket", required=True, help="the containerd to build into")
    p.add_argument("--namespace", default="k8s.io", help="containerd namespace (the kubelet's: k8s.io)")
    p.add_argument("--target", action="append", choices=TARGETS, help="build only these (default: all)")
    p.add_argument("--ctr", help="containerd's ctr client (default: the local node's)")
    args = p.parse_args(argv)
    refs = ensure_images(args.containerd_socket, args.namespace, tuple(args.target or TARGETS), ctr=args.ctr,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(refs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
