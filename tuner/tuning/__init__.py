"""Finding the best config: a problem made runnable (`workload`), the reference check, optuna studies and
the search driver, recorded programs tuned (`autotuning`), timing, the bench, the TPU dry run and its
compiled rows, the HTML report. Imports every layer below `cli`."""
