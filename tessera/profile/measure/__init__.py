"""The torch side of `tessera.profile`: measurements on the devices (`hardware`, `model`), memory
instrumentation (`memory`) and plan runs (`validate`). Their arithmetic and records live in the
torch-free modules of `tessera.profile` (`fit`, `fit_hardware`, `results`), which the planner reads."""
