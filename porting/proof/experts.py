"""The proofs of a mixture of experts: every token routed to the same experts on both sides, a
layer's experts streamed one at a time, and two experts swapped as the negative control."""

from __future__ import annotations

from pathlib import Path

import torch

from porting.convert.container import reference_architecture
from porting.proof.parity import checkpoint_family, prompts_of, prove_parity


@torch.no_grad()
def routing(
    hf_dir: str | Path, ckpt: str | Path, router_suffix: str, prompts=None, router_logits=None
):
    """``(hf, megatron)``: per layer, per prompt, the sorted top-k expert ids of every token, and
    HF's smallest gap between the k-th and (k+1)-th router logit.

    ``router_suffix`` names the HF router modules (``block_sparse_moe.gate``, ``mlp.gate``); the
    Megatron side is every ``TopKRouter``'s routing map. ``router_logits(module, inputs, output)``
    gives the logits of a router whose output is not them (gpt-oss's returns its top-k scores
    and indices), or None for a module of that name that routes nothing (a dense layer's MLP
    where the hook is on the MLP); by default the output is, or its first element (transformers
    5's routers return their logits, scores and indices).
    """
    from megatron.core.transformer.moe.router import TopKRouter

    from porting.convert import packed_experts
    from porting.convert.hf_files import read_hf_config
    from porting.convert.megatron import init_parallel, mcore_logits
    from porting.parity.harness import reference_config
    from porting.testing import load_checkpoint_model

    family, m = checkpoint_family(ckpt)
    prompts = prompts_of(ckpt) if prompts is None else prompts
    hf_model = family.hf_class(reference_architecture(m)).from_pretrained(
        str(hf_dir),
        config=reference_config(family, read_hf_config(hf_dir)),
        dtype=torch.float32,
        attn_implementation=family.hf_attn_implementation,
    )
    k = hf_model.config.num_experts_per_tok
    renamed = packed_experts.renamed_in_5x(hf_model.config.model_type)
    # transformers 5 may keep the router under another module name than the published one
    suffix = renamed.get(f"{router_suffix}.weight", router_suffix).removesuffix(".weight")
    routers = [
        mod
        for name, mod in hf_model.named_modules()
        if name.endswith(router_suffix) or name.endswith(suffix)
    ]
    assert routers, f"no module of the HF model is named *{router_suffix}"

    hf_logits = [[] for _ in routers]
    read = router_logits or (lambda mod, a, out: out[0] if isinstance(out, tuple) else out)

    def keep(i: int, mod, a, out) -> None:
        got = read(mod, a, out)
        if got is not None:
            hf_logits[i].append(got.reshape(-1, got.shape[-1]))

    hooks = [
        r.register_forward_hook(lambda mod, a, out, i=i: keep(i, mod, a, out))
        for i, r in enumerate(routers)
    ]
    for p in prompts:
        hf_model.eval()(p)
    for h in hooks:
        h.remove()
    hf_logits = [layer for layer in hf_logits if layer]
    hf_top = [[t.topk(k, -1).indices.sort(-1).values for t in layer] for layer in hf_logits]
    gaps = [
        (s[:, k - 1] - s[:, k]).min().item()
        for layer in hf_logits
        for s in (t.sort(-1, descending=True).values for t in layer)
    ]
    init_parallel()
    model, _ = load_checkpoint_model(ckpt, dtype=torch.float32)
    mc_maps = {}
    mc_routers = [mod for mod in model.modules() if isinstance(mod, TopKRouter)]
    hooks = [
        r.register_forward_hook(lambda mod, a, out, i=i: mc_maps.setdefault(i, []).append(out[1]))
        for i, r in enumerate(mc_routers)
    ]
    for p in prompts:
        mcore_logits(model, p)
    for h in hooks:
        h.remove()
    mc_top = [
        [rm.nonzero()[:, 1].reshape(rm.shape[0], k).sort(-1).values for rm in mc_maps[i]]
        for i in range(len(mc_routers))
    ]
    return hf_top, mc_top, min(gaps)


