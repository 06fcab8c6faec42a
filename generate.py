"""Sample text from a trained checkpoint or export, streamed to stdout.

    python generate.py ckpt=<run dir, .ckpt or export> prompt="ROMEO:" max_new_tokens=300 \
        temperature=0.8 top_k=50 top_p=0.95 num_samples=2 seed=1
    python generate.py ckpt=<...> prompt_file=prompt.txt     # the file's text is the prompt
    echo "ROMEO:" | python generate.py ckpt=<...> prompt=-    # so is stdin's
    python generate.py ckpt=<...> interactive=true           # a continuation per line of stdin
    python generate.py ckpt=<...> attention_plot=attn.png    # and the sample's attention maps

The checkpoint carries the model config and the tokenizer, so it needs nothing else.
"""

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.tokenizer import tokenizer_from_dict
from errors import (
    USER_ERRORS,
    check,
    check_field_types,
    check_known,
    check_writable,
    run_command,
)
from model.checkpoint import find_checkpoint, load_checkpoint, pick_device
from model.encdec import EncoderDecoder
from model.figures import plot_heads
from model.generation import beam_search, decode_greedy_or_sample, decoding_ids
from model.gpt import GPT
from model.inspect import head_maps, record_attention, self_attention_figure, token_labels
from model.sampling import SEPARATOR, SamplingConfig, encode, stream_samples

if TYPE_CHECKING:  # matplotlib loads when a figure is drawn
    from matplotlib.figure import Figure


# What attention_plot= may be saved as (matplotlib's formats, those through Pillow included).
FIGURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps")


@dataclass
class Inputs:
    """Where the text comes from, checked before anything loads: prompt= ("-": stdin),
    prompt_file=, or interactive=true, a prompt per line of stdin; an encoder-decoder reads
    source= instead, or a source per line."""

    prompt: str | None = None  # null: a newline
    prompt_file: str | None = None
    interactive: bool = False
    source: str | None = None
    attention_plot: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "")
        if self.prompt is not None and self.prompt_file is not None:
            raise ValueError(
                f"prompt={self.prompt!r} and prompt_file={self.prompt_file} both give the "
                "prompt: keep one"
            )
        if self.attention_plot is not None:  # checked now, not after the decoding
            plot = Path(self.attention_plot).expanduser()
            suffix = plot.suffix.lower().removeprefix(".")
            formats = ", ".join(f".{f}" for f in FIGURE_FORMATS)
            check(
                suffix in FIGURE_FORMATS,
                "attention_plot",
                f"an image path ending in {formats}",
                self.attention_plot,
            )
            if plot.is_dir():
                raise ValueError(
                    f"attention_plot={self.attention_plot} is a folder: give the image's path, "
                    f"e.g. {plot / 'attention.png'}"
                )
            check_writable(
                plot, f"attention_plot={self.attention_plot}", "give a path you can write to"
            )
        if not self.interactive:
            return
        for key in ("prompt", "prompt_file", "source"):
            if getattr(self, key) is not None:
                raise ValueError(
                    f"interactive=true reads its input from stdin, one a line: drop "
                    f"{key}={getattr(self, key)!r}"
                )
        if self.attention_plot is not None:
            raise ValueError(
                f"attention_plot={self.attention_plot} draws one prompt's attention and "
                "interactive=true reads many: drop one of them"
            )

    def prompt_text(self) -> str:
        """The prompt given, stdin's text for prompt=-, or the file's, exactly (a final newline
        included); a newline when none is given."""
        if self.prompt_file is not None:
            path = Path(self.prompt_file).expanduser()
            if not self.prompt_file.strip():  # prompt_file=$FILE with FILE unset
                raise ValueError("prompt_file= is empty: give a text file's path, or drop it")
            if path.is_dir():
                raise ValueError(f"prompt_file={self.prompt_file} is a folder: give a text file")
            if not path.is_file():
                raise FileNotFoundError(f"prompt_file={self.prompt_file}: no file at {path}")
            # bytes decoded, not read_text: its newlines stay as they are (\r\n too); utf-8-sig:
            # a byte-order mark that starts the file (Windows editors write one) is not text,
            # as data.paths reads it
            try:
                text, key = path.read_bytes().decode("utf-8-sig"), "prompt_file"
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"prompt_file={self.prompt_file} is not UTF-8 text ({error.reason}): save "
                    "it as UTF-8"
                ) from None
        elif self.prompt == "-":
            text, key = sys.stdin.read().removeprefix("\ufeff"), "prompt=- (stdin)"
        else:
            return "\n" if self.prompt is None else self.prompt
        if not text:
            raise ValueError(f"{key} gave an empty prompt: give at least one character")
        return text

    def check_model(self, model: GPT | EncoderDecoder, path: Path) -> None:
        """The inputs of a GPT are prompts, an encoder-decoder's sources."""
        if not isinstance(model, EncoderDecoder):
            if self.source is not None:
                raise ValueError(
                    f'{path} is a GPT: continue a prompt="..." (source= is for '
                    "encoder-decoder checkpoints)"
                )
        elif self.prompt is not None or self.prompt_file is not None:
            raise ValueError(
                f'{path} is an encoder-decoder: give its input as source="..." (prompt= and '
                "prompt_file= are for GPT checkpoints)"
            )
        elif self.source is None and not self.interactive:
            raise ValueError(
                f'{path} is an encoder-decoder: give the input as source="..." (or one a '
                "line on stdin with interactive=true)"
            )


