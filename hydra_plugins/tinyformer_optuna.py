"""The Optuna sweeper of `python train.py hparams_search=...`: a Hydra sweeper on Optuna's
ask-and-tell interface (Optuna >= 4), configured in configs/hydra/sweeper/optuna.yaml.

Each trial is one job of the sweep, run in this process, in `<sweep dir>/<trial number>`:
- its value is what train.py returns (the best validation loss);
- the job reports its validation curve to the trial, and stops early when the pruner judges
  it hopeless (training/sweep.py); the trial is then recorded as PRUNED;
- a job that fails (an invalid combination, a diverged run) is recorded as FAIL and the search
  goes on;
- `divides: {a: b}` draws `a` only among the divisors of the `b` drawn for the same trial, so
  that no trial is spent on an invalid pair such as (n_head=2, n_kv_head=8).

With a storage (an sqlite file), running the same command again resumes the study: it runs
until `n_trials` trials have ended, and first re-runs a trial that an interruption cut short.

Hydra imports this module at every start (it scans hydra_plugins/ for plugins): Optuna and the
training code load only when a search runs.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

# user attributes of a trial: the swept values and all the job's overrides; and on the trial
# that re-runs the values of one an interruption cut short, that one's number
PARAMS = "params"
OVERRIDES = "overrides"
RETRY_OF = "retry_of"


@dataclass
class Dimension:
    """One swept key: a choice among override strings, or an interval."""

    key: str
    choices: list[str] | None = None
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    integer: bool = False


def dimension(override: Override) -> Dimension:
    key = override.get_key_element()
    if override.is_discrete_sweep():
        return Dimension(key, choices=list(override.sweep_string_iterator()))
    sweep = override.value()
    if not isinstance(sweep, IntervalSweep):
        raise ValueError(f"{key}: the Optuna sweeper takes choice(), range() or interval()")
    # Hydra reads interval()'s bounds as floats: tag(int, interval(1, 8)) asks for integers.
    integer = "int" in sweep.tags
    low, high = (int(sweep.start), int(sweep.end)) if integer else (sweep.start, sweep.end)
    return Dimension(key, low=low, high=high, log="log" in sweep.tags, integer=integer)


def divisors_name(key: str, target: str, value: str) -> str:
    # One categorical parameter per value of the target: Optuna needs a fixed set of choices per
    # parameter name, and the divisors of 2 are not those of 8.
    return f"{key} | {target}={value}"


class OptunaSweeper(Sweeper):
    """Runs `n_trials` trials of an Optuna study, one Hydra job each (see the module's notes)."""

    def __init__(
        self,
        direction: str,
        n_trials: int,
        sampler: Any,
        pruner: Any,
        study_name: str | None = None,
        storage: str | None = None,
        params: DictConfig | None = None,
        divides: DictConfig | None = None,
    ) -> None:
        self.direction = direction
        self.n_trials = n_trials
        self.sampler = sampler
        self.pruner = pruner
        self.study_name = study_name
        self.storage = storage
        self.params = dict(params or {})
        self.divides = dict(divides or {})

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def space(self, arguments: list[str]) -> tuple[list[str], list[Dimension]]:
        """The fixed overrides and the swept dimensions: the config's `params`, then the command
        line's (which win), the target of each `divides` before its divisor."""
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        given = [f"{key}={value}" for key, value in self.params.items()] + list(arguments)
        fixed: dict[str, str] = {}
        swept: dict[str, Dimension] = {}
        for override in parser.parse_overrides(given):
            key = override.get_key_element()
            fixed.pop(key, None)
            swept.pop(key, None)
            if override.is_sweep_override():
                swept[key] = dimension(override)
            else:
                fixed[key] = f"{key}={override.get_value_element_as_str()}"
        for key, target in self.divides.items():
            if key in swept and target not in swept and target not in fixed:
                raise ValueError(
                    f"hydra.sweeper.divides: {key} must divide {target}, which is neither swept "
                    f"nor given; sweep it or give it, e.g. {target}=4"
                )
        ordered = sorted(swept.values(), key=lambda d: d.key in self.divides)
        return list(fixed.values()), ordered

    def suggest(self, trial: Any, fixed: list[str], space: list[Dimension]) -> dict[str, str]:
        """The trial's value of every swept key, as override strings."""
        known = dict(o.split("=", 1) for o in fixed)
        chosen: dict[str, str] = {}
        for d in space:
            if d.choices is None:
                suggest = trial.suggest_int if d.integer else trial.suggest_float
                chosen[d.key] = str(suggest(d.key, d.low, d.high, log=d.log))
            elif d.key in self.divides:
                target = self.divides[d.key]
                total = (chosen | known)[target]
                choices = [c for c in d.choices if int(total) % int(c) == 0]
                if not choices:
                    raise ValueError(f"no value of {d.key} in {d.choices} divides {target}={total}")
                name = divisors_name(d.key, target, total)
                chosen[d.key] = trial.suggest_categorical(name, choices)
            else:
                chosen[d.key] = trial.suggest_categorical(d.key, d.choices)
        return chosen

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        from training.sweep import running_trial

        fixed, space = self.space(arguments)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        study = optuna.create_study(
            study_name=self.study_name,
            storage=self.storage,
            sampler=self.sampler,  # Hydra instantiated them with this sweeper
            pruner=self.pruner,
            direction=self.direction,
            load_if_exists=True,
        )
        sampler = self.config.hydra.sweeper.sampler
        if study.trials and sampler.get("seed") is not None:
            # Resumed: seeded as at the start, the sampler would draw the first trials' values
            # again; seeded past them, a resumed search is as reproducible as a fresh one.
            seed = resumed_sampler_seed(sampler.seed, len(study.trials))
            study.sampler = instantiate(sampler, seed=seed)
        retry_interrupted(study)
        failures = []
        for _ in range(self.n_trials - ended_trials(study)):
            trial = study.ask()
            try:  # a space or config that cannot make a job ends the search, its trial failed
                params = self.suggest(trial, fixed, space)
                overrides = fixed + [f"{key}={value}" for key, value in params.items()]
                self.validate_batch_is_legal([overrides])
            except Exception:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            trial.set_user_attr(PARAMS, params)
            trial.set_user_attr(OVERRIDES, overrides)
            with running_trial(trial):
                (result,) = self.launcher.launch([overrides], initial_job_idx=trial.number)
            try:
                value = float(result.return_value)
            except optuna.TrialPruned as pruned:
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                log.info(f"trial {trial.number} pruned: {pruned}")
            except Exception as error:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                failures.append(f"trial {trial.number}: {error}")
                log.warning(f"trial {trial.number} failed: {error}")
            else:
                study.tell(trial, value)
                log.info(f"trial {trial.number}: {value:.4f}")
            save_best(study, sweep_dir / "optimization_results.yaml")
        completed = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if failures and not completed:
            raise RuntimeError(f"every trial failed; the first: {failures[0]}")


def resumed_sampler_seed(seed: int, trials: int) -> int:
    """The seed of a search's sampler resumed after `trials` trials: a hash of both numbers,
    unrelated to other pairs' and to the seeds searches start from. Until 2026-11-27 it was
    seed + trials, so a search of seed s resumed after one trial drew the values of a new search
    of seed s + 1, correlating searches meant to be independent. 32 bits: what Optuna's samplers
    take (numpy's RandomState)."""
    import numpy as np  # only when a search resumes: Hydra imports this module at every start

    return int(np.random.SeedSequence(seed, spawn_key=(trials,)).generate_state(1)[0])


def retry_interrupted(study: Any) -> None:
    """A trial still RUNNING when its search resumes was cut short (no two searches share a
    study): it is closed as failed, and its values are tried again first, in a new trial."""
    import optuna

    for trial in study.get_trials(states=[optuna.trial.TrialState.RUNNING]):
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})


