"""export.py: a checkpoint as plain files that tinyformer loads without the training stack and,
with format=hf, that transformers loads as a GPT-2 computing the same logits; and an export
never loses a file it was not asked to replace."""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from data.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer
from export import ExportOptions, export
from helpers import (
    ROOT,
    read_only,
    run_script,
    run_unread,
    save_checkpoint,
    sharpened,
    small_disk,
    tiny_encdec,
    tiny_gpt,
)
from model.attention import AttentionConfig
from model.checkpoint import find_checkpoint, load_checkpoint

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
CHARS = CharTokenizer.from_text(TEXT)
# The files of an export in the default format
SAFETENSORS_EXPORT = [
    "config.json",
    "model.safetensors",
    "tinyformer_tokenizer.json",
    "tokenizer.json",
]


def checkpoint_of(model, tmp_path: Path, tokenizer=CHARS) -> Path:
    return save_checkpoint(sharpened(model), tokenizer, tmp_path / "model.ckpt")


def exported(checkpoint: Path, out: Path, **options) -> Path:
    export(ExportOptions(ckpt=str(checkpoint), out=str(out), **options))
    return out


def load(path: Path):
    return load_checkpoint(find_checkpoint(path, "best", "ckpt"))


def ties(model: torch.nn.Module) -> set[tuple[str, ...]]:
    """The names of each tensor of the model's state dict: two or more where tied."""
    names: dict[int, list[str]] = {}
    for name, tensor in model.state_dict().items():
        names.setdefault(tensor.data_ptr(), []).append(name)
    return {tuple(group) for group in names.values()}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)[0]


@pytest.mark.parametrize("kind", ["gpt", "encdec"])
def test_safetensors_export_loads_the_same_weights_ties_and_hparams(tmp_path, kind):
    model = tiny_gpt(CHARS.vocab_size) if kind == "gpt" else tiny_encdec(CHARS.vocab_size)
    checkpoint = checkpoint_of(model, tmp_path)
    out = exported(checkpoint, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == SAFETENSORS_EXPORT
    loaded, hparams = load(out)
    original, original_hparams = load_checkpoint(checkpoint)
    assert type(loaded) is type(original)
    for key in ("kind", "model", "tokenizer", "run_config"):
        assert hparams[key] == original_hparams[key], key
    assert hparams["exported_from"] == str(checkpoint.resolve())
    assert loaded.state_dict().keys() == original.state_dict().keys()
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # Tied tensors (the head and the embeddings) are stored once and tied again on load.
    assert ties(loaded) == ties(original) and len(ties(original)) < len(original.state_dict())
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert len(list(weights.keys())) == len(ties(original))
    # The tokenizer files are a run directory's: our loader and the library read them.
    assert load_tokenizer(out / "tokenizer.json").encode(TEXT) == CHARS.encode(TEXT)


def test_a_damaged_export_is_one_error_naming_its_file(tmp_path):
    out = exported(checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    config["tinyformer"]["model"]["n_layer"] = 3  # the weights hold 2 layers
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model.safetensors does not hold the weights of .*"):
        load(out)
    (out / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match=r"config.json is not a tinyformer export's config"):
        load(out)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_file_of_an_export_names_its_directory(tmp_path, name):
    out = exported(checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path), tmp_path / "export")
    with pytest.raises(ValueError) as error:
        find_checkpoint(str(out / name), "best", "ckpt")
    assert str(error.value) == (
        f"ckpt={out / name} is a file of the export {out}: give the export's directory, ckpt={out}"
    )
    beside = checkpoint_of(tiny_gpt(CHARS.vocab_size), out)  # a checkpoint kept in it is itself
    assert find_checkpoint(str(beside), "best", "ckpt") == beside


def test_an_export_cannot_be_resumed_from(tmp_path):
    out = exported(checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path), tmp_path / "export")
    with pytest.raises(ValueError, match="is an export, which holds the weights only"):
        find_checkpoint(out, "last", "ckpt_path")


# GPTs whose every setting GPT-2 has: its defaults, no biases, no scaling of QKᵀ, a padded
# vocabulary (cut to the tokenizer's), a wider MLP.
EXPRESSIBLE = {
    "default": {},
    "no_bias": {"bias": False},
    "unscaled": {"attention": AttentionConfig(n_head=4, scale=1.0)},
    "padded_vocabulary": {"vocab_size": 64},
    "mlp_ratio_2": {"mlp_ratio": 2, "n_layer": 3},
    "gqa": {"n_kv_head": 2},  # each shared key/value head repeated for its 2 query heads
    "mqa_no_bias": {"n_kv_head": 1, "bias": False},
    "window_of_the_block": {"window": 16},  # the block's 16 keys: every key a query may see
}


