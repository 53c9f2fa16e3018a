"""The multi-token-prediction layer a published DeepSeek-V3 checkpoint carries after its decoder
layers, added to a random-init HF directory (transformers' class builds none, so its
``save_pretrained`` writes none), and its logits computed from transformers' own modules.

What the layer is (DeepSeek-V3 report, arXiv 2412.19437, section 2.2; the checkpoint's names):
at position ``i``, ``h' = eh_proj([enorm(embed(t[i + 1])); hnorm(h[i])])`` with ``h`` the main
model's last hidden state (after ``model.norm``), then one decoder layer at index
``num_hidden_layers`` (a mixture-of-experts layer), then ``shared_head.norm`` and the head. The
layer's ``embed_tokens`` and ``shared_head.head`` are copies of the model's.
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from porting.convert.safetensors_io import SAFE_INDEX

MTP_FILE = "model-mtp.safetensors"


def _config(hf_dir: Path):
    from transformers import DeepseekV3Config

    cfg = json.loads((hf_dir / "config.json").read_text())
    skip = ("architectures", "auto_map", "quantization_config")
    # a deep copy: transformers rewrites a nested rope_scaling in place
    fields = copy.deepcopy({k: v for k, v in cfg.items() if k not in skip})
    return cfg, DeepseekV3Config(**fields)


def add_mtp_layer(hf_dir: str | Path, seed: int = 0) -> list[str]:
    """Write the layer into ``hf_dir`` as one more shard (indexed, as the releases are) and set
    ``num_nextn_predict_layers: 1``; the names written."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    hf_dir = Path(hf_dir)
    cfg, config = _config(hf_dir)
    n = cfg["num_hidden_layers"]
    index_path = hf_dir / SAFE_INDEX
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
    else:
        with safe_open(hf_dir / "model.safetensors", "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")

    def stored(key: str) -> torch.Tensor:
        with safe_open(hf_dir / weight_map[key], "pt") as f:
            return f.get_tensor(key)

    dtype = stored("model.norm.weight").dtype
    gen = torch.Generator().manual_seed(seed)
    layer = DeepseekV3DecoderLayer(config, layer_idx=n)
    prefix = f"model.layers.{n}."
    tensors = {}
    std = config.initializer_range
    for name, t in layer.state_dict().items():
        # the layer's constructor leaves some tensors unset (transformers initialises them from
        # the model): every one is drawn here
        if name.endswith("e_score_correction_bias"):  # positive, as the tests' (test_deepseek)
            t = 0.5 * torch.rand(t.shape, generator=gen)
        elif t.dim() == 1:  # norms off 1, so that a dropped one shows
            t = 1 + 0.1 * torch.randn(t.shape, generator=gen)
        else:
            t = std * torch.randn(t.shape, generator=gen)
        if name.endswith("mlp.gate.weight"):
            t = t * 10.0  # sigmoid scores spread over (0, 1), as the tests' routers are
        tensors[prefix + name] = t
    h = config.hidden_size
    tensors[prefix + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    tensors[prefix + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    tensors[prefix + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    tensors[prefix + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    # transformers 5's layer stacks its experts; a release stores one tensor per expert
    from porting.convert.packed_experts import unstacked

    tensors = unstacked(tensors, "deepseek_v3", "the MTP layer")
    keep = {k: v for k, v in tensors.items() if not k.endswith("e_score_correction_bias")}
    tensors = {k: v.to(dtype) for k, v in keep.items()} | {
        k: v.float() for k, v in tensors.items() if k not in keep
    }
    tensors[prefix + "embed_tokens.weight"] = stored("model.embed_tokens.weight")
    tensors[prefix + "shared_head.head.weight"] = stored("lm_head.weight")
    save_file(tensors, hf_dir / MTP_FILE, metadata={"format": "pt"})
    weight_map |= dict.fromkeys(tensors, MTP_FILE)
    index_path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (hf_dir / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}, indent=2))
    return sorted(tensors)


@torch.no_grad()
def hf_mtp_logits(hf_dir: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """The layer's logits ``[batch, seq, vocab]`` in fp32 from transformers' model and its own
    decoder-layer and norm classes (position ``i`` predicts token ``i + 2``; the last position
    reads token 0 in place of the missing next one, as Megatron-Core's rolled input does)."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.masking_utils import create_causal_mask
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    hf_dir = Path(hf_dir)
    n = json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"]
    model = DeepseekV3ForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    config = model.config
    index = json.loads((hf_dir / SAFE_INDEX).read_text())["weight_map"]
    prefix = f"model.layers.{n}."
    own = {}
    for key, file in index.items():
        if key.startswith(prefix):
            with safe_open(hf_dir / file, "pt") as f:
                own[key[len(prefix) :]] = f.get_tensor(key).float()
    layer = DeepseekV3DecoderLayer(config, layer_idx=n).float().eval()
    wanted = layer.state_dict()
    if "mlp.experts.gate_up_proj" in wanted:
        # transformers 5 computes the experts from two stacks: each expert's gate rows, then its up
        experts = range(config.n_routed_experts)
        part = "mlp.experts.{}.{}_proj.weight"
        own["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([own[part.format(e, "gate")], own[part.format(e, "up")]]) for e in experts]
        )
        own["mlp.experts.down_proj"] = torch.stack([own[part.format(e, "down")] for e in experts])
    layer.load_state_dict({k: v for k, v in own.items() if k in wanted}, strict=True)
    h = config.hidden_size
    enorm, hnorm, head_norm = (DeepseekV3RMSNorm(h, eps=config.rms_norm_eps) for _ in range(3))
    enorm.weight.copy_(own["enorm.weight"])
    hnorm.weight.copy_(own["hnorm.weight"])
    head_norm.weight.copy_(own["shared_head.norm.weight"])
    eh_proj = torch.nn.Linear(2 * h, h, bias=False)
    eh_proj.weight.copy_(own["eh_proj.weight"])

    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    following = torch.roll(input_ids, -1, dims=1)
    following[:, -1] = 0
    embedded = torch.nn.functional.embedding(following, own["embed_tokens.weight"])
    x = eh_proj(torch.cat([enorm(embedded), hnorm(hidden)], dim=-1))
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
    # transformers 4.57 spells it input_embeds and wants the cache positions, 5.x inputs_embeds
    takes = inspect.signature(create_causal_mask).parameters
    mask = create_causal_mask(
        config=config,
        **{"inputs_embeds" if "inputs_embeds" in takes else "input_embeds": x},
        **({"cache_position": positions[0]} if "cache_position" in takes else {}),
        attention_mask=None,
        past_key_values=None,
        position_ids=positions,
    )
    out = layer(
        x,
        attention_mask=mask,
        position_ids=positions,
        position_embeddings=model.model.rotary_emb(x, positions),
    )
    out = out[0] if isinstance(out, tuple) else out
    return torch.nn.functional.linear(head_norm(out), own["shared_head.head.weight"])
