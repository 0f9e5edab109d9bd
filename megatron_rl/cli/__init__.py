"""The ``megatron-rl`` command: one installed entry point for the trainer and the tools.

``megatron-rl <command> [options]``; ``megatron-rl --help`` lists the commands
(megatron_rl/cli/__main__.py), each the ``main(argv) -> int`` of one module, imported only when
its command runs (megatron_rl/cli/dispatch.py). The commands' own code lives here (``plan``,
``convert``, ``study``, ``study-summary``, ``bench <name>``) or in the package it belongs to
(``train``, ``serve``, ``recipes``, ``warm-start``); the scripts in ``tools/`` of a checkout call
the same ``main``.
"""