@pytest.mark.parametrize("options", EXPRESSIBLE.values(), ids=EXPRESSIBLE.keys())
def test_hf_export_computes_our_logits_in_transformers_and_back_in_tinyformer(tmp_path, options):
    transformers = pytest.importorskip("transformers")
    options = {"vocab_size": CHARS.vocab_size, **options}
    model = tiny_gpt(options.pop("vocab_size"), **options)
    out = exported(checkpoint_of(model, tmp_path), tmp_path / "hf", format="hf")
    ids = torch.tensor([CHARS.encode(TEXT[: model.config.block_size])])
    ours = logits(model, ids)[..., : CHARS.vocab_size]

    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(gpt2).__name__ == "GPT2LMHeadModel"
    assert ours.abs().max() > 1.0  # logits large enough for a mapping error to show
    torch.testing.assert_close(logits(gpt2, ids), ours, atol=1e-4, rtol=0)
    reloaded, hparams = load(out)  # tinyformer reads GPT-2's layout back
    assert hparams["model"]["vocab_size"] == CHARS.vocab_size
    assert hparams["model"]["attention"]["n_kv_head"] is None  # GPT-2's heads, unshared
    assert reloaded.config.attention.kv_heads == model.config.attention.n_head
    torch.testing.assert_close(logits(reloaded, ids), ours, atol=1e-5, rtol=0)


