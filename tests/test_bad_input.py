"""Bad input through the real command line, one table: every case exits with status 1 and says
what is wrong in one line (Hydra's own composition errors in its few lines), never with a
traceback, and a checkpoint that would run code never does."""

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from data.tokenizer import CharTokenizer
from export import ExportOptions, export
from helpers import (
    SMALLEST_BASE,
    damage_checkpoint,
    read_only,
    run_script,
    save_checkpoint,
    tiny_encdec,
    write_hub_dataset,
)
from training.module import LanguageModelModule

# (id, script, overrides, what the message says). {tmp} is this module's folder of inputs,
# {run} a trained GPT's run directory. "hydra:" cases are Hydra's own multi-line messages.
CASES = [
    ("heads_not_dividing", "train.py", ["model.attention.n_head=3"],
     "error: model.n_embd=128 is not divisible by model.attention.n_head=3"),
    ("kv_heads_not_dividing", "train.py", ["model.attention.n_kv_head=3"],
     "error: model.attention.n_head=4 is not divisible by model.attention.n_kv_head=3"),
    ("rope_on_odd_heads", "train.py", ["model.position=rope", "model.n_embd=120",
                                       "model.attention.n_head=8"],
     "error: model.position=rope needs an even head dimension, but model.n_embd=120 / "
     "model.attention.n_head=8 = 15: make n_embd a multiple of 2 * n_head (model.n_embd=128, "
     "say), or use another position"),
    ("negative_lr", "train.py", ["optim.lr=-1"], "error: optim.lr must be > 0, got -1"),
    ("seed_not_a_number", "train.py", ["seed=abc"], "error: seed must be an integer"),
    # a GPU recipe is bad input only where torch finds no GPU
    *([] if torch.cuda.is_available() else [
        ("gpu_recipe_without_a_gpu", "train.py", ["experiment=gpu_fast"],
         "error: trainer.accelerator must be cpu or auto where torch finds no GPU "
         "(use trainer=cpu"),
    ]),
    # Lightning's own refusal of a TPU without torch_xla was a traceback
    *([] if importlib.util.find_spec("torch_xla") else [
        ("tpu_without_torch_xla", "train.py", ["trainer.accelerator=tpu"],
         "error: trainer.accelerator must be cpu or auto where torch finds no TPU (use "
         "trainer=cpu or trainer=ddp_cpu, or a TPU machine with torch_xla), got 'tpu'"),
    ]),
    ("seed_out_of_range", "train.py", ["seed=99999999999999"],
     "error: seed must be an integer in [0, 2**32), got 99999999999999"),
    ("lr_not_a_number", "train.py", ["optim.lr=abc"],
     "error: optim.lr must be a finite number, got 'abc'"),
    ("dropout_not_a_number", "train.py", ["model.dropout=high"],
     "error: model.dropout must be a finite number, got 'high'"),
    ("encdec_on_character_lm_data", "train.py", ["model=encdec", "data=shakespeare_char"],
     "error: model=encdec cannot train on data=shakespeare_char: use data=shakespeare_denoise"),
    ("zero_steps", "train.py", ["trainer.max_steps=0"],
     "error: trainer.max_steps must be a positive integer"),
    ("unknown_compile_mode", "train.py", ["compile=true", "compile_mode=fast"],
     "error: compile_mode must be one of default, reduce-overhead, max-autotune, "
     "max-autotune-no-cudagraphs, got 'fast'"),
    ("compile_mode_without_compile", "train.py", ["compile_mode=reduce-overhead"],
     "error: compile_mode must be default unless compile=true (add compile=true, or drop "
     "compile_mode), got 'reduce-overhead'"),
    # generate.py's options that the end-of-run sample cannot use fail before training, not after
    ("end_sample_on_a_gpu_graph", "train.py", ["+sample.cuda_graph=true"],
     "error: sample.cuda_graph=True is generate.py's option, not the end-of-run sample's: drop "
     "it (or set sample.cuda_graph=false), and after the run use python generate.py "
     "ckpt=<run dir> cuda_graph=..."),
    ("end_sample_by_beam_search", "train.py", ["sample.decoding=beam"],
     "error: sample.decoding='beam' is for generate.py on an encoder-decoder"),
    # the end-of-run sample's messages name train.py's keys, fix hints too
    ("end_sample_too_cold", "train.py", ["sample.temperature=0"],
     "error: sample.temperature must be > 0, got 0: use sample.decoding=greedy for argmax"),
    ("end_sample_empty_prompt", "train.py", ["sample.prompt=''"],
     "error: sample.prompt is empty: give at least one character, e.g. sample.prompt="),
    ("end_sample_nucleus_too_wide", "train.py", ["sample.top_p=1.5"],
     "error: sample.top_p must be in (0, 1] or null, got 1.5"),
    # Lightning's own options that it would take: ascent, a division by zero once training
    ("negative_clipping", "train.py", ["trainer.gradient_clip_val=-1"],
     "error: trainer.gradient_clip_val must be a number >= 0 or null, got -1"),
    ("validation_never", "train.py", ["trainer.val_check_interval=0"],
     "error: trainer.val_check_interval must be a positive integer (training batches), got 0"),
    ("logging_never", "train.py", ["trainer.log_every_n_steps=0"],
     "error: trainer.log_every_n_steps must be a positive integer, got 0"),
    # a metric the run never logs, or the wrong way round: Lightning would fail at the first
    # validation, or keep the worst checkpoint
    ("unknown_monitor", "train.py", ["callbacks.model_checkpoint.monitor=val/foo"],
     "error: callbacks.model_checkpoint.monitor must be a metric that validation logs for the "
     "gpt model (val/loss, val/perplexity, val/best_loss, val/bits_per_char), step or epoch, or "
     "null (keep the latest checkpoint only), got 'val/foo'"),
    ("monitor_a_training_metric", "train.py", ["callbacks.model_checkpoint.monitor=train/loss"],
     "error: callbacks.model_checkpoint.monitor must be a metric that validation logs for the "
     "gpt model (val/loss, "),
    ("monitor_the_other_kinds_metric", "train.py",
     ["model=encdec", "callbacks.model_checkpoint.monitor=val/bits_per_char"],
     "error: callbacks.model_checkpoint.monitor must be a metric that validation logs for the "
     "encdec model (val/loss, val/perplexity, val/best_loss, val/token_accuracy, "
     "val/exact_match, val/cer), step or epoch, or null"),
    ("monitor_the_wrong_way", "train.py",
     ["model=encdec", "callbacks.model_checkpoint.monitor=val/exact_match"],
     "error: callbacks.model_checkpoint.mode must be max for val/exact_match (its highest is its "
     "best), got 'min'"),
    ("unknown_mode", "train.py", ["callbacks.model_checkpoint.mode=lowest"],
     "error: callbacks.model_checkpoint.mode must be min for val/loss (its lowest is its best), "
     "got 'lowest'"),
    # without last.ckpt, ckpt_path=last started over and a new run wrote over the best checkpoint
    ("no_last_checkpoint", "train.py", ["callbacks.model_checkpoint.save_last=false"],
     "error: callbacks.model_checkpoint.save_last=false: last.ckpt is what a run continues from "
     "(ckpt_path=<run dir>, ckpt_path=last)"),
    ("early_stop_on_an_unknown_metric", "train.py",
     ["+callbacks.early_stop._target_=lightning.pytorch.callbacks.EarlyStopping",
      "+callbacks.early_stop.monitor=val/foo"],
     "error: callbacks.early_stop.monitor must be a metric that validation logs for the gpt model "
     "(val/loss, val/perplexity, val/best_loss, val/bits_per_char), step or epoch, got 'val/foo'"),
    # no option takes an infinite number: the run would end in NaN a step later
    ("infinite_lr", "train.py", ["optim.lr=inf"],
     "error: optim.lr must be a finite number, got inf"),
    ("infinite_scale", "train.py", ["model.attention.scale=inf"],
     "error: model.attention.scale must be a finite number or a string or null, got inf"),
    ("infinite_temperature", "train.py", ["sample.temperature=inf"],
     "error: sample.temperature must be a finite number, got inf"),
    # a key added with + that nothing takes: one line naming it and the keys there are
    # the end-of-run sample's options only: none of those it refuses or ignores (source, beam's)
    ("unknown_sample_key", "train.py", ["+sample.foo=1"],
     "error: sample.foo is not an option of sample; its options are prompt, max_new_tokens, "
     "decoding, temperature, top_k, top_p, num_samples, seed, use_cache"),
    ("end_sample_beam_width", "train.py", ["+sample.beam_size=2"],
     "error: sample.beam_size is not an option of sample; its options are prompt, "),
    ("unknown_optim_key", "train.py", ["+optim.foo=1"],
     "error: optim.foo is not an option of optim; its options are name, lr, "),
    ("unknown_attention_key", "train.py", ["+model.attention.foo=1"],
     "error: model.attention.foo is not an option of model.attention; its options are n_head, "),
    ("unknown_trainer_key", "train.py", ["+trainer.foo=1"],
     "error: trainer.foo is not an option of trainer; its options are accelerator, "),
    ("unknown_data_key", "train.py", ["+data.foo=1"],
     "error: data.foo is not an option of a GPT's data; its options are source, "),
    # an entry that is no logger or callback: the Trainer took it as one, in a traceback
    ("key_on_a_logger_not_chosen", "train.py", ["+logger.wandb.foo=1"],
     "error: logger.wandb is no logger of logger=none: drop logger.wandb.foo, or use "
     "logger=wandb"),
    ("callback_without_target", "train.py", ["+callbacks.foo.bar=1"],
     "error: callbacks.foo is no callback of callbacks=default: drop callbacks.foo.bar, or give "
     "callbacks.foo._target_"),
    ("callback_set_to_null", "train.py", ["callbacks.progress_bar=null"],
     "error: callbacks.progress_bar=null is no callback: to go without it, give "
     "~callbacks.progress_bar"),
    ("unknown_nonfinite_action", "train.py", ["on_nonfinite=ignore"],
     "error: on_nonfinite='ignore' is not one of stop, skip"),
    ("unknown_position", "train.py", ["model.position=spiral"], "error: model.position='spiral'"),
    ("zero_batch", "train.py", ["data.batch_size=0"],
     "error: data.batch_size must be a positive integer, got 0"),
    ("bad_precision", "train.py", ["trainer.precision=17"], "error: Precision 17 is invalid"),
    # on the CPU Lightning refused these with a TypeError, in Hydra's lines
    ("zero_devices", "train.py", ["trainer=cpu", "trainer.devices=0"],
     "error: trainer.devices must be a positive integer on the CPU (processes: trainer=ddp_cpu "
     "runs 2) or auto, got 0"),
    ("devices_not_a_number", "train.py", ["trainer=cpu", "trainer.devices=abc"],
     "error: trainer.devices must be a positive integer on the CPU"),
    ("gpu_ids_on_the_cpu", "train.py", ["trainer=cpu", "trainer.devices=[0]"],
     "error: trainer.devices must be a positive integer on the CPU"),
    # Lightning took these without a word: training nothing, or a sanity check of -5 batches
    ("no_training_batches", "train.py", ["+trainer.limit_train_batches=0"],
     "error: trainer.limit_train_batches must be a positive integer (batches) or a fraction in "
     "(0, 1], got 0"),
    ("negative_validation_batches", "train.py", ["trainer.limit_val_batches=-1"],
     "error: trainer.limit_val_batches must be an integer >= 0 (batches; 0: no validation) or a "
     "fraction in [0, 1], got -1"),
    ("negative_sanity_check", "train.py", ["trainer.num_sanity_val_steps=-5"],
     "error: trainer.num_sanity_val_steps must be an integer >= 0 (validation batches before "
     "training), or -1 for all of them, got -5"),
    # a folder that cannot be made: the run trained, then failed at its first checkpoint
    ("checkpoints_under_a_file", "train.py",
     ["callbacks.model_checkpoint.dirpath={tmp}/table.csv/checkpoints"],
     "error: callbacks.model_checkpoint.dirpath={tmp}/table.csv/checkpoints cannot be written "
     "(Not a directory in {tmp}/table.csv): give callbacks.model_checkpoint.dirpath= a "
     "directory on a disk you can write to"),
    # a traceback once the sanity check was done, on a terminal only (elsewhere unused)
    ("progress_refresh_not_a_number", "train.py", ["callbacks.progress_bar.refresh_rate=abc"],
     "error: callbacks.progress_bar.refresh_rate must be a non-negative integer, got 'abc'"),
    ("unknown_model_choice", "train.py", ["model=transformer"],
     "hydra:Could not find 'model/transformer'"),
    ("unknown_key", "train.py", ["model.n_layr=2"], "hydra:Key 'n_layr' is not in struct"),
    ("missing_data_file", "train.py", ["data=text_files", "data.paths=[{tmp}/nope.txt]"],
     "error: data.paths: no file at {tmp}/nope.txt; check the path"),
    ("no_matching_files", "train.py", ["data=text_files", "data.paths=[{tmp}/nope*.txt]"],
     "error: data.paths: no file matches '{tmp}/nope*.txt'"),
    ("empty_corpus", "train.py", ["data=text_files", "data.paths=[{tmp}/empty.txt]"],
     "error: data.paths: every file is empty ({tmp}/empty.txt)"),
    # a file that `datasets` cannot read (after its progress bar): a traceback that named neither
    # the file nor the line
    ("pairs_line_not_json", "train.py",
     ["model=encdec", "data=pairs", "data.paths=[{tmp}/pairs.jsonl,{tmp}/cut_off.jsonl]"],
     "error: data.paths: cannot read {tmp}/cut_off.jsonl (line 301 is not JSON: Unterminated "
     "string starting at column 19); check that it is JSON Lines, one object per line, or a "
     "JSON array of objects"),
    # read only as the stream reaches it, long after the read that names a file: it named none
    ("streamed_file_not_utf8", "train.py",
     ["data=text_files", "data.streaming=true", "data.paths=[{tmp}/lines.txt,{tmp}/not_utf8.txt]"],
     "error: data.paths: cannot read {tmp}/not_utf8.txt ('utf-8' codec can't decode byte 0xff in "
     "position 1200: invalid start byte); check that it is UTF-8 text"),
    # pages that pyarrow cannot read behind a footer that reads: a traceback
    # `datasets`' words alone, naming neither the option nor a fix
    ("hub_folder_without_data", "train.py", ["data=hub", "data.name={tmp}/no_data_hub"],
     "error: data.name={tmp}/no_data_hub: "),
    ("hub_name_of_a_text_file", "train.py", ["data=hub", "data.name={tmp}/table.csv"],
     "error: data.name={tmp}/table.csv: "),
    ("hub_file_damaged", "train.py", ["data=hub", "data.name={tmp}/damaged_hub"],
     "error: data.name: cannot read {tmp}/damaged_hub/data/validation-00000-of-00001.parquet "
     "(Couldn't deserialize thrift"),
    # by the bytes of its text once read, before the tokenizer is trained (once tokenized, it was)
    ("hub_shorter_than_a_block", "train.py", ["data=hub", "data.name={tmp}/short_hub"],
     "error: data.name holds 27 bytes of text (the train split of {tmp}/short_hub), so fewer than "
     "the 258 tokens that data.block_size=128 needs: a block and the token after it to train on "
     "and as many to validate on; add text or lower model.block_size"),
    ("pairs_csv_line_too_long", "train.py",
     ["model=encdec", "data=pairs", "data.paths=[{tmp}/pairs.csv]"],
     "error: data.paths: cannot read {tmp}/pairs.csv (Error tokenizing data. C error: Expected 2 "
     "fields in line 302, saw 3); check that no line has more fields than the header and every "
     "quote is closed"),
    ("cache_through_a_file", "train.py", ["paths.cache_dir={tmp}/short.txt/cache"],
     "error: the data cache {tmp}/short.txt/cache cannot be written (Not a directory in "
     "{tmp}/short.txt): give a folder that can be written: TINYFORMER_CACHE=/other/dir"),
    ("vocab_smaller_than_tokenizer", "train.py", ["model.vocab_size=10"],
     "error: model.vocab_size=10 is smaller than the tokenizer's"),
    ("data_block_apart_from_the_model", "train.py", ["data.block_size=64"],
     "error: data.block_size=64 differs from model.block_size=128: drop data.block_size (it "
     "follows model.block_size), or set model.block_size=64"),
    ("encdec_given_a_sample_option", "train.py", ["model=encdec", "sample.prompt=hello"],
     "error: sample.prompt is for a GPT's end-of-run sample; an encoder-decoder's decodes "
     "validation sources: drop sample.prompt"),
    ("padded_encdec_vocab", "train.py", ["model=encdec", "model.vocab_size=500"],
     "error: model.vocab_size=500: only the GPT's vocabulary can be padded"),
    ("resume_with_another_vocab_size", "train.py",
     ["ckpt_path={run}", "model.vocab_size=128", "trainer.max_steps=1000"],
     "error: ckpt_path={run}/checkpoints/last.ckpt has a "),
    ("missing_checkpoint", "train.py", ["ckpt_path={tmp}/nope.ckpt"],
     "error: ckpt_path={tmp}/nope.ckpt: no checkpoint at {tmp}/nope.ckpt"),
    ("checkpoint_that_runs_code", "train.py", ["ckpt_path={tmp}/evil.ckpt"],
     "error: {tmp}/evil.ckpt is not a readable tinyformer checkpoint"),
    ("truncated_checkpoint", "train.py", ["ckpt_path={tmp}/truncated.ckpt"],
     "error: {tmp}/truncated.ckpt is not a readable tinyformer checkpoint"),
    ("foreign_checkpoint", "train.py", ["ckpt_path={tmp}/foreign.ckpt"],
     "error: ckpt_path={tmp}/foreign.ckpt was not written by train.py"),
    # init_from: a new run from a trained GPT's weights
    ("init_from_nothing", "train.py", ["init_from={tmp}/nope"],
     "error: init_from={tmp}/nope: no checkpoint at {tmp}/nope"),
    ("init_from_a_checkpoint_that_runs_code", "train.py", ["init_from={tmp}/evil.ckpt"],
     "error: {tmp}/evil.ckpt is not a readable tinyformer checkpoint"),
    ("init_from_another_shape", "train.py", ["init_from={run}", "model.n_layer=3"],
     "error: init_from={run}: its weights do not fit this run's model"),
    ("init_from_another_position_scheme", "train.py", ["init_from={run}", "model.position=rope"],
     "error: init_from={run}: model.position='rope' (the source's: 'learned') changes what its "
     "weights compute"),
    # the weights' shapes kept, but not what they compute
    ("init_from_another_head_split", "train.py", ["init_from={run}", "model.attention.n_head=2"],
     "error: init_from={run}: model.attention.n_head=2 (the source's: 4) changes what its "
     "weights compute; drop those model.* overrides to start from the source's model"),
    ("init_from_another_attention_scale", "train.py",
     ["init_from={run}", "model.attention.scale=1.0"],
     "error: init_from={run}: model.attention.scale=1.0 (the source's: null) changes what its "
     "weights compute"),
    ("init_from_and_ckpt_path", "train.py", ["init_from={run}", "ckpt_path={run}"],
     "error: init_from={run} starts a new run from a model's weights and ckpt_path="),
    # files that are no tokenizer.json: the extras file beside one was a KeyError in Hydra's
    # lines, and the others named neither the option nor a fix
    ("tokenizer_file_the_extras_beside_it", "train.py",
     ["data.tokenizer_file={run}/tinyformer_tokenizer.json"],
     "error: data.tokenizer_file={run}/tinyformer_tokenizer.json: {run}/tinyformer_tokenizer.json "
     "holds the type and special tokens that tinyformer saves beside a tokenizer.json: give that "
     "file ({run}/tokenizer.json)"),
    ("tokenizer_file_other_json", "train.py", ["data.tokenizer_file={run}/summary.json"],
     "error: data.tokenizer_file={run}/summary.json: {run}/summary.json is JSON but no tokenizer "
     "file: give a tokenizer.json that tinyformer saved (a run's, or an export's)"),
    ("tokenizer_file_not_json", "train.py", ["data.tokenizer_file={tmp}/table.csv"],
     "error: data.tokenizer_file={tmp}/table.csv: {tmp}/table.csv cannot be read as a tokenizer "
     "file (Expecting value: line 1 column 1 (char 0)): give a tokenizer.json that tinyformer "
     "saved"),
    ("init_from_with_a_tokenizer_file", "train.py",
     ["init_from={run}", "data.tokenizer_file={run}/tokenizer.json"],
     "error: data.tokenizer_file={run}/tokenizer.json: init_from={run} brings its own tokenizer"),
    # a given char tokenizer lacks characters of the training text: all named, and who gave it
    ("init_from_text_in_other_characters", "train.py",
     ["init_from={run}", "data=text_files", "data.paths=[{tmp}/other_characters.txt]"],
     "error: init_from={run}: its char tokenizer has no id for 3 character(s) of the training "
     "text: '{{', '}}', '☃'; remove them from the text, or let a run without that tokenizer "
     "train one on it"),
    ("tokenizer_file_for_text_in_other_characters", "train.py",
     ["data.tokenizer_file={run}/tokenizer.json", "data=text_files",
      "data.paths=[{tmp}/other_characters.txt]"],
     "error: data.tokenizer_file={run}/tokenizer.json: its char tokenizer has no id for 3 "),
    ("init_from_with_another_tokenizer", "train.py",
     ["init_from={run}", "data.tokenizer=bpe"],
     "error: data.tokenizer=bpe: init_from={run} brings its own tokenizer"),
    ("init_from_into_an_encdec", "train.py",
     ["init_from={run}", "model=encdec", "data=shakespeare_denoise"],
     "error: init_from={run} starts a GPT run, and this run trains an encoder-decoder: drop "
     "model=encdec"),
    ("init_from_an_encdec", "train.py", ["init_from={tmp}/encdec.ckpt"],
     "error: init_from={tmp}/encdec.ckpt holds an encoder-decoder: init_from starts a GPT run "
     "from a GPT's weights only"),
    ("unimportable_callback", "train.py", ["callbacks.model_checkpoint._target_=foo.Bar"],
     "error: callbacks.model_checkpoint._target_='foo.Bar' cannot be imported "
     "(ModuleNotFoundError: No module named 'foo'): give a class's import path, as configs/ do"),
    ("unimportable_trainer", "train.py", ["trainer._target_=lightning.NoTrainer"],
     "error: trainer._target_='lightning.NoTrainer' cannot be imported"),
    ("checkpoint_of_another_kind", "train.py",
     ["ckpt_path={run}", "model=encdec", "data=shakespeare_denoise"],
     "error: ckpt_path={run}/checkpoints/last.ckpt holds a GPT and this command asks for an "
     "encoder-decoder"),
    # an empty path (a shell variable not set) was the current directory: an export wrote there
    ("empty_ckpt", "generate.py", ["ckpt="],
     "error: give ckpt=: the directory of a run that saved checkpoints"),
    ("empty_prompt_file", "generate.py", ["ckpt={run}", "prompt_file="],
     "error: prompt_file= is empty: give a text file's path, or drop it"),
    ("empty_export_out", "export.py", ["ckpt={run}", "out="],
     "error: out= is empty: give the directory to write the export to"),
    ("negative_max_new_tokens", "generate.py", ["ckpt={run}", "max_new_tokens=-1"],
     "error: max_new_tokens must be a non-negative integer, got -1"),
    ("top_p_above_one", "generate.py", ["ckpt={run}", "top_p=1.5"],
     "error: top_p must be in (0, 1] or null, got 1.5"),
    ("top_p_zero", "generate.py", ["ckpt={run}", "top_p=0"],
     "error: top_p must be in (0, 1] or null, got 0"),
    ("prompt_with_an_interpolation", "generate.py", ["ckpt={run}", 'prompt="${{x}}"'],
     "error: prompt: Interpolation key 'x' not found: Hydra reads ${{...}} in a value as an "
     "interpolation; write \\${{...}} to keep it as text"),
    ("sample_prompt_with_an_interpolation", "train.py", ['sample.prompt="${{x}}"'],
     "error: Interpolation key 'x' not found: Hydra reads ${{...}} in a value as an "
     "interpolation; write \\${{...}} to keep it as text"),
    ("seed_beyond_its_range", "generate.py", ["ckpt={run}", "seed=18446744073709551616"],
     "error: seed must be an integer in [0, 2**32), got 18446744073709551616"),
    ("temperature_not_a_number", "generate.py", ["ckpt={run}", "temperature=hot"],
     "error: temperature must be a finite number, got 'hot'"),
    ("cuda_graph_without_cache", "generate.py",
     ["ckpt={run}", "cuda_graph=true", "use_cache=false"],
     "error: cuda_graph=true replays a KV-cache step: it needs use_cache=true"),
    ("cuda_graph_on_the_cpu", "generate.py", ["ckpt={run}", "cuda_graph=true", "device=cpu"],
     "error: cuda_graph=true needs a GPU, and decoding runs on cpu: use device=cuda"),
    ("compile_without_cuda_graph", "generate.py", ["ckpt={run}", "compile=true"],
     "error: compile=true compiles the step that cuda_graph=true replays: add cuda_graph=true"),
    ("attention_plot_not_an_image", "generate.py", ["ckpt={run}", "attention_plot={tmp}/x.ckpt"],
     "error: attention_plot must be an image path ending in .png, .pdf, .svg, "),
    ("prompt_file_a_folder", "generate.py", ["ckpt={run}", "prompt_file={tmp}"],
     "error: prompt_file={tmp} is a folder: give a text file"),
    ("unknown_generate_key", "generate.py", ["ckpt={run}", "+foo=1"],
     "error: foo is not an option of generate.py; its options are ckpt, device, prompt, "),
    ("unknown_evaluate_key", "evaluate.py", ["ckpt={run}", "+foo=1"],
     "error: foo is not an option of evaluate.py; its options are ckpt, device, batch_size, "),
    ("unknown_export_key", "export.py", ["ckpt={run}", "out={tmp}/export", "+foo=1"],
     "error: foo is not an option of export.py; its options are "),
    ("zero_temperature", "generate.py", ["ckpt={run}", "temperature=0"],
     "error: temperature must be > 0, got 0: use decoding=greedy for argmax"),
    ("prompt_outside_vocabulary", "generate.py", ["ckpt={run}", "prompt='ROMEO☃'"],
     "error: prompt='ROMEO☃': text contains 1 character(s) not in the vocabulary: '☃'"),
    ("beam_search_on_a_gpt", "generate.py", ["ckpt={run}", "decoding=beam"],
     "error: decoding=beam is for encoder-decoder checkpoints"),
    ("source_for_a_gpt", "generate.py", ["ckpt={run}", "source=hello"],
     "error: {run}/checkpoints/"),
    ("unknown_device", "generate.py", ["ckpt={run}", "device=tpu"],
     "error: device='tpu' is not one of auto, cpu, cuda"),
    ("generate_without_checkpoint", "generate.py", ["prompt=hi"],
     "error: give ckpt=: the directory of a run that saved checkpoints"),
    ("evaluate_with_another_tokenizer", "evaluate.py",
     ["ckpt={run}", "data=text_files", "data.paths=[{tmp}/lines.txt]", "data.tokenizer=bpe"],
     "error: data.tokenizer=bpe: evaluate.py scores {run}/checkpoints/"),
    ("evaluate_with_a_tokenizer_file", "evaluate.py",
     ["ckpt={run}", "+data.tokenizer_file={run}/tokenizer.json"],
     "error: data.tokenizer_file={run}/tokenizer.json: evaluate.py scores {run}/checkpoints/"),
    ("evaluate_without_checkpoint", "evaluate.py", [],
     "error: give ckpt=: the directory of a run that saved checkpoints"),
    ("null_checkpoint", "generate.py", ["ckpt=null"], "error: give ckpt=: "),
    ("checkpoint_hydra_reads_as_a_number", "evaluate.py", ["ckpt=0"],
     "error: ckpt=0 is not text: Hydra reads numbers and true/false as such; quote it, "
     "e.g. 'ckpt=\"0\"'"),
    ("checkpoint_missing_a_weight", "generate.py", ["ckpt={tmp}/missing_weight.ckpt"],
     "error: {tmp}/missing_weight.ckpt does not hold the weights of its own model config "
     "(RuntimeError: Error(s) in loading state_dict for GPT: Missing key(s)"),
    ("generate_missing_checkpoint", "generate.py", ["ckpt={tmp}/nope"],
     "error: ckpt={tmp}/nope: no checkpoint at {tmp}/nope; give the directory of a run that "
     "saved checkpoints (runs live under outputs/) or a .ckpt file"),
    ("generate_from_a_folder_without_checkpoints", "generate.py", ["ckpt={tmp}/no_checkpoints"],
     "error: ckpt={tmp}/no_checkpoints: no best*.ckpt or last.ckpt in {tmp}/no_checkpoints; "),
    ("generate_damaged_checkpoint", "generate.py", ["ckpt={tmp}/damaged.ckpt"],
     "error: {tmp}/damaged.ckpt is damaged: its archive/data/"),
    ("resume_damaged_checkpoint", "train.py",
     ["ckpt_path={tmp}/damaged/checkpoints/last.ckpt", "trainer.max_steps=100"],
     "error: {tmp}/damaged/checkpoints/last.ckpt is damaged: its archive/data/"),
    ("generate_a_model_of_another_version", "generate.py", ["ckpt={tmp}/unknown_setting.ckpt"],
     "error: {tmp}/unknown_setting.ckpt holds a model this version cannot build: model.foo is "
     "not an option of GPTConfig"),
    ("init_from_a_model_of_another_version", "train.py", ["init_from={tmp}/unknown_setting.ckpt"],
     "error: {tmp}/unknown_setting.ckpt holds a model this version cannot build: "),
    ("generate_checkpoint_that_runs_code", "generate.py", ["ckpt={tmp}/evil.ckpt"],
     "error: {tmp}/evil.ckpt is not a readable tinyformer checkpoint"),
    ("generate_foreign_checkpoint", "generate.py", ["ckpt={tmp}/foreign.ckpt"],
     "error: {tmp}/foreign.ckpt is not a tinyformer checkpoint (TypeError: a Tensor, not a dict)"),
    ("generate_truncated_checkpoint", "generate.py", ["ckpt={tmp}/truncated.ckpt"],
     "error: {tmp}/truncated.ckpt is not a readable tinyformer checkpoint"),
    ("prompt_and_prompt_file", "generate.py",
     ["ckpt={run}", "prompt=ROMEO:", "prompt_file={tmp}/prompt.txt"],
     "error: prompt='ROMEO:' and prompt_file={tmp}/prompt.txt both give the prompt: keep one"),
    ("missing_prompt_file", "generate.py", ["ckpt={run}", "prompt_file={tmp}/nope.txt"],
     "error: prompt_file={tmp}/nope.txt: no file at {tmp}/nope.txt"),
    ("interactive_with_source", "generate.py", ["ckpt={run}", "interactive=true", "source=hi"],
     "error: interactive=true reads its input from stdin, one a line: drop source='hi'"),
    ("export_unknown_format", "export.py", ["ckpt={run}", "out={tmp}/export", "format=onnx"],
     "error: format='onnx' is not one of safetensors, hf"),
    ("export_without_out", "export.py", ["ckpt={run}"],
     "error: give out=: python export.py ckpt=<run dir, .ckpt or export> out=<new directory>"),
    ("export_into_other_files", "export.py", ["ckpt={run}", "out={tmp}"],
     "error: out={tmp} is not empty and holds no earlier export: give a new directory, or add "
     "overwrite=true"),
    ("export_into_its_run", "export.py", ["ckpt={run}", "out={run}", "overwrite=true"],
     "error: out={run} holds the checkpoint it exports"),
    ("resume_from_an_export", "train.py", ["ckpt_path={tmp}/export_of_run"],
     "error: ckpt_path={tmp}/export_of_run is an export, which holds the weights only"),
]  # fmt: skip

