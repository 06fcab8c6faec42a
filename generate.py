"""Sample text from a trained checkpoint, streamed to stdout.

    python generate.py ckpt=<run dir or .ckpt> prompt="ROMEO:" max_new_tokens=300 \
        temperature=0.8 top_k=50 top_p=0.95 num_samples=2 seed=1

The checkpoint carries the model config and the tokenizer, so it needs nothing else.
"""

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.tokenizer import BPETokenizer, CharTokenizer, tokenizer_from_dict
from model.checkpoint import load_checkpoint
from model.config import check_field_types
from model.encdec import EncoderDecoder
from model.generation import beam_search, decode_greedy_or_sample, decoding_ids, generate
from model.gpt import GPT

T = TypeVar("T")


# What a user's config or input causes; the message names the value and the fix.
USER_ERRORS = (ValueError, FileNotFoundError)


def exit_on_user_error(
    action: Callable[[], T], errors: tuple[type[Exception], ...] = USER_ERRORS
) -> T:
    """Run action; an error of `errors` (one the user can fix) is printed on one line and exits
    with status 1.

    HYDRA_FULL_ERROR=1 shows the traceback instead, as it does for Hydra's own errors.
    """
    try:
        return action()
    except errors as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


def resolve_checkpoint(path: str) -> Path:
    """A .ckpt file as given, or for a run directory its best checkpoint (else last.ckpt)."""
    given = Path(path).expanduser()
    if given.is_file():
        return given
    if given.is_dir():
        folder = given / "checkpoints" if (given / "checkpoints").is_dir() else given
        best = sorted(folder.glob("best*.ckpt"), key=lambda p: p.stat().st_mtime)
        candidates = best or sorted(folder.glob("last*.ckpt")) or sorted(folder.glob("*.ckpt"))
        if candidates:
            return candidates[-1]
        raise FileNotFoundError(
            f"no .ckpt file in {given} or {given}/checkpoints: "
            "pass ckpt=<run dir> of a run that saved checkpoints, or ckpt=<file.ckpt>"
        )
    raise FileNotFoundError(
        f"checkpoint {path} does not exist: pass ckpt=<run dir> (runs live under outputs/) "
        "or ckpt=<file.ckpt>"
    )


def load_run(path: Path) -> tuple[GPT | EncoderDecoder, CharTokenizer | BPETokenizer, dict]:
    """(model in eval mode, tokenizer, hyper_parameters) from a training checkpoint."""
    model, hparams = load_checkpoint(path)
    return model, tokenizer_from_dict(hparams["tokenizer"]), hparams


@dataclass
class SamplingConfig:
    """What generate.py takes besides the checkpoint; validated before the model loads."""

    prompt: str = "\n"
    source: str | None = None  # encoder-decoder input
    max_new_tokens: int = 300
    decoding: str = "sample"  # sample | greedy | beam (beam: encoder-decoder only)
    beam_size: int = 4
    length_penalty: float = 1.0
    temperature: float = 0.8
    top_k: int | None = 50
    top_p: float | None = None
    num_samples: int = 1
    seed: int = 1
    use_cache: bool = True
    attention_plot: str | None = None  # encoder-decoder: PNG of the decode's cross-attention

    def __post_init__(self) -> None:
        check_field_types(self, "")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens}")
        if self.decoding not in ("sample", "greedy", "beam"):
            raise ValueError(f"decoding={self.decoding!r} is not one of sample, greedy, beam")
        if not isinstance(self.beam_size, int) or self.beam_size < 1:
            raise ValueError(f"beam_size must be a positive integer, got {self.beam_size}")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0, got {self.temperature}: use decoding=greedy for argmax"
            )
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive integer or null, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or null, got {self.top_p}")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {self.num_samples}")
        if not self.prompt:
            raise ValueError('prompt is empty: give at least one character, e.g. prompt="\\n"')

    def sampling_kwargs(self, generator: torch.Generator) -> dict:
        if self.decoding != "sample":
            return {"greedy": True}
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "generator": generator,
        }


