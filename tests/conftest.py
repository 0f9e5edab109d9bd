"""Test-suite wide set-up: the multi-rank helpers of tests/model are importable from every test
directory (``from qwen3_moe_testing import spawn_ranks``)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "model"))
