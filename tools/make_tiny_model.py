#!/usr/bin/env python
"""Write a small random Hugging Face MoE checkpoint of a supported architecture, for tests and examples.

    python tools/make_tiny_model.py --arch mixtral --out /tmp/tiny-mixtral
    python tools/make_tiny_model.py --arch qwen2_moe --out DIR --set num_experts=6 --set norm_topk_prob=true
    python tools/make_tiny_model.py --arch olmoe --out DIR --fused-experts --shards 3
    python tools/make_tiny_model.py --arch deepseek_v3 --out DIR --set q_lora_rank=null
    python tools/make_tiny_model.py --arch gpt_oss --out DIR --mxfp4
    python tools/make_tiny_model.py --arch switch_transformers --out DIR --set expert_capacity=2

The model is built and saved by transformers itself (so it is a real checkpoint of that architecture),
with a byte-level BPE tokenizer trained on a built-in paragraph, a tokenizer_config.json with a chat
template and a generation_config.json. switch_transformers (encoder-decoder) gets its own base config
and a T5-style tokenizer that appends </s> to each input instead of starting it with <s>.
--fused-experts rewrites the experts stacked over experts ([E, 2I, D] gate_up_proj, [E, D, I]
down_proj) as some checkpoints store them; --shards splits the weights over several files with a
model.safetensors.index.json; --mxfp4 (gpt_oss) stores the experts MXFP4-quantized, as the released
GPT-OSS checkpoints do.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TEXT = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
    "arrows of outrageous fortune, or to take arms against a sea of troubles and by opposing end them. "
    "Now is the winter of our discontent made glorious summer by this sun of York. All the world's a stage, "
    "and all the men and women merely players; they have their exits and their entrances. "
)

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6)
ARCH_DEFAULTS = {
    "mixtral": dict(num_local_experts=4, intermediate_size=96),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                      intermediate_size=128),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=48, intermediate_size=128, head_dim=16),
    "olmoe": dict(num_experts=4, intermediate_size=96),
    # Multi-head latent attention: every head has its own key and value (num_key_value_heads = heads);
    # key (12 + 8) and value (20) dims differ; one dense layer first.
    "deepseek_v2": dict(n_routed_experts=6, moe_intermediate_size=32, n_shared_experts=2, intermediate_size=96,
                        first_k_dense_replace=1, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16,
                        q_lora_rank=None, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20),
    "deepseek_v3": dict(n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1, intermediate_size=96,
                        first_k_dense_replace=1, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=16,
                        q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20, n_group=4,
                        topk_group=2, routed_scaling_factor=2.5),
    "phimoe": dict(num_local_experts=4, intermediate_size=96, attention_bias=True, lm_head_bias=True),
    # Alternate sliding-window (4 positions, shorter than the tests' texts) and full attention layers.
    "gpt_oss": dict(num_local_experts=4, intermediate_size=64, head_dim=16, sliding_window=4),
    # Encoder-decoder (none of BASE's names): 4 encoder and 3 decoder layers, every other one MoE (the
    # odd layers, transformers' rule), small relative-position buckets so that the log-spaced ones are used.
    "switch_transformers": dict(d_model=64, d_kv=16, d_ff=96, num_heads=4, num_layers=4, num_decoder_layers=3,
                                num_sparse_encoder_layers=2, num_sparse_decoder_layers=1, num_experts=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                layer_norm_epsilon=1e-6, decoder_start_token_id=2),
}
SEQ2SEQ = ("switch_transformers",)


def train_tokenizer(vocab_size: int, append_eos: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    if append_eos:   # T5 style: the encoder's input ends with </s>
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))])
    else:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def parse_overrides(pairs: list[str]) -> dict:
    overrides = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def fuse_experts(out: Path) -> None:
    """Rewrite per-expert tensors as stacked gate_up_proj [E, 2I, D] and down_proj [E, D, I]."""
    path = out / "model.safetensors"
    tensors = load_file(path)
    pattern = re.compile(r"(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in list(tensors):
        m = pattern.match(name)
        if m:
            role = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}.get(m[3], "down")
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[role] = tensors.pop(name)
    for prefix, experts in groups.items():
        order = sorted(experts)
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in order])
        tensors[f"{prefix}.down_proj"] = torch.stack([experts[e]["down"] for e in order])
    save_file(tensors, path, metadata={"format": "pt"})


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., C] (C a multiple of 32) -> MXFP4 blocks uint8 [..., C/32, 16] and scales uint8 [..., C/32]:
    per block of 32 the smallest power-of-two scale that fits its largest value within +-6, then each value
    rounded to the nearest e2m1 code, stored two per byte with the low nibble first."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    table = torch.tensor(E2M1)
    codes = (scaled[..., None] - table).abs().argmin(-1).to(torch.uint8)       # [..., G, 32]
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def mxfp4_experts(out: Path) -> None:
    """Store GPT-OSS's expert matrices as the released checkpoints do: MXFP4 blocks and scales of the
    untransposed weights (gate_up [E, 2I, D], down [E, D, I]), with quantization_config mxfp4."""
    path = out / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = encode_mxfp4(tensors.pop(name).transpose(1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks.contiguous(), scales.contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))


def shard(out: Path, shards: int) -> None:
    path = out / "model.safetensors"
    tensors = load_file(path)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, out / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    path.unlink()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def make_tiny_model(out: str | Path, arch: str = "mixtral", seed: int = 0, dtype: str = "float32",
                    fused_experts: bool = False, shards: int = 1, vocab_size: int = 320, mxfp4: bool = False,
                    **overrides) -> Path:
    """Build, save and return the directory of a random `arch` checkpoint (config keys in `overrides`)."""
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seq2seq = arch in SEQ2SEQ
    tok = train_tokenizer(vocab_size, append_eos=seq2seq)
    config_cls = transformers.AutoConfig.for_model(arch).__class__
    params = {**({} if seq2seq else BASE), **ARCH_DEFAULTS[arch], **overrides}
    params.update(vocab_size=tok.get_vocab_size(), bos_token_id=tok.token_to_id("<s>"),
                  eos_token_id=tok.token_to_id("</s>"), pad_token_id=tok.token_to_id("<pad>"))
    config = config_cls(**params)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    model = auto.from_config(config)
    _randomize(model, seed)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    if fused_experts:
        fuse_experts(out)
    if mxfp4:
        mxfp4_experts(out)
    if shards > 1:
        shard(out, shards)
    return out


def _randomize(model, seed: int) -> None:
    """Give every weight a visible random value: transformers initialises some (norms, routers) to
    constants, which would hide errors in how they are applied."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights and biases
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g) if "norm" in name and name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1]) ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # DeepSeek-V3's selection-only router bias
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="mixtral", choices=sorted(ARCH_DEFAULTS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--fused-experts", action="store_true")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--mxfp4", action="store_true", help="gpt_oss: experts stored MXFP4-quantized")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config.json key (value parsed as JSON)")
    args = parser.parse_args()
    out = make_tiny_model(args.out, args.arch, args.seed, args.dtype, args.fused_experts, args.shards,
                          mxfp4=args.mxfp4, **parse_overrides(args.set))
    print(out)


if __name__ == "__main__":
    main()