def encode(tokenizer, text: str, key: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except ValueError as error:
        raise ValueError(f"{key}={text!r}: {error}") from None


def stream_samples(model: GPT, tokenizer, config: SamplingConfig, device: torch.device) -> None:
    """Print num_samples continuations of the prompt, token by token."""
    if config.decoding == "beam":
        raise ValueError("decoding=beam is for encoder-decoder checkpoints: use sample or greedy")
    prompt = torch.tensor([encode(tokenizer, config.prompt, "prompt")], device=device)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    for index in range(config.num_samples):
        if index:
            print("\n" + "-" * 40)
        print(config.prompt, end="", flush=True)
        tokens = generate(
            model,
            prompt,
            config.max_new_tokens,
            use_cache=config.use_cache,
            vocab_size=tokenizer.vocab_size,
            **config.sampling_kwargs(generator),
        )
        # Decode the whole continuation each step and print what is new: a character that
        # byte-level BPE splits over several tokens appears once all of its bytes have.
        ids, shown = [], ""
        for token in tokens:
            ids += token.tolist()
            text = tokenizer.decode(ids)
            if not text.endswith("\ufffd"):
                print(text[len(shown) :], end="", flush=True)
                shown = text
        print(tokenizer.decode(ids)[len(shown) :])


def translate(
    model: EncoderDecoder, tokenizer, config: SamplingConfig, device: torch.device
) -> list[list[int]]:
    """Decode the source num_samples times (once for greedy and beam); print each output."""
    source_ids = encode(tokenizer, config.source, "source")
    limit = model.config.max_source_len
    if not 0 < len(source_ids) <= limit:
        raise ValueError(
            f"source has {len(source_ids)} tokens; this model reads 1 to model.max_source_len="
            f"{limit}: shorten it"
        )
    source = torch.tensor([source_ids], device=device)
    ids = decoding_ids(tokenizer)
    if config.decoding == "beam":
        outputs = beam_search(
            model,
            source,
            None,
            max_new_tokens=config.max_new_tokens,
            beam_size=config.beam_size,
            length_penalty=config.length_penalty,
            **ids,
        )
    else:
        generator = torch.Generator(device=device).manual_seed(config.seed)
        repeats = config.num_samples if config.decoding == "sample" else 1
        outputs = decode_greedy_or_sample(
            model,
            source.expand(repeats, -1),
            None,
            max_new_tokens=config.max_new_tokens,
            use_cache=config.use_cache,
            **ids,
            **config.sampling_kwargs(generator),
        )
    for output in outputs:
        print(tokenizer.decode(output))
    if config.attention_plot:
        save_cross_attention(model, tokenizer, source_ids, outputs[0], config.attention_plot)
    return outputs


def save_cross_attention(
    model: EncoderDecoder, tokenizer, source_ids: list[int], output: list[int], path: str
) -> None:
    """Plot every decoder layer's cross-attention while it reads back its own decode."""
    target_in = [tokenizer.bos_id, *output][: model.config.max_target_len]
    device = next(model.parameters()).device
    source = torch.tensor([source_ids], device=device)
    target = torch.tensor([target_in], device=device)
    from model.inspect import plot_heads, record_attention  # matplotlib: only when plotting

    records = record_attention(model, lambda: model(source, target))
    cross = [r for r in records if r.name.endswith("cross_attn")]

    def labels(ids: list[int]) -> list[str]:
        return [tokenizer.decode([i], skip_special=False) for i in ids]

    figure = plot_heads(cross, labels(target_in), labels(source_ids), "cross-attention")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    print(f"cross-attention map saved to {path}", file=sys.stderr)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") or (name == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"device={name!r} is not available here: use auto, cpu or cuda")
    return torch.device(name)


def run(cfg: DictConfig) -> None:
    options = OmegaConf.to_container(cfg, resolve=True)
    ckpt, device = options.pop("ckpt"), pick_device(options.pop("device"))
    config = SamplingConfig(**options)  # bad options fail before anything is loaded
    checkpoint_path = resolve_checkpoint(ckpt)
    model, tokenizer, _ = load_run(checkpoint_path)
    model = model.to(device)
    torch.manual_seed(config.seed)
    if isinstance(model, EncoderDecoder):
        if config.source is None:
            raise ValueError(
                f'{checkpoint_path} is an encoder-decoder: give the input as source="..."'
            )
        translate(model, tokenizer, config, device)
    else:
        if config.source is not None or config.attention_plot:
            raise ValueError(
                f'{checkpoint_path} is a GPT: continue a prompt="..." (source= and '
                "attention_plot= are for encoder-decoder checkpoints)"
            )
        stream_samples(model, tokenizer, config, device)


@hydra.main(version_base="1.3", config_path="configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    try:
        exit_on_user_error(lambda: run(cfg))
    except KeyboardInterrupt:  # Ctrl-C: the text so far stays on screen, no traceback
        print(file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
