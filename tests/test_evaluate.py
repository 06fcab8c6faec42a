"""evaluate.py end to end: it reproduces the validation metrics a run logged (GPT on the embedded
plays and on a Hub dataset's own split, encoder-decoder on pairs), scores whole files and a Hub
dataset's test split, and turns mistakes into one line."""

import json
import math
import os
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from data.lm import BPE_SPECIALS
from data.lm_text import LMDataConfig
from data.local_files import from_launch_dir
from data.pairs import split_rows
from data.seq2seq import SPECIALS
from data.seq2seq_text import Seq2SeqDataConfig, collate_pairs
from data.tokenizer import BPETokenizer, CharTokenizer, tokenizer_from_dict
from evaluate import run_data, score_encdec, score_gpt
from export import ExportOptions, export
from helpers import (
    BOS,
    EOS,
    PAD,
    ROOT,
    SMALLEST_BASE,
    read_only,
    run_script,
    run_unread,
    save_checkpoint,
    sharpened,
    small_disk,
    tiny_encdec,
    tiny_gpt,
    train_run,
    write_hub_dataset,
)
from kinds import KINDS
from model.checkpoint import load_checkpoint

# One worker runs this file (pytest-xdist --dist loadgroup), so its module fixtures train once.
pytestmark = pytest.mark.xdist_group("evaluate_runs")

# Ten steps, then one validation of every block: the val/loss evaluate.py must reproduce.
FULL_VALIDATION = [
    "trainer.max_steps=10",
    "trainer.val_check_interval=10",
    "trainer.limit_val_batches=1.0",
    "logger=none",
]
TINY_ENCDEC = [
    "model=encdec",
    "model.n_encoder_layer=1",
    "model.n_decoder_layer=1",
    "model.n_embd=32",
    "model.max_source_len=32",
    "model.max_target_len=33",
    "data=pairs",
    "data.batch_size=8",
    "trainer.num_sanity_val_steps=0",
    "callbacks.attention_maps.sample_length=16",
]
WORDS = "the quick brown fox jumps over a lazy dog and cat".split()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, cache) -> Path:
    run_dir = tmp_path_factory.mktemp("gpt_run")
    # Not the default val_fraction: evaluate.py must take the run's to score its validation text.
    overrides = [*SMALLEST_BASE, *FULL_VALIDATION, "data.val_fraction=0.15"]
    return train_run(run_dir, *overrides, cache_dir=cache)


@pytest.fixture(scope="module")
def hub_dataset(tmp_path_factory) -> Path:
    """A dataset in the Hub's layout with train, validation and test splits of sentences."""
    rng = np.random.default_rng(0)
    rows = [" ".join(rng.choice(WORDS, 12)) + "." for _ in range(600)]
    folder = tmp_path_factory.mktemp("hub") / "dataset"
    return write_hub_dataset(
        folder, {"train": rows[:400], "validation": rows[400:500], "test": rows[500:]}
    )


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory, cache, hub_dataset) -> Path:
    run_dir = tmp_path_factory.mktemp("hub_run")
    data = ["data=hub", f"data.name={hub_dataset}", "data.tokenizer=char", "data.num_proc=1"]
    return train_run(run_dir, *SMALLEST_BASE, *data, *FULL_VALIDATION, cache_dir=cache)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    sources = [" ".join(rng.choice(WORDS, 4)) for _ in range(80)]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    rows = [{"source": s, "target": s.upper()} for s in sources]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def encdec_run(tmp_path_factory, cache, pairs_file) -> Path:
    run_dir = tmp_path_factory.mktemp("encdec_run")
    overrides = [*TINY_ENCDEC, f"data.paths=[{pairs_file}]", *FULL_VALIDATION]
    return train_run(run_dir, *overrides, cache_dir=cache)


