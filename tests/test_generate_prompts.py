"""generate.py's prompts: from the command line (commas and newlines quoted as the README shows),
a file, stdin (prompt=-) or one a line (interactive=true), driven through a pipe as a shell
would; conflicting options fail before anything loads."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.seq2seq import SPECIALS
from data.tokenizer import CharTokenizer
from generate import Inputs, translate
from helpers import (
    ROOT,
    clean_env,
    default_signals,
    run_script,
    save_checkpoint,
    sharpened,
    tiny_encdec,
    tiny_gpt,
)
from model.generation import decode_greedy_or_sample, decoding_ids
from model.sampling import SEPARATOR, SamplingConfig

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
CHARS = CharTokenizer.from_text(TEXT)
GREEDY = ["decoding=greedy", "max_new_tokens=12"]


@pytest.fixture(scope="module")
def gpt(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpt")
    # A module's fixture is made before the first test's seed is set (conftest.py): seeded
    # here, its weights are the same in every order and on every worker.
    torch.manual_seed(0)
    model = sharpened(tiny_gpt(CHARS.vocab_size, block_size=64))
    return save_checkpoint(model, CHARS, folder / "gpt.ckpt")


def generate(checkpoint: Path, *options: str, stdin: str = "", status: int = 0) -> str:
    """generate.py's stdout, once it exited with `status`."""
    result = run_script(
        "generate.py", f"ckpt={checkpoint}", *options, cache_dir=checkpoint.parent, stdin=stdin
    )
    assert result.returncode == status, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_a_prompt_file_with_commas_and_newlines_is_the_prompt_as_quoted_on_the_command_line(
    gpt, tmp_path
):
    prompt = "All:\nSpeak, speak.\n\nFirst Citizen:\n"
    (tmp_path / "prompt.txt").write_text(prompt)
    from_file = generate(gpt, f"prompt_file={tmp_path / 'prompt.txt'}", *GREEDY)
    assert from_file.startswith(prompt) and len(from_file) == len(prompt) + 12 + 1
    # The README's quoting: the shell hands Hydra prompt="..." with the newlines in it.
    assert generate(gpt, f'prompt="{prompt}"', *GREEDY) == from_file


@pytest.mark.slow
def test_prompt_dash_reads_the_prompt_from_stdin(gpt):
    prompt = "Before we proceed, hear me.\n"
    piped = generate(gpt, "prompt=-", *GREEDY, stdin=prompt)
    assert piped.startswith(prompt) and len(piped) == len(prompt) + 12 + 1
    assert generate(gpt, f'prompt="{prompt}"', *GREEDY) == piped


@pytest.mark.slow
def test_interactive_answers_each_line_as_that_prompt_would_be_answered(gpt):
    lines = ["All:", "Speak, speak", ""]
    answers = generate(gpt, "interactive=true", *GREEDY, stdin="\n".join(lines) + "\n")
    expected = [generate(gpt, f'prompt="{line or chr(10)}"', *GREEDY) for line in lines]
    assert answers == f"\n{SEPARATOR}\n".join(expected)


@pytest.mark.slow
def test_an_option_for_the_other_kind_of_model_fails_once_before_any_line(gpt):
    options = ["interactive=true", "decoding=beam"]
    result = run_script(
        "generate.py", f"ckpt={gpt}", *options, cache_dir=gpt.parent, stdin="All:\nhear me\n"
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: decoding=beam is for encoder-decoder checkpoints; {gpt} is a GPT: use "
        "decoding=sample or greedy"
    ]


@pytest.mark.slow
def test_interactive_reads_windows_lines_as_lines(gpt):
    lines = ["All:", "Speak, speak", ""]
    answers = generate(gpt, "interactive=true", *GREEDY, stdin="\r\n".join(lines) + "\r\n")
    assert answers == generate(gpt, "interactive=true", *GREEDY, stdin="\n".join(lines) + "\n")


