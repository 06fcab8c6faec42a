"""Sample text from a trained checkpoint, streamed to stdout.

    python generate.py ckpt=<run dir or .ckpt> prompt="ROMEO:" max_new_tokens=300 \
        temperature=0.8 top_k=50 top_p=0.95 num_samples=2 seed=1

The checkpoint carries the model config and the tokenizer, so it needs nothing else.
"""

import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.tokenizer import tokenizer_from_dict
from model.generation import generate
from model.gpt import GPT, GPTConfig

T = TypeVar("T")


def exit_on_user_error(action: Callable[[], T]) -> T:
    """Run action; an error the user can fix is printed on one line and exits with status 1.

    HYDRA_FULL_ERROR=1 shows the traceback instead, as it does for Hydra's own errors.
    """
    try:
        return action()
    except (ValueError, FileNotFoundError) as error:
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


def load_checkpoint(path: Path):
    """(model in eval mode, tokenizer, hyper_parameters) from a training checkpoint.

    weights_only=True: a checkpoint holds tensors and plain data, never code to run.
    """
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        hparams = checkpoint["hyper_parameters"]
        state = checkpoint["state_dict"]
        config = GPTConfig.from_dict(hparams["model"])
        tokenizer = tokenizer_from_dict(hparams["tokenizer"])
    except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, TypeError) as error:
        raise ValueError(
            f"{path} is not a readable tinyformer checkpoint ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'truncated or foreign file'}); "
            "point ckpt= at a .ckpt written by train.py"
        ) from error
    model = GPT(config)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return model.eval(), tokenizer, hparams


@dataclass
class SamplingConfig:
    """What generate.py takes besides the checkpoint; validated before the model loads."""

    prompt: str = "\n"
    max_new_tokens: int = 300
    decoding: str = "sample"
    temperature: float = 0.8
    top_k: int | None = 50
    top_p: float | None = None
    num_samples: int = 1
    seed: int = 1
    use_cache: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens}")
        if self.decoding not in ("sample", "greedy"):
            raise ValueError(f"decoding={self.decoding!r} is not one of sample, greedy")
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
        if self.decoding == "greedy":
            return {"greedy": True}
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "generator": generator,
        }


def stream_samples(model: GPT, tokenizer, config: SamplingConfig, device: torch.device) -> None:
    """Print num_samples continuations of the prompt, token by token."""
    try:
        prompt_ids = tokenizer.encode(config.prompt)
    except ValueError as error:
        raise ValueError(f"prompt={config.prompt!r}: {error}") from None
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
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
            **config.sampling_kwargs(generator),
        )
        for token in tokens:
            print(tokenizer.decode(token.tolist()), end="", flush=True)
        print()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") or (name == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"device={name!r} is not available here: use auto, cpu or cuda")
    return torch.device(name)


def run(cfg: DictConfig) -> None:
    options = OmegaConf.to_container(cfg, resolve=True)
    checkpoint_path = resolve_checkpoint(options.pop("ckpt"))
    device = pick_device(options.pop("device"))
    config = SamplingConfig(**options)
    model, tokenizer, _ = load_checkpoint(checkpoint_path)
    torch.manual_seed(config.seed)
    stream_samples(model.to(device), tokenizer, config, device)


@hydra.main(version_base="1.3", config_path="configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(lambda: run(cfg))


if __name__ == "__main__":
    main()