def evaluate(cache: Path, *overrides: str, cwd: Path = ROOT) -> dict:
    """Run evaluate.py from `cwd`, check that it succeeded, and return the JSON it wrote."""
    result = run_script("evaluate.py", *overrides, cache_dir=cache, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    written = result.stdout.strip().splitlines()[-1].removeprefix("written to ")
    return {**json.loads(Path(written).read_text()), "stdout": result.stdout, "out": written}


def last_validation(run_dir: Path) -> dict:
    history = json.loads((run_dir / "summary.json").read_text())["history"]
    return [row for row in history if "val/loss" in row][-1]


def test_bits_per_char_counts_the_characters_each_bpe_token_stands_for(tmp_path):
    paragraphs = ["But soft, what light through yonder window breaks?"] * 12
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n\n".join(paragraphs))
    tokenizer = BPETokenizer.train(paragraphs, 300, BPE_SPECIALS)
    model = tiny_gpt(tokenizer.vocab_size)  # a 16-token block
    config = LMDataConfig(
        source="text_files", paths=[str(held_out)], block_size=16, cache_dir=str(tmp_path)
    )
    scored = score_gpt(model, tokenizer, config, batch_size=4, device=torch.device("cpu"))
    windows = torch.tensor(tokenizer.encode("\n\n".join(paragraphs))).unfold(0, 17, 16)
    with torch.no_grad():
        _, loss = model(windows[:, :-1], windows[:, 1:])
    chars = int(torch.tensor(tokenizer.token_char_counts())[windows[:, 1:]].sum())
    assert scored["tokens"] == windows[:, 1:].numel() < chars == scored["characters"]
    assert scored["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert scored["bits_per_char"] == pytest.approx(
        loss.item() * scored["tokens"] / chars / math.log(2), rel=1e-5
    )


def test_a_padded_vocabulary_gets_the_loss_of_its_exports_over_the_tokenizers_ids(tmp_path):
    pytest.importorskip("transformers")  # format=hf
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\n" * 3
    (tmp_path / "held_out.txt").write_text(text)
    tokenizer = CharTokenizer.from_text(text)
    padded = sharpened(tiny_gpt(64))  # 40 rows beyond the tokenizer's 24, never sampled
    checkpoint = save_checkpoint(padded, tokenizer, tmp_path / "padded.ckpt")
    for format in ("safetensors", "hf"):  # hf cuts the padding rows
        export(ExportOptions(ckpt=str(checkpoint), out=str(tmp_path / format), format=format))
    config = LMDataConfig(
        source="text_files",
        paths=[str(tmp_path / "held_out.txt")],
        block_size=16,
        cache_dir=str(tmp_path / "cache"),
    )
    cpu = torch.device("cpu")
    losses = {
        path.name: score_gpt(load_checkpoint(path)[0], tokenizer, config, 4, cpu)["loss"]
        for path in (checkpoint, tmp_path / "safetensors", tmp_path / "hf")
    }
    assert load_checkpoint(tmp_path / "hf")[0].config.vocab_size == tokenizer.vocab_size
    assert losses["padded.ckpt"] == pytest.approx(losses["hf"], rel=1e-5), losses
    assert losses["safetensors"] == pytest.approx(losses["hf"], rel=1e-5), losses
    # The softmax of all 64 rows, as training's val/loss takes it, puts mass on the padding.
    windows = torch.tensor(tokenizer.encode(text)).unfold(0, 17, 16)
    with torch.no_grad():
        _, all_rows = padded(windows[:, :-1], windows[:, 1:])
    assert all_rows.item() > losses["hf"] + 0.1


def test_encdec_loss_is_the_mean_over_every_target_token_whatever_the_batches(tmp_path):
    rng = np.random.default_rng(0)
    sources = [" ".join(rng.choice(WORDS, rng.integers(1, 4))) for _ in range(7)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"source": s, "target": s[::-1]}) + "\n" for s in sources))
    tokenizer = CharTokenizer(sorted(set("".join(sources))), SPECIALS)
    model = sharpened(tiny_encdec(tokenizer.vocab_size))  # losses that differ from pair to pair
    config = Seq2SeqDataConfig(
        task="pairs",
        paths=[str(path)],
        max_source_len=16,
        max_target_len=16,
        cache_dir=str(tmp_path),
    )
    scored = score_encdec(model, tokenizer, config, batch_size=3, device=torch.device("cpu"))
    pairs = [(tokenizer.encode(s[:16]), tokenizer.encode(s[::-1][:15])) for s in sources]
    batch = collate_pairs([(np.array(s), np.array(t)) for s, t in pairs], PAD, BOS, EOS)
    with torch.no_grad():
        _, loss = model(
            *(batch[k] for k in ("source", "target_in", "source_mask", "target_mask")),
            batch["target_out"],
        )
    assert scored["pairs"] == 7 and scored["tokens"] == sum(len(t) + 1 for _, t in pairs)
    assert scored["loss"] == pytest.approx(loss.item(), rel=1e-5)