@pytest.mark.slow
def test_interactive_reports_a_bad_line_and_answers_the_others(gpt):
    result = run_script(
        "generate.py",
        f"ckpt={gpt}",
        "interactive=true",
        *GREEDY,
        cache_dir=gpt.parent,
        stdin="All:\nSpeak☃\nhear me\n",
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: prompt='Speak☃': text contains 1 character(s) not in the vocabulary: '☃'; the "
        "char tokenizer's vocabulary was built from the training corpus, so use only characters "
        "that occur there"
    ]
    answers = result.stdout.split(f"\n{SEPARATOR}\n")
    assert len(answers) == 3 and answers[1] == ""  # the n-th answer is the n-th line's
    assert answers[0].startswith("All:") and answers[2].startswith("hear me")


@pytest.mark.slow
def test_interactive_decodes_each_line_as_a_source_for_an_encoder_decoder(tmp_path):
    chars = CharTokenizer.from_text(TEXT, specials=SPECIALS)
    checkpoint = save_checkpoint(sharpened(tiny_encdec(chars.vocab_size)), chars, tmp_path / "ed")
    lines = ["Speak, speak.", "hear<mask> me"]  # <mask>: the mask token, as in source=
    answers = generate(checkpoint, "interactive=true", *GREEDY, stdin="\n".join(lines) + "\n")
    expected = [generate(checkpoint, f'source="{line}"', *GREEDY) for line in lines]
    assert answers == f"\n{SEPARATOR}\n".join(expected)


@pytest.mark.slow
def test_a_reader_that_stops_early_ends_generate_quietly(gpt):
    # `generate.py ... | head -2`: the pipe closes while samples are still being written (100k
    # characters, more than a pipe holds: generate.py cannot have written them all).
    command = [sys.executable, str(ROOT / "generate.py"), f"ckpt={gpt}", "max_new_tokens=5000"]
    with subprocess.Popen(
        command + ["num_samples=20"],
        cwd=ROOT,
        env=clean_env(gpt.parent),
        preexec_fn=default_signals,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as process:
        process.stdout.read(64)
        process.stdout.close()
        stderr = process.stderr.read().decode()
    assert process.returncode == 128 + signal.SIGPIPE, stderr
    assert stderr == ""


@pytest.mark.slow
def test_an_empty_source_is_one_line(tmp_path):
    chars = CharTokenizer.from_text(TEXT, specials=["<pad>", "<bos>", "<eos>"])
    checkpoint = save_checkpoint(tiny_encdec(chars.vocab_size), chars, tmp_path / "ed")
    result = run_script("generate.py", f"ckpt={checkpoint}", 'source=""', cache_dir=tmp_path)
    assert result.returncode == 1
    assert (
        result.stderr == 'error: source is empty: give the text to decode from, e.g. source="..."\n'
    )


def test_a_sources_mask_is_the_mask_token_a_span_corrupted_model_fills(capsys):
    chars = CharTokenizer.from_text(TEXT, specials=SPECIALS)  # no '<' or '>' among its characters
    torch.manual_seed(0)
    model = sharpened(tiny_encdec(chars.vocab_size))
    config = SamplingConfig(source="Speak<mask> me<mask>", decoding="greedy", max_new_tokens=12)
    (output,) = translate(model, chars, config, torch.device("cpu"))
    source = [*chars.encode("Speak"), chars.mask_id, *chars.encode(" me"), chars.mask_id]
    (expected,) = decode_greedy_or_sample(
        model, torch.tensor([source]), None, max_new_tokens=12, greedy=True, **decoding_ids(chars)
    )
    assert output == expected and capsys.readouterr().out == chars.decode(output) + "\n"


def test_an_encoder_decoders_samples_are_separated_as_a_gpts(capsys):
    # Targets hold newlines (a passage of a speech): without the line between them, where one
    # sample ends is lost.
    chars = CharTokenizer.from_text(TEXT, specials=SPECIALS)
    torch.manual_seed(0)
    model = sharpened(tiny_encdec(chars.vocab_size))
    config = SamplingConfig(source="Speak", num_samples=3, max_new_tokens=12, temperature=2.0)
    outputs = translate(model, chars, config, torch.device("cpu"))
    expected = f"\n\n{SEPARATOR}\n".join(chars.decode(output) for output in outputs) + "\n"
    assert len(outputs) == 3 and capsys.readouterr().out == expected


# Options that contradict each other, and the line that says so.
CONFLICTS = {
    "prompt_and_file": (
        {"prompt": "All:", "prompt_file": "p.txt"},
        "prompt='All:' and prompt_file=p.txt both give the prompt: keep one",
    ),
    "interactive_and_source": (
        {"interactive": True, "source": "Speak"},
        "interactive=true reads its input from stdin, one a line: drop source='Speak'",
    ),
    "interactive_and_prompt": (
        {"interactive": True, "prompt": "-"},
        "interactive=true reads its input from stdin, one a line: drop prompt='-'",
    ),
    "interactive_and_plot": (
        {"interactive": True, "attention_plot": "a.png"},
        "attention_plot=a.png draws one prompt's attention and interactive=true reads many: "
        "drop one of them",
    ),
    "number_prompt": (
        {"prompt": 42},
        "prompt=42 is not text: Hydra reads numbers and true/false as such; quote it, "
        "e.g. 'prompt=\"42\"'",
    ),
}


@pytest.mark.parametrize(("options", "message"), CONFLICTS.values(), ids=CONFLICTS.keys())
def test_conflicting_prompt_options_are_one_error(options, message):
    with pytest.raises(ValueError) as error:
        Inputs(**options)
    assert str(error.value) == message


def test_prompt_file_and_stdin_must_give_some_text(tmp_path, monkeypatch):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"^prompt_file gave an empty prompt"):
        Inputs(prompt_file=str(tmp_path / "empty.txt")).prompt_text()
    with pytest.raises(FileNotFoundError, match=r"^prompt_file=nope.txt: no file at nope.txt$"):
        Inputs(prompt_file="nope.txt").prompt_text()
    monkeypatch.setattr("sys.stdin", open("/dev/null"))
    with pytest.raises(ValueError, match=r"^prompt=- \(stdin\) gave an empty prompt"):
        Inputs(prompt="-").prompt_text()
    assert Inputs().prompt_text() == "\n"  # no prompt: a newline, as before


