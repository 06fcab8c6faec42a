"""The LightningModule's validation metrics, through a real Trainer on real cached data."""

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from data.lm import LMDataModule
from helpers import tiny_gpt_config
from training.module import LanguageModelModule

TEXT = "\n\n".join(f"Speaker {i}:\nSome words, and more words; line {i % 7}." for i in range(200))


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_bits_per_char_is_loss_per_character_of_val_text(tmp_path, tokenizer):
    (tmp_path / "corpus.txt").write_text(TEXT)  # ASCII: each character is one byte
    data = LMDataModule(
        source="text_files",
        paths=[str(tmp_path / "corpus.txt")],
        tokenizer=tokenizer,
        bpe_vocab_size=300,
        block_size=16,
        batch_size=4,
        cache_dir=str(tmp_path / "cache"),
    )
    data.prepare_data()
    data.setup()
    config = tiny_gpt_config(data.vocab_size, n_layer=1)
    module = LanguageModelModule(config.to_dict(), {"lr": 1e-3}, data.tokenizer.to_dict())
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
