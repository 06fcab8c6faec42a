"""The LightningModules: loss, optimizer groups, warm-up + cosine schedule, metric logging.

TrainingModule holds what both tasks share; LanguageModelModule trains the GPT on next-token
prediction, Seq2SeqModule the encoder-decoder on (source, target) pairs.
"""

import math
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar

import lightning as L
import torch
from torch import Tensor
from torchmetrics import Metric, SumMetric

from data.lm import LMDataModule
from data.metrics import character_error_rate
from data.seq2seq import Seq2SeqDataModule
from data.seq2seq_text import pad_sequences
from data.tokenizer import tokenizer_from_dict
from errors import check_field_types, check_int
from model.blocks import IGNORE_INDEX
from model.checkpoint import build_model
from model.encdec import EncoderDecoder
from model.generation import Tokenizer, decode_greedy_or_sample, decoding_ids
from model.inspect import token_labels
from training.guard import TrainingDiverged, UpdateGuard, check_nonfinite_action
from training.optimizers import OPTIMIZERS, build_optimizer, join_saved_state, peak_rates

DataModule = LMDataModule | Seq2SeqDataModule
# query labels and key labels of an attention map, by the map's name
LabelsFor = Callable[[str], tuple[list[str], list[str]]]


@dataclass
class OptimConfig:
    """The optimizer and its schedule, `optim.*` on the command line."""

    name: str = "adamw"  # or "muon": Muon for the hidden weight matrices, AdamW for the rest
    lr: float = 1e-3
    muon_lr: float = 4e-3  # name=muon: the matrices' learning rate (on AdamW's scale)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio

    def __post_init__(self) -> None:
        check_field_types(self, "optim.")
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name={self.name!r} is not one of {', '.join(OPTIMIZERS)}")
        for name in ("lr", "muon_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"optim.{name} must be > 0, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        check_int("optim.warmup_steps", self.warmup_steps, minimum=0)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Linear warm-up to 1, then cosine decay to min_lr_ratio at total_steps."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine


def validation_sum() -> SumMetric:
    """A sum over a validation's batches and ranks that keeps NaN: torchmetrics' default drops
    NaN values with a warning, which would report a diverged validation by its finite batches,
    and checks every update for them on the host, a wait for a GPU each batch."""
    return SumMetric(nan_strategy="disable")


class TrainingModule(L.LightningModule):
    """Optimizer, schedule, throughput and validation loss, shared by both tasks.

    Constructor arguments are plain dicts so that the checkpoint's hyper_parameters hold the
    model config, the optimizer config, the tokenizer and the resolved run config, and a
    checkpoint loads with torch.load(weights_only=True) and nothing else.
    """

    kind: str  # "gpt" or "encdec": recorded in the checkpoint, so generate.py knows the model
    # What every validation logs, and which way each metric improves: what a checkpoint callback
    # can monitor (training/plan.py checks `monitor` and `mode` against it before anything
    # trains) and what W&B summarises by its best value. Each task adds its own.
    validation_metrics: ClassVar[dict[str, str]] = {
        "val/loss": "min",
        "val/perplexity": "min",
        "val/best_loss": "min",  # the lowest finite val/loss so far
    }

    def __init__(
        self,
        model: dict,
        optim: dict,
        tokenizer: dict,
        run_config: dict | None = None,
        on_nonfinite: str = "stop",
    ):
        super().__init__()
        check_nonfinite_action(on_nonfinite)
        self.save_hyperparameters(logger=False)
        self.hparams["kind"] = self.kind
        self.model = build_model(self.kind, model)
        self.tokenizer = tokenizer_from_dict(tokenizer)
        self.optim = OptimConfig(**optim)
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        # val/loss = summed nats / summed scored tokens, over the batches and the ranks.
        self.val_nats, self.val_scored = validation_sum(), validation_sum()
        self.best_val_loss = math.inf  # the lowest finite val/loss so far, kept in checkpoints
        self._window_start: float | None = None  # when the current throughput window began
        self._window_tokens = 0
        self._step_loss: Tensor | None = None
        self._trainable: list[Tensor] | None = None
        self._update_guard = UpdateGuard()
        # The gradients hold batches that no optimizer step has applied yet: a step under way,
        # its batches accumulating (+trainer.accumulate_grad_batches).
        self._unapplied_gradients = False
        self._gradients_to_restore: dict[str, Tensor] | None = None  # until training starts

    def loss(self, batch) -> tuple[Tensor, Tensor, Tensor | int]:
        """(loss, logits, number of real tokens in the batch)."""
        raise NotImplementedError

    def attention_sample(
        self, datamodule: DataModule, length: int
    ) -> tuple[Callable[[], object], LabelsFor]:
        """A forward pass over a fixed validation sample, and the axis labels of its maps. The
        pass calls forward() itself, eagerly: through a compiled model (compile=true), the
        recording hooks would make torch.compile recompile it at every map."""
        raise NotImplementedError

    def training_step(self, batch, batch_idx: int) -> Tensor:
        loss, _, tokens = self.loss(batch)
        self._window_tokens += tokens * self.trainer.world_size
        self._step_loss = loss.detach()
        # Only the steps whose values reach the loggers log: on a small model, logging every
        # step costs several percent of the step time.
        if (self.global_step + 1) % self.trainer.log_every_n_steps == 0:
            self.log("train/loss", loss, prog_bar=True, sync_dist=True)  # the mean over ranks
            # AdamW's group (the last one): optim.lr's schedule, whichever optimizer
            self.log("train/lr", self.lr_schedulers().get_last_lr()[-1])
            if self.skipped_steps:
                self.log("train/skipped_steps", float(self.skipped_steps))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # The last step is validated (and checkpointed by its validation) even where
        # val_check_interval does not divide max_steps: Lightning validates after any step
        # that asks the run to stop, and max_steps would stop it there anyway.
        if 0 < self.trainer.max_steps <= self.global_step:
            self.trainer.should_stop = True

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        # Throughput over the steps since the last log, from one update's end to another's: data
        # loading, forward, backward, optimizer and callbacks, on every rank together. Logged
        # here, once a step however many batches accumulate, and not at the batch's end: the
        # callbacks' on_train_batch_end (the run history behind summary.json) runs before the
        # module's, and would read the value of the log before.
        now = time.perf_counter()
        if self._window_start is None:
            self._window_start, self._window_tokens = now, 0
            return
        if (self.global_step + 1) % self.trainer.log_every_n_steps == 0:  # the step it ends
            self.log("train/tokens_per_sec", self._window_tokens / (now - self._window_start))
            self._window_start, self._window_tokens = now, 0

    def on_after_backward(self) -> None:
        self._unapplied_gradients = True

    def on_before_optimizer_step(self, optimizer) -> None:
        # Applied from here on, though they stay until the next step's first batch zeroes them:
        # that there are gradients does not tell a step under way.
        self._unapplied_gradients = False

    def on_validation_start(self) -> None:
        self._window_start = None  # validation time is not training throughput

    def on_train_end(self) -> None:
        self._act_on_skipped_updates()  # the last step's

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self._act_on_skipped_updates()  # nothing is saved after a diverged step
        checkpoint["skipped_steps"] = self.skipped_steps
        checkpoint["best_val_loss"] = self.best_val_loss
        if self._unapplied_gradients:  # written inside a step: its batches' sum so far
            checkpoint["partial_gradients"] = self._partial_gradients()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.skipped_steps = checkpoint.get("skipped_steps", 0)
        # checkpoints from before val/best_loss have none: every loss since is the best so far
        self.best_val_loss = checkpoint.get("best_val_loss", math.inf)
        # Put back as training starts: Lightning zeroes the gradients after loading.
        self._gradients_to_restore = checkpoint.get("partial_gradients")
        # Checkpoints from before attention's q, k and v projections were joined: the model
        # joins their weights as it loads them, and the optimizer state is joined alike here,
        # before Lightning hands it to the optimizer.
        if "optimizer_states" in checkpoint:
            saved = {name.removeprefix("model.") for name in checkpoint["state_dict"]}
            names = {id(param): name for name, param in self.model.named_parameters()}
            groups = [[names[id(p)] for p in g["params"]] for g in self.model.optimizer_groups(0)]
            checkpoint["optimizer_states"] = [
                join_saved_state(state, groups, saved) for state in checkpoint["optimizer_states"]
            ]

    def _partial_gradients(self) -> dict[str, Tensor]:
        """The gradients summed so far over the batches of the step under way, by parameter
        name, each stacked over the ranks: until the step all-reduces them, each rank holds the
        sum over its own batches. A collective: every rank saves each checkpoint."""
        gradients = {name: p.grad for name, p in self.named_parameters() if p.grad is not None}
        if self.trainer.world_size == 1:
            return {name: gradient[None] for name, gradient in gradients.items()}
        return self.all_gather(gradients)

    def _restore_partial_gradients(self) -> None:
        """Give the parameters the gradients that a checkpoint written inside a step saved for
        this rank: the resumed run's next batch is not a step's first, so Lightning adds to them
        instead of zeroing them, as the interrupted run did. Resumed on another number of ranks,
        every rank takes the saved ranks' mean (a step's gradient is the mean over ranks)."""
        saved, self._gradients_to_restore = self._gradients_to_restore, None
        if saved is None:
            return
        parameters = dict(self.named_parameters())
        rank, ranks = self.trainer.global_rank, self.trainer.world_size
        for name, stacked in saved.items():
            gradient = stacked[rank] if len(stacked) == ranks else stacked.mean(0)
            parameter = parameters[name]
            parameter.grad = gradient.to(parameter.device, parameter.dtype)
        self._unapplied_gradients = True

    def on_train_start(self) -> None:
        self._restore_partial_gradients()
        # A run resumed with another optim.lr or muon_lr: the restored schedule keeps the
        # checkpoint's base rates, so rescale them (and this step's rates) to the ones asked for.
        scheduler = self.lr_schedulers()
        asked = peak_rates(scheduler.optimizer, self.optim.lr, self.optim.muon_lr)
        if scheduler.base_lrs == asked:
            return
        scheduler.base_lrs = asked
        total_steps = int(self.trainer.estimated_stepping_batches)
        factor = self.optim.lr_factor(scheduler.last_epoch, total_steps)
        for group, rate in zip(scheduler.optimizer.param_groups, asked, strict=True):
            group["initial_lr"], group["lr"] = rate, rate * factor

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm=None
    ) -> None:
        """Clip as the trainer says, and guard the update: a step whose loss or gradient norm
        is not finite leaves the weights as they were (training/guard.py). What that step
        means, stop or skip, is decided here one step later, before the next update."""
        self._act_on_skipped_updates()
        if self._trainable is None:
            # Listed once: walking the module tree twice a step costs about 0.1 ms, 0.4% of a
            # step of nanoGPT's CPU shape.
            self._trainable = [p for p in self.parameters() if p.requires_grad]
        grads = [p.grad for p in self._trainable if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        # fp16's gradient scaler skips overflowing steps itself (they are routine while it
        # finds its scale, not divergence) and hands the fused optimizer its own found_inf.
        if getattr(self.trainer.precision_plugin, "scaler", None) is None:
            self._flag_update(optimizer, norm)
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            torch.nn.utils.clip_grads_with_norm_(self._trainable, gradient_clip_val, norm)
        elif gradient_clip_val:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def _flag_update(self, optimizer, norm: Tensor) -> None:
        loss = self._step_loss.clone()
        if self.trainer.world_size > 1:
            # Every rank must take the same decision. Gradients, and so the norm, are the same
            # everywhere already; the loss becomes the mean over ranks, finite only if every
            # rank's is (an all-reduce queued on the device: the host does not wait for it).
            torch.distributed.all_reduce(loss)
            loss /= self.trainer.world_size
        self._update_guard.flag(optimizer, self.trainer.global_step + 1, norm, loss)

    def _act_on_skipped_updates(self) -> None:
        """Count and report the updates skipped so far (on_nonfinite=skip), or stop at the first
        one (stop), before anything that follows it is saved."""
        for skipped in self._update_guard.skipped():
            what = (
                f"step {skipped.step}: the loss is {skipped.loss:.4g} and the gradient norm "
                f"{skipped.norm:.4g}"
            )
            if self.on_nonfinite == "skip":
                self.skipped_steps += 1
                if self.trainer.is_global_zero:
                    print(f"warning: {what}: update skipped (on_nonfinite=skip)", file=sys.stderr)
                continue
            checkpoint = self.trainer.checkpoint_callback
            last = getattr(checkpoint, "last_model_path", "") or ""
            where = (
                f"the last good checkpoint is {last} (resume: python train.py ckpt_path={last})"
                if last
                else "no checkpoint was saved before it"
            )
            raise TrainingDiverged(
                f"{what}; training stopped before this update, and {where}. Lower optim.lr, or "
                "set on_nonfinite=skip to drop such updates"
            )

    def validation_step(self, batch, batch_idx: int) -> None:
        loss, _, tokens = self.validation_loss(batch)
        self.add_val_loss(loss, tokens)

    def validation_loss(self, batch) -> tuple[Tensor, Tensor, Tensor | int]:
        """self.loss(batch), with a compiled model run eagerly in the sanity check: compiling
        its no-grad graph there (or loading it from the cache) would hold the first training
        step back by seconds, and the first validation compiles it anyway."""
        eager = self.trainer.sanity_checking and hasattr(torch.compiler, "set_stance")  # 2.6+
        with torch.compiler.set_stance("force_eager") if eager else nullcontext():
            return self.loss(batch)

    def add_val_loss(self, loss: Tensor, scored: Tensor | int) -> None:
        """Count a batch's mean loss over its `scored` tokens into val/loss."""
        self.val_nats.update(loss * scored)
        self.val_scored.update(scored)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_nats.compute() / self.val_scored.compute()
        self.val_nats.reset()
        self.val_scored.reset()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/perplexity", torch.exp(loss))
        if self.trainer.sanity_checking:
            return  # the sanity check scores the weights before training: not a result
        # W&B Sweeps optimise a metric's last value, so the sweep's objective is this running
        # minimum. `loss` is already the mean over ranks, so every rank keeps the same one; and
        # reading it is one host sync a validation, not one a batch.
        value = float(loss)
        if math.isfinite(value) and value < self.best_val_loss:
            self.best_val_loss = value
        self.log("val/best_loss", self.best_val_loss)

    def configure_optimizers(self):
        optimizer = build_optimizer(
            self.optim.name,
            self.model.optimizer_groups(self.optim.weight_decay),
            lr=self.optim.lr,
            betas=(self.optim.beta1, self.optim.beta2),
            muon_lr=self.optim.muon_lr,
        )
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: self.optim.lr_factor(step, total_steps)
        )
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


