"""`porting train --engine bridge` beyond the tsuzumi family (current stack, CPU, fp32, gloo): a
family whose Megatron-Bridge provider is its own (Falcon's), and a mixture of experts split over
expert-parallel ranks. Apart from tests/test_train_bridge.py so that the two pytest workers share
the current stack's training runs.
"""

from __future__ import annotations

from porting.testing import porting_train, train_losses


def test_a_family_with_its_own_provider_trains_and_exports_through_the_gate(tmp_path):
    """Falcon's provider class is the family's (``models.falcon_bridge``), not Bridge's: the
    ranks register its package, Bridge builds the model from it, and the trained checkpoint
    (whose run_config.yaml Bridge wrote again) exports through the gate."""
    from transformers import AutoTokenizer

    from porting.api import export_hf, import_hf
    from porting.testing import TRAIN_TEXT, make_falcon, make_indexed_dataset

    hf = make_falcon(tmp_path / "hf")
    import_hf(hf, tmp_path / "ckpt", verify=False, show_progress=False, fmt="megatron-bridge")
    tok = AutoTokenizer.from_pretrained(str(hf))
    data = make_indexed_dataset(tmp_path / "data" / "corpus", tok, [TRAIN_TEXT] * 300)
    done = porting_train(
        tmp_path / "ckpt", data, tmp_path / "run", "--steps", "4", "--save-every", "4"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == [0, 1, 2, 3] and losses[3] < losses[0], losses
    report = export_hf(tmp_path / "run" / "checkpoints", tmp_path / "back")
    assert report.passed and report.max_abs_diff < 1e-4


def test_expert_parallel_2_trains_as_expert_parallel_1(tmp_path):
    """A Mixtral-layout mixture of experts: EP=2 (the 4 experts of each layer split over two gloo
    ranks, tokens dispatched all-to-all) gives EP=1's losses step by step."""
    from transformers import AutoTokenizer

    from porting import proof
    from porting.api import import_hf
    from porting.testing import TRAIN_TEXT, make_indexed_dataset

    hf = proof.make_hf(
        tmp_path / "hf", "MixtralForCausalLM", vocab_size=130, hidden_size=64,
        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
    )  # fmt: skip
    import_hf(hf, tmp_path / "ckpt", verify=False, show_progress=False, fmt="megatron-bridge")
    tok = AutoTokenizer.from_pretrained(str(hf))
    data = make_indexed_dataset(tmp_path / "data" / "corpus", tok, [TRAIN_TEXT] * 300)
    steps = ["--steps", "4", "--save-every", "0"]
    one = porting_train(tmp_path / "ckpt", data, tmp_path / "ep1", *steps)
    two = porting_train(
        tmp_path / "ckpt", data, tmp_path / "ep2", *steps, "--ep", "2", "--gpus-per-node", "2",
        "--executor", "torchrun",
    )  # fmt: skip
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-3000:]
    ep1, ep2 = train_losses(tmp_path / "ep1"), train_losses(tmp_path / "ep2")
    assert sorted(ep1) == sorted(ep2) == [0, 1, 2, 3]
    assert max(abs(ep1[s] - ep2[s]) for s in ep1) < 1e-4, (ep1, ep2)