def ended_trials(study: Any) -> int:
    """Trials that ran to an end: complete, pruned or failed, not counting those cut short."""
    retried = {t.user_attrs[RETRY_OF] for t in study.trials if RETRY_OF in t.user_attrs}
    return sum(t.state.is_finished() and t.number not in retried for t in study.trials)


def config_values(params: dict[str, str]) -> dict[str, Any]:
    """Swept values, kept as override strings ("0.01", "4", "rope"), as the config reads them:
    numbers as numbers, for whatever reads the results as YAML."""
    parser = OverridesParser.create()
    return {key: parser.parse_override(f"{key}={value}").value() for key, value in params.items()}


def save_best(study: Any, path: Path) -> None:
    """optimization_results.yaml: the best trial's number, value, swept values (typed, as the
    config reads them) and overrides, and how many trials ended in each state."""
    import optuna

    if not study.get_trials(states=[optuna.trial.TrialState.COMPLETE]):
        return
    best = study.best_trial
    states = {
        state.name: len(study.get_trials(states=[state])) for state in optuna.trial.TrialState
    }
    results = {
        "name": study.study_name,
        "best_trial": best.number,
        "best_value": best.value,
        "best_params": config_values(best.user_attrs[PARAMS]),
        "best_overrides": best.user_attrs[OVERRIDES],
        "trials": states,
    }
    OmegaConf.save(OmegaConf.create(results), path)