class LanguageModelModule(TrainingModule):
    """Next-token prediction with the GPT; batches are (x, y) blocks. Validation also reports
    bits per character, which compares across tokenizers where loss per token cannot."""

    kind = "gpt"
    validation_metrics = TrainingModule.validation_metrics | {"val/bits_per_char": "min"}

    def __init__(self, model: dict, optim: dict, tokenizer: dict, **options):
        super().__init__(model, optim, tokenizer, **options)
        chars = torch.tensor(self.tokenizer.token_char_counts())
        self.register_buffer("token_chars", chars, persistent=False)
        self.val_chars = validation_sum()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, _, tokens = self.validation_loss(batch)
        self.add_val_loss(loss, tokens)
        self.val_chars.update(self.token_chars[batch[1]].sum())

    def on_validation_epoch_end(self) -> None:
        bits = self.val_nats.compute() / self.val_chars.compute() / math.log(2)
        self.val_chars.reset()
        self.log("val/bits_per_char", bits)
        super().on_validation_epoch_end()  # after: it resets val_nats

    def loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, int]:
        x, y = batch
        logits, loss = self.model(x, y)
        return loss, logits, y.numel()

    def attention_sample(
        self, datamodule: DataModule, length: int
    ) -> tuple[Callable[[], object], LabelsFor]:
        sample = datamodule.val_sample(min(length, self.model.config.block_size)).to(self.device)
        labels = token_labels(self.tokenizer, sample.tolist())
        return (lambda: self.model.forward(sample[None])), (lambda name: (labels, labels))


