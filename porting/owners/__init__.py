"""Code that runs in the owners' environment, not in ours: Python 3.12 with Megatron-LM's and
Megatron-Bridge's own packages (``scripts/env.sh`` builds it as ``.venv-owners``; docs/formats.md).

Tests run these modules there to load our checkpoints with the owners' loaders and to make
checkpoints with the owners' save paths. They import nothing of porting but :mod:`porting.cpu`.
"""
