"""The family registry: every :class:`~porting.contract.family.Family` installed, found through entry points.

A package ships a family by naming its ``Family`` object in the ``porting.families`` entry-point
group (ours do so in ``pyproject.toml``, exactly as an outside package does)::

    [project.entry-points."porting.families"]
    tsuzumi = "converters.tsuzumi:FAMILY"

The entry's name is the family's name. Loading a family imports its converter module, which
imports only the contract (:mod:`porting.contract`): listing the families costs no torch, NeMo or
Megatron. Its Megatron side, and its NeMo ``io.ModelConnector`` importer/exporter, are loaded by
the engine when a conversion needs them (:func:`porting.convert.connectors.model_class`).

A family that fails to load (its import raises or calls ``sys.exit``, or its ``FAMILY`` is not a
well-formed :class:`~porting.contract.family.Family`) is kept with its error: ``porting families`` lists it
and exits 2, a checkpoint only it could have claimed is refused naming it, and the other families
work as before. Ctrl-C and SIGTERM during a slow import stop the command as anywhere else; a
plugin calling ``os._exit`` ends the process, which no in-process loader can prevent.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata as md
from dataclasses import dataclass

from porting import guard
from porting.contract.config_map import to_mcore
from porting.contract.container import Container
from porting.contract.family import Family
from porting.errors import PortingError
from porting.guard import Terminated

GROUP = "porting.families"
GUIDE = "docs/families.md"

_MAMBA = (
    "a hybrid state-space model: Megatron-Core runs its Mamba mixers only through mamba_ssm's and "
    "causal_conv1d's CUDA kernels, so no CPU-proven family converts it"
)
# Architectures no family of ours claims, and why none can on this stack (docs/families.md,
# "Hybrid state-space models"): refused by name where no installed family claims them, so a plugin
# that runs them on a GPU still may.
OUT_OF_SCOPE = {
    "NemotronHForCausalLM": _MAMBA,
    "GraniteMoeHybridForCausalLM": _MAMBA,
    "FalconH1ForCausalLM": _MAMBA,
    "BambaForCausalLM": _MAMBA,
    "Mamba2ForCausalLM": _MAMBA,
    "JambaForCausalLM": _MAMBA,
    "Zamba2ForCausalLM": _MAMBA,
    "Qwen3NextForCausalLM": (
        "a hybrid model: Megatron-Core runs its gated DeltaNet layers through "
        "flash-linear-attention's Triton kernels (and as Megatron-Core's HybridModel, not the GPT "
        "model every family builds), so no CPU-proven family converts it"
    ),
}


@dataclass(frozen=True)
class Installed:
    """One entry point of the group: where a family comes from, loaded or not."""

    name: str
    value: str
    package: str
    family: Family | None = None
    error: str | None = None


def _package(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.metadata['Name']} {dist.version}" if dist is not None else "?"


def _load(ep: md.EntryPoint) -> Installed:
    base = Installed(ep.name, ep.value, _package(ep))
    try:
        with guard.sigint_recorded():
            family = ep.load()
            if isinstance(family, Family):
                family.check()
    except (KeyboardInterrupt, Terminated) as err:
        if guard.signal_arrived():
            raise  # the user stopping the command (a slow plugin import), not the plugin's fault
        # raised by the plugin's own code, no signal behind it: a broken plugin like any other
        return Installed(**{**base.__dict__, "error": f"{type(err).__name__} raised on import"})
    except BaseException as err:
        # A broken plugin must not take the others down, nor end the process: SystemExit (a
        # module calling sys.exit on import) is reported like any error. os._exit cannot be caught.
        said = (str(err).strip().splitlines() or [""])[0][:300]  # it goes into one-line errors
        what = f"sys.exit({err.code!r}) on import" if isinstance(err, SystemExit) else said
        kind = "" if isinstance(err, PortingError) else f"{type(err).__name__}: "
        return Installed(**{**base.__dict__, "error": kind + what})
    if not isinstance(family, Family):
        return Installed(
            **{**base.__dict__, "error": f"{ep.value} is a {type(family).__name__}, not a Family"}
        )
    if family.name != ep.name:
        return Installed(
            **{
                **base.__dict__,
                "error": f"entry point {ep.name!r} names a family called {family.name!r}; "
                "the entry's name must be the family's",
            }
        )
    return Installed(**{**base.__dict__, "family": family})


@functools.cache
def installed() -> tuple[Installed, ...]:
    """Every entry point of the group, each loaded (a failed load is kept with its error)."""
    eps = sorted(md.entry_points(group=GROUP), key=lambda e: (e.name, e.value))
    seen: dict[str, md.EntryPoint] = {}
    out = []
    for ep in eps:
        if ep.name in seen:
            if seen[ep.name].value == ep.value:
                continue  # one distribution seen twice on the path (an editable install)
            raise PortingError(
                f"two packages install a family called {ep.name!r}: {_package(seen[ep.name])} "
                f"({seen[ep.name].value}) and {_package(ep)} ({ep.value}); uninstall one"
            )
        seen[ep.name] = ep
        out.append(_load(ep))
    _check_claims(out)
    return tuple(out)


def _check_claims(found: list[Installed]) -> None:
    owner: dict[str, Installed] = {}
    by_model: dict[str, Installed] = {}
    for inst in found:
        if inst.family is None:
            continue
        # NeMo finds a checkpoint's connectors through its model class: one class, one family.
        model = inst.family.model_cls
        if isinstance(model, type):
            model = f"{model.__module__}:{model.__qualname__}"
        other = by_model.setdefault(model, inst)
        if other is not inst:
            raise PortingError(
                f"families {other.name} ({other.value}) and {inst.name} ({inst.value}) share the "
                f"model class {model.split(':')[1]}; each family needs its own "
                "(a subclass is enough) so that NeMo finds its importer and exporter"
            )
        containers = tuple(c.architecture for c in inst.family.containers)
        for key in (*inst.family.keys, *containers):
            if key in owner:
                other = owner[key]
                raise PortingError(
                    f"{key!r} is claimed by two families: {other.name} (package {other.package}, "
                    f"{other.value}) and {inst.name} (package {inst.package}, {inst.value}); "
                    "uninstall one or narrow its Family.architectures / model_types / containers"
                )
            owner[key] = inst


def refresh() -> None:
    """Forget what was found (after a package is installed or removed in this process)."""
    importlib.invalidate_caches()
    installed.cache_clear()


def families() -> list[Family]:
    """The families that loaded, by name."""
    return [i.family for i in installed() if i.family is not None]


def known_keys() -> list[str]:
    """Every architecture and model type some installed family claims."""
    return sorted(k for f in families() for k in f.keys)


def _not_found(what: str) -> PortingError:
    broken = [f"{i.name} ({i.value}: {i.error})" for i in installed() if i.error]
    hint = f"; families that failed to load: {', '.join(broken)}" if broken else ""
    claims = "; ".join(f"{f.name} ({', '.join(f.keys)})" for f in families()) or "none"
    return PortingError(
        f"{what}; installed families: {claims}{hint}. A new architecture is a family package: "
        f"see {GUIDE}, or start one with `porting new-family NAME --from HF_DIR`"
    )


def family_by_name(name: str) -> Family:
    """Return the installed family called ``name`` (``--family``, our checkpoints' manifests)."""
    for fam in families():
        if fam.name == name:
            return fam
    raise _not_found(f"no family called {name!r} is installed")


def claiming(hf_config: dict) -> Family | None:
    """The family that claims an HF config, by ``architectures[0]``, then by ``model_type``;
    ``None`` where none does."""
    archs = hf_config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    mtype = hf_config.get("model_type")
    fams = families()
    return next((f for f in fams if arch in f.architectures), None) or next(
        (f for f in fams if mtype in f.model_types), None
    )


def container_for(hf_config: dict) -> tuple[Family, Container] | None:
    """The family whose language model a container config holds, and that container
    (:attr:`Family.containers`, by ``architectures[0]``); None for any other config."""
    archs = hf_config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    for fam in families():
        for container in fam.containers:
            if container.architecture == arch:
                return fam, container
    return None


def family_for_config(hf_config: dict) -> Family:
    """The family that claims an HF config (:func:`claiming`); refused by name where none does."""
    fam = claiming(hf_config)
    if fam is not None:
        return fam
    arch = (hf_config.get("architectures") or [None])[0]
    mtype = hf_config.get("model_type")
    if isinstance(arch, str) and arch in OUT_OF_SCOPE:
        raise PortingError(
            f"architecture {arch!r} (model_type {mtype!r}) is not supported: "
            f"{OUT_OF_SCOPE[arch]} ({GUIDE}, Hybrid state-space models)"
        )
    raise _not_found(f"unknown architecture {arch!r} (model_type {mtype!r})")


def family_for_hf_config(
    cfg: dict, where: str = "config.json", family: str | None = None
) -> Family:
    """The family of a parsed HF config, the config checked by the family's config map
    (:func:`porting.contract.config_map.to_mcore`); errors name ``where``.

    ``family`` forces one by name (``porting import --family``); it must still claim the config,
    so a checkpoint cannot be read through a table written for another layout.
    """
    if family is not None:
        fam = family_by_name(family)
        if not fam.claims(cfg):
            raise PortingError(
                f"{where}: family {fam.name} claims {', '.join(fam.keys)}, not architecture "
                f"{cfg['architectures'][0]!r} (model_type {cfg.get('model_type')!r})"
            )
    else:
        try:
            fam = family_for_config(cfg)
        except PortingError as err:
            raise PortingError(f"{where}: {err}") from err
    # Every value and relation the family's config map checks, before any model is built or any
    # output made: the callers build from this config next.
    to_mcore(cfg, fam.config_entries, where)
    return fam
