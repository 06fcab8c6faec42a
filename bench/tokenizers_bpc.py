"""Char vs byte-level BPE on the embedded Shakespeare: the same model trained on the same number
of tokens, compared in validation bits per character (loss per token does not compare across
tokenizers). Extra arguments are train.py overrides, e.g. trainer=gpu or trainer.max_steps=400.

    python bench/tokenizers_bpc.py trainer.max_steps=400
"""

import sys

from runs import last, median_after, train


def main(overrides: list[str]) -> None:
    print("| data | vocab | val loss (nats/token) | val bits/char | tokens/s | wall s |")
    print("|---|---|---|---|---|---|")
    for data in ("shakespeare_char", "shakespeare_bpe"):
        seconds, rows = train(f"data={data}", *overrides)
        vocab = "char" if data.endswith("char") else "BPE"
        print(
            f"| {data} | {vocab} | {last(rows, 'val/loss'):.3f} | "
            f"{last(rows, 'val/bits_per_char'):.3f} | "
            f"{median_after(rows, 'train/tokens_per_sec', 5):,.0f} | {seconds:.0f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
