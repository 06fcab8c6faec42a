"""The LightningModule's validation metrics: through a real Trainer on real cached data, and
through the module's validation hooks driven by hand on batches built to the purpose; and the
progress lines a run writes to a log."""

import io
import math
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from data.lm import LMDataModule
from data.tokenizer import CharTokenizer
from helpers import BOS, FIRST_WORD, tiny_encdec, tiny_gpt_config
from training.module import LanguageModelModule, Seq2SeqModule, TrainingModule
from training.progress import LineProgress, clock

TEXT = "\n\n".join(f"Speaker {i}:\nSome words, and more words; line {i % 7}." for i in range(200))


def text_and_gpt(folder: Path, tokenizer: str = "char") -> tuple[LMDataModule, TrainingModule]:
    """TEXT as a prepared text_files data module (16-token blocks, batches of 4), and a
    one-layer GPT module for its tokenizer."""
    (folder / "corpus.txt").write_text(TEXT)  # ASCII: each character is one byte
    data = LMDataModule(
        source="text_files",
        paths=[str(folder / "corpus.txt")],
        tokenizer=tokenizer,
        bpe_vocab_size=300,
        block_size=16,
        batch_size=4,
        cache_dir=str(folder / "cache"),
    )
    data.prepare_data()
    data.setup()
    config = tiny_gpt_config(data.vocab_size, n_layer=1)
    module = LanguageModelModule(config.to_dict(), {"lr": 1e-3}, data.tokenizer.to_dict())
    return data, module


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_bits_per_char_is_loss_per_character_of_val_text(tmp_path, tokenizer):
    data, module = text_and_gpt(tmp_path, tokenizer)
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    metrics = trainer.validate(module, datamodule=data, verbose=False)[0]

    nats = chars = 0.0
    with torch.no_grad():
        for x, y in data.val_dataloader():
            logits, _ = module.model(x, y)
            nats += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            chars += sum(len(data.tokenizer.decode(row)) for row in y.tolist())
    assert metrics["val/bits_per_char"] == pytest.approx(nats / chars / math.log(2), rel=1e-4)
    tokens = sum(y.numel() for _, y in data.val_dataloader())
    assert metrics["val/loss"] == pytest.approx(nats / tokens, rel=1e-4)


