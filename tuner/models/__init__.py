"""Analytic models that rank without running: the TPU kernel timing model, the strategies' model, and the
reading of compiled HLO schedules they are checked against. Imports the layers up to `strategies`."""