@pytest.mark.slow
def test_gpt_default_reproduces_the_runs_validation_of_the_plays(gpt_run, cache):
    logged = last_validation(gpt_run)
    scored = evaluate(cache, f"ckpt={gpt_run}")
    assert scored["out"] == str(gpt_run / "eval_val.json")
    assert scored["loss"] == pytest.approx(logged["val/loss"], rel=1e-4)
    assert scored["bits_per_char"] == pytest.approx(logged["val/bits_per_char"], rel=1e-4)
    assert scored["perplexity"] == pytest.approx(math.exp(scored["loss"]))
    assert scored["tokens"] == scored["characters"] > 600_000  # one char a token, 15% of the plays
    table = scored["stdout"]
    assert "the embedded plays' validation split (data.val_fraction=0.15)" in table
    assert f"loss        {scored['loss']:.4f} nats/token" in table
    # +data.key=value changes the default data; the split it names is the one scored anyway.
    again = evaluate(cache, f"ckpt={gpt_run}", "+data.split=validation", "batch_size=64")
    assert again["loss"] == pytest.approx(scored["loss"], rel=1e-6)  # other batches, same sum


@pytest.mark.slow
def test_text_files_scores_every_block_of_the_files(gpt_run, cache, tmp_path):
    paragraphs = ["ROMEO:\nBut soft, what light through yonder window breaks?"] * 7
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n\n".join(paragraphs) + "\n")
    out = tmp_path / "scores.json"
    options = ["data=text_files", f"data.paths=[{held_out}]", f"out={out}", "batch_size=5"]
    scored = evaluate(cache, f"ckpt={gpt_run}", *options)  # batches of 5, 5 and 2 blocks
    assert scored["out"] == str(out)
    # The whole text, paragraphs joined as training joins documents, in blocks of 32 tokens.
    model, hparams = load_checkpoint(gpt_run / "checkpoints" / "last.ckpt")
    ids = tokenizer_from_dict(hparams["tokenizer"]).encode("\n\n".join(paragraphs))
    windows = torch.tensor(ids).unfold(0, 33, 32)
    assert scored["tokens"] == windows[:, 1:].numel() == (len(ids) - 1) // 32 * 32
    with torch.no_grad():
        _, loss = model(windows[:, :-1], windows[:, 1:])
    assert scored["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert scored["data"] == "all of data.paths (1 file(s))"


@pytest.mark.slow
def test_a_text_files_run_is_scored_by_default_on_its_own_validation_split(cache, tmp_path):
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(WORDS, 30)) for _ in range(120)))
    # A path relative to where train.py runs (the root), read from there whatever directory
    # evaluate.py is launched in
    data = ["data=text_files", f"data.paths=[{os.path.relpath(corpus, ROOT)}]"]
    run_dir = train_run(tmp_path / "run", *SMALLEST_BASE, *data, *FULL_VALIDATION, cache_dir=cache)
    logged = last_validation(run_dir)
    scored = evaluate(cache, f"ckpt={run_dir}", cwd=tmp_path)
    assert scored["loss"] == pytest.approx(logged["val/loss"], rel=1e-4)
    assert scored["data"] == "the validation split of data.paths (1 file(s), data.val_fraction=0.1)"
    assert scored["out"] == str(run_dir / "eval_val.json")
    # data=text_files scores all of the files: ten times the text
    everything = evaluate(cache, f"ckpt={run_dir}", *data, f"out={tmp_path / 'all.json'}")
    assert everything["tokens"] > 8 * scored["tokens"]
    # Files the run read that are gone: one line, saying they were the run's
    corpus.rename(tmp_path / "moved.txt")
    result = run_script("evaluate.py", f"ckpt={run_dir}", cache_dir=cache)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert re.search(rf"trained on: data.paths: no file at {re.escape(str(corpus))}", last), last
    assert last.endswith(
        "(put them back, run evaluate.py in the moved project's directory, or score other text "
        "with data=text_files or data=hub)"
    ), last


