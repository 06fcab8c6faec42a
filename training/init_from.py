"""A new run that starts from a trained GPT's weights (`init_from=`): fine-tuning on other text,
or training again under another schedule. Unlike ckpt_path, which continues a run with its
optimizer, schedule, step and data position, only the weights, the model's shape and the
tokenizer carry over.

The model's settings become overrides of the new run (`++model.n_layer=4 ...`, before this
command's own), so the run's config, recorded in its checkpoints, says what it trains, and a
later resume of it composes the same model without reading the source again."""

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hydra import compose
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from data.lm_text import TOKENIZER_OPTIONS
from errors import override_key
from kinds import KINDS, kind_of
from model.checkpoint import find_checkpoint, load_checkpoint, weights_mismatch
from model.gpt import GPTConfig
from training.resume import Resume, flatten
from training.summary import print_once


@dataclass
class InitFrom:
    """The trained model a new run starts from: init_from's value, the file or export it names,
    its tokenizer's record and its weights."""

    given: str
    path: Path
    model: GPTConfig
    tokenizer: dict
    weights: dict[str, torch.Tensor] = field(repr=False)

    @property
    def option(self) -> str:
        return f"init_from={self.given}"

    def check_model(self, model: GPTConfig) -> None:
        """The run's model, `model`, must compute what the weights were trained to: a change of
        the heads' split, the position scheme or the attention's scale keeps (most of) their
        shapes, so the weights would load and the run start from another model than the
        source's. Shape changes are refused as the weights load."""
        source = self.model
        changed = [
            (name, old, new)
            for name, old, new in (
                ("attention.n_head", source.attention.n_head, model.attention.n_head),
                ("position", source.position, model.position),
            )
            if old != new
        ]
        # The scale compared as a factor: null and 1/sqrt_dk are the same (on the source's heads)
        head_dim = source.n_embd // source.attention.n_head
        if source.attention.scale_for(head_dim) != model.attention.scale_for(head_dim):
            changed.append(("attention.scale", source.attention.scale, model.attention.scale))
        if changed:
            shown = "; ".join(
                f"model.{name}={override_value(new)} (the source's: {override_value(old)})"
                for name, old, new in changed
            )
            raise ValueError(
                f"{self.option}: {shown} changes what its weights compute; drop "
                "those model.* overrides to start from the source's model"
            )

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy the weights into `model`, the run's own, built from the same settings unless an
        override changed its shape."""
        try:
            model.load_state_dict(self.weights)
        except RuntimeError as error:
            raise ValueError(
                f"{self.option}: its weights do not fit this run's model "
                f"({weights_mismatch(error)}); drop the model.* overrides that change the "
                "model's shape or position scheme"
            ) from None


def prepare_init(resume: Resume, given: list[str]) -> tuple[Resume, InitFrom | None]:
    """The run `resume` starts, composed again with init_from's model settings, and what it
    starts from; (resume, None) without init_from, and for a run that continues (its checkpoint
    holds the weights, its recorded overrides the model). `given`: this command's overrides."""
    cfg = resume.cfg
    source = cfg.get("init_from")
    keys = {override_key(o) for o in given}
    if source is None:
        return resume, None
    if resume.path is not None:  # see check_starts_or_continues
        return resume, None
    # The weights come with the tokenizer they were trained with: another would be ignored.
    key = next((key for key in TOKENIZER_OPTIONS if key in keys), None)
    if key is not None:
        raise ValueError(
            f"{key}={OmegaConf.select(cfg, key)}: init_from={source} brings its own "
            f"tokenizer, which its weights were trained with; drop {key}"
        )
    path = find_checkpoint(source, "best", "init_from")
    # GPTs only: the encoder-decoder builds its tokenizer from its data, so it takes no other
    kind = kind_of(cfg.model)
    if kind.name != "gpt":
        raise ValueError(
            f"init_from={source} starts a GPT run, and this run trains {kind.label}: drop "
            "model=encdec"
        )
    model, hparams = load_checkpoint(path, "init_from")
    saved_kind = hparams.get("kind", "gpt")
    if saved_kind != "gpt":
        label = KINDS[saved_kind].label if saved_kind in KINDS else f"a {saved_kind} model"
        raise ValueError(
            f"init_from={source} holds {label}: init_from starts a GPT run from a GPT's "
            "weights only (an encoder-decoder builds its tokenizer from its data); give a GPT run"
        )
    settings = [
        f"++model.{name}={override_value(value)}"
        for name, value in flatten(hparams["model"]).items()
        if f"model.{name}" not in keys  # this command's own model.* overrides win
    ]
    overrides = [*settings, *resume.overrides]
    try:
        cfg = compose("train", overrides=overrides)
    except ConfigCompositionException as error:
        raise ValueError(
            f"init_from={source}: its model settings do not compose with this command's "
            f"overrides ({' '.join(str(error).split())})"
        ) from None
    print_once(f"init_from: starting from the weights and tokenizer of {path}")
    init = InitFrom(str(source), path, model.config, hparams["tokenizer"], model.state_dict())
    return Resume(cfg, overrides), init


def check_starts_or_continues(cfg: DictConfig, given: list[str]) -> None:
    """init_from, among this command's overrides `given`, starts a run and ckpt_path continues
    one: both are refused, before the checkpoint is read (and its resume announced). But
    ckpt_path=last continues the run once it has a checkpoint: a command a pre-empted job
    repeats starts from init_from's weights the first time, and continues after that."""
    ckpt_path = cfg.get("ckpt_path")
    if "init_from" in {override_key(o) for o in given} and ckpt_path and ckpt_path != "last":
        raise ValueError(
            f"init_from={cfg.init_from} starts a new run from a model's weights and "
            f"ckpt_path={ckpt_path} continues a run: give one of them"
        )


def override_value(value: object) -> str:
    """`value` as Hydra's override grammar and OmegaConf read it back: null, true/false, a
    number, or a quoted string (a position name, a scale such as 1/sqrt_dk) taken as written."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return repr(value)
    # OmegaConf would resolve "${...}" as an interpolation: escaped, it is text.
    text = re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", str(value))
    # In a quoted value Hydra reads a backslash as an escape only before a quote or the end.
    text = re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), text)
    return f"'{text}'"
