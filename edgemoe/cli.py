"""The `edgemoe` command: thin typer commands over the library. Errors in input print one line naming
the file, tensor or option, and exit with status 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from .errors import EdgeMoEError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run Mixture-of-Experts LLMs on machines too small to hold them.")


@app.callback()
def _group() -> None:
    """Run Mixture-of-Experts LLMs on machines too small to hold them."""


def _model_path(model: Optional[Path]) -> Path:
    if model is not None:
        return model
    from .bundled import bundled_model_path
    return bundled_model_path()


@app.command()
def run(
    model: Optional[Path] = typer.Argument(None, help="Checkpoint directory (default: the bundled model)."),
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue (default: start from nothing)."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", "-n"),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy (default: the model's generation_config)."),
    top_k: Optional[int] = typer.Option(None, "--top-k"),
    top_p: Optional[float] = typer.Option(None, "--top-p"),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    stop: List[str] = typer.Option([], "--stop", help="Stop when this text is produced (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
):
    """Generate text, streamed as it is produced."""
    import edgemoe

    m = edgemoe.load(_model_path(model))
    if m.tokenizer is None:
        raise EdgeMoEError(f"{model}: no tokenizer.json, cannot generate text")
    text = m.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    options = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items() if v is not None}
    if not chat:
        sys.stdout.write(prompt)
    m.generate(text, on_text=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()),
               max_new_tokens=max_new_tokens, seed=seed, stop_strings=tuple(stop), **options)
    sys.stdout.write("\n")


@app.command("eval")
def eval_(
    model: Optional[Path] = typer.Argument(None, help="Checkpoint directory (default: the bundled model)."),
    text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text file (default with the bundled "
                                        "model: its held-out eval.txt)."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Also report top-1 agreement and KL "
                                             "divergence against this model."),
    context: Optional[int] = typer.Option(None, help="Window length in tokens (default: the model's "
                                          "max_position_embeddings, at most 1024)."),
    stride: Optional[int] = typer.Option(None, help="Window step (default: context / 2)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Perplexity over a text (sliding window); with --reference, agreement and KL too."""
    import json

    import edgemoe
    from .evaluate import evaluate_text

    if text is None:
        if model is not None:
            raise typer.BadParameter("--text is required for a model other than the bundled one", param_hint="--text")
        from .bundled import bundled_text
        text = bundled_text("eval.txt")
    content = _read_text(text)
    m = edgemoe.load(_model_path(model))
    ref = edgemoe.load(reference) if reference is not None else None
    result = evaluate_text(m, content, context=context, stride=stride, reference=ref)
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    print(f"text: {text} ({result.tokens} tokens scored; context {result.context} tokens, stride {result.stride})")
    print(f"perplexity: {result.perplexity:.4f}   (nll {result.nll:.4f} nats/token)")
    if ref is not None:
        print(f"reference perplexity: {result.reference_perplexity:.4f}")
        print(f"top-1 agreement with reference: {result.top1_agreement:.4f}")
        print(f"mean KL(reference || model): {result.kl:.6f} nats/token")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EdgeMoEError(f"{path}: text file not found") from None
    except UnicodeDecodeError as e:
        raise EdgeMoEError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def main() -> None:
    try:
        app()
    except EdgeMoEError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, OSError) as e:  # bad options reaching the library, unreadable files
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