class TokenAccuracy(Metric):
    """Predictions equal to their target over the targets scored (not IGNORE_INDEX), as the sums
    of both over all batches and ranks, divided once: a mean of per-batch or per-rank ratios
    would weigh a token by the size of its batch. Updates stay on the device (no host sync)."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("counted", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, predictions: Tensor, targets: Tensor) -> None:
        scored = targets != IGNORE_INDEX
        # a mask product, not indexing by the mask: indexing sizes its result on the host
        self.correct += ((predictions == targets) & scored).sum()
        self.counted += scored.sum()

    def compute(self) -> Tensor:
        return self.correct / self.counted.clamp(min=1)  # 0, not NaN, when nothing was scored


class Seq2SeqModule(TrainingModule):
    """The encoder-decoder on (source, target) pairs, scored by loss, token accuracy, and by
    exact match and character error rate of greedy decodes of a fixed validation subset."""

    kind = "encdec"
    validation_metrics = TrainingModule.validation_metrics | {
        "val/token_accuracy": "max",
        "val/exact_match": "max",
        "val/cer": "min",
    }

    def __init__(self, model: dict, optim: dict, tokenizer: dict, **options):
        super().__init__(model, optim, tokenizer, **options)
        self.val_token_accuracy = TokenAccuracy()

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        logits, loss = self.model(
            batch["source"],
            batch["target_in"],
            batch["source_mask"],
            batch["target_mask"],
            batch["target_out"],
        )
        # A tensor, read only when the throughput is logged: int() here would make the host
        # wait for a GPU every step.
        tokens = batch["source_mask"].sum() + batch["target_mask"].sum()
        return loss, logits, tokens

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, logits, _ = self.validation_loss(batch)
        targets = batch["target_out"]
        scored = targets != IGNORE_INDEX
        self.add_val_loss(loss, scored.sum())  # the loss is a mean over these
        self.val_token_accuracy.update(logits.argmax(-1), targets)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        # summed over batches and ranks already: logged as it is, with no sync_dist averaging
        self.log("val/token_accuracy", self.val_token_accuracy.compute())
        self.val_token_accuracy.reset()
        exact_match, cer = self.decode_scores(self.trainer.datamodule)
        self.log("val/exact_match", exact_match)
        self.log("val/cer", cer)

    def decode_scores(self, datamodule: Seq2SeqDataModule) -> tuple[float, float]:
        """Exact match and character error rate of greedy decodes of the validation subset."""
        pairs = datamodule.val_pairs(datamodule.config.val_subset)
        predictions = greedy_decodes(self.model, self.tokenizer, [s for s, _ in pairs])
        references = [target for _, target in pairs]
        exact = sum(p == r for p, r in zip(predictions, references, strict=True)) / len(pairs)
        return exact, character_error_rate(predictions, references)

    def attention_sample(
        self, datamodule: DataModule, length: int
    ) -> tuple[Callable[[], object], LabelsFor]:
        source_ids, target_ids = datamodule.val_pairs(1)[0]
        source_ids = source_ids[:length]
        target_in = [self.tokenizer.bos_id, *target_ids[: length - 1]]
        source = torch.tensor([source_ids], device=self.device)
        target = torch.tensor([target_in], device=self.device)
        source_labels = token_labels(self.tokenizer, source_ids)
        target_labels = token_labels(self.tokenizer, target_in)

        def labels_for(name: str) -> tuple[list[str], list[str]]:
            if name.startswith("encoder"):
                return source_labels, source_labels
            if name.endswith("cross_attn"):
                return target_labels, source_labels
            return target_labels, target_labels

        return (lambda: self.model.forward(source, target)), labels_for


def greedy_decodes(
    model: EncoderDecoder, tokenizer: Tokenizer, sources: list[list[int]], batch_size: int = 128
) -> list[list[int]]:
    """Greedy decodes (ids before EOS) of source id lists, padded and decoded in batches."""
    device = next(model.parameters()).device
    outputs = []
    for start in range(0, len(sources), batch_size):
        source, mask = pad_sequences(sources[start : start + batch_size], tokenizer.pad_id)
        outputs += decode_greedy_or_sample(
            model,
            source.to(device),
            mask.to(device),
            **decoding_ids(tokenizer),
            max_new_tokens=model.config.max_target_len,
            greedy=True,
        )
    return outputs
