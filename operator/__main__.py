"""`python -m disagg.operator`: run the operator (all namespaces unless --namespace)."""

from __future__ import annotations

import argparse
import asyncio

import kopf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m disagg.operator")
    parser.add_argument("--namespace", action="append", help="watch only these namespaces (repeatable)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="liveness endpoint URL")
    args = parser.parse_args(argv)
    from . import memory

    memory.install()  # opt-in report (DISAGG_OPERATOR_MEMORY); tracing starts in handlers.startup
    from . import handlers  # registers the handlers

    handlers.NAMESPACES[:] = args.namespace or []

    asyncio.run(kopf.operator(clusterwide=not args.namespace, namespaces=args.namespace or (),
                              standalone=True, liveness_endpoint=args.liveness))


if __name__ == "__main__":
    main()
