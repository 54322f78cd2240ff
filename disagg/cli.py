"""The ``disagg`` command. Subcommands grow with the components."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _crds(args: argparse.Namespace) -> int:
    from disagg.api import crd

    directory, templates = Path(args.dir), Path(args.chart_templates)
    if args.check:
        failed = 0
        for where, rendered in ((directory, crd.render()), (templates, crd.render_chart_templates())):
            stale = [name for name, content in rendered.items()
                     if not (where / name).exists() or (where / name).read_text() != content]
            if stale:
                print(f"{where}: out of date with disagg/api: {', '.join(stale)}; run `make crds`", file=sys.stderr)
                failed = 1
        return failed
    for path in [*crd.write(directory), *crd.write_chart_templates(templates)]:
        print(f"wrote {path}")
    return 0


def _harness(module: str):
    """A module of the local cluster and demo harness (``disagg.e2e``), which only a source checkout has: the
    images' wheel leaves it out (Dockerfile), so there ``disagg cluster`` and ``disagg demo`` say so."""
    import importlib

    try:
        return importlib.import_module(f"disagg.e2e.{module}")
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("disagg.e2e"):
            raise
        raise SystemExit(f"disagg: this command runs the local cluster harness (disagg.e2e), which this "
                         f"installation does not include; run it from a source checkout (make demo)") from None


def _cluster(args: argparse.Namespace) -> int:
    cluster = _harness("localcluster").LocalCluster(args.name, real_node=args.real_node)
    if args.action == "up":
        cluster.up(nodes_file=Path(args.nodes) if args.nodes else None)
        node = cluster.node
        print(f"cluster {args.name!r} is up; use it with:\n  export KUBECONFIG={cluster.kubeconfig}"
              + (f"\nreal node: containerd at {node.containerd_socket} (namespace {node.containerd_namespace})"
                 if node else ""))
    elif args.action == "down":
        cluster.down()
        print(f"cluster {args.name!r} is down")
    elif args.action == "status":
        running = cluster.running()
        print(f"cluster {args.name!r}: {'running' if running else 'not running'}"
              + (f"\n  export KUBECONFIG={cluster.kubeconfig}" if running else ""))
        return 0 if running else 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    return _harness("demo").run(cluster_name=args.cluster)


def _simulate(args: argparse.Namespace) -> int:
    from disagg.simulator import simulate

    return simulate.run_cli(args, REPO)


def _serve(args: argparse.Namespace) -> int:
    if not args.local:
        print("only `disagg serve --local` is available; in Kubernetes, apply a DisaggDeployment", file=sys.stderr)
        return 2
    from disagg.workers.local import serve_local

    return serve_local(port=args.port, model=args.model, once=args.once,
                       otlp_traces_endpoint=args.otlp_traces_endpoint)


def _profile(args: argparse.Namespace) -> int:
    from disagg.perf import profile

    return profile.run_cli(args)


def _configure(args: argparse.Namespace) -> int:
    from disagg.configurator import cli

    return cli.run_cli(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg", description="Disaggregated LLM serving on Kubernetes.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("crds", help="write crds/ and the chart's InferencePool CRD from the API models (or --check "
                                    "for drift)")
    p.add_argument("--dir", default=str(REPO / "crds"))
    p.add_argument("--chart-templates", default=str(REPO / "charts" / "disagg" / "templates"),
                   help="where the chart's generated templates go (the InferencePool CRD)")
    p.add_argument("--check", action="store_true", help="exit 1 if crds/ differs from the models")
    p.set_defaults(func=_crds)

    p = sub.add_parser("cluster", help="the local control plane with simulated GPU node pools and one real node")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--name", default="default", help="cluster name (one state directory each)")
    p.add_argument("--nodes", help="node pool file (default: e2e/clusters/default.yaml)")
    p.add_argument("--no-real-node", dest="real_node", action="store_false",
                   help="up: only simulated nodes, no containerd/kubelet on this machine (one real node per machine)")
    p.set_defaults(func=_cluster)

    p = sub.add_parser("demo", help="bring up the local cluster and show the API at work")
    p.add_argument("--cluster", default="default")
    p.set_defaults(func=_demo)

    p = sub.add_parser("simulate", help="simulate a P/D deployment on a trace under the planner or a baseline")
    from disagg.simulator.simulate import add_arguments as _simulate_arguments
    _simulate_arguments(p)
    p.set_defaults(func=_simulate)

    p = sub.add_parser("profile", help="measure a running worker and write the planner's performance profile")
    from disagg.perf.profile import add_arguments as _profile_arguments
    _profile_arguments(p)
    p.set_defaults(func=_profile)

    p = sub.add_parser("configure", help="aggregated vs disaggregated layouts for a model, GPUs and SLO: "
                                         "frontiers, CSV, PNG and the best layout's DisaggDeployment (--serve: web page)")
    from disagg.configurator.cli import add_arguments as _configure_arguments
    _configure_arguments(p)
    p.set_defaults(func=_configure)

    p = sub.add_parser("serve", help="prefill + decode workers and the router on this machine (--local)")
    p.add_argument("--local", action="store_true", help="run everything as local processes (CPU, tiny model)")
    p.add_argument("--port", type=int, default=8080, help="the router's port")
    p.add_argument("--model", help="model directory (default: the generated tiny model)")
    p.add_argument("--once", action="store_true", help="exit after the first answer")
    p.add_argument("--otlp-traces-endpoint", help="trace every request (router and both vLLM workers) to this "
                                                  "OTLP/gRPC endpoint, e.g. a local Jaeger's http://127.0.0.1:4317")
    p.set_defaults(func=_serve)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
