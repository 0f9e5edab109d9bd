"""Test doubles for megatron_rl: never imported by the library itself.

`megatron_rl.testing.loopback_server` is a stand-in for SGLang's HTTP server, backed by the
in-process engine, for the fast test lane, the benchmarks in ``tools/`` and faults the real server
cannot be made to show on demand. It is not a serving system: users run the real SGLang server
(``python -m sglang.launch_server``, or `megatron_rl.rollout.launch`). A test
(``tests/test_package_layout.py``) checks that no module outside this package imports it.
"""