def test_hf_export_samples_through_transformers_generate_as_our_model_would(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_gpt(CHARS.vocab_size, block_size=32)
    out = exported(checkpoint_of(model, tmp_path), tmp_path / "hf", format="hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = "All:\nSpeak, speak"  # commas and newlines encode as ours do
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids.tolist() == [CHARS.encode(prompt)]
    with torch.no_grad():
        generated = gpt2.generate(ids, max_new_tokens=12, do_sample=False)[0]
    assert generated.size(0) == ids.size(1) + 12
    text = tokenizer.decode(generated)
    assert text.startswith(prompt) and len(text) == len(prompt) + 12
    # Each greedy token is our model's most likely one, within float noise of a near tie.
    for end in range(ids.size(1), generated.size(0)):
        step = logits(model, generated[None, :end])[0, -1]
        assert step[generated[end]] >= step.max() - 1e-4


def test_hf_export_of_a_bpe_gpt_keeps_its_special_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    bpe = BPETokenizer.train(TEXT * 4, vocab_size=300, specials=specials)
    model = tiny_gpt(bpe.vocab_size)
    out = exported(checkpoint_of(model, tmp_path, bpe), tmp_path / "hf", format="hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("Speak, speak.").input_ids == bpe.encode("Speak, speak.")  # no BOS added
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == tuple(specials[:3])
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)


# What GPT-2 cannot compute, and the line that says so.
NOT_GPT2 = {
    "rope": ({"position": "rope"}, "needs model.position=learned, this checkpoint has rope"),
    "alibi": ({"position": "alibi"}, "needs model.position=learned, this checkpoint has alibi"),
    "none": ({"position": "none"}, "needs model.position=learned, this checkpoint has none"),
    "sinusoidal": (
        {"position": "sinusoidal"},
        "needs model.position=learned, this checkpoint has sinusoidal",
    ),
    "window": (
        {"window": 4},
        "needs model.attention.window=null (or at least model.block_size=16), this checkpoint "
        "has 4",
    ),
    "scale": (
        {"attention": AttentionConfig(n_head=4, scale="1/dk")},
        "needs model.attention.scale=1/sqrt_dk or 1.0, this checkpoint has 1/dk (= 0.125 for "
        "d_k=8)",
    ),
    "encdec": (None, "needs a GPT (model=gpt), this checkpoint is an encoder-decoder"),
}


@pytest.mark.parametrize(("options", "reason"), NOT_GPT2.values(), ids=NOT_GPT2.keys())
def test_hf_export_refuses_what_gpt2_cannot_compute_and_writes_nothing(tmp_path, options, reason):
    vocab = CHARS.vocab_size
    model = tiny_encdec(vocab) if options is None else tiny_gpt(vocab, **options)
    checkpoint = checkpoint_of(model, tmp_path)
    with pytest.raises(ValueError) as refused:
        exported(checkpoint, tmp_path / "hf", format="hf")
    assert str(refused.value) == (
        f"format=hf {reason}; export format=safetensors (the default) instead"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_an_earlier_export_is_replaced_whole_and_other_files_stay(tmp_path):
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    out = exported(checkpoint, tmp_path / "export", format="hf")
    (out / "README.md").write_text("my notes")
    (out / "eval_val.json").write_text("{}")  # evaluate.py's score of the earlier weights
    exported(checkpoint, out)  # no overwrite=true needed over an earlier export
    # the hf export's tokenizer_config.json and generation_config.json went with it, and the
    # score of its weights
    assert sorted(p.name for p in out.iterdir()) == ["README.md", *SAFETENSORS_EXPORT]
    assert (out / "README.md").read_text() == "my notes"
    assert load(out)[1]["exported_from"] == str(checkpoint.resolve())
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_directory_of_other_files_is_written_into_only_with_overwrite(tmp_path):
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "gpt2"}')  # say, a model from the Hub
    (out / "model.safetensors").write_text("their weights")
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"is not empty and holds no earlier export: .*overwrite"):
        exported(checkpoint, out)
    assert (out / "model.safetensors").read_text() == "their weights"
    exported(checkpoint, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me"
    assert load(out)[1]["kind"] == "gpt"


def test_an_existing_empty_out_is_written_into_and_kept(tmp_path, monkeypatch):
    # out=. from a shell in the new folder: the folder stays the shell's, with the export in it.
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    out = tmp_path / "export"
    out.mkdir()
    folder = out.stat().st_ino
    monkeypatch.chdir(out)
    exported(checkpoint, Path("."))
    assert out.stat().st_ino == folder and Path.cwd() == out
    assert load(out)[1]["kind"] == "gpt"
    assert sorted(p.name for p in out.iterdir()) == SAFETENSORS_EXPORT


@pytest.mark.parametrize("earlier", [False, True], ids=["empty", "earlier-export"])
def test_an_out_that_is_a_mount_point_is_exported_into(tmp_path, earlier):
    # Another disk than its parent's: the export's files cannot be renamed into it from beside
    # it, nor the folder replaced.
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    with small_disk(tmp_path / "disk", "4m") as out:
        if earlier:
            for path in exported(checkpoint, tmp_path / "first", format="hf").iterdir():
                shutil.copy(path, out)
        exported(checkpoint, out)
        assert load(out)[1]["format"] == "safetensors"
        assert sorted(p.name for p in out.iterdir()) == SAFETENSORS_EXPORT
    assert not list(tmp_path.glob(".*.tmp"))


def test_out_may_not_hold_the_checkpoint_it_exports(tmp_path):
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    with pytest.raises(ValueError, match="holds the checkpoint it exports"):
        exported(checkpoint, tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_a_failed_export_leaves_the_earlier_one_as_it_was(tmp_path, monkeypatch):
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    out = exported(checkpoint, tmp_path / "export")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("export.save_model", full_disk)
    with pytest.raises(ValueError, match=r"^no space left on the disk of .* to write the export"):
        exported(checkpoint, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob(".*.tmp"))


# Ctrl-C in the middle of an export's writing of the weights, ended as export.py's main ends it
INTERRUPTED_EXPORT = """
import sys
import export
from errors import run_command

def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

export.save_model = interrupted
run_command(lambda: export.export(export.ExportOptions(ckpt=sys.argv[1], out=sys.argv[2])))
"""


def test_ctrl_c_in_an_export_ends_it_as_ctrl_c_does_and_leaves_the_earlier_one(tmp_path):
    """Ctrl-C in the middle of writing the weights, through errors.run_command as export.py's
    main ends (and generate.py's and evaluate.py's): the process ends by SIGINT, printing one
    blank line, no traceback; the export being written is removed, the earlier one left whole."""
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    out = exported(checkpoint, tmp_path / "export")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    command = [sys.executable, "-c", INTERRUPTED_EXPORT, str(checkpoint), str(out)]
    ended = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ended.returncode == -signal.SIGINT and ended.stderr == "\n", ended.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_export_command_writes_what_generate_samples_like_the_checkpoint(
    trained_run, shared_cache, tmp_path
):
    out = tmp_path / "export"
    result = run_script("export.py", f"ckpt={trained_run}", f"out={out}", cache_dir=shared_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    best = find_checkpoint(trained_run, "best", "ckpt")
    assert result.stdout.startswith(f"exported {best} to {out}/ (")
    assert "model.safetensors" in result.stdout
    assert f"python generate.py ckpt={out}" in result.stdout
    # Weights only: smaller than the checkpoint, which holds the optimiser's state too.
    assert (out / "model.safetensors").stat().st_size < best.stat().st_size / 2
    sampled = [
        run_script("generate.py", f"ckpt={ckpt}", "max_new_tokens=40", cache_dir=shared_cache)
        for ckpt in (trained_run, out)
    ]
    assert sampled[0].returncode == 0 and sampled[1].returncode == 0, sampled[1].stderr
    assert sampled[1].stdout == sampled[0].stdout


@pytest.mark.parametrize(
    "command",
    [["generate.py"], ["evaluate.py"], ["export.py", "out={tmp}/export"]],
    ids=["generate", "evaluate", "export"],
)
@pytest.mark.parametrize("text", ["hi", "hello world", "Kate", "Jp"])
def test_a_text_file_given_as_checkpoint_is_one_line_naming_it(tmp_path, command, text):
    # Read as pickle opcodes, such bytes fail inside torch's unpickler, each its own way.
    checkpoint = tmp_path / "x.ckpt"
    checkpoint.write_text(text)
    script, *options = command
    options = [option.format(tmp=tmp_path) for option in options]
    result = run_script(script, f"ckpt={checkpoint}", *options, cache_dir=tmp_path / "cache")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: {checkpoint} is not a readable tinyformer checkpoint (not the zip archive "
        "torch.save writes); point at a .ckpt written by train.py"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]  # and nothing written


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def export_command(checkpoint: Path, out: Path, *options: str) -> str:
    """The one line of an export.py that stopped at a mistake, with status 1."""
    result = run_script(
        "export.py", f"ckpt={checkpoint}", f"out={out}", *options, cache_dir=out.parent / "cache"
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    return line


@pytest.mark.parametrize("overwrite", ["overwrite=false", "overwrite=true"])
@pytest.mark.parametrize("record", ["checkpoints", ".hydra"])
def test_another_runs_directory_is_never_exported_into(tmp_path, overwrite, record):
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    run_dir = tmp_path / "run"  # another run's, as train.py left it: resumed from its files
    (run_dir / record).mkdir(parents=True)
    (run_dir / record / "kept").write_text("its state")
    CHARS.save(run_dir / "tokenizer.json")
    before = files_under(run_dir)
    line = export_command(checkpoint, run_dir, overwrite)
    assert line == (
        f"error: out={run_dir} is a run's directory, whose files an export would replace: give "
        f"a new directory, e.g. out={run_dir / 'export'}"
    )
    if record == "checkpoints":  # nor its checkpoints/ folder
        line = export_command(checkpoint, run_dir / "checkpoints", overwrite)
        assert line == (
            f"error: out={run_dir / 'checkpoints'} is a run's checkpoints/ folder, whose files "
            f"an export would replace: give a new directory, e.g. out={run_dir / 'export'}"
        )
    assert files_under(run_dir) == before
    exported(checkpoint, run_dir / "export")  # a new folder inside it is the export's own
    assert load(run_dir / "export")[1]["kind"] == "gpt"


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_a_reader_that_stops_early_ends_export_quietly(tmp_path, buffered):
    # `export.py ... | head -1`: the export is written before anything is printed.
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    out = tmp_path / "export"
    options = (f"ckpt={checkpoint}", f"out={out}")
    result = run_unread("export.py", *options, cache_dir=tmp_path / "cache", buffered=buffered)
    assert result.returncode == 128 + signal.SIGPIPE and result.stderr == "", result.stderr
    assert load(out)[1]["kind"] == "gpt"


def test_an_out_on_a_read_only_disk_is_one_line_and_writes_nothing(tmp_path):
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    disk = tmp_path / "disk"
    earlier = exported(checkpoint, disk / "earlier")
    before = files_under(disk)
    with read_only(disk):
        for out, folder in ((disk / "new", disk), (earlier, earlier)):
            assert export_command(checkpoint, out) == (
                f"error: out={out} cannot be written (Read-only file system in {folder}): give "
                "out= a directory on a disk you can write to"
            )
    assert files_under(disk) == before


def test_an_export_that_fills_the_disk_is_one_line_and_leaves_nothing(tmp_path):
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)  # 100 kB of weights
    with small_disk(tmp_path / "disk", "64k") as disk:
        out = disk / "export"
        # safetensors says "No space left on device (os error 28)" in its message only.
        assert export_command(checkpoint, out) == (
            f"error: no space left on the disk of {disk} to write the export (nothing was "
            f"written to {out}): free some space, or give out= on another disk"
        )
        assert list(disk.iterdir()) == []


@pytest.mark.parametrize("earlier", [False, True], ids=["empty", "earlier-export"])
def test_what_a_killed_export_left_inside_out_is_removed(tmp_path, earlier):
    # A killed export leaves its staging directory inside an existing out: an empty out was
    # then refused as 'not empty', and an earlier export kept the leftover for good.
    checkpoint = checkpoint_of(tiny_gpt(CHARS.vocab_size), tmp_path)
    out = tmp_path / "export"
    if earlier:
        exported(checkpoint, out)
    else:
        out.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid, of a process no longer there, names the killed export's folder
    leftover = out / f".export.{gone.pid}.tmp"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    exported(checkpoint, out)
    assert load(out)[1]["kind"] == "gpt"
    assert sorted(p.name for p in out.iterdir()) == SAFETENSORS_EXPORT
