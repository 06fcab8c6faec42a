"""Score a trained checkpoint on a whole corpus: every block or pair of it, in batches.

    python evaluate.py ckpt=<run dir or .ckpt>            # the validation split it trained on
    python evaluate.py ckpt=<run dir> data=text_files 'data.paths=[held_out.txt]'
    python evaluate.py ckpt=<run dir> data=hub data.name=wikitext \
        data.config=wikitext-2-raw-v1 data.split=test

A GPT gets its loss (nats per token), perplexity and bits per character; an encoder-decoder its
loss, perplexity, and the exact match and character error rate of its greedy decodes. A table
goes to stdout and the same as JSON to out= (default: eval_<data>.json in the checkpoint's run
directory). The checkpoint carries the model and its tokenizer; Lightning and W&B never load.
"""

import json
import math
import sys
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from torch.utils.data import DataLoader
from tqdm import tqdm

from data.files import disk_full_cause, write_text_atomic
from data.lm_text import (
    TOKENIZER_OPTIONS,
    LMDataConfig,
    TokenBlocks,
    eval_documents,
    token_stream,
    whole_batch,
)
from data.local_files import from_launch_dir_or_here
from data.metrics import character_error_rate
from data.seq2seq_text import (
    IGNORE_INDEX,
    PairDataset,
    Seq2SeqDataConfig,
    collate_pairs,
    eval_pairs,
)
from data.sources import progress_bars_on_terminals_only
from data.tokenizer import tokenizer_from_dict
from errors import (
    check,
    check_field_types,
    check_int,
    check_known,
    check_writable,
    config_from,
    override_key,
    run_command,
)
from kinds import KINDS, ModelKind
from model.checkpoint import (
    EXPORT_CONFIG,
    find_checkpoint,
    is_export,
    load_checkpoint,
    pick_device,
    run_dir_of,
)
from model.encdec import EncoderDecoder
from model.generation import decode_greedy_or_sample, decoding_ids
from model.gpt import GPT

# The table's rows after the checkpoint and the data: (label, result key, format).
ROWS = (
    ("loss", "loss", "{:.4f} nats/token"),
    ("perplexity", "perplexity", "{:.3f}"),
    ("bits/char", "bits_per_char", "{:.4f}"),
    ("exact match", "exact_match", "{:.4f}"),
    ("CER", "cer", "{:.4f}"),
    ("pairs", "pairs", "{:,}"),
    ("tokens", "tokens", "{:,}"),
    ("characters", "characters", "{:,}"),
    ("dropped", "characters_dropped", "{:,} characters the tokenizer has no id for"),
)


@dataclass
class EvalConfig:
    """evaluate.py's own options (data.* are the data's: see configs/data/)."""

    batch_size: int = 32  # blocks or pairs per forward pass
    out: str | None = None  # the JSON file; None: eval_<data>.json in the run directory

    def __post_init__(self) -> None:
        check_field_types(self, "")
        check_int("batch_size", self.batch_size)
        check(self.out is None or bool(self.out), "out", "a file path or null", self.out)