# train.py's mistakes in data.* that only reading the data finds, refused in one line that holds
# the message before any progress bar of `datasets` reading the files (drawn in the tests' pipes,
# as on a terminal, by HF_DATASETS_DISABLE_PROGRESS_BARS=0) and any training step: files checked
# with the config (a file's columns by its header, schema or first rows), a text too small for
# the blocks by its files' sizes, a Hub dataset's splits by its files' names and its columns by
# its card (or its files' schema), the batch before the sanity check. The default corpus is
# prepared already (the trained run's); the others are read by no other case.
BEFORE_ANY_BAR = [
    ("unsupported_file_after_a_readable_one",
     ["data=text_files", "data.paths=[{tmp}/lines.txt,{tmp}/table.csv]"],
     "error: data.paths: {tmp}/table.csv has an unsupported extension; use one of .txt, .md, "
     ".jsonl"),
    # a file's first rows tell its columns: a file without the column is refused before the
    # files before it are read (pairs read them all at once, and failed in a traceback)
    ("jsonl_without_the_text_column",
     ["data=text_files", "data.paths=[{tmp}/lines.txt,{tmp}/rows.jsonl]"],
     "error: data.text_column='text' is not a column of {tmp}/rows.jsonl; available columns: "
     "['body']; set data.text_column"),
    # pairs' files are one dataset, whose files must share their columns: a file of others is
    # named with the first, not as a column to set (which the first file would then lack)
    ("pairs_file_without_the_columns",
     ["model=encdec", "data=pairs", "data.paths=[{tmp}/pairs.jsonl,{tmp}/questions.jsonl]"],
     "error: data.paths: {tmp}/questions.jsonl has the columns ['question', 'answer'] and "
     "{tmp}/pairs.jsonl has ['source', 'target'], but the files of a dataset must share their "
     "columns"),
    ("hub_split_not_there", ["data=hub", "data.name={tmp}/hub", "data.val_split=dev"],
     "error: data.val_split: {tmp}/hub has no split named 'dev'; its splits are ['train', 'test']"),
    ("hub_column_not_there", ["data=hub", "data.name={tmp}/carded_hub", "data.text_column=body"],
     "error: data.text_column='body' is not a column of the Hub dataset {tmp}/carded_hub; "
     "available columns: ['text']; set data.text_column"),
    # without a card, by the schema of each split's first file
    ("hub_column_not_there_without_a_card",
     ["data=hub", "data.name={tmp}/hub", "data.text_column=body"],
     "error: data.text_column='body' is not a column of "
     "{tmp}/hub/data/train-00000-of-00001.parquet; available columns: ['text']; set "
     "data.text_column"),
    # files of other columns, whichever the text column: it is the files that disagree
    ("hub_splits_of_other_columns", ["data=hub", "data.name={tmp}/mixed_hub"],
     "error: data.name: {tmp}/mixed_hub/data/validation-00000-of-00001.parquet has the columns "
     "['body'] and {tmp}/mixed_hub/data/train-00000-of-00001.parquet has ['text'], but the files "
     "of a dataset must share their columns"),
    # by the files' sizes: no tokenizer makes more tokens than a text has bytes
    ("corpus_shorter_than_a_block",
     ["data=text_files", "data.paths=[{tmp}/short.txt]", "model.block_size=256"],
     "error: data.paths holds 258 bytes of text ({tmp}/short.txt), so fewer than the 514 tokens "
     "that data.block_size=256 needs: a block and the token after it to train on and as many to "
     "validate on; add text or lower model.block_size"),
    # after the number of training examples, which the version of the plays sets
    ("batch_larger_than_the_data", ["data.batch_size=100000000"],
     " training examples make no full batch of data.batch_size=100000000 on each of 1 "
     "process(es): lower data.batch_size or add data"),
]  # fmt: skip
# What tqdm draws of a bar, whichever library's: its time and rate, "[00:01<00:02, ..."
PROGRESS_BAR = re.compile(r"\[\d\d:\d\d[<,]")


