"""JSONL corpora and local Hugging Face datasets to Megatron's indexed dataset (``.bin``/``.idx``).

``porting prep-data`` (:mod:`data_prep.run`, run by one of :mod:`data_prep.executors`),
``prep-data merge`` (:mod:`data_prep.merge`) and ``prep-data inspect``
(:mod:`data_prep.inspection`); see docs/data_prep.md. Importing the package is cheap: the worker
processes import only what tokenizing needs.
"""
