"""The embedded-model pipeline: how the models in models/ (the target, its DFlash 1
and DFlash 2 drafters, the classic draft model) were made and checked. One entry
point, run from the repository root: `python -m tools.embedded COMMAND ...`
(`python -m tools.embedded --help` lists the commands)."""
