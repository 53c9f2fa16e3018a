"""``porting verify --plot``: divergence per decoder layer, log scale, with the gate's line."""

from __future__ import annotations

from pathlib import Path

from porting.parity.streamed import LAYER_RTOL


def write_plot(report, path: str | Path) -> Path:
    """Draw the per-layer divergence of a layer-streamed report into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from porting.errors import PortingError

    if not report.layers:
        raise PortingError("--plot needs the layer-streamed check (drop --whole-model)")
    floor = 1e-12  # log scale: an exact layer is drawn at the floor
    layers = [d["layer"] for d in report.layers]
    # the layer alone where it ran on the HF layer's input: a layer within the gate's line on
    # its own input does not run again (porting.parity.streamed)
    alone = [d for d in report.layers if d.get("own_on_hf_input", True)]
    own = [max(d["own_max_rel"], floor) for d in alone]
    carried = [max(d["max_rel"], floor) for d in report.layers]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.semilogy(layers, carried, "o-", color="tab:blue", label="propagated (each side's own input)")
    ax.semilogy(
        [d["layer"] for d in alone],
        own,
        "s--",
        color="tab:orange",
        label="layer alone (HF layer's input)",
    )
    ax.axhline(LAYER_RTOL, color="tab:red", lw=1, label=f"gate: {LAYER_RTOL:g} relative")
    if report.first_divergent_layer is not None:
        ax.axvline(report.first_divergent_layer, color="tab:red", ls=":", lw=1)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("max |d hidden| / max |hidden|")
    verdict = "PASS" if report.passed else "FAIL"
    ax.set_title(f"HF vs Megatron, per layer ({verdict}; max |dlogit| {report.max_abs_diff:.1e})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
