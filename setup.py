from setuptools import find_packages, setup

setup(
    name="ds-recycle",
    version="0.1.0",
    description="ReCycle: resilient DeepSpeed pipeline training through GPU failures, without spare servers",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_recycle", "ds_recycle.*"]),
    # the node-availability traces ship with the package, with their README (source and licence)
    package_data={"ds_recycle": ["corpus.txt", "sim/data/traces/*.csv", "sim/data/traces/README.md"]},
    python_requires=">=3.10",
    install_requires=[
        # torch is pinned by the install step (torch==2.13.0, CPU wheel) before this package;
        # a range that 2.13.0 satisfies keeps pip from pulling a CUDA build.
        "torch>=2.13",
        "deepspeed==0.19.8",
        "mip>=2.0",
        "pyyaml",
        "wandb",
        "matplotlib",
        # --rdzv-backend etcd: etcd's grpc-gateway (HTTP/JSON), no protobuf (runtime/shared/etcd_transport.py)
        "etcd3gw>=2.7",
    ],
    extras_require={
        # import-linter: the import contract in pyproject.toml (tests/unit/test_code_contracts.py runs it)
        "test": ["pytest", "pytest-timeout", "hypothesis", "ruff", "import-linter>=2.16,<3", "mip[highs]"],
        "highs": ["mip[highs]"],
        # HF Trainer integration (ds_recycle.integrations.hf): it overrides private Trainer hooks,
        # so the range is the one tested.
        "hf": ["transformers>=5.23,<6", "accelerate>=1.15,<2", "safetensors"],
    },
    entry_points={"console_scripts": ["ds-recycle=ds_recycle.cli:console"]},
)
