#!/usr/bin/env python
"""Write a Mixtral-shaped Hugging Face checkpoint with random weights, one tensor at a time.

    python tools/make_synthetic_model.py --out /data/synthetic-3b            # the default shape below
    python tools/make_synthetic_model.py --out DIR --layers 4 --hidden 256 --expert-hidden 896

Default shape (about 3B parameters, about 6 GB in bf16): hidden 1024, expert hidden 3584, 32 layers,
8 experts, top-2, 16 heads, 4 KV heads, vocab 32000. Memory stays bounded by one tensor: the
safetensors file is written tensor by tensor. The weights are random (std 1/sqrt(fan_in), norms 1):
a model for measuring speed and memory, not quality. With --replay (edgemoe bench) its routers are
replaced by a real model's recorded routing. A byte-level BPE tokenizer makes it a loadable
checkpoint; it covers the first few hundred ids (the rest decode to nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch

from edgemoe.checkpoint import write_safetensors


def _tiny_tool():
    spec = importlib.util.spec_from_file_location("make_tiny_model", Path(__file__).with_name("make_tiny_model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mixtral_config(args) -> dict:
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": args.vocab,
        "hidden_size": args.hidden, "intermediate_size": args.expert_hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "num_local_experts": args.experts,
        "num_experts_per_tok": args.top_k, "max_position_embeddings": args.max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "sliding_window": None, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    }


def tensor_plan(c: dict, seed: int) -> list:
    """(name, dtype, shape, produce) for every tensor, in file order; produce() draws it when written."""
    D, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head = D // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head
    generator = torch.Generator().manual_seed(seed)

    def random(shape):
        return lambda: (torch.randn(shape, generator=generator) / shape[-1] ** 0.5).to(torch.bfloat16)

    def ones(shape):
        return lambda: torch.ones(shape, dtype=torch.bfloat16)

    plan = [("model.embed_tokens.weight", (V, D), random), ("model.norm.weight", (D,), ones),
            ("lm_head.weight", (V, D), random)]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        plan += [(p + "input_layernorm.weight", (D,), ones), (p + "post_attention_layernorm.weight", (D,), ones),
                 (p + "self_attn.q_proj.weight", (D, D), random), (p + "self_attn.k_proj.weight", (kv, D), random),
                 (p + "self_attn.v_proj.weight", (kv, D), random), (p + "self_attn.o_proj.weight", (D, D), random),
                 (p + "block_sparse_moe.gate.weight", (c["num_local_experts"], D), random)]
        for e in range(c["num_local_experts"]):
            q = p + f"block_sparse_moe.experts.{e}."
            plan += [(q + "w1.weight", (I, D), random), (q + "w3.weight", (I, D), random),
                     (q + "w2.weight", (D, I), random)]
    return [(name, "BF16", shape, make(shape)) for name, shape, make in plan]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-hidden", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = mixtral_config(args)
    start = time.perf_counter()
    plan = tensor_plan(config, args.seed)
    write_safetensors(out / "model.safetensors", plan)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    tiny = _tiny_tool()
    tokenizer = tiny.train_tokenizer(512)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "chat_template": tiny.CHAT_TEMPLATE}))
    params = sum(torch.Size(shape).numel() for _, _, shape, _ in plan)
    print(f"{out}: {params / 1e6:.1f}M parameters, {(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB, "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
