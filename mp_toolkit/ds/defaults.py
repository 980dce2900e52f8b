"""DeepSpeed's own defaults and refusals, for the keys a DeepSpeed config leaves out or must not hold.

A key absent from a DeepSpeed config means DeepSpeed's default, and that default moves between
releases (``gradient_clipping`` became 1.0 in 0.19.3; before, absent was no clipping). So the
values are read from the installed ``deepspeed`` package's sources when there is one, and from
0.19.x's documented defaults (`DOCUMENTED`) when there is none::

    d = deepspeed_defaults()
    d.source                 # "DeepSpeed 0.19.8", or "DeepSpeed 0.19.x (its documented defaults: ...)"
    d.gradient_clipping      # 1.0

The sources are parsed (``ast``), not imported: importing ``deepspeed`` picks an accelerator and
takes seconds, and a config reader must not. What is read, and from where in the package:

* ``runtime/constants.py``: ``GRADIENT_CLIPPING_DEFAULT``, ``FP16_<KEY>_DEFAULT`` for the six loss-scale
  keys, ``BFLOAT16_ENABLED_DEFAULT``;
* ``ops/lamb/fused_lamb.py``: the keyword defaults of ``FusedLamb.__init__`` (what ``"type": "Lamb"``
  builds, with ``optimizer.params`` as its keyword arguments);
* ``runtime/config.py``: the keys of ``_REMOVED_TOP_LEVEL_CONFIG_KEYS`` and ``_REMOVED_ZERO_CONFIG_KEYS``,
  which ``DeepSpeedConfig`` refuses (``sparse_attention``, ``amp``, ``elasticity``, ...).

A default the installed package does not define as a plain literal (a file that cannot be read, a
name it lacks) keeps the documented one, and ``source`` names those keys; a list of refused keys it
does not define refuses none (a release before the removals), and ``source`` says that too.
`tests/test_ds_parity.py` checks these against ``import deepspeed`` itself.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from mp_toolkit.optim.loss_scaler import LOSS_SCALE_FIELDS, Numerics


@dataclass(frozen=True)
class DeepSpeedDefaults:
    """What an absent key means to one DeepSpeed release, and which keys it refuses."""

    version: str
    """The DeepSpeed release: the installed one's version ("0.19.8"), or "0.19.x" for `DOCUMENTED`."""
    installed: bool = False
    """True when read from an installed deepspeed package."""
    gradient_clipping: float = 1.0
    """``GRADIENT_CLIPPING_DEFAULT``: the max global gradient norm when the key is absent."""
    fp16: Numerics = Numerics(precision="fp16")
    """The ``fp16`` block's loss-scale keys (`LOSS_SCALE_FIELDS`, ``FP16_*_DEFAULT``)."""
    bf16_enabled: bool = False
    """``BFLOAT16_ENABLED_DEFAULT``."""
    lamb: tuple[tuple[str, object], ...] = (("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)),
                                            ("eps", 1e-8), ("weight_decay", 0.0), ("max_coeff", 10.0),
                                            ("min_coeff", 0.01))
    """FusedLamb's keyword defaults, as (name, value) pairs."""
    removed_top: tuple[str, ...] = ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
                                    "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting",
                                    "curriculum_learning", "progressive_layer_drop")
    """Top-level keys DeepSpeedConfig refuses (features removed from DeepSpeed)."""
    removed_zero: tuple[str, ...] = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")
    """``zero_optimization`` keys DeepSpeedConfig refuses."""
    fallback: tuple[str, ...] = ()
    """The keys whose defaults the installed package's sources did not give: they keep `DOCUMENTED`'s."""
    unread_refusals: tuple[str, ...] = ()
    """The lists of refused keys (``_REMOVED_..._KEYS``) the installed package's sources did not give:
    none of their keys is refused."""

    @property
    def source(self) -> str:
        """Whose defaults these are, in words: "DeepSpeed 0.19.8", "DeepSpeed 0.19.x (documented ...)", or
        the installed release's with the keys that fell back to the documented values named."""
        if not self.installed:
            return f"DeepSpeed {self.version} (its documented defaults: deepspeed is not installed)"
        if len(self.fallback) == len(DEFAULT_KEYS):
            text = (f"DeepSpeed {DOCUMENTED.version} (its documented defaults: none could be read from the installed "
                    f"DeepSpeed {self.version}'s sources)")
        elif self.fallback:
            text = (f"DeepSpeed {self.version}, and DeepSpeed {DOCUMENTED.version}'s documented defaults for "
                    f"{', '.join(self.fallback)} (not found in its sources)")
        else:
            text = f"DeepSpeed {self.version}"
        if self.unread_refusals:
            text += (f"; refusing no keys: the {' and '.join(self.unread_refusals)} keys DeepSpeed {self.version} "
                     "refuses were not found in its runtime/config.py")
        return text

    def lamb_default(self, name: str):
        """FusedLamb's default for keyword ``name``."""
        return dict(self.lamb)[name]