def prove_routing(
    hf_dir: str | Path, ckpt: str | Path, router_suffix: str, router_logits=None
) -> None:
    """Both sides pick the same experts for every token of every prompt in every layer, and no
    HF top-k decision is within 1e-4 of a tie (a hundred times the fp32 rounding of router logits
    of order one, so rounding cannot decide it)."""
    hf_top, mc_top, gap = routing(hf_dir, ckpt, router_suffix, router_logits=router_logits)
    assert gap > 1e-4, f"a routing near-tie ({gap:.2e}) in the test model; widen the router"
    assert len(hf_top) == len(mc_top) > 0
    for layer, (a, b) in enumerate(zip(hf_top, mc_top, strict=True)):
        for prompt, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"layer {layer}, prompt {prompt}: experts differ"
    # the routing really varies: several experts are used
    assert len(torch.cat([t.flatten() for t in hf_top[0]]).unique()) > 1


def prove_experts_streamed(hf_dir: str | Path, ckpt: str | Path, prompts=None) -> dict[str, int]:
    """The streamed gate's memory bound below a layer, observed on both sides (and in a
    multi-token-prediction check): each time an expert returns, it is the only expert of its
    layer holding tensors, so neither the layer's read nor the prefetch of the next expert has
    bound more; under transformers 5, whose experts are two stacks per layer, each time one
    expert's slice of a stack is read no other slice read before is still held. The gate's
    verdict is the whole model's (:func:`prove_parity`). Returns how many experts ran in each
    kind of module streaming them (the class of the layer or block; ``ExpertStack`` for the
    stacks' reads)."""
    import weakref
    from contextlib import contextmanager

    from porting.parity import modules, mtp, sides

    seen: dict[str, list[int]] = {}
    real = modules.experts_streamed
    real_item = modules.ExpertStack.__getitem__
    handed: list[weakref.ref] = []

    def item(stack, expert):
        t = real_item(stack, expert)
        handed[:] = [r for r in handed if r() is not None]
        seen.setdefault(modules.ExpertStack.__name__, []).append(1 + len(handed))
        handed.append(weakref.ref(t))
        return t

    @contextmanager
    def observed(layers, load):
        layers = list(layers)
        every = [x for _, layer in layers for _, xs in modules.expert_lists(layer) for x in xs]

        def returned(module, args, output):
            live = sum(any(p.device.type != "meta" for p in x.parameters()) for x in every)
            seen.setdefault(type(layers[0][1]).__name__, []).append(live)

        # registered first, so they run before the stream releases the expert
        handles = [x.register_forward_hook(returned) for x in every]
        try:
            with real(layers, load):
                yield
        finally:
            for h in handles:
                h.remove()

    sides.experts_streamed = mtp.experts_streamed = observed
    modules.ExpertStack.__getitem__ = item
    try:
        prove_parity(hf_dir, ckpt, prompts)
    finally:
        sides.experts_streamed = mtp.experts_streamed = real
        modules.ExpertStack.__getitem__ = real_item
    assert len(seen) >= 2, f"experts seen running in {sorted(seen)} only"
    for kind, live in seen.items():
        assert set(live) == {1}, f"{kind}: experts holding tensors when one returned: {live}"
    return {kind: len(live) for kind, live in seen.items()}


def swapped_experts_table(table, layer: int, a: int, b: int, num_layers: int, num_experts: int):
    """``table`` with experts ``a`` and ``b`` of one layer swapped (each written from the other's
    HF tensors): the negative control of a mixture-of-experts mapping."""
    from porting.contract.mapping import EXPERT, LAYER, Fused, Rename

    out = []
    for e in table:
        names = (
            (e.mcore, *((e.hf,) if isinstance(e, Rename) else e.hf))
            if isinstance(e, Rename | Fused)
            else ()
        )
        if not any(EXPERT in n for n in names):
            out.append(e)
            continue
        hf = (e.hf,) if isinstance(e, Rename) else e.hf
        transform = e.transform if isinstance(e, Fused) else None
        for i in range(num_layers):

            def when(c, i=i, e=e) -> bool:  # an entry for some layers only stays for those
                return (e.when is None or e.when(c)) and (e.layers is None or e.layers(c, i))

            for x in range(num_experts):
                src = {a: b, b: a}.get(x, x) if i == layer else x
                keys = tuple(k.replace(LAYER, str(i)).replace(EXPERT, str(src)) for k in hf)
                mcore = e.mcore.replace(LAYER, str(i)).replace(EXPERT, str(x))
                if transform is None:
                    out.append(Rename(keys[0], mcore, when=when))
                else:
                    out.append(Fused(keys, mcore, transform, when=when))
    return tuple(out)
