"""A LoRA adapter of the tiny model (workers/tinymodel.py), made on this machine, for the LoRA tests.

Apart from tinymodel.py on purpose: that file's hash names the tiny model's cache directory, and an adapter
is no reason to build the model again.
"""

from __future__ import annotations

from pathlib import Path

from .tinymodel import _readable

# A LoRA adapter of the tiny model (make_adapter): rank, alpha and the modules it adapts, as peft names them.
ADAPTER_RANK = 8
ADAPTER_ALPHA = 16
_ADAPTED = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def make_adapter(model: Path, out: Path, seed: int = 7) -> Path:
    """A LoRA adapter of the tiny model at ``model``, written as peft writes one (adapter_config.json and
    adapter_model.safetensors, peft's tensor names) with random non-zero A and B (peft starts B at zero,
    which would change nothing), at the scale of the model's own weights, so its answers differ from the
    base model's. Light environment: numpy and safetensors only, no peft or torch."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    rng = np.random.default_rng(seed)
    std = cfg["initializer_range"]
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{_ADAPTED[name]}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, std, (ADAPTER_RANK, fan_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, std, (fan_out, ADAPTER_RANK)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model),
        "r": ADAPTER_RANK, "lora_alpha": ADAPTER_ALPHA, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(_ADAPTED), "fan_in_fan_out": False, "modules_to_save": None,
        "use_rslora": False, "use_dora": False, "inference_mode": True}, indent=2))
    _readable(out)
    return out