def stdin_lines() -> Iterator[str]:
    """Lines of stdin as they come, without their line ending: a newline, or a carriage return
    and a newline (a file saved on Windows; a char tokenizer knows no carriage return); on a
    terminal "> " asks for each."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line.removesuffix("\n").removesuffix("\r")


def translate(
    model: EncoderDecoder, tokenizer, config: SamplingConfig, device: torch.device
) -> list[list[int]]:
    """Decode the source num_samples times (once for greedy and beam); print each output. A
    "<mask>" in the source is the mask token that span corruption trained the model to fill."""
    if not config.source:
        raise ValueError('source is empty: give the text to decode from, e.g. source="..."')
    source_ids = encode(tokenizer, config.source, "source", masks=True)
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
    for index, output in enumerate(outputs):
        if index:  # as between a GPT's samples: a decode may hold newlines of its own
            print("\n" + SEPARATOR)
        print(tokenizer.decode(output))
    if config.attention_plot:
        save_cross_attention(model, tokenizer, source_ids, outputs[0], config.attention_plot)
    return outputs


def continue_prompt(
    model: GPT, tokenizer, config: SamplingConfig, device: torch.device
) -> list[list[int]]:
    """Stream num_samples continuations of the prompt; plot the first one's attention."""
    outputs = stream_samples(model, tokenizer, config, device)
    if config.attention_plot:
        prompt = encode(tokenizer, config.prompt, "prompt")
        ids = (prompt + outputs[0])[-model.config.block_size :]  # what the model can read
        boundary = max(0, len(ids) - len(outputs[0]))  # the first generated token
        title = f"self-attention: prompt ({len(prompt)} tokens), continuation ({len(outputs[0])})"
        figure = self_attention_figure(
            model, torch.tensor(ids, device=device), token_labels(tokenizer, ids), title, boundary
        )
        save_figure(figure, config.attention_plot, "attention map")
    return outputs


def save_cross_attention(
    model: EncoderDecoder, tokenizer, source_ids: list[int], output: list[int], path: str
) -> None:
    """Plot every decoder layer's cross-attention while it reads back its own decode."""
    target_in = [tokenizer.bos_id, *output][: model.config.max_target_len]
    device = next(model.parameters()).device
    source = torch.tensor([source_ids], device=device)
    target = torch.tensor([target_in], device=device)
    records = record_attention(model, lambda: model(source, target))
    cross = [head_maps(r) for r in records if r.name.endswith("cross_attn")]
    labels = token_labels(tokenizer, target_in), token_labels(tokenizer, source_ids)
    save_figure(plot_heads(cross, *labels, "cross-attention"), path, "cross-attention map")


def save_figure(figure: "Figure", path: str, what: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    print(f"{what} saved to {path}", file=sys.stderr)


def run(cfg: DictConfig) -> None:
    options = OmegaConf.to_container(cfg, resolve=True)
    names = [
        "ckpt",
        "device",
        *(f.name for f in fields(Inputs)),
        *(f.name for f in fields(SamplingConfig)),
    ]
    check_known(options, list(dict.fromkeys(names)), "", "generate.py")  # `+foo=1` adds one
    ckpt, device = options.pop("ckpt"), pick_device(options.pop("device"))
    inputs = Inputs(
        **{key: options.pop(key) for key in ("prompt", "prompt_file", "interactive")},
        source=options["source"],
        attention_plot=options["attention_plot"],
    )
    config = SamplingConfig(**options)  # bad options fail before anything is loaded
    config.check_device(device)
    if not inputs.interactive:
        config = replace(config, prompt=inputs.prompt_text())
    checkpoint_path = find_checkpoint(ckpt, "best", "ckpt")
    model, hparams = load_checkpoint(checkpoint_path)
    inputs.check_model(model, checkpoint_path)
    # Before any input is read: interactive=true would otherwise fail each line alike.
    if config.decoding == "beam" and not isinstance(model, EncoderDecoder):
        raise ValueError(
            f"decoding=beam is for encoder-decoder checkpoints; {checkpoint_path} is a GPT: use "
            "decoding=sample or greedy"
        )
    if config.cuda_graph and isinstance(model, EncoderDecoder):
        raise ValueError(
            f"cuda_graph=true is for GPT checkpoints; {checkpoint_path} is an encoder-decoder: "
            "drop cuda_graph"
        )
    tokenizer = tokenizer_from_dict(hparams["tokenizer"])
    model = model.to(device)
    torch.manual_seed(config.seed)
    respond, field = (
        (translate, "source") if isinstance(model, EncoderDecoder) else (continue_prompt, "prompt")
    )
    if not inputs.interactive:
        respond(model, tokenizer, config, device)
        return

    def answer(line: str) -> None:
        respond(model, tokenizer, replace(config, **{field: line}), device)

    if not answer_each_line(answer):
        sys.exit(1)


def answer_each_line(answer: Callable[[str], None]) -> bool:
    """answer() each line of stdin (an empty one as a newline), a separator between answers,
    until EOF. A line that fails (say, with a character the tokenizer lacks) gets its one-line
    error and the next line its answer; returns whether every line succeeded."""
    succeeded = True
    for index, line in enumerate(stdin_lines()):
        if index:
            print("\n" + SEPARATOR, flush=True)
        try:
            answer(line or "\n")
        except USER_ERRORS as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            succeeded = False
    return succeeded


@hydra.main(version_base="1.3", config_path="configs", config_name="generate")
def main(cfg: DictConfig) -> None:
    run_command(lambda: run(cfg))


if __name__ == "__main__":
    main()
