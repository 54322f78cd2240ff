"""``disagg configure --serve``: a small local page with the CLI's inputs, both frontiers drawn as an
interactive chart, and each point's figures and DisaggDeployment YAML.

The page posts its form to ``/api/configure``, which runs :func:`disagg.configurator.configure` (the
CLI's code path, no second model) and answers both frontiers with every point's YAML, validated as the
CLI validates it. The chart is inline SVG drawn by the page's own script (no CDN, works offline).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web

from disagg.perf import model as pm

from . import manifest, report
from .estimate import Estimate, Inputs, Result, configure

STATIC = Path(__file__).resolve().parent / "static"
FORM_FIELDS = ("model", "gpu", "gpus", "isl", "osl", "ttft_ms", "itl_ms", "percentile", "interconnect",
               "prefix_reuse", "precision")


def _point(result: Result, e: Estimate, pid: str) -> dict[str, Any]:
    d = e.to_dict()
    d["id"] = pid
    d["best"] = e == result.best
    d["yaml"] = manifest.to_yaml(result, e)
    d["name"] = manifest.default_name(result, e)
    return d


def answer(result: Result) -> dict[str, Any]:
    """What the page draws: both frontiers (every point with its YAML), the best point, the gains."""
    agg = [_point(result, e, f"agg-{n}") for n, e in enumerate(result.aggregated)]
    dis = [_point(result, e, f"disagg-{n}") for n, e in enumerate(result.disaggregated)]
    best = next((p["id"] for p in agg + dis if p["best"]), None)
    return {"summary": result.summary(), "aggregated": agg, "disaggregated": dis, "best": best,
            "gains": [{"tokens_per_s_per_user": s, "aggregated": a, "disaggregated": d, "ratio": r}
                      for s, a, d, r in report.gains(result)],
            "table": report.table(result)}


def options(defaults: Any = None) -> dict[str, Any]:
    gpus = pm._load("gpus.yaml")
    form = {"model": "Qwen/Qwen2.5-32B-Instruct", "gpu": "h200", "gpus": 16, "isl": 3000, "osl": 150,
            "ttft_ms": 500, "itl_ms": 50, "percentile": 90, "interconnect": "infiniband", "prefix_reuse": 0,
            "precision": "bf16"}
    if defaults is not None:
        for k in FORM_FIELDS:
            v = getattr(defaults, k, None)
            if v is not None:
                form[k] = v
    return {"models": pm.known_models(),
            "gpus": [{"name": k, "aliases": v.get("aliases", [])} for k, v in gpus["gpus"].items()],
            "interconnects": [{"name": k, "aliases": v.get("aliases", [])} for k, v in gpus["interconnects"].items()],
            "defaults": form}


def make_app(defaults: Any = None) -> web.Application:
    """The page's application; ``defaults`` (the CLI's arguments) fill the form and carry --calibration,
    --profile and the search limits, which the page does not change."""
    fixed = {k: getattr(defaults, k) for k in ("calibration", "profile", "max_batch", "max_batched_tokens", "max_tp",
                                               "gpus_per_node", "domain_gpus", "max_data")
             if defaults is not None and getattr(defaults, k, None) is not None}

    async def index(_: web.Request) -> web.Response:
        return web.Response(text=(STATIC / "index.html").read_text(), content_type="text/html")

    async def get_options(_: web.Request) -> web.Response:
        return web.json_response(options(defaults))

    async def post_configure(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("send the form as a JSON object")
            unknown = set(body) - set(FORM_FIELDS)
            if unknown:
                raise ValueError(f"unknown inputs: {', '.join(sorted(unknown))}")
            inputs = Inputs.from_mapping({**body, **fixed})
            result = await asyncio.to_thread(configure, inputs)
            return web.json_response(await asyncio.to_thread(answer, result))
        except (KeyError, ValueError, TypeError, json.JSONDecodeError, FileNotFoundError) as e:
            return web.json_response({"error": str(e.args[0]) if e.args else str(e)}, status=400)

    app = web.Application()
    app.add_routes([web.get("/", index), web.get("/api/options", get_options),
                    web.post("/api/configure", post_configure)])
    return app


def serve(host: str = "127.0.0.1", port: int = 8090, defaults: Any = None) -> None:
    print(f"disagg configure: serving on http://{host}:{port}/ (Ctrl-C to stop)", flush=True)
    web.run_app(make_app(defaults), host=host, port=port, print=None)