# A dataset card that declares the columns, as a Hub dataset's README does
CARD = "---\ndataset_info:\n  features:\n  - name: text\n    dtype: string\n---\n"


class RunsCode:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, trained_run, shared_cache) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("bad_inputs")
    (tmp / "empty.txt").write_text("")
    (tmp / "no_checkpoints").mkdir()
    (tmp / "short.txt").write_text("\n\n".join(f"line {i}" for i in range(30)))
    torch.save({"state_dict": {}, "payload": RunsCode(tmp / "pwned")}, tmp / "evil.ckpt")
    torch.save(torch.ones(3), tmp / "foreign.ckpt")
    last = (trained_run / "checkpoints" / "last.ckpt").read_bytes()
    (tmp / "truncated.ckpt").write_bytes(last[: len(last) // 2])
    (tmp / "damaged.ckpt").write_bytes(last)
    damage_checkpoint(tmp / "damaged.ckpt")
    shutil.copytree(trained_run, tmp / "damaged")  # a run whose last checkpoint went bad
    damage_checkpoint(tmp / "damaged" / "checkpoints" / "last.ckpt")
    checkpoint = torch.load(trained_run / "checkpoints" / "last.ckpt", weights_only=True)
    checkpoint["state_dict"].pop(next(k for k in checkpoint["state_dict"] if "mlp" in k))
    torch.save(checkpoint, tmp / "missing_weight.ckpt")
    checkpoint["hyper_parameters"]["model"]["foo"] = 1  # a setting of a later version
    torch.save(checkpoint, tmp / "unknown_setting.ckpt")
    words = CharTokenizer.from_text("a b", specials=("<pad>", "<bos>", "<eos>", "<mask>"))
    save_checkpoint(tiny_encdec(words.vocab_size), words, tmp / "encdec.ckpt")
    (tmp / "prompt.txt").write_text("ROMEO:")
    (tmp / "lines.txt").write_text("\n\n".join(f"line {i}" for i in range(300)))
    other = [f"line {i}" for i in range(300)]
    other[3] += " {braced}"  # characters Shakespeare's text lacks, in two paragraphs
    other[200] += " \u2603"
    (tmp / "other_characters.txt").write_text("\n\n".join(other))
    (tmp / "table.csv").write_text("a,b\n1,2\n")
    (tmp / "rows.jsonl").write_text("".join(f'{{"body": "row {i}"}}\n' for i in range(300)))
    pair = '{"source": "a b", "target": "b a"}\n'
    (tmp / "pairs.jsonl").write_text(pair * 300)
    (tmp / "cut_off.jsonl").write_text(pair * 300 + '{"source": "a b", "tar\n')
    (tmp / "pairs.csv").write_text("source,target\n" + "a b,b a\n" * 300 + "a b,b a,c\n")
    (tmp / "questions.jsonl").write_text('{"question": "a b?", "answer": "b a"}\n' * 300)
    for hub in ("hub", "carded_hub"):
        write_hub_dataset(tmp / hub, {"train": ["some text"] * 300, "test": ["more"] * 30})
    (tmp / "carded_hub" / "README.md").write_text(CARD)
    write_hub_dataset(tmp / "mixed_hub", {"train": ["some text"] * 300})
    write_hub_dataset(tmp / "mixed_hub", {"validation": ["more"] * 30}, column="body")
    (tmp / "not_utf8.txt").write_bytes(b"some words\n\n" * 100 + b"\xff\xfe\n")
    write_hub_dataset(tmp / "damaged_hub", {"train": ["some text"] * 300, "validation": ["more"]})
    damaged = tmp / "damaged_hub" / "data" / "validation-00000-of-00001.parquet"
    data = bytearray(damaged.read_bytes())
    data[8:40] = b"\xff" * 32  # the first page's header, just after the magic bytes
    damaged.write_bytes(bytes(data))
    write_hub_dataset(tmp / "short_hub", {"train": ["some text"] * 3})
    (tmp / "no_data_hub").mkdir()
    export(ExportOptions(ckpt=str(trained_run), out=str(tmp / "export_of_run")))
    return {"tmp": tmp, "run": trained_run, "cache": shared_cache}


@pytest.mark.slow
@pytest.mark.parametrize(("script", "overrides", "message"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_input_gets_one_line_and_status_1(inputs, tmp_path, script, overrides, message):
    def fill(text: str) -> str:
        return text.format(tmp=inputs["tmp"], run=inputs["run"])

    overrides = [fill(o) for o in overrides]
    if script == "train.py":
        overrides += ["logger=none", f"hydra.run.dir={tmp_path / 'failed_run'}"]
    result = run_script(script, *overrides, cache_dir=inputs["cache"])
    assert_refused(result, fill(message))
    assert not (inputs["tmp"] / "pwned").exists(), "a checkpoint ran code"


@pytest.mark.slow
@pytest.mark.parametrize(("overrides", "message"), [c[1:] for c in BEFORE_ANY_BAR],
                         ids=[c[0] for c in BEFORE_ANY_BAR])  # fmt: skip
def test_data_mistakes_are_refused_before_any_progress_bar(inputs, tmp_path, overrides, message):
    overrides = [o.format(tmp=inputs["tmp"]) for o in overrides]
    run_dir = f"hydra.run.dir={tmp_path / 'failed_run'}"
    bars = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "0"}
    result = run_script(
        "train.py", *overrides, "logger=none", run_dir, cache_dir=inputs["cache"], env=bars
    )
    assert_refused(result, "error: ")
    assert message.format(tmp=inputs["tmp"]) in result.stderr.splitlines()[-1]
    assert not PROGRESS_BAR.search(result.stdout + result.stderr), result.stderr[-3000:]
    assert "step " not in result.stdout  # no progress line: no step trained


@pytest.mark.slow
@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_an_output_dir_on_a_read_only_disk_is_one_line(shared_cache, tmp_path, key):
    disk = tmp_path / "disk"
    disk.mkdir()
    multirun = ["-m"] if key == "hydra.sweep.dir" else []
    with read_only(disk):
        result = run_script(
            "train.py", *multirun, f"{key}={disk / 'run'}", "logger=none", cache_dir=shared_cache
        )
    assert_refused(
        result,
        f"error: {key}={disk / 'run'} cannot be written (Read-only file system in {disk}): give "
        f"{key}= a directory on a disk you can write to",
    )


def assert_refused(result: subprocess.CompletedProcess, message: str) -> None:
    """The command exited with status 1 and no traceback, its last word the one line that
    starts with `message` (a "hydra:" message: Hydra's own few lines hold it)."""
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    if message.startswith("hydra:"):
        assert message.removeprefix("hydra:") in result.stderr
        assert "Set the environment variable HYDRA_FULL_ERROR=1" in result.stderr
    else:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(message), result.stderr[-3000:]
        # The message is the run's last word: nothing after it.
        assert result.stderr.strip().splitlines()[-1] == errors[0]
    # A mistake ends the run before Lightning or W&B say anything (they would not, in any case).
    assert "GPU available" not in result.stdout and "wandb:" not in result.stderr


def test_a_monitor_the_run_never_logs_fails_before_the_data_loads(tmp_path):
    # Lightning finds the metric missing at the first validation only, after training up to it
    # (step 2 here, so that the run gets there fast without the check).
    run_dir, cache_dir = tmp_path / "run", tmp_path / "cache"
    overrides = [*SMALLEST_BASE, "trainer.max_steps=4", "trainer.val_check_interval=2"]
    overrides += ["logger=none", "callbacks.model_checkpoint.monitor=val/foo"]
    result = run_script("train.py", *overrides, f"hydra.run.dir={run_dir}", cache_dir=cache_dir)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: callbacks.model_checkpoint.monitor must be ")
    assert lines[0].endswith("got 'val/foo'")
    for metric in [*LanguageModelModule.validation_metrics, "null"]:  # what can be monitored
        assert metric in lines[0]
    assert not cache_dir.exists(), "no data may be prepared for an invalid config"
    assert "Epoch" not in result.stderr  # no training step: the progress bar never started
    assert not (run_dir / "checkpoints").exists()
