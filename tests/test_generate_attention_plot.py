"""generate.py attention_plot= for a GPT: the attention of one forward pass over the prompt and
its continuation, every layer a row of panels, every head a panel."""

import matplotlib.image
import pytest
import torch

from data.tokenizer import CharTokenizer
from helpers import run_script, save_checkpoint, sharpened, tiny_gpt
from model.figures import MAX_LABELLED_TOKENS, token_label
from model.inspect import self_attention_figure

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
CHARS = CharTokenizer.from_text(TEXT)


@pytest.mark.parametrize(("n_layer", "n_head"), [(1, 2), (3, 4)])
def test_the_figure_has_a_row_per_layer_and_a_panel_per_head(n_layer, n_head):
    model = tiny_gpt(CHARS.vocab_size, n_layer=n_layer, n_head=n_head, block_size=32)
    ids = torch.tensor(CHARS.encode(TEXT[:20]))
    labels = list(TEXT[:20])
    figure = self_attention_figure(model, ids, labels, "attention", boundary=14)
    assert len(figure.axes) == n_layer * n_head
    for index, axes in enumerate(figure.axes):
        layer, head = divmod(index, n_head)
        assert axes.get_subplotspec().get_geometry()[:2] == (n_layer, n_head)
        name = f"layer{layer}/attn " if n_layer > 1 else ""
        assert axes.get_title().startswith(f"{name}head {head} ")
        shown = [label.get_text() for label in axes.get_xticklabels()]
        assert shown == ([token_label(t) for t in labels] if head == 0 else [])
        # The prompt ends before token 14: a line across and down every panel.
        assert [line.get_xydata()[0].tolist() for line in axes.lines] == [[0, 13.5], [13.5, 0]]


def test_a_long_sequence_has_no_token_labels():
    model = tiny_gpt(CHARS.vocab_size, block_size=80)
    ids = torch.tensor(CHARS.encode(TEXT[: MAX_LABELLED_TOKENS + 1]))
    figure = self_attention_figure(model, ids, list(TEXT[: len(ids)]), "attention")
    assert all(not axes.get_xticklabels() for axes in figure.axes)
    assert all(not axes.lines for axes in figure.axes)  # no boundary given, none drawn


@pytest.mark.slow
def test_generate_saves_a_png_that_grows_with_the_layers_and_keeps_the_sample(tmp_path):
    sizes = {}
    for n_layer in (1, 2):
        model = sharpened(tiny_gpt(CHARS.vocab_size, n_layer=n_layer, block_size=32))
        checkpoint = save_checkpoint(model, CHARS, tmp_path / f"{n_layer}.ckpt")
        plot = tmp_path / "plots" / f"{n_layer}.png"
        options = [f"ckpt={checkpoint}", "prompt=All:", "max_new_tokens=10", "decoding=greedy"]
        plotted = run_script("generate.py", *options, f"attention_plot={plot}", cache_dir=tmp_path)
        assert plotted.returncode == 0, plotted.stderr[-3000:]
        assert plotted.stderr == f"attention map saved to {plot}\n"
        plain = run_script("generate.py", *options, cache_dir=tmp_path)
        assert plotted.stdout == plain.stdout  # plotting changes nothing of the sample
        sizes[n_layer] = matplotlib.image.imread(plot).shape[:2]
    assert sizes[2][0] > 1.8 * sizes[1][0] and sizes[2][1] == sizes[1][1]