def data_config(
    cfg: DictConfig, kind: ModelKind, hparams: dict, shown: str
) -> LMDataConfig | Seq2SeqDataConfig:
    """The checked data options: data=<choice>'s, with the data configs' interpolations of
    model.* filled from the checkpoint's model; without data=, its run's own (run_data), or the
    kind's default data for a checkpoint that records none. `shown` names the checkpoint in
    messages."""
    choice = HydraConfig.get().runtime.choices.get("data")
    node = cfg.get("data")
    given_target = node.get("_target_") if node is not None else None
    if given_target is not None and given_target != kind.datamodule:
        raise ValueError(
            f"data={choice} is data for the other kind of model and {shown} is {kind.label}: "
            f"score it on {kind.eval_data_choices}, or leave data= out for its validation split"
        )
    given = {override_key(o) for o in HydraConfig.get().overrides.task}
    tokenizer_option = next((key for key in TOKENIZER_OPTIONS if key in given), None)
    if tokenizer_option is not None:
        raise ValueError(
            f"{tokenizer_option}={OmegaConf.select(cfg, tokenizer_option)}: evaluate.py scores "
            f"{shown} with its own tokenizer, the one its weights were trained with; drop "
            f"{tokenizer_option}"
        )
    with open_dict(cfg):
        cfg.model = hparams["model"]  # what ${model.block_size} and the like read
    options = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    options.pop("_target_", None)
    which = f"data={choice}" if choice else "the default data"
    if choice is None:
        trained = run_data(kind, hparams)
        defaults = {
            **(trained or kind.eval_default),
            **{key: hparams["model"][key] for key in kind.lengths},
            "cache_dir": cfg.paths.cache_dir,
        }
        if trained:  # checked alone first: a failure here is the run's data, not the command's
            try:
                config_from(kind.data_options, defaults, "data.", which)
            except (ValueError, FileNotFoundError) as error:
                moved = "put them back, run evaluate.py in the moved project's directory, or "
                hint = moved if isinstance(error, FileNotFoundError) else ""
                raise type(error)(
                    f"the data {shown} trained on: {error} ({hint}score other text with "
                    f"{kind.eval_data_choices})"
                ) from None
        options = {**defaults, **options}  # +data.key=value on the command line
    config = config_from(kind.data_options, options, "data.", which)
    # Without data=, evaluate.yaml has no data node: the command line adds its keys, with `+`.
    setting = "data." if choice else "+data."
    for key in kind.lengths:  # positions beyond the model's were never trained
        given, limit = getattr(config, key), hparams["model"][key]
        if given > limit:
            raise ValueError(
                f"data.{key}={given} is more than the checkpoint's model.{key}={limit}, the "
                f"longest it was trained on; set {setting}{key}={limit} or less"
            )
    return config


def run_data(kind: ModelKind, hparams: dict) -> dict | None:
    """The data options the checkpoint's run trained with, as evaluate.py scores them by default
    (its validation split), or None for a checkpoint that does not record them. The tokenizer's
    are left out: the checkpoint's own tokenizer scores, whichever file its run read it from.
    Its files are read where the run read them, or, where nothing is there any more but is
    here, here (the project has moved), with a line on stderr saying so."""
    data = (hparams.get("run_config") or {}).get("data")
    if not data or data.get("_target_") != kind.datamodule:
        return None
    ignored = {"_target_", *(key.removeprefix("data.") for key in TOKENIZER_OPTIONS)}
    known = {field.name for field in fields(kind.data_options)}
    options = {key: value for key, value in data.items() if key in known - ignored}
    launch_dir = hparams["run_config"].get("launch_dir")  # absent from older checkpoints
    if launch_dir is None:
        return options
    read, notes = from_launch_dir_or_here(options, Path(launch_dir), Path.cwd())
    for note in notes:
        print(note, file=sys.stderr)
    return read


def progress(loader: DataLoader) -> tqdm:
    """The batches, with a progress bar on a terminal when scoring takes more than 2 s."""
    return tqdm(loader, desc="scoring", unit="batch", leave=False, delay=2, disable=None)


@torch.inference_mode()
def score_gpt(
    model: GPT,
    tokenizer,
    config: LMDataConfig,
    batch_size: int,
    device: torch.device,
    as_trained: bool = False,
) -> dict:
    """Loss, perplexity and bits per character over non-overlapping blocks of the text, as
    training validates: each token after the first is scored once, with the tokens before it
    in its block as context (the last partial block is left out, as in training). The text is
    eval_documents's: `as_trained`, text files' validation split as training cut it for the
    model's block size, rather than all of them.

    The softmax is over the tokenizer's ids only: the rows that pad a model.vocab_size beyond
    them are never sampled (generate.py) and a format=hf export has none, so a model and its
    exports get one loss. Training's val/loss counts them, and is higher by their share."""
    trained_block_size = model.config.block_size if as_trained else None
    documents, shown = eval_documents(config, trained_block_size)
    tokens, dropped = token_stream(tokenizer, documents)
    block = config.block_size
    if len(tokens) < block + 1:
        raise ValueError(
            f"{shown} has {len(tokens)} tokens, fewer than one block of data.block_size={block} "
            "and the token after it; score more text or lower data.block_size"
        )
    blocks = DataLoader(
        TokenBlocks(tokens, block, stride=block), batch_size, collate_fn=whole_batch
    )
    token_chars = torch.tensor(tokenizer.token_char_counts(), device=device)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    chars = torch.zeros((), dtype=torch.int64, device=device)
    count = 0
    for x, y in progress(blocks):
        x, y = x.to(device), y.to(device)
        logits, _ = model(x)
        loss = F.cross_entropy(logits[..., : tokenizer.vocab_size].flatten(0, 1), y.flatten())
        nats += loss.double() * y.numel()  # the loss is a mean over the batch's tokens
        chars += token_chars[y].sum()
        count += y.numel()
    loss, chars = float(nats) / count, int(chars)
    return {
        "data": shown,
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_char": float(nats) / chars / math.log(2),
        "tokens": count,
        "characters": chars,
        "characters_dropped": dropped,
    }


