"""A tiny llama written locally: random weights of ordinary scale.

``load_format="dummy"`` initialises weights near zero, and then the greedy
tokens barely depend on the context, so KV from the wrong request hardly
changes them. With weights of ordinary scale (query and key projections
large enough that attention is sharp) the output depends on the context:
a request that loads poisoned KV generates different tokens. The checkpoint
is a pure function of its seed. Runs inside a vLLM venv (needs torch and
safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from journal import atomic_output

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write(folder: Path, seed: int = 0) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``folder`` unless present."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / "model.safetensors"
    if weights.exists() and (folder / "config.json").exists():
        return folder
    g = torch.Generator().manual_seed(seed)
    c = CONFIG
    h, inter, heads, kv, hd = (
        c["hidden_size"],
        c["intermediate_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    tensors = {"model.embed_tokens.weight": normal(c["vocab_size"], h, std=1.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # q and k at twice the usual scale: sharp attention, context-dependent output
        tensors[p + "self_attn.q_proj.weight"] = normal(heads * hd, h, std=2 / h**0.5)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv * hd, h, std=2 / h**0.5)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv * hd, h, std=1 / h**0.5)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, heads * hd, std=1 / (heads * hd) ** 0.5)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, h, std=1 / h**0.5)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, h, std=1 / h**0.5)
        tensors[p + "mlp.down_proj.weight"] = normal(h, inter, std=1 / inter**0.5)
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
    tensors["model.norm.weight"] = torch.ones(h)
    tensors["lm_head.weight"] = normal(c["vocab_size"], h, std=1 / h**0.5)
    # Written to temporary names and renamed, so a half-written model never loads.
    for name, write_to in (
        ("config.json", lambda f: f.write_text(json.dumps(CONFIG, indent=2) + "\n")),
        ("model.safetensors", lambda f: save_file(tensors, str(f))),
    ):
        with atomic_output(folder / name, force=True) as tmp:
            write_to(Path(tmp))
    return folder