def test_the_runs_relative_paths_are_read_from_the_directory_it_was_launched_in(tmp_path):
    (tmp_path / "hub_copy").mkdir()
    launched = {
        "paths": ["corpus.txt", "../shared/*.txt", str(tmp_path / "elsewhere.txt")],
        "val_paths": ["texts"],
        "name": "hub_copy",  # a Hub-layout directory there
        "hub_name": "someone/pairs",  # a Hub name: no such directory
        "block_size": 64,
    }
    assert from_launch_dir(launched, tmp_path) == {
        "paths": [
            str(tmp_path / "corpus.txt"),
            str(tmp_path.parent / "shared" / "*.txt"),
            str(tmp_path / "elsewhere.txt"),
        ],
        "val_paths": [str(tmp_path / "texts")],
        "name": str(tmp_path / "hub_copy"),
        "hub_name": "someone/pairs",
        "block_size": 64,
    }


def test_a_moved_projects_run_is_scored_on_its_files_where_they_are_now(
    tmp_path, monkeypatch, capsys
):
    """A project moved (or copied to another machine) after training: a relative path that
    names nothing where the run was launched any more, but does in the directory evaluate.py
    runs in, is read there, with a line saying so; what is still where the run read it is read
    there, and what is nowhere stays the run's, for the data's check to name."""
    launched, here = tmp_path / "before", tmp_path / "after"
    for folder in (launched / "texts", here / "texts"):
        folder.mkdir(parents=True)
    (here / "texts" / "train.txt").write_text("moved with the project")
    for copy in (launched, here):
        (copy / "texts" / "valid.txt").write_text("still where the run read it")
    data = {"_target_": KINDS["gpt"].datamodule, "paths": ["texts/train.txt", "gone.txt"]}
    data["val_paths"] = ["texts/valid.txt"]
    run_config = {"data": data, "launch_dir": str(launched)}
    monkeypatch.chdir(here)
    options = run_data(KINDS["gpt"], {"run_config": run_config})
    assert options["paths"] == [str(here / "texts" / "train.txt"), str(launched / "gone.txt")]
    assert options["val_paths"] == [str(launched / "texts" / "valid.txt")]
    assert capsys.readouterr().err.splitlines() == [
        f"data.paths: texts/train.txt named nothing in {launched}, where the run was launched, "
        f"any more: read from here, {here}"
    ]
    # Run where it was launched, nothing is taken from elsewhere, and nothing is said.
    monkeypatch.chdir(launched)
    assert run_data(KINDS["gpt"], {"run_config": run_config})["paths"][0] == str(
        launched / "texts" / "train.txt"
    )
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_hub_dataset_validation_and_test_splits(hub_run, hub_dataset, cache):
    logged = last_validation(hub_run)
    assert "data=hub: validating on the 'validation' split" in (hub_run / "stdout.txt").read_text()
    hub = ["data=hub", f"data.name={hub_dataset}"]
    validation = evaluate(cache, f"ckpt={hub_run}", *hub, "data.split=validation")
    assert validation["loss"] == pytest.approx(logged["val/loss"], rel=1e-4)
    assert validation["out"] == str(hub_run / "eval_hub.json")
    by_default = evaluate(cache, f"ckpt={hub_run}")  # the dataset the run trained on
    assert by_default["loss"] == validation["loss"]
    assert by_default["out"] == str(hub_run / "eval_val.json")
    test = evaluate(cache, f"ckpt={hub_run}", *hub, "data.split=test")
    assert test["data"] == f"the 'test' split of {hub_dataset}"
    assert test["out"] == str(hub_run / "eval_hub_test.json")
    assert test["loss"] != validation["loss"]
    its_test = evaluate(cache, f"ckpt={hub_run}", "+data.split=test")  # of the run's dataset
    assert its_test["out"] == str(hub_run / "eval_test.json")
    assert its_test["loss"] == test["loss"]