@torch.inference_mode()
def score_encdec(
    model: EncoderDecoder,
    tokenizer,
    config: Seq2SeqDataConfig,
    batch_size: int,
    device: torch.device,
    as_trained: bool = False,
) -> dict:
    """Loss and perplexity over every target token (teacher-forced, as training validates), and
    exact match and character error rate of greedy decodes of every pair: eval_pairs's,
    `as_trained` the validation pairs its run drew from its pairs rather than all of them."""
    (sources, targets), dropped, shown = eval_pairs(config, tokenizer, as_trained)
    if len(sources) == 0:
        raise ValueError(f"{shown} holds no pair with a source this tokenizer can encode")
    ids = decoding_ids(tokenizer)
    collate = partial(
        collate_pairs, pad_id=tokenizer.pad_id, bos_id=ids["bos_id"], eos_id=ids["eos_id"]
    )
    batches = DataLoader(PairDataset(sources, targets), batch_size, collate_fn=collate)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    scored = torch.zeros((), dtype=torch.int64, device=device)
    predictions = []
    for batch in progress(batches):
        batch = {key: value.to(device) for key, value in batch.items()}
        source, source_mask = batch["source"], batch["source_mask"]
        _, loss = model(
            source, batch["target_in"], source_mask, batch["target_mask"], batch["target_out"]
        )
        targets_scored = (batch["target_out"] != IGNORE_INDEX).sum()
        nats += loss.double() * targets_scored  # the loss is a mean over the scored targets
        scored += targets_scored
        predictions += decode_greedy_or_sample(
            model,
            source,
            source_mask,
            **ids,
            max_new_tokens=model.config.max_target_len,
            greedy=True,
        )
    references = [targets[i].tolist() for i in range(len(targets))]
    exact = sum(p == r for p, r in zip(predictions, references, strict=True)) / len(references)
    loss = float(nats) / int(scored)
    return {
        "data": shown,
        "loss": loss,
        "perplexity": math.exp(loss),
        "exact_match": exact,
        "cer": character_error_rate(predictions, references),
        "pairs": len(references),
        "tokens": int(scored),
        "characters_dropped": dropped,
    }


def default_out(checkpoint: Path, name: str) -> Path:
    """eval_<name>.json in the checkpoint's run directory: above its checkpoints/ folder, else
    the folder holding it (an export is a folder itself)."""
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    return (run_dir_of(folder) or folder) / f"eval_{name}.json"


# The keys every result of evaluate.py holds: an existing out= file with them may be replaced.
RESULT_KEYS = {"checkpoint", "kind", "data", "loss"}
# A result is a few hundred bytes; a bigger file is something else, and is not read whole.
RESULT_MAX_BYTES = 1_000_000


def earlier_result(path: Path) -> bool:
    """Whether the file `path` holds an earlier result of evaluate.py, which a new one may
    replace."""
    try:
        if path.stat().st_size > RESULT_MAX_BYTES:
            return False
        result = json.loads(path.read_bytes())
    except (OSError, ValueError):  # unreadable, not JSON, or not text: a checkpoint, say
        return False
    return isinstance(result, dict) and RESULT_KEYS <= result.keys()