DOCUMENTED = DeepSpeedDefaults(version="0.19.x")
"""DeepSpeed 0.19.8's values, used when no deepspeed package is installed."""

_CONSTANTS = {"gradient_clipping": ("gradient_clipping", "GRADIENT_CLIPPING_DEFAULT"),
              "bf16_enabled": ("bf16.enabled", "BFLOAT16_ENABLED_DEFAULT")}
"""Our field -> (its config key, the name in ``deepspeed/runtime/constants.py``); the fp16 ones are
``FP16_<FIELD>_DEFAULT``."""
_REFUSALS = {"removed_top": ("top-level", "_REMOVED_TOP_LEVEL_CONFIG_KEYS"),
             "removed_zero": ("zero_optimization", "_REMOVED_ZERO_CONFIG_KEYS")}
"""Our field -> (what it lists, in words; the dict in ``deepspeed/runtime/config.py``)."""
DEFAULT_KEYS = (*(key for key, _ in _CONSTANTS.values()), *(f"fp16.{name}" for name in LOSS_SCALE_FIELDS),
                *(f"Lamb's {name}" for name, _ in DOCUMENTED.lamb))
"""Every key whose default is read from the sources, as `DeepSpeedDefaults.fallback` names them."""


def _module(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def _literal_assignments(tree: ast.Module) -> dict[str, object]:
    """Module-level ``NAME = literal`` assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def _dict_keys(tree: ast.Module, name: str) -> tuple[str, ...] | None:
    """The string keys of the module-level dict display ``name = {...}`` (its values may be f-strings)."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == name and isinstance(node.value, ast.Dict)):
            keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            return tuple(keys) if len(keys) == len(node.value.keys) else None
    return None


def _init_defaults(tree: ast.Module, cls: str) -> dict[str, object]:
    """Literal keyword defaults of ``cls.__init__`` in ``tree``."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    args = f.args.args[len(f.args.args) - len(f.args.defaults):]
                    out = {}
                    for a, d in zip(args, f.args.defaults):
                        try:
                            out[a.arg] = ast.literal_eval(d)
                        except ValueError:
                            continue
                    return out
    return {}


def read_installed(root: Path, version: str) -> DeepSpeedDefaults:
    """The defaults of the deepspeed package whose folder is ``root`` (``.../site-packages/deepspeed``);
    what its sources do not give falls back as the module docstring says, and is recorded."""
    fallback: list[str] = []
    constants = _module(root / "runtime" / "constants.py")
    found = _literal_assignments(constants) if constants is not None else {}

    def constant(key: str, name: str, default):
        v = found.get(name)
        if isinstance(v, (bool, int, float)):
            return type(default)(v)
        fallback.append(key)
        return default

    values: dict[str, object] = {field: constant(key, name, getattr(DOCUMENTED, field))
                                 for field, (key, name) in _CONSTANTS.items()}
    values["fp16"] = Numerics(precision="fp16", **{
        name: constant(f"fp16.{name}", f"FP16_{name.upper()}_DEFAULT", getattr(DOCUMENTED.fp16, name))
        for name in LOSS_SCALE_FIELDS})
    lamb = _module(root / "ops" / "lamb" / "fused_lamb.py")
    init = _init_defaults(lamb, "FusedLamb") if lamb is not None else {}
    fallback += [f"Lamb's {k}" for k, _ in DOCUMENTED.lamb if k not in init]
    values["lamb"] = tuple((k, (tuple(init[k]) if k == "betas" else init[k]) if k in init else v)
                           for k, v in DOCUMENTED.lamb)
    config = _module(root / "runtime" / "config.py")
    unread = []
    for field, (what, name) in _REFUSALS.items():
        keys = _dict_keys(config, name) if config is not None else None
        values[field] = () if keys is None else keys  # a release before the removals refuses none
        if keys is None:
            unread.append(what)
    return dataclasses.replace(DOCUMENTED, version=version, installed=True, fallback=tuple(fallback),
                               unread_refusals=tuple(unread), **values)


@functools.cache
def deepspeed_defaults() -> DeepSpeedDefaults:
    """The installed DeepSpeed's defaults, or `DOCUMENTED` without one (its ``source`` says so)."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return DOCUMENTED
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = "(unknown version)"
    return read_installed(Path(next(iter(spec.submodule_search_locations))), version)
