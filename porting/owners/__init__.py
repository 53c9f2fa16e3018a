"""Code that runs with the owners' own packages: the current stack (Python 3.12, Megatron-Core 0.19,
Megatron-Bridge; ``scripts/env.sh`` builds it as ``.venv``; docs/formats.md).

Tests run these modules there to load our checkpoints with the owners' loaders and to make
checkpoints with the owners' save paths. They import nothing of porting but :mod:`porting.cpu`.
"""
