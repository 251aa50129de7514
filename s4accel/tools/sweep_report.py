"""The callback `s4accel sweep` attaches to each trial's run: every evaluation's metric reported to the trial in the
Optuna study (its SQLite file), and the trial stopped there when Optuna's pruner says it will not do better than the
median of the earlier trials. The main process reports and decides; the loop makes every process stop together."""

from __future__ import annotations

import math

from ..training.callbacks import Callback


class ReportToStudy(Callback):
    def __init__(self, storage: str, study: str, trial_id: int, metric: str, prune: dict | None = None):
        self.storage, self.study_name, self.trial_id, self.metric = storage, study, trial_id, metric
        self.prune = prune  # the recipe's sweep.prune: the pruner is this process's, not stored in the study
        self.trial = None

    def on_train_start(self, run):
        if run.accelerator.is_main_process:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            pruner = pruner_for(self.prune)
            try:
                study = optuna.load_study(study_name=self.study_name, storage=self.storage, pruner=pruner)
            except KeyError:  # the sweep's folder is gone: a trial's run trained again on its own
                run.accelerator.print(f"warning: the sweep's study {self.study_name} is gone from {self.storage}; "
                                      f"this run reports to no sweep")
                return
            # A trial of a study in another process: Optuna's Trial over the id the sweep asked for (its
            # constructor is what study.optimize uses; there is no public handle for a trial run elsewhere).
            self.trial = optuna.trial.Trial(study, self.trial_id)

    def on_eval_end(self, run, metrics):
        if self.trial is None:
            return
        value, step = float(metrics[self.metric]), run.state.step
        import optuna

        try:
            self.trial.set_user_attr("last_eval_step", step)
        except optuna.exceptions.UpdateFinishedTrialError:  # a finished trial's run resumed by hand: not the sweep's
            self.trial = None
            return
        if not math.isfinite(value):
            return  # Optuna refuses it: the step without a value is what fails the trial, if it is the last
        self.trial.report(value, step)
        if self.trial.should_prune():
            self.trial.set_user_attr("pruned_at", step)
            run.request_stop(f"pruned by the sweep: eval {self.metric} {value:.4g} at step {step} is worse than the "
                             f"median of the earlier trials")


def pruner_for(prune: dict | None):
    """The recipe's `sweep.prune` as Optuna's pruner, the same in the sweep and in each trial (Optuna keeps no
    pruner in the study: a trial loading it would get the default one)."""
    import optuna

    if prune is None:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=prune["after_trials"], n_warmup_steps=prune["after_steps"])
