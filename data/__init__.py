"""Text source -> tokenizer -> cached token arrays -> batches: corpora, tokenizers and the
Lightning data modules that feed token blocks (language model) and padded (source, target)
pairs (encoder-decoder) to the models. Import what you need from its module (data.tokenizer,
data.lm, ...): this package imports nothing itself, so the tokenizer loads without datasets or
Lightning."""
