"""Package metadata for megatron_rl.

torch is deliberately unpinned: GPU users bring their own CUDA build. CPU machines (laptops, CI)
install through ``constraints-cpu.txt``, which keeps torch on the 2.13.0 CPU wheel; the Makefile
does that for you.
"""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron_rl",
    version="0.1.0",
    description="Reinforcement-learning post-training of mixture-of-experts LLMs on Megatron-core",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    # the CPU grouped GEMM kernel's source, compiled at install (`make`) or on first use
    package_data={"megatron_rl.kernels": ["*.cpp"]},
    install_requires=[
        "torch>=2.4",
        # the router, MLA and padding-mask hooks reach into megatron-core 0.16.1's internals
        # (tested there; 0.17 ships Python 3.12 wheels only): a new minor release needs a port
        "megatron-core>=0.16.1,<0.17",
        "transformers>=4.51",
        "safetensors>=0.4",
        "numpy>=1.26",
        "matplotlib>=3.8",
        "rich>=13",
        "tqdm>=4.66",
        "math-verify[antlr4_13_2]>=0.9",
        "pyarrow>=15",
        "wandb>=0.19",
        "tensorboard>=2.14",  # --tensorboard-dir only; imported when the flag is given
        # megatron-core's dist_checkpointing writer calls psutil in each writer process, outside
        # its error handling: without psutil a torch_dist save waits forever
        "psutil>=5.9",
        # this process's own GPU memory (NVML's per-process list; pure Python, unused on CPU)
        "nvidia-ml-py>=12",
        # torch's extension builder runs ninja to compile megatron_rl/kernels (CPU only)
        "ninja>=1.11",
    ],
    entry_points={
        "console_scripts": [
            # every command: megatron-rl train | plan | convert | study | ... (megatron_rl/cli)
            "megatron-rl = megatron_rl.cli.__main__:main",
            "megatron-rl-train = megatron_rl.train.__main__:main",  # = megatron-rl train
        ]
    },
    extras_require={
        # build: the wheel lane (.ci/wheel, make wheel-check) builds the sdist and the wheel
        "dev": [
            # below 9.2: pytest 9.2 keeps node ids where pytest-xdist 3.8 cannot add its group
            # suffix, so every xdist_group was silently ignored (tests/test_xdist_groups.py)
            "pytest>=8,<9.2",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            # the LoRA export is checked by loading it with PEFT (tests/lora/test_peft_export.py);
            # 0.21's MoE target conversion is pinned there, so a new minor release is re-checked
            "peft>=0.21,<0.22",
            "ruff==0.17.6",
            "build>=1.2",
        ],
        # Cluster extras. Transformer Engine needs CUDA headers to build; never install on CPU.
        "gpu": ["transformer-engine[pytorch]>=2.4"],
        # the serving environment, pinned to the releases the contract is proven on: the client's
        # payloads, routed experts (base64 since 0.5.10) and weight-update routes are tested
        # against sglang 0.5.23's own code and its real server (Makefile, tests/real_sglang)
        "sglang": [
            "sglang==0.5.23",
            # the router the tests start in front of the real servers (tests/real_sglang)
            "sglang-router==0.3.2",
        ],
    },
)