class ValidationSteps(L.Callback):
    """The global step of every validation a run makes."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.steps.append(trainer.global_step)


def short_run(
    max_steps: int, val_check_interval: int, callback: L.Callback, sanity_steps: int = 0
) -> L.Trainer:
    """A CPU Trainer that validates one batch every val_check_interval steps, `sanity_steps`
    before training, with `callback` and nothing else attached (no logger, no checkpoints)."""
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        val_check_interval=val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=sanity_steps,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )


@pytest.mark.parametrize("max_steps, expected", [(7, [3, 6, 7]), (6, [3, 6])])
def test_the_last_step_is_validated_once_whatever_the_interval(tmp_path, max_steps, expected):
    data, module = text_and_gpt(tmp_path)
    validations = ValidationSteps()
    trainer = short_run(max_steps, 3, validations)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == max_steps
    assert validations.steps == expected


class CompiledGraphs(L.Callback):
    """How many graphs torch.compile had made when the sanity check ended."""

    def __init__(self, graphs: list) -> None:
        self.graphs = graphs
        self.after_sanity_check: int | None = None

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.after_sanity_check = len(self.graphs)


@pytest.mark.skipif(
    not hasattr(torch.compiler, "set_stance"), reason="torch.compiler.set_stance: torch 2.6+"
)
def test_the_sanity_check_runs_a_compiled_model_eagerly(tmp_path):
    data, module = text_and_gpt(tmp_path)
    grad_modes = []  # one per graph compiled: with gradients (training) or without (validation)

    def backend(graph: torch.fx.GraphModule, inputs: list) -> Callable:
        grad_modes.append(torch.is_grad_enabled())
        return graph.forward

    # torch.compile keeps at most 8 graphs of a function per process, whatever compiled them:
    # start from none, and leave none behind
    torch.compiler.reset()
    module.model.compile(backend=backend)  # in place, as train.py's compile=true does
    compiled = CompiledGraphs(grad_modes)
    trainer = short_run(max_steps=2, val_check_interval=2, callback=compiled, sanity_steps=1)
    try:
        trainer.fit(module, datamodule=data)
    finally:
        torch.compiler.reset()
    assert compiled.after_sanity_check == 0
    # the first step compiled the training graph, and the validation after it the no-grad one
    assert grad_modes == [True, False]


LINE = re.compile(
    r"step (\d+)/6 \(\d+%\)  train/loss \d+\.\d{4}(  val/loss \d+\.\d{4})?"
    r"(  tokens/s [\d,]+)?  \d+:\d\d in(, ~\d+:\d\d left)?"
)


@pytest.mark.parametrize(
    ("every_seconds", "expected"),
    [
        (1e9, [(3, True), (6, True)]),  # only the validations' lines, never the sanity check's
        # a line every step too, with no val/loss but just after a validation
        (
            1e-9,
            [(1, False), (2, False), (3, False), (3, True), (4, False), (5, False), (6, False)]
            + [(6, True)],
        ),
    ],
    ids=["validations", "every step"],
)
def test_a_log_gets_a_line_at_every_validation_and_every_so_often(
    tmp_path, capfd, every_seconds, expected
):
    data, module = text_and_gpt(tmp_path)
    capfd.readouterr()  # what preparing the data printed
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=6,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        callbacks=[LineProgress(every_seconds)],
        log_every_n_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    lines = capfd.readouterr().out.strip().splitlines()
    matches = [LINE.fullmatch(line) for line in lines]
    assert all(matches), lines
    steps = [(int(m[1]), m[2] is not None) for m in matches]
    assert steps == expected
    assert [m[4] is not None for m in matches] == [step < 6 for step, _ in steps]  # time left


def test_clock_reads_as_minutes_or_hours():
    assert [clock(s) for s in (0, 59.9, 61, 3599, 3600, 36_061)] == [
        "0:00",
        "0:59",
        "1:01",
        "59:59",
        "1:00:00",
        "10:01:01",
    ]


def validate(
    module: TrainingModule, batches: list, monkeypatch, sanity_checking: bool = False
) -> dict[str, float]:
    """What one validation of `batches` logs, through the module's own hooks in the trainer's
    order, with a stand-in for the trainer: a real one logs only inside its loops."""
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **_: logged.update({name: float(value)}))
    module.trainer = SimpleNamespace(sanity_checking=sanity_checking, datamodule=None)
    module.on_validation_start()
    with torch.no_grad():
        for index, batch in enumerate(batches):
            module.validation_step(batch, index)
    module.on_validation_epoch_end()
    return logged


def seq2seq_batch(module: Seq2SeqModule, rows: int, length: int, correct: list, scored: int):
    """A batch of `rows` pairs whose target_out holds the model's own prediction at the
    positions `correct` lists ((row, position) pairs), another id at the other positions
    before `scored` in each row, and -100 from there on."""
    words = module.tokenizer.vocab_size - FIRST_WORD
    source = torch.randint(FIRST_WORD, FIRST_WORD + words, (rows, length))
    target_in = torch.randint(FIRST_WORD, FIRST_WORD + words, (rows, length))
    target_in[:, 0] = BOS
    mask = torch.ones(rows, length, dtype=torch.bool)
    with torch.no_grad():
        predicted = module.model(source, target_in, mask, mask)[0].argmax(-1)
    target_out = FIRST_WORD + (predicted - FIRST_WORD + 1) % words  # never the prediction
    for row, position in correct:
        target_out[row, position] = predicted[row, position]
    target_out[:, scored:] = -100
    return {
        "source": source,
        "target_in": target_in,
        "source_mask": mask,
        "target_mask": mask,
        "target_out": target_out,
    }


def test_token_accuracy_is_correct_tokens_over_all_scored_tokens(monkeypatch):
    tokenizer = CharTokenizer(list("abcde"), specials=["<pad>", "<bos>", "<eos>"])
    config = tiny_encdec(tokenizer.vocab_size).config.to_dict()
    module = Seq2SeqModule(config, {"lr": 1e-3}, tokenizer.to_dict()).eval()
    monkeypatch.setattr(module, "decode_scores", lambda datamodule: (0.0, 0.0))
    # 2 of 2 scored tokens right, then 1 of 10: 3 of 12 in all, where the mean of the batches'
    # ratios (or of two ranks', one batch each) would be 0.55.
    batches = [
        seq2seq_batch(module, rows=1, length=4, correct=[(0, 0), (0, 1)], scored=2),
        seq2seq_batch(module, rows=2, length=5, correct=[(1, 3)], scored=5),
    ]
    logged = validate(module, batches, monkeypatch)
    assert logged["val/token_accuracy"] == pytest.approx(3 / 12)

    # val/loss weighs each batch's mean loss by its scored tokens
    with torch.no_grad():
        losses = [float(module.loss(batch)[0]) for batch in batches]
    assert logged["val/loss"] == pytest.approx((2 * losses[0] + 10 * losses[1]) / 12, rel=1e-5)

    # the next validation counts afresh
    assert validate(module, batches[1:], monkeypatch)["val/token_accuracy"] == pytest.approx(0.1)


def test_a_validation_logs_the_metrics_its_task_declares(monkeypatch):
    # validation_metrics is what train.py accepts as a checkpoint's `monitor`: a name logged but
    # not declared could not be monitored, and one declared but not logged would fail the run
    # at its first validation.
    tokenizer = CharTokenizer(list("abcde"), specials=["<pad>", "<bos>", "<eos>"])
    gpt = LanguageModelModule(
        tiny_gpt_config(tokenizer.vocab_size, n_layer=1).to_dict(),
        {"lr": 1e-3},
        tokenizer.to_dict(),
    )
    batch = (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    assert set(validate(gpt, [batch], monkeypatch)) == set(gpt.validation_metrics)

    config = tiny_encdec(tokenizer.vocab_size).config.to_dict()
    encdec = Seq2SeqModule(config, {"lr": 1e-3}, tokenizer.to_dict()).eval()
    monkeypatch.setattr(encdec, "decode_scores", lambda datamodule: (0.0, 0.0))
    batch = seq2seq_batch(encdec, rows=2, length=4, correct=[], scored=4)
    assert set(validate(encdec, [batch], monkeypatch)) == set(encdec.validation_metrics)


def test_a_nan_batch_makes_the_whole_validation_nan(monkeypatch):
    # One diverged batch among finite ones: the validation's figures are NaN, not the mean of
    # the batches left once it is dropped, which would hide the divergence.
    tokenizer = CharTokenizer(list("abcde"))
    config = tiny_gpt_config(tokenizer.vocab_size, n_layer=1).to_dict()
    module = LanguageModelModule(config, {"lr": 1e-3}, tokenizer.to_dict())
    losses = iter([1.5, math.nan, 2.5])
    monkeypatch.setattr(module, "loss", lambda batch: (torch.tensor(next(losses)), None, 8))
    batch = (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    logged = validate(module, [batch] * 3, monkeypatch)
    for name in ("val/loss", "val/perplexity", "val/bits_per_char"):
        assert math.isnan(logged[name]), name
    assert "val/best_loss" in logged and logged["val/best_loss"] == math.inf  # no finite result


def test_best_loss_is_the_lowest_finite_val_loss_and_survives_a_checkpoint(monkeypatch):
    tokenizer = CharTokenizer(list("abcde"))
    config = tiny_gpt_config(tokenizer.vocab_size, n_layer=1).to_dict()

    def new_module() -> LanguageModelModule:
        return LanguageModelModule(config, {"lr": 1e-3}, tokenizer.to_dict())

    def best_after(module: LanguageModelModule, loss: float, **options) -> float | None:
        """val/best_loss as logged by a validation whose loss is `loss`."""
        monkeypatch.setattr(module, "loss", lambda batch: (torch.tensor(loss), None, 8))
        batch = (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
        logged = validate(module, [batch], monkeypatch, **options)
        assert logged["val/loss"] == pytest.approx(loss, nan_ok=True)
        return logged.get("val/best_loss")

    module = new_module()
    # the sanity check's validation is no result: neither logged nor kept
    assert best_after(module, 0.1, sanity_checking=True) is None
    losses = [3.0, math.inf, 2.0, math.nan, -math.inf, 2.5, 1.5, 1.75]  # exact in float32
    expected = [3.0, 3.0, 2.0, 2.0, 2.0, 2.0, 1.5, 1.5]
    assert [best_after(module, loss) for loss in losses] == expected

    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    resumed = new_module()
    resumed.on_load_checkpoint(torch.load(buffer, weights_only=True))  # as checkpoints load
    assert best_after(resumed, 1.75) == 1.5
    assert best_after(resumed, 1.25) == 1.25

    # a checkpoint saved before val/best_loss existed starts from infinity
    older = new_module()
    older.on_load_checkpoint({"skipped_steps": 0})
    assert best_after(older, math.inf) == math.inf
    assert best_after(older, 9.0) == 9.0


@pytest.mark.parametrize("kind", ["gpt", "encdec"])
def test_throughput_counts_each_steps_real_tokens_on_every_rank(monkeypatch, kind):
    tokenizer = CharTokenizer(list("abcde"))
    if kind == "gpt":
        config = tiny_gpt_config(tokenizer.vocab_size, n_layer=1).to_dict()
        module = LanguageModelModule(config, {"lr": 1e-3}, tokenizer.to_dict())
        batch = (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
        tokens = 8
    else:
        config = tiny_encdec(tokenizer.vocab_size).config.to_dict()
        module = Seq2SeqModule(config, {"lr": 1e-3}, tokenizer.to_dict())
        words = torch.full((2, 5), FIRST_WORD)
        source_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
        target_mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
        batch = {
            "source": words,
            "target_in": words,
            "target_out": words,
            "source_mask": source_mask,
            "target_mask": target_mask,
        }
        tokens = 8 + 6  # the real tokens of both sides, padding left out
    logged = {}

    def log(name, value, **_):
        logged[name] = float(torch.as_tensor(value).detach())

    monkeypatch.setattr(module, "log", log)
    monkeypatch.setattr(module, "lr_schedulers", lambda: SimpleNamespace(get_last_lr=lambda: [1]))
    clock = iter([10.0, 11.0, 12.0, 14.0])  # the ends of steps 1 to 4
    # training.module's clock only: the process's own time.perf_counter stays for everyone else
    monkeypatch.setattr("training.module.time", SimpleNamespace(perf_counter=lambda: next(clock)))
    module.trainer = SimpleNamespace(world_size=2, log_every_n_steps=2, global_step=0, max_steps=10)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    rates = []
    for step in range(4):
        module.trainer.global_step = step
        module.training_step(batch, step)
        module.optimizer_step(0, step, optimizer)
        module.trainer.global_step = step + 1  # Lightning counts the step once it is taken
        module.on_train_batch_end(None, batch, step)
        rates.append(logged.pop("train/tokens_per_sec", None))
    # the window opens at step 1's end; step 2 adds 1 s, steps 3 and 4 add 3 s
    assert rates == [None, pytest.approx(2 * tokens / 1.0), None, pytest.approx(4 * tokens / 3.0)]


def test_throughput_is_logged_once_a_step_when_batches_accumulate(monkeypatch):
    tokenizer = CharTokenizer(list("abcde"))
    config = tiny_gpt_config(tokenizer.vocab_size, n_layer=1).to_dict()
    module = LanguageModelModule(config, {"lr": 1e-3}, tokenizer.to_dict())
    batch = (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    logged = []
    monkeypatch.setattr(module, "log", lambda name, value, **_: logged.append((name, value)))
    monkeypatch.setattr(module, "lr_schedulers", lambda: SimpleNamespace(get_last_lr=lambda: [1]))
    clock = iter([10.0, 11.5, 12.0, 14.0])  # the ends of 4 steps
    monkeypatch.setattr("training.module.time", SimpleNamespace(perf_counter=lambda: next(clock)))
    module.trainer = SimpleNamespace(world_size=1, log_every_n_steps=2, global_step=0, max_steps=9)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    rates = []
    for batch_idx in range(8):  # two batches a step: the optimizer steps after every second
        module.trainer.global_step = batch_idx // 2
        module.training_step(batch, batch_idx)
        if batch_idx % 2 == 1:
            module.optimizer_step(0, batch_idx, optimizer)
        module.trainer.global_step = (batch_idx + 1) // 2
        module.on_train_batch_end(None, batch, batch_idx)
        rates += [value for name, value in logged if name == "train/tokens_per_sec"]
        logged.clear()
    # the window opens at the first step's end; step 2 ends 1.5 s and 2 batches later, step 4
    # 2.5 s and 4 batches after that
    assert rates == [pytest.approx(2 * 8 / 1.5), pytest.approx(4 * 8 / 2.5)]


def test_a_steps_gradients_so_far_are_saved_and_come_back_to_their_rank(monkeypatch):
    # Lightning's hooks driven by hand: a checkpoint written between a backward and the step
    # holds the gradients (stacked over the ranks), one written once the step took them does
    # not; resumed, each rank gets its own back, or the ranks' mean on another number of ranks.
    tokenizer = CharTokenizer(list("abcde"))
    config = tiny_gpt_config(tokenizer.vocab_size, n_layer=1).to_dict()

    def started(checkpoint: dict, rank: int = 0, ranks: int = 1) -> LanguageModelModule:
        """A module loaded from `checkpoint`, as training starts on process `rank` of `ranks`."""
        module = LanguageModelModule(config, {"lr": 1e-3}, tokenizer.to_dict())
        module.trainer = SimpleNamespace(
            global_rank=rank, world_size=ranks, estimated_stepping_batches=10
        )
        scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
        monkeypatch.setattr(module, "lr_schedulers", lambda: scheduler)
        module.on_load_checkpoint(checkpoint)
        module.on_train_start()
        return module

    module = started({})
    batch = (torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    module.loss(batch)[0].backward()
    module.on_after_backward()
    gradients = {name: p.grad.clone() for name, p in module.named_parameters()}
    inside, after = {}, {}
    module.on_save_checkpoint(inside)
    module.on_before_optimizer_step(None)
    module.on_save_checkpoint(after)
    assert "partial_gradients" not in after  # the step took them: nothing to keep
    saved = inside["partial_gradients"]
    assert saved.keys() == gradients.keys()
    assert all(torch.equal(saved[name], gradient[None]) for name, gradient in gradients.items())

    buffer = io.BytesIO()
    torch.save(inside, buffer)
    buffer.seek(0)
    resumed = started(torch.load(buffer, weights_only=True))  # as checkpoints load
    for name, parameter in resumed.named_parameters():
        assert torch.equal(parameter.grad, gradients[name]), name
    assert all(parameter.grad is None for parameter in started(after).parameters())

    two = {"partial_gradients": {name: torch.stack([g, 3 * g]) for name, g in gradients.items()}}
    for rank, ranks, factor in [(1, 2, 3), (0, 1, 2), (3, 4, 2)]:
        resumed = started(two, rank, ranks)
        for name, parameter in resumed.named_parameters():
            assert torch.allclose(parameter.grad, factor * gradients[name]), (name, rank, ranks)
