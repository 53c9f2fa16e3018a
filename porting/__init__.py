"""porting: move LLM checkpoints and corpora between Hugging Face and NeMo 2.0 / Megatron-Core."""

__version__ = "0.1.0"