def test_a_prompt_file_is_the_prompt_byte_for_byte(tmp_path):
    (tmp_path / "crlf.txt").write_bytes("ROMEO:\r\nAy, \u2018tis\r\n".encode())
    assert (
        Inputs(prompt_file=str(tmp_path / "crlf.txt")).prompt_text()
        == "ROMEO:\r\nAy, \u2018tis\r\n"
    )


def test_a_prompt_files_byte_order_mark_is_not_text(tmp_path, monkeypatch):
    (tmp_path / "bom.txt").write_bytes("\ufeffROMEO:\r\n".encode())
    assert Inputs(prompt_file=str(tmp_path / "bom.txt")).prompt_text() == "ROMEO:\r\n"
    monkeypatch.setattr("sys.stdin", open(tmp_path / "bom.txt", encoding="utf-8", newline=""))
    assert Inputs(prompt="-").prompt_text() == "ROMEO:\r\n"  # piped the same way
    (tmp_path / "only_bom.txt").write_bytes("\ufeff".encode())
    with pytest.raises(ValueError, match=r"^prompt_file gave an empty prompt"):
        Inputs(prompt_file=str(tmp_path / "only_bom.txt")).prompt_text()


def test_an_attention_plot_that_cannot_be_written_fails_before_anything_loads(tmp_path):
    (tmp_path / "maps.png").mkdir()
    with pytest.raises(ValueError) as error:
        Inputs(attention_plot=str(tmp_path / "maps.png"))
    shown = tmp_path / "maps.png"
    assert str(error.value) == (
        f"attention_plot={shown} is a folder: give the image's path, e.g. {shown}/attention.png"
    )
    (tmp_path / "notes.txt").write_text("")
    through_a_file = tmp_path / "notes.txt" / "maps.png"
    with pytest.raises(ValueError) as error:
        Inputs(attention_plot=str(through_a_file))
    assert str(error.value) == (
        f"attention_plot={through_a_file} cannot be written (Not a directory in "
        f"{tmp_path / 'notes.txt'}): give a path you can write to"
    )
    Inputs(attention_plot=str(tmp_path / "new" / "maps.png"))  # folders to make are made
