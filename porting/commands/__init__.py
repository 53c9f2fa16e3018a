"""The `porting` commands, one module each: argument parsing and the command's edge (inputs read
and refused here, objects handed down to the engine). Each exposes ``register(subparsers)``;
:mod:`porting.cli` lists them. Nothing below this package imports it (tests/test_layout.py)."""