def check_out(out: Path, shown: str) -> None:
    """Refuse an `out` (named `shown` in messages) that the result could not be written to, or
    whose writing would replace a saved file: before scoring, which may take long."""
    if out.is_dir():
        raise ValueError(
            f"{shown} is a directory: give a .json file's path, e.g. out={out / 'eval.json'}"
        )
    folder = out.absolute().parent  # out=x.json given inside a checkpoints/ folder too
    if run_dir_of(folder) not in (None, folder):
        raise ValueError(
            f"{shown} lies in a run's checkpoints/ folder, which holds its checkpoints only: "
            "leave out= out to write eval_<data>.json in the run directory, or give a .json "
            "path elsewhere"
        )
    if out.name == EXPORT_CONFIG and is_export(folder):
        raise ValueError(f"{shown} is an export's config: give a .json path outside the export")
    if out.suffix.lower() != ".json":
        raise ValueError(f"{shown} is not a .json path: give a file name ending in .json")
    if out.is_file() and not earlier_result(out):
        raise ValueError(
            f"{shown} holds a file that is not an earlier result of evaluate.py (a checkpoint, "
            "a run's summary.json...): give a new .json path, or remove that file"
        )
    check_writable(out, shown, "give out= a .json path in a folder you can write to")


def report(result: dict, out: Path) -> None:
    """The result as JSON in `out` and the table on stdout: the file first, so that a reader
    of stdout that stops early (`| head -3`) costs no result."""
    lines = [("checkpoint", f"{result['checkpoint']} ({result['kind']})"), ("data", result["data"])]
    lines += [(label, form.format(result[key])) for label, key, form in ROWS if key in result]
    width = max(len(label) for label, _ in lines)
    table = "\n".join(f"{label:<{width}}  {value}" for label, value in lines)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # A new file renamed over the old: never written in place, so that a hard link of it
        # elsewhere keeps its content, and a failed write leaves the earlier result whole.
        write_text_atomic(out, json.dumps(result, indent=2) + "\n")
    except OSError as error:
        if disk_full_cause(error) is None:
            raise
        print(table)
        raise ValueError(
            f"no space left on the disk of {out.parent} to write {out.name} (nothing there "
            "was replaced; the table above holds the result): free some space, or give out= "
            "on another disk"
        ) from None
    print(table)
    # Flushed here, where a reader gone is caught, rather than at exit, where it is not.
    print(f"written to {out}", flush=True)


def run(cfg: DictConfig) -> dict:
    # `+foo=1` adds a key nothing reads
    names = ["ckpt", "device", *(field.name for field in fields(EvalConfig)), "paths", "data"]
    check_known(cfg, names, "", "evaluate.py")
    options = EvalConfig(batch_size=cfg.batch_size, out=cfg.out)  # before anything is loaded
    device = pick_device(cfg.device)
    checkpoint = find_checkpoint(cfg.get("ckpt"), "best", "ckpt")  # None where not given
    model, hparams = load_checkpoint(checkpoint)
    kind = hparams.get("kind", "gpt")
    config = data_config(cfg, KINDS[kind], hparams, str(checkpoint))
    choice = HydraConfig.get().runtime.choices.get("data")
    name = choice or "val"
    if getattr(config, "split", None) == "test":  # a Hub dataset's, given or the run's own
        name = f"{choice}_test" if choice else "test"
    out = Path(options.out).expanduser() if options.out else default_out(checkpoint, name)
    check_out(out, f"out={options.out}" if options.out else f"the default out={out}")
    tokenizer = tokenizer_from_dict(hparams["tokenizer"])
    score = score_gpt if kind == "gpt" else score_encdec
    result = {"checkpoint": str(checkpoint), "kind": kind}
    # Without data=, the run's own validation split, whichever data gave it one
    as_trained = choice is None
    result |= score(model.to(device), tokenizer, config, options.batch_size, device, as_trained)
    result["data_config"] = asdict(config)
    report(result, out)
    return result


@hydra.main(version_base="1.3", config_path="configs", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    progress_bars_on_terminals_only()
    run_command(lambda: run(cfg))


if __name__ == "__main__":
    main()
