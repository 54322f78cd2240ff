"""The configurator's analytic estimate against the discrete-event simulator (simulator/simulate.py).

For a few disaggregated layouts, the simulator serves Poisson arrivals at the request rate the estimate
says the layout carries (fixed ISL/OSL, no prefix reuse, the same performance models, prefill workers
taking one prompt at a time as the emitted YAML configures them), and its TTFT and ITL at the SLO
percentile must agree with the analytic ones.

Tolerance: 15% on TTFT p90 and on ITL p90 (3000 requests, the first 10% dropped as warm-up). The analytic
side approximates the prefill queue as M/D/c (Allen-Cunneen on Erlang C) and the decode batch at the
percentile as its mean plus z x sqrt(mean); on these layouts the simulator comes out 1-9% above the
analytic figures.
The simulator has no aggregated (co-located) mode, so aggregated layouts are checked by the physical
bounds in test_configurator.py only.
"""

from __future__ import annotations

import random
import pytest

from disagg.configurator import Inputs
from disagg.configurator import estimate as est
from disagg.simulator.simulate import SimConfig, Simulation, StaticPolicy, _pct
from disagg.simulator.traces import Request, Trace

TOLERANCE = 0.15
REQUESTS = 3000

LAYOUTS = [
    # (inputs, prefill TP, decode TP, decode workers, batch per decode worker)
    (dict(model="meta-llama/Llama-3.1-8B-Instruct", gpu="h100", gpus=8, ttft_ms=1000), 1, 1, 1, 96),
    (dict(model="meta-llama/Llama-3.1-8B-Instruct", gpu="h100", gpus=8, ttft_ms=1000), 1, 1, 2, 64),
    (dict(model="Qwen/Qwen2.5-32B-Instruct", gpu="h200", gpus=16, ttft_ms=500), 4, 2, 1, 48),
    (dict(model="Qwen/Qwen2.5-32B-Instruct", gpu="h200", gpus=16, ttft_ms=500, interconnect="ethernet"),
     2, 4, 1, 24),
]


@pytest.mark.parametrize("kw,tp_p,tp_d,y,b", LAYOUTS, ids=["8b-1d-b96", "8b-2d-b64", "32b-tp4p-tp2d", "32b-roce"])
def test_analytic_estimate_agrees_with_the_simulator(kw, tp_p, tp_d, y, b):
    inputs = Inputs(**{**dict(isl=3000, osl=150, itl_ms=50), **kw})
    setup = est.Setup.of(inputs)
    e = est.least_prefill(setup, est._prefill(setup, tp_p, tp_d), tp_d, est._decode(setup, tp_d, b), y, b)
    assert e is not None and 0.4 < e.prefill_utilization < 0.95
    rate = e.request_rate / e.replicas           # one xPyD unit
    rng = random.Random(7)
    t, requests = 0.0, []
    for _ in range(REQUESTS):
        t += rng.expovariate(rate)
        requests.append(Request(t, inputs.isl, inputs.osl))
    config = SimConfig(prefill_tp=tp_p, decode_tp=tp_d, percentile=inputs.percentile, interval=1e9,
                       initial_prefill=e.prefill_workers, initial_decode=y, max_num_seqs=10 ** 6,
                       max_batch_tokens=inputs.isl, ttft_target=inputs.ttft_ms / 1000, itl_target=inputs.itl_ms / 1000)
    sim = Simulation(config, Trace("fixed-lengths", tuple(requests)), StaticPolicy(e.prefill_workers, y))
    # the configurator's models: tensor-parallel all-reduces, the chosen interconnect (lanes: min of both TPs)
    sim.prefill_model = _with_transfer(setup.model(tp_p), e.kv_transfer_s, inputs.isl)
    sim.decode_model = setup.model(tp_d)
    result = sim.run()
    assert result.finished == REQUESTS
    warm = REQUESTS // 10
    ttft = _pct(result.ttft[warm:], inputs.percentile)
    itl = _pct(result.itl[warm:], inputs.percentile)
    print(f"{e.layout} b={b}: TTFT p90 sim/analytic {ttft / e.ttft_s:.3f}, ITL p90 {itl / e.itl_s:.3f}")
    assert ttft == pytest.approx(e.ttft_s, rel=TOLERANCE), f"{e.layout}: TTFT sim {ttft:.3f}s vs {e.ttft_s:.3f}s"
    assert itl == pytest.approx(e.itl_s, rel=TOLERANCE), f"{e.layout}: ITL sim {itl * 1e3:.1f}ms vs {e.itl_s * 1e3:.1f}ms"


def _with_transfer(model, seconds: float, isl: int):
    """The simulator moves KV with the prefill model's own lanes; give it the estimate's (min of both TPs)."""
    class Model(type(model)):
        def kv_transfer_time_tokens(self, tokens: float) -> float:
            return seconds * tokens / isl if tokens else 0.0

    return Model(**{f: getattr(model, f) for f in model.__dataclass_fields__})
