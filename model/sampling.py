"""Text from a GPT for people: the sampling options (generate.py's, and the end-of-run sample's
in train.py) and a continuation streamed to stdout as it is generated."""

from dataclasses import InitVar, dataclass

import torch

from errors import check, check_field_types, check_int, check_seed
from model.generation import Tokenizer, generate
from model.gpt import GPT

SEPARATOR = "-" * 40  # the line between two samples


@dataclass
class SamplingConfig:
    """What generate.py takes besides the checkpoint (and train.py's `sample.*`); validated
    before the model loads."""

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
    cuda_graph: bool = False  # GPT on a GPU: replay the KV-cache steps as CUDA graphs
    compile: bool = False  # with cuda_graph: the step's forward pass compiled before capture
    attention_plot: str | None = None  # PNG of the attention: GPT self-, encoder-decoder cross-
    # Where the user sets these options, for the messages: "" for generate.py, "sample." for
    # train.py, whose fix hints must name its own keys.
    key_prefix: InitVar[str] = ""

    def __post_init__(self, prefix: str) -> None:
        check_field_types(self, prefix)
        check_int(f"{prefix}max_new_tokens", self.max_new_tokens, minimum=0)
        if self.decoding not in ("sample", "greedy", "beam"):
            raise ValueError(
                f"{prefix}decoding={self.decoding!r} is not one of sample, greedy, beam"
            )
        check_int(f"{prefix}beam_size", self.beam_size)
        if not self.temperature > 0:
            raise ValueError(
                f"{prefix}temperature must be > 0, got {self.temperature}: use "
                f"{prefix}decoding=greedy for argmax"
            )
        check_int(f"{prefix}top_k", self.top_k, optional=True)
        top_p = self.top_p
        check(top_p is None or 0.0 < top_p <= 1.0, f"{prefix}top_p", "in (0, 1] or null", top_p)
        check_int(f"{prefix}num_samples", self.num_samples)
        check_seed(f"{prefix}seed", self.seed)
        if self.cuda_graph and not self.use_cache:
            raise ValueError(
                f"{prefix}cuda_graph=true replays a KV-cache step: it needs "
                f"{prefix}use_cache=true (or drop {prefix}cuda_graph)"
            )
        if self.compile and not self.cuda_graph:
            raise ValueError(
                f"{prefix}compile=true compiles the step that {prefix}cuda_graph=true replays: add "
                f"{prefix}cuda_graph=true (or drop {prefix}compile)"
            )
        if not self.prompt:
            raise ValueError(
                f'{prefix}prompt is empty: give at least one character, e.g. {prefix}prompt="\\n"'
            )

    def check_device(self, device: torch.device) -> None:
        """cuda_graph=true decodes on a GPU only: on the CPU each step would read the whole
        block instead of the positions so far."""
        if self.cuda_graph and device.type != "cuda":
            raise ValueError(
                f"cuda_graph=true needs a GPU, and decoding runs on {device.type}: use "
                "device=cuda on a machine with one, or drop cuda_graph"
            )

    def sampling_kwargs(self, generator: torch.Generator) -> dict:
        if self.decoding != "sample":
            return {"greedy": True}
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "generator": generator,
        }


def encode(tokenizer: Tokenizer, text: str, key: str, masks: bool = False) -> list[int]:
    """`text` as token ids; a character the tokenizer lacks names the option `key` it came from.
    With `masks`, each "<mask>" in the text is the mask token (an encoder-decoder's source)."""
    try:
        return tokenizer.encode_with_masks(text) if masks else tokenizer.encode(text)
    except ValueError as error:
        raise ValueError(f"{key}={text!r}: {error}") from None


def stream_samples(
    model: GPT, tokenizer: Tokenizer, config: SamplingConfig, device: torch.device
) -> list[list[int]]:
    """Print num_samples continuations of the prompt, token by token; return their ids."""
    config.check_device(device)
    prompt = torch.tensor([encode(tokenizer, config.prompt, "prompt")], device=device)
    generator = torch.Generator(device=device).manual_seed(config.seed)
    samples = []
    for index in range(config.num_samples):
        if index:
            print("\n" + SEPARATOR)
        print(config.prompt, end="", flush=True)
        tokens = generate(
            model,
            prompt,
            config.max_new_tokens,
            use_cache=config.use_cache,
            static_cache=config.cuda_graph,
            compile_step=config.compile,
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
        samples.append(ids)
    return samples