@pytest.mark.slow
def test_encdec_reproduces_the_runs_validation_pairs(encdec_run, pairs_file, cache, tmp_path):
    """Scored on exactly the pairs the run validated on (all of them decoded in one batch, as
    training decodes them), the loss, exact match and CER are the run's."""
    lines = pairs_file.read_text().splitlines()
    _, val_rows = split_rows(len(lines), 0.1, seed=1234)
    val_file = tmp_path / "val.jsonl"
    val_file.write_text("".join(lines[i] + "\n" for i in val_rows))
    logged = last_validation(encdec_run)
    by_default = evaluate(cache, f"ckpt={encdec_run}", "batch_size=64")  # its own split
    assert (
        by_default["data"]
        == "the validation pairs of data.paths (data.val_fraction=0.1, data.seed=1234)"
    )
    scored = evaluate(
        cache, f"ckpt={encdec_run}", "data=pairs", f"data.paths=[{val_file}]", "batch_size=64"
    )
    for key in ("pairs", "loss", "cer", "exact_match"):
        assert by_default[key] == scored[key]
    assert scored["pairs"] == len(val_rows)
    assert scored["loss"] == pytest.approx(logged["val/loss"], rel=1e-4)
    assert scored["cer"] == pytest.approx(logged["val/cer"], abs=1e-9)
    assert scored["exact_match"] == pytest.approx(logged["val/exact_match"], abs=1e-9)
    assert "CER" in scored["stdout"] and "bits/char" not in scored["stdout"]
    # Batches of 3, 3 and 2 pairs: the loss is still the mean over every target token.
    uneven = evaluate(
        cache, f"ckpt={encdec_run}", "data=pairs", f"data.paths=[{val_file}]", "batch_size=3"
    )
    assert uneven["loss"] == pytest.approx(logged["val/loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "overrides", "message"),
    [
        ("gpt", ["data=pairs", "data.paths=[x.jsonl]"], r"data=pairs is data for the other kind "),
        (
            "encdec",
            ["data=shakespeare_char"],
            r"data=shakespeare_char is data for the other kind of model and .* is an "
            r"encoder-decoder: score it on data=pairs",
        ),
        # the command's own mistakes, not put down to the run's data
        ("gpt", ["+data.split=test"], r"^error: data.split=test: the embedded plays have no test"),
        ("gpt", ["+data.nope=1"], r"^error: data.nope is not an option of the default data; its"),
        ("gpt", ["batch_size=0"], r"batch_size must be a positive integer, got 0"),
        (
            "gpt",
            ["data=text_files", "data.paths=[{short}]", "data.block_size=64"],
            r"data.block_size=64 is more than the checkpoint's model.block_size=32",
        ),
        (
            "gpt",
            ["+data.block_size=64"],  # no data=: the key the message suggests is added, with +
            r"^error: data.block_size=64 is more than the checkpoint's model.block_size=32, the "
            r"longest it was trained on; set \+data.block_size=32 or less$",
        ),
        (
            "encdec",
            ["+data.max_source_len=40"],
            r"data.max_source_len=40 is more .*; set \+data.max_source_len=32 or less$",
        ),
        (
            "encdec",
            ["data=shakespeare_next_line", "data.max_target_len=40"],
            r"data.max_target_len=40 is more .*; set data.max_target_len=33 or less$",
        ),
        (
            "gpt",
            ["data=text_files", "data.paths=[{short}]"],
            r"all of data.paths \(1 file\(s\)\) has 21 tokens, fewer than one block of "
            r"data.block_size=32 and the token after it",
        ),
    ],
)
def test_mistakes_are_one_line(request, cache, tmp_path, run, overrides, message):
    short = tmp_path / "short.txt"
    short.write_text("ROMEO:\nBut soft, what")
    run_dir = request.getfixturevalue(f"{run}_run")
    overrides = [o.format(short=short) for o in overrides]
    result = run_script("evaluate.py", f"ckpt={run_dir}", *overrides, cache_dir=cache)
    assert result.returncode == 1, result.stderr[-3000:]
    # The error's line ends stderr; before it, only `datasets`' notes on reading the files.
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.search(message, last), last


@pytest.mark.slow
@pytest.mark.parametrize(
    "data", [[], ["data=text_files", "data.paths=[{text}]"]], ids=["", "files"]
)
def test_the_block_size_a_message_suggests_runs_as_written(gpt_run, cache, tmp_path, data):
    """With data= or without, the setting that the too-long block's message gives is accepted
    by the command line that got it."""
    (tmp_path / "text.txt").write_text(TEXT * 8)
    data = [option.format(text=tmp_path / "text.txt") for option in data]
    too_long = f"{'data.' if data else '+data.'}block_size=64"
    result = run_script("evaluate.py", f"ckpt={gpt_run}", *data, too_long, cache_dir=cache)
    assert result.returncode == 1, result.stderr[-3000:]
    suggested = re.search(r"; set (\S+)=32 or less$", result.stderr.strip()).group(1)
    out = f"out={tmp_path / 'scores.json'}"
    scored = evaluate(cache, f"ckpt={gpt_run}", *data, f"{suggested}=16", out, "batch_size=512")
    assert scored["data_config"]["block_size"] == 16


TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n" * 4


def saved_run(folder: Path) -> Path:
    """A run directory as train.py leaves it after one best checkpoint: last.ckpt a hard link
    of best-step5.ckpt, summary.json and the Hydra record beside them; and a text to score."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (folder / "summary.json").write_text('{"status": "completed"}')
    tokenizer = CharTokenizer.from_text(TEXT)
    best = save_checkpoint(
        tiny_gpt(tokenizer.vocab_size), tokenizer, folder / "checkpoints" / "best-step5.ckpt"
    )
    (folder / "checkpoints" / "last.ckpt").hardlink_to(best)
    (folder / "held_out.txt").write_text(TEXT)
    return folder


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def evaluate_text(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """evaluate.py of the run's checkpoint on its held_out.txt: a few blocks, scored at once."""
    text = ["data=text_files", f"data.paths=[{run_dir / 'held_out.txt'}]"]
    return run_script(
        "evaluate.py", f"ckpt={run_dir}", *text, *overrides, cache_dir=run_dir.parent / "cache"
    )


def refused(result: subprocess.CompletedProcess) -> str:
    """The one line of a command that stopped at a mistake before it scored anything."""
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stdout == "", result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: "), line
    return line


# out= values (in a saved run with an export folder) that would lose a saved file, and the line
# that refuses each.
REFUSED_OUTS = [
    # last.ckpt is a hard link of best-step5.ckpt: written in place, both would be lost.
    (
        "checkpoints/last.ckpt",
        r"out=.*/checkpoints/last.ckpt lies in a run's checkpoints/ folder, which holds its "
        r"checkpoints only: leave out= out .* or give a .json path elsewhere$",
    ),
    ("checkpoints/scores.json", r"out=.*/checkpoints/scores.json lies in a run's checkpoints/"),
    (
        "summary.json",
        r"out=.*/summary.json holds a file that is not an earlier result of evaluate.py .*: "
        r"give a new .json path, or remove that file$",
    ),
    (
        "export/config.json",
        r"out=.*/export/config.json is an export's config: give a .json path outside the "
        r"export$",
    ),
    (".", r"out=.* is a directory: give a .json file's path, e.g. out=.*/eval.json$"),
    ("scores.txt", r"out=.*/scores.txt is not a .json path: give a file name ending in .json$"),
    (
        "summary.json/scores.json",
        r"out=.*/summary.json/scores.json cannot be written \(Not a directory in "
        r".*/summary.json\): give out= a .json path in a folder you can write to$",
    ),
]


@pytest.mark.parametrize(("out", "message"), REFUSED_OUTS, ids=[out for out, _ in REFUSED_OUTS])
def test_an_out_that_would_replace_a_saved_file_is_refused_before_scoring(tmp_path, out, message):
    run_dir = saved_run(tmp_path / "run")
    (run_dir / "export").mkdir()
    for name in ("config.json", "model.safetensors"):  # what makes a folder an export
        (run_dir / "export" / name).write_text("{}")
    before = files_under(run_dir)
    line = refused(evaluate_text(run_dir, f"out={run_dir / out}"))
    assert re.search(message, line), line
    assert files_under(run_dir) == before


def test_an_out_that_cannot_be_written_is_refused_before_scoring(tmp_path):
    run_dir = saved_run(tmp_path / "run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with read_only(run_dir), read_only(elsewhere):
        line = refused(evaluate_text(run_dir))
        assert line == (
            f"error: the default out={run_dir / 'eval_text_files.json'} cannot be written "
            f"(Read-only file system in {run_dir}): give out= a .json path in a folder you can "
            "write to"
        )
        out = elsewhere / "new" / "scores.json"  # its folder is made when written
        line = refused(evaluate_text(run_dir, f"out={out}"))
        assert line.startswith(
            f"error: out={out} cannot be written (Read-only file system in {elsewhere}): "
        )


def test_the_result_replaces_an_earlier_one_by_rename_never_in_place(tmp_path):
    run_dir = saved_run(tmp_path / "run")
    out = run_dir / "eval_text_files.json"
    result = evaluate_text(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    first = out.read_text()
    (tmp_path / "kept.json").hardlink_to(out)  # as last.ckpt is of the best checkpoint
    (run_dir / "held_out.txt").write_text(TEXT * 2)
    result = evaluate_text(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "kept.json").read_text() == first
    assert json.loads(out.read_text())["tokens"] > json.loads(first)["tokens"]
    assert not list(run_dir.glob(".*.tmp"))


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_reader_that_stops_early_costs_no_result_and_no_traceback(tmp_path, buffered):
    # `evaluate.py ... | head -3`: the result is written all the same, and the command ends
    # as a pipeline's tools do when their reader goes.
    run_dir = saved_run(tmp_path / "run")
    text = ["data=text_files", f"data.paths=[{run_dir / 'held_out.txt'}]"]
    result = run_unread(
        "evaluate.py", f"ckpt={run_dir}", *text, cache_dir=tmp_path / "cache", buffered=buffered
    )
    assert result.returncode == 128 + signal.SIGPIPE, result.stderr[-3000:]
    assert "BrokenPipeError" not in result.stderr and "Traceback" not in result.stderr
    assert json.loads((run_dir / "eval_text_files.json").read_text())["tokens"] > 0


def test_a_full_disk_keeps_the_earlier_result_and_is_one_line(tmp_path):
    run_dir = saved_run(tmp_path / "run")
    with small_disk(tmp_path / "small", "64k") as disk:
        out = disk / "scores.json"
        result = evaluate_text(run_dir, f"out={out}")
        assert result.returncode == 0, result.stderr[-3000:]
        earlier = out.read_text()
        # Every page of the disk but the one that scores.json holds.
        (disk / "filler").write_bytes(b"x" * (64 * 1024 - 4096))
        result = evaluate_text(run_dir, f"out={out}")
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert result.stderr.strip().splitlines() == [
            f"error: no space left on the disk of {disk} to write scores.json (nothing there was "
            "replaced; the table above holds the result): free some space, or give out= on "
            "another disk"
        ]
        assert "loss" in result.stdout  # the table
        assert out.read_text() == earlier
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "scores.json"]
