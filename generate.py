"""Sample text from a trained checkpoint, streamed to stdout.

    python generate.py ckpt=<run dir or .ckpt> prompt="ROMEO:" max_new_tokens=300 \
        temperature=0.8 top_k=50 top_p=0.95 num_samples=2 seed=1

The checkpoint carries the model config and the tokenizer, so it needs nothing else.
"""

import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.tokenizer import tokenizer_from_dict
from errors import exit_on_user_error
from model.checkpoint import find_checkpoint, load_checkpoint
from model.encdec import EncoderDecoder
from model.generation import beam_search, decode_greedy_or_sample, decoding_ids
from model.sampling import SamplingConfig, encode, stream_samples


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
    checkpoint_path = find_checkpoint(ckpt, "best", "ckpt")
    model, hparams = load_checkpoint(checkpoint_path)
    tokenizer = tokenizer_from_dict(hparams["tokenizer"])
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
